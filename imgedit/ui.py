"""The Gradio Blocks page and its API (`/edit`, `/gpu_status`): one event per GPU job, one queue.

Every GPU event shares the concurrency group "gpu" and goes straight on to the manager's line,
where UI, gradio API and REST jobs wait together in arrival order (the page shows how many are
ahead); the line, not Gradio, bounds the wait (QUEUE_MAX_SIZE) and each worker's lock keeps its
GPUs to one job. The edit handler is async: when a user (or gradio_client) cancels, Gradio cancels
the task, `manager.run` sets the job's cancel flag, and the pipeline stops within one step.
"""

from __future__ import annotations

import asyncio
import html
import logging

import gradio as gr

from imgedit.errors import ImgEditError, InvalidInput
from imgedit.gpu_panel import panel_html
from imgedit.gpus import GpuMonitor, snapshot
from imgedit.identity import page_owner
from imgedit.images import open_image
from imgedit.jobs import EditRequest
from imgedit.ui_fast import build_speed_controls, parse_speed_inputs
from imgedit.uploads import gallery_paths, uploaded_paths
from imgedit.validation import MAX_INPUT_IMAGES, check_counts, check_params, default_steps

log = logging.getLogger(__name__)
GPU_GROUP = "gpu"
DEMO_BANNER = ("**Demo mode**: a tiny random-weight model runs on the CPU, so outputs are noise. "
               "Set `QWEN_MODEL` or `QWEN_MODEL_DIR` to serve a real checkpoint.")


def user_error(exc: BaseException) -> gr.Error:
    """Only gr.Error text reaches users; it is rendered as HTML, so escape it."""
    if isinstance(exc, ImgEditError):
        return gr.Error(html.escape(exc.message), title=exc.kind.replace("_", " "))
    log.exception("unexpected error in the UI handler", exc_info=exc)
    return gr.Error("internal error: see the server log")


def _number(value, name: str, default=None):
    """A number from the raw event data (events run with preprocess=False: any JSON can arrive)."""
    if value is None or value == "":
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise InvalidInput(f"{name} must be a number, got {str(value)[:40]!r}", name)
    try:
        number = float(value)
    except ValueError:
        raise InvalidInput(f"{name} must be a number, got {str(value)[:40]!r}", name) from None
    return int(number) if number.is_integer() else number


def _text(value, name: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidInput(f"{name} must be text", name)
    return value


def build_request(manager, files, prompt, negative_prompt, seed, randomize_seed, steps, cfg, num_images,
                  width, height, source: str, speed=None, lora=None, lora_scale=None) -> EditRequest:
    """Parse one event's raw values. Every file must lie in Gradio's upload cache (imgedit.uploads)."""
    settings = manager.settings
    paths = uploaded_paths(files)
    check_counts(len(paths), manager.family)
    images = tuple(open_image(p, settings.max_input_pixels, f"image {i + 1}") for i, p in enumerate(paths))
    speed, lora, lora_scale = parse_speed_inputs(speed, lora, lora_scale)
    return EditRequest(
        images=images, prompt=_text(prompt, "prompt"), negative_prompt=_text(negative_prompt, "negative_prompt"),
        seed=None if randomize_seed else _number(seed, "seed", 0),
        num_inference_steps=_number(steps, "num_inference_steps"),
        true_cfg_scale=_number(cfg, "true_cfg_scale"), num_images=_number(num_images, "num_images", 1),
        width=_number(width, "width", 0) or None, height=_number(height, "height", 0) or None, speed=speed,
        lora=lora, lora_scale=lora_scale, source=source)


def build_blocks(manager, demo: bool = False, monitor: GpuMonitor | None = None, history=None, jobs=None) -> gr.Blocks:
    settings = manager.settings
    monitor = monitor or GpuMonitor()
    max_inputs = MAX_INPUT_IMAGES["plus"]
    family_steps = default_steps(settings, manager.family)

    fields = ("images", "prompt", "negative_prompt", "seed", "randomize_seed", "num_inference_steps",
              "true_cfg_scale", "num_images", "width", "height", "speed", "lora", "lora_scale")

    def validate(files, prompt, negative_prompt, seed, randomize_seed, steps, cfg, num_images, width, height,
                 *speed_values):
        """Runs before the job enters the queue: bad input costs nothing else. The message goes to
        the input at fault."""
        n_inputs = len(fields) - 3 + len(speed_values)  # the History tab's re-run sends no speed values
        speed, lora, lora_scale = (*speed_values, None, None, None)[:3]
        verdicts = [gr.validate(True, "")] * len(fields)
        try:
            req = build_request(manager, files, prompt, negative_prompt, seed, randomize_seed, steps, cfg,
                                num_images, width, height, "validator", speed, lora, lora_scale)
            check_params(req, settings, manager.family)
        except ImgEditError as exc:
            at = fields.index(exc.field) if exc.field in fields else 0
            verdicts[at] = gr.validate(False, html.escape(exc.message))
        except Exception:
            log.exception("validator failed")
            verdicts[0] = gr.validate(False, "these inputs could not be read")
        return verdicts[:n_inputs]

    async def edit(files, prompt, negative_prompt, seed, randomize_seed, steps, cfg, num_images, width, height,
                   speed=None, lora=None, lora_scale=None, request: gr.Request = None, progress=gr.Progress()):
        source = "ui" if request is not None and request.headers.get("referer") else "api"
        try:  # decoding up to three large images: off the event loop
            req = await asyncio.to_thread(build_request, manager, files, prompt, negative_prompt, seed,
                                          randomize_seed, steps, cfg, num_images, width, height, source, speed, lora,
                                          lora_scale)
        except Exception as exc:
            raise user_error(exc) from None
        progress(0, desc="waiting for a free GPU worker")

        def on_wait(ahead: int) -> None:
            progress(0, desc=f"in line: {ahead} job(s) ahead of yours")

        def on_step(step: int, total: int) -> None:
            progress((step, total), desc="denoising", unit="steps")

        try:
            result = await manager.run(req, on_step=on_step, on_wait=on_wait)
        except Exception as exc:
            raise user_error(exc) from None
        if history is not None and (owner := page_owner(request, settings.auth is not None)):
            await history.record(owner, req.request_id, 0, req, result)
        return result.images, result.seed

    def preview_inputs(files) -> list[str]:
        try:
            return uploaded_paths(files)
        except Exception as exc:
            raise user_error(exc) from None

    def use_result(gallery) -> list[str]:
        try:
            paths = gallery_paths(gallery)
        except Exception as exc:
            raise user_error(exc) from None
        if not paths:
            raise gr.Error("there is no result yet")
        return paths[:1]

    def gpu_status() -> dict:
        """Per GPU: index, name, used/total MiB, utilisation, what is placed on it, which job/step it runs."""
        return snapshot(monitor, manager.status())

    def panel() -> str:
        return panel_html(snapshot(monitor, manager.status(), history=True))

    with gr.Blocks(title="imgedit") as blocks:
        gr.Markdown("# imgedit — edit images with Qwen-Image-Edit")
        if demo:
            gr.Markdown(DEMO_BANNER, elem_id="demo-banner")
        with gr.Row():
            with gr.Column():
                files = gr.File(label=f"Input images (1 for Qwen-Image-Edit, up to {max_inputs} for 2509/2511)",
                                file_count="multiple", file_types=["image"], elem_id="input-files")
                preview = gr.Gallery(label="Inputs", height=160, columns=3, interactive=False, format="png")
                prompt = gr.Textbox(label="What to change", lines=2, elem_id="prompt",
                                    placeholder="e.g. make the sky a sunset, keep the people unchanged")
                with gr.Row():
                    run = gr.Button("Edit", variant="primary", elem_id="edit-button")
                    stop = gr.Button("Cancel", variant="stop", elem_id="cancel-button")
                with gr.Accordion("Advanced", open=False):
                    negative = gr.Textbox(label="Negative prompt", value="")
                    with gr.Row():
                        seed = gr.Number(label="Seed", value=0, precision=0, minimum=0)
                        randomize = gr.Checkbox(label="Randomize seed", value=True)
                    steps = gr.Number(label=f"Steps (1-{settings.max_steps})", value=family_steps, precision=0)
                    cfg = gr.Slider(1.0, 20.0, value=settings.default_true_cfg, step=0.5, label="True CFG scale")
                    num = gr.Slider(1, settings.max_images_per_prompt, value=1, step=1, label="Images per prompt")
                    with gr.Row():
                        width = gr.Number(label="Width (0 = auto)", value=0, precision=0, minimum=0)
                        height = gr.Number(label="Height (0 = auto)", value=0, precision=0, minimum=0)
                speed_inputs = build_speed_controls(settings)  # Speed, LoRA, strength (imgedit.ui_fast)
            with gr.Column():
                result = gr.Gallery(label="Result", format="png", columns=2, elem_id="result", interactive=False)
                used_seed = gr.Number(label="Seed used", precision=0, interactive=False)
                again = gr.Button("Use result as input")
        with gr.Accordion("GPUs", open=True):
            gpu_panel = gr.HTML(panel(), elem_id="gpu-panel")
        timer = gr.Timer(2.0)

        # preprocess=False: our own code parses the raw values (junk gets our message, not a Gradio
        # processing error). Files were checked twice before a handler runs (imgedit.uploads.EventGuard,
        # then Gradio's upload check); the handlers check the paths they open or return once more.
        files.change(preview_inputs, files, preview, queue=False, preprocess=False, api_visibility="private")
        inputs = [files, prompt, negative, seed, randomize, steps, cfg, num, width, height]
        edit_inputs = inputs + speed_inputs  # the History tab re-fills `inputs` only: speed stays as chosen
        # No Gradio limit: every job goes straight to the manager's line, where UI, API and REST jobs
        # wait together in arrival order and QUEUE_MAX_SIZE is enforced once; the workers' locks keep
        # each GPU to one job.
        line = None
        event = run.click(edit, edit_inputs, [result, used_seed], api_name="edit", concurrency_id=GPU_GROUP,
                          concurrency_limit=line, validator=validate, preprocess=False)
        submitted = prompt.submit(edit, edit_inputs, [result, used_seed], api_visibility="private",
                                  concurrency_id=GPU_GROUP, concurrency_limit=line, validator=validate,
                                  preprocess=False)
        stop.click(None, None, None, cancels=[event, submitted], queue=False, api_visibility="private")
        again.click(use_result, result, files, queue=False, preprocess=False, api_visibility="private")
        timer.tick(panel, None, gpu_panel, queue=False, api_visibility="private")
        gr.api(gpu_status, api_name="gpu_status", queue=False)
        if jobs is not None:  # Batch and History tabs (imgedit.ui_batch, imgedit.ui_history)
            from imgedit.ui_batch import build_batch_tab
            from imgedit.ui_history import build_history_tab

            with gr.Tabs():
                build_batch_tab(manager, jobs, inputs[2:])
                history_api = build_history_tab(manager, history, inputs, result, used_seed, edit, GPU_GROUP,
                                                validate)
            gr.api(history_api, api_name="history", queue=False)
    return blocks
