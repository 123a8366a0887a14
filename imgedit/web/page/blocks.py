"""The Gradio Blocks page and its API (`/edit`, `/gpu_status`): one event per GPU job, one queue.

Every GPU event shares the concurrency group "gpu" and goes straight on to the manager's line,
where UI, gradio API and REST jobs wait together in arrival order (the page shows how many are
ahead); the line, not Gradio, bounds the wait (QUEUE_MAX_SIZE) and each worker's lock keeps its
GPUs to one job. The edit handler is async: when a user (or gradio_client) cancels, Gradio cancels
the task, `manager.run` sets the job's cancel flag, and the pipeline stops within one step.

The page's Edit button and the `/edit` API are two events on one handler: the API's inputs are
hidden components without ranges (so gradio_client's values reach our own checks and messages),
and the page raises every problem as a gr.Error, which the page always shows.
"""

from __future__ import annotations

import asyncio
import functools
import html
import logging
import tempfile
from dataclasses import replace

import gradio as gr

from imgedit.config.settings import Settings
from imgedit.engine.images import frame_notices, png_bytes
from imgedit.engine.interface import Engine
from imgedit.engine.validation import default_steps
from imgedit.engine.workers.gpus import GpuMonitor
from imgedit.errors import ImgEditError
from imgedit.planning.families import FAMILIES
from imgedit.protocol import EDIT, param, parameters
from imgedit.web.identity import page_owner
from imgedit.web.page.assets import INPUT_PREVIEW_CSS
from imgedit.web.page.batch_tab import build_batch_tab
from imgedit.web.page.chain import build_chain_controls, wire_chain
from imgedit.web.page.enhance_controls import build_enhance_buttons, wire_enhance
from imgedit.web.page.examples import example_rows
from imgedit.web.page.history_tab import build_history_tab
from imgedit.web.page.mask_controls import build_mask_controls, follow_first_input, painted_mask
from imgedit.web.page.panel import banner_html, panel_html
from imgedit.web.page.progress import EditProgress
from imgedit.web.page.requests import (
    api_component,
    build_request,
    edit_fields,
    edit_signature,
    form_signature,
    page_control,
)
from imgedit.web.page.sizes import size_presets, wire_size_presets
from imgedit.web.page.speed import build_cache_control, build_speed_controls
from imgedit.web.page.tools import PageTools, cached_pngs, page_files, user_error
from imgedit.web.page.uploads import upload_folder
from imgedit.web.public import open_snapshot

log = logging.getLogger(__name__)
UPLOAD_CACHE_SWEEP_S = 600
UPLOAD_CACHE_AGE_S = 2 * 3600  # a result on a page left open longer is in History
GPU_GROUP = "gpu"
DEMO_BANNER = ("**Demo mode**: a tiny random-weight model runs on the CPU, so outputs are noise. "
               "Set `QWEN_MODEL` or `QWEN_MODEL_DIR` to serve a real checkpoint.")
DEMO_SIZE, DEMO_STEPS = 256, 4  # a first-time visitor of the demo sees a result in seconds


def build_blocks(settings: Settings, manager: Engine, demo: bool = False, monitor: GpuMonitor | None = None,
                 history=None, jobs=None) -> gr.Blocks:
    monitor = monitor or GpuMonitor()
    family = FAMILIES[manager.family]
    max_inputs = family.max_images
    family_steps = default_steps(settings, manager.family)
    cache_refused = manager.cache_refusal()  # the Step cache control is hidden, and its value unused, then
    tools = PageTools(settings, manager.family, family_steps, manager.prompt_tokens,
                      cache_offered=not cache_refused)
    # `/edit`'s parameters in the declaration's order: the page's edit inputs follow it
    fields = edit_fields()
    # The page's own controls for declared parameters, by name as each is made (`lay`); any other declared one
    # gets a control of its own under Advanced (imgedit.web.page.requests.page_control).
    laid_out: dict[str, gr.components.Component] = {}

    def lay(name: str, control):
        laid_out[param(name).name] = control  # a declared parameter's name (KeyError for any other)
        return control

    def validate(*values):
        """Runs before an API job enters the queue: bad input costs nothing else. The message goes to
        the input at fault. `values`: `/edit`'s parameters in order (web.page.requests.edit_fields)."""
        verdicts = [gr.validate(True, "")] * len(fields)
        try:
            # the images by their headers: the event decodes them once
            req = build_request(settings, manager.family, *values, source="validator", decode=False)
            manager.check(req)  # the values, and whether these workers can run them
        except ImgEditError as exc:
            at = fields.index(exc.field) if exc.field in fields else 0
            verdicts[at] = gr.validate(False, html.escape(exc.message))
        except Exception:
            log.exception("validator failed")
            verdicts[0] = gr.validate(False, "these inputs could not be read")
        return verdicts

    async def run_edit(values: tuple, request: gr.Request | None, progress: gr.Progress):
        source = "ui" if request is not None and request.headers.get("referer") else "api"
        try:  # decoding up to three large images: off the event loop
            parse = functools.partial(build_request, settings, manager.family, *values, source=source)
            req = await asyncio.to_thread(parse)
            params = manager.resolve(req)  # every check, once: the job runs with these
        except Exception as exc:
            raise user_error(exc) from None
        owner = page_owner(request, settings.auth is not None)
        # The line's share is per login or browser; a client without cookies (gradio_client) per session.
        session = f"session:{request.session_hash}" if request is not None else None
        req = replace(req, client=owner or session)
        track = EditProgress(req.request_id)
        running = manager.run(req, on_step=track.on_step, on_wait=track.on_wait, params=params)
        job = asyncio.ensure_future(running)
        try:
            while not job.done():
                value, desc = track.render(manager.status())
                progress(value, desc=desc, unit="steps")
                await asyncio.wait({job}, timeout=0.25)
            result = job.result()
        except asyncio.CancelledError:
            job.cancel()  # manager.run sets the job's cancel flag: the worker stops at its next step
            raise
        except Exception as exc:
            raise user_error(exc) from None
        # The results' PNGs are written once (zlib level 1, with their settings), off the event loop, for the
        # page's components and the history alike.
        pngs = await asyncio.to_thread(lambda: [png_bytes(image) for image in result.images])
        if history is not None and owner:
            await history.record(owner, req.request_id, 0, req, result, pngs=pngs)
        return req, result, pngs

    @edit_signature  # the API's parameters and defaults: the declaration's (imgedit.protocol.PARAMETERS)
    async def edit(*args):
        """Edit the images as the prompt says; returns the result images and the seed used. With `mask` (an
        image the first image's size: white, or fully transparent, marks where to edit) only that area
        changes and the result is the first image's size. With `enhance_prompt` the model's text encoder
        rewrites the prompt first (each PNG then carries the prompt used and the original_prompt). `cache`
        (none, first-block, taylorseer; default: the server's CACHE) speeds up a quality edit, lossily."""
        *values, request, progress = args  # Gradio passes them after the parameters (edit_signature)
        _, result, pngs = await run_edit(tuple(values), request, progress)
        return await asyncio.to_thread(cached_pngs, pngs, "result"), result.seed

    @form_signature(fields, progress=True)
    async def edit_page(*args):
        """The Edit button: result, a status line with the seed used, the comparison, the chosen result, and
        the message beside Edit. A refused edit leaves the rest as it was and says why beside Edit until the
        next run (as a toast it vanished after a few seconds and left a bare "Error" badge on the result).
        `args`: the page's controls in `/edit`'s order, then the request and the progress."""
        *values, request, progress = args
        form = dict(zip(fields, values, strict=True))
        keep = gr.update()
        try:
            if not form["mask"]:  # "": nothing painted
                form.update(mask=None, mask_grow=None, mask_feather=None, strength=None)
            form["cache"] = tools.page_cache(form["cache"], form["speed"])
            req, result, pngs = await run_edit(tuple(form[name] for name in fields), request, progress)
        except gr.Error as exc:
            return keep, keep, keep, keep, f"**{exc.title or 'Not edited'}:** {exc.message}"
        try:
            return await show_result(req, result, pngs)
        except Exception:  # the job ran; its files could not be shown: say so beside Edit, not a silent page
            log.exception("%s: the result could not be shown", req.request_id)
            said = f"the result of {req.request_id} could not be shown (an internal error: see the log)"
            return keep, keep, keep, keep, f"**Not shown:** {said}"

    async def show_result(req, result, pngs):
        """The page's outputs for a finished job: the gallery, the status line, the comparison, the chosen
        one."""
        seeds = [image.info.get("seed", "?") for image in result.images]
        each = ""
        if len(seeds) > 1:
            each = (f" Image i was drawn from seed + i ({', '.join(seeds)}): that seed with one image makes "
                    "it again.")
        done = (f"Done in {result.seconds:.1f} s: {len(result.images)} image(s), "
                f"{result.width}x{result.height}, {result.steps} steps. **Seed used: {result.seed}** "
                f"(to repeat it, untick *Randomize seed* under Advanced and enter this seed).{each}")
        if req.mask is not None:
            done += " Only the painted area of the first image changed; the result has its size."
        if cached := result.images[0].info.get("cache"):
            done += f" Step cache: {cached} (lossy)."
        if result.weights:
            done += f" Ran on the server's {result.weights} fast-mode weights (lossy)."
        if notices := frame_notices(req.images):  # e.g. an animated GIF: its first frame was edited
            done += "\n\n**Note:** " + "; ".join(notices) + "."
        files, compare = await asyncio.to_thread(page_files, req, result.images[0], pngs)
        return files, done, compare, 0, ""

    def gpu_status() -> dict:
        """Per GPU: index, name, used/total MiB, utilisation, what is placed on it, the step it runs
        (the open view: no job ids, process ids or paths; see imgedit.web.public)."""
        return open_snapshot(monitor, manager.status())

    def panel() -> tuple[str, str]:
        data = open_snapshot(monitor, manager.status(), history=True)
        # Batch items wait in their job (one at a time enters the line): "waiting: 0" alone hid them.
        data["batch_items"] = jobs.pending_items() if jobs is not None else 0
        return panel_html(data), banner_html(data)

    # Gradio's cache keeps every upload and every file an event returned: files older than
    # UPLOAD_CACHE_AGE_S go every UPLOAD_CACHE_SWEEP_S, and all of them when the server stops.
    with gr.Blocks(title="imgedit", delete_cache=(UPLOAD_CACHE_SWEEP_S, UPLOAD_CACHE_AGE_S)) as blocks:
        verb = "make and edit" if family.generates else "edit"
        gr.Markdown(f"# imgedit — {verb} images with {family.model}")
        if demo:
            gr.Markdown(DEMO_BANNER, elem_id="demo-banner")
        # Loading (and what it is doing), a worker that could not load, an optimisation that fell back: one
        # line each, refreshed with the GPU panel; empty when all is well.
        banner = gr.HTML(elem_id="server-banner", padding=False)
        with gr.Row(elem_id="editor"):
            with gr.Column(elem_id="editor-left"):
                files = lay("images", gr.File(label=family.inputs_label, file_count="multiple",
                                              file_types=["image"], elem_id="input-files"))
                # The inputs as pictures (remove one with its x in the list above; click one to choose it).
                preview = gr.Gallery(label="Inputs, in the order the model gets them", columns=max_inputs,
                                     object_fit="contain", height=170, interactive=False,
                                     elem_id="input-preview", buttons=[], allow_preview=False)
                chosen_input = gr.Number(value=-1, visible=False)
                first = gr.Button("Make the chosen input image 1", size="sm", elem_id="make-first")
                prompt = lay("prompt", gr.Textbox(
                    label="What to change", lines=2, elem_id="prompt",
                    placeholder="e.g. make the sky a sunset, keep the people unchanged",
                    info="Ctrl+Enter (⌘+Enter on a Mac) runs the edit"))
                # characters and tokens, as the edit counts them
                counter = gr.Markdown(elem_id="prompt-count")
                enhance_controls = build_enhance_buttons()  # the model rewrites the instruction
                restore = gr.Button("Restore the settings saved in this PNG", visible=False, size="sm",
                                    elem_id="restore-settings")
                # The settings found in the last uploaded PNG. Not a gr.State: State makes every page
                # hold a heartbeat connection open for the session's lifetime.
                stored = gr.JSON({}, visible=False)
                with gr.Row():
                    # a model that generates: "Generate" while there is no input image (web.page.tools)
                    run = gr.Button("Generate" if family.generates else "Edit", variant="primary",
                                    elem_id="edit-button")
                    # Active only while an edit of this page runs (it looked ready to click when idle).
                    stop = gr.Button("Cancel", variant="stop", elem_id="cancel-button", interactive=False)
                # why the last edit was refused, until the next run
                message = gr.Markdown(elem_id="edit-message")
                # What comes after the Edit button on a phone, below the result (INPUT_PREVIEW_CSS)
                with gr.Column(elem_id="editor-more"):
                    # a folder of this server's own: Gradio deletes the files it served when its server
                    # stops, and a shared folder left another running server's examples blank (403)
                    examples_folder = tempfile.mkdtemp(prefix="imgedit-examples-", dir=upload_folder())
                    rows, labels = example_rows(examples_folder, max_inputs)
                    examples = gr.Examples(rows, [files, prompt], example_labels=labels,
                                           label="Examples (click one to fill the form)", elem_id="examples")
                    # Speed, LoRA, strength (imgedit.web.page.speed)
                    laid_out.update(build_speed_controls(settings))
                    canvas, masking = build_mask_controls()  # painted mask, grow, feather, strength
                    laid_out.update(masking)
                    size_preset = size_presets(max_inputs)  # the output's shape by name
                    with gr.Accordion("Advanced", open=False, elem_id="advanced"):
                        lay("negative_prompt", gr.Textbox(label="Negative prompt", value=""))
                        with gr.Row():
                            lay("seed", gr.Number(label="Seed", value=0, precision=0,
                                                  minimum=param("seed").low, maximum=param("seed").high))
                            randomize = lay("randomize_seed", gr.Checkbox(label="Randomize seed", value=True))
                        # the bounds the checks hold to (imgedit.protocol.PARAMETERS)
                        low, high = param("num_inference_steps").bounds(settings)
                        lay("num_inference_steps", gr.Number(
                            label=f"Steps ({low}-{high})", precision=0,
                            value=min(DEMO_STEPS, family_steps) if demo else family_steps))
                        low, high = param("true_cfg_scale").bounds(settings)
                        cfg = family.cfg(settings.default_true_cfg)
                        lay("true_cfg_scale", gr.Slider(low, high, value=cfg, step=0.5,
                                                        label="True CFG scale"))
                        low, high = param("num_images").bounds(settings)
                        lay("num_images", gr.Slider(low, high, value=1, step=1, label="Images per prompt"))
                        with gr.Row():
                            # The demo: a small width, the height from the input's aspect (0 = auto).
                            auto = DEMO_SIZE if demo else 0
                            width = lay("width", gr.Number(label="Width (0 = auto)", value=auto, precision=0,
                                                           minimum=0))
                            height = lay("height", gr.Number(label="Height (0 = auto)", value=0, precision=0,
                                                             minimum=0))
                        # hidden where refused
                        lay("cache", build_cache_control(settings, cache_refused))
                        # a declared parameter the page does not lay out: a control of its own (the
                        # declaration's)
                        generic = {p.name: page_control(p, settings) for p in parameters(EDIT)
                                   if p.name not in laid_out}
                    area, auto_width = (DEMO_SIZE**2, DEMO_SIZE) if demo else (1024**2, 0)
                    wire_size_presets(size_preset, files, width, height, area=area, auto_width=auto_width)
                # the page rewrites a prompt with its own button (web.page.enhance_controls): never on Edit
                lay("enhance_prompt", gr.Checkbox(False, visible=False))
            with gr.Column(elem_id="editor-right"):
                result = gr.Gallery(label="Result", format="png", columns=2, elem_id="result",
                                    interactive=False, object_fit="contain", height="auto",
                                    buttons=["download", "fullscreen"])
                status = gr.Markdown("Results appear here.", elem_id="edit-status")
                with gr.Row():
                    # Enabled once there is a result (they only said "there is no result yet" before).
                    again = gr.Button("Use this result as input", elem_id="use-result", interactive=False)
                    add = gr.Button("Add it as another input", elem_id="add-result", interactive=False)
                    download = gr.DownloadButton("Download PNG", elem_id="download-result", interactive=False)
                    reuse = gr.Button("Reuse its seed", elem_id="reuse-seed", interactive=False)
                # "Use this result as input" builds a chain of steps with Undo and Redo (web.page.chain)
                chain_controls = build_chain_controls()
                compare = gr.ImageSlider(label="Before / after (drag the handle)", format="png", type="pil",
                                         interactive=False, elem_id="compare", max_height=420)
                chosen = gr.Number(value=0, visible=False)  # the result the buttons and the comparison use
                copy_api = gr.Button("Copy as API call", size="sm", elem_id="copy-api")
                with gr.Group(visible=False, elem_id="api-call") as snippets:
                    kinds = (("gradio", "python", "gradio_client"), ("curl", "shell", "curl (REST)"),
                             ("openai", "python", "OpenAI SDK (REST)"))
                    snippet_code = [gr.Code(language=language, label=label, interactive=False,
                                            elem_id=f"api-{key}")
                                    for key, language, label in kinds]
                    snippet_inputs = gr.File(
                        label="The inputs as the snippets name them (save them beside it)",
                                             file_count="multiple", interactive=False, elem_id="api-inputs")
        made = {**laid_out, **generic}
        controls = {name: made[name] for name in fields}  # in `/edit`'s order
        page_outputs = [result, status, compare, chosen, message]
        # GPUs, Batch and History: tabs of one strip, the GPU panel's open (below the panel, with the Batch
        # tab open, they made the page 2,700 px tall before any result)
        history_api = None
        with gr.Tabs(elem_id="page-tabs"):
            with gr.Tab("GPUs", id="gpus"):
                gpu_panel = gr.HTML(elem_id="gpu-panel")  # filled on every page load (below)
            if jobs is not None:  # Batch and History tabs (web.page.batch_tab, web.page.history_tab)
                build_batch_tab(settings, manager, jobs, controls)
                history_api = build_history_tab(settings, history, controls, page_outputs, edit_page,
                                                GPU_GROUP, cache_offered=not cache_refused,
                                                family=manager.family)
        timer = gr.Timer(2.0)
        gr.HTML(INPUT_PREVIEW_CSS, padding=False)  # a style block: here it leaves no gap in the form
        # The `/edit` API: hidden inputs without ranges, so every value reaches the validator and our
        # messages.
        with gr.Row(visible=False):
            # Every parameter after `prompt` is optional in gradio_client (a value here, or a None default in
            # `edit`'s signature), and the results are named.
            api_inputs = [api_component(p) for p in parameters(EDIT)]
            api_outputs = [gr.Gallery(format="png", label="images"), gr.Number(label="seed")]
            api_button = gr.Button()

        # preprocess=False: our own code parses the raw values (junk gets our message, not a Gradio
        # processing error). Files were checked twice before a handler runs (web.page.uploads.EventGuard,
        # then Gradio's upload check); the handlers check the paths they open or return once more.
        files.upload(tools.check_uploads, files, [files, compare, restore, stored], preprocess=False,
                     api_visibility="private")
        # an example's inputs fill Before/after as an upload does (they did not: no upload event)
        examples.load_input_event.then(tools.first_input_compare, files, compare, preprocess=False,
                                       queue=False, api_visibility="private")
        # No Gradio limit: every job goes straight to the manager's line, where UI, API and REST jobs
        # wait together in arrival order and QUEUE_MAX_SIZE is enforced once; the workers' locks keep
        # each GPU to one job (concurrency_limit=None below).
        edit_inputs = list(controls.values())
        # The last refusal's message goes first, then the edit (one chain: two listeners raced, and a quick
        # refusal was wiped by the clearing of the one before).
        cleared = run.click(lambda: ("", gr.update(interactive=True)), None, [message, stop], queue=False,
                            api_visibility="private")
        # The painted strokes become a mask file first (the canvas's own preprocessing reads them).
        masked = cleared.then(painted_mask, canvas, controls["mask"], queue=False, preprocess=False,
                              api_visibility="private")
        event = masked.then(edit_page, edit_inputs, page_outputs, api_visibility="private",
                            concurrency_id=GPU_GROUP, concurrency_limit=None, preprocess=False,
                            show_progress_on=[result])
        idle = gr.update(interactive=False)
        event.then(lambda: idle, None, stop, queue=False, api_visibility="private")  # done, refused or failed
        api_button.click(edit, api_inputs, api_outputs, api_name="edit", concurrency_id=GPU_GROUP,
                                     concurrency_limit=None, validator=validate, preprocess=False)
        stop.click(lambda: ("Cancelled: nothing was kept from that run.", idle), None, [status, stop],
                   cancels=[event], queue=False, api_visibility="private")
        event.success(tools.download_chosen, [result, chosen], download, preprocess=False, queue=False,
                      api_visibility="private")
        result.change(tools.result_buttons, result, [again, add, reuse], preprocess=False, queue=False,
                      api_visibility="private")
        reuse.click(tools.reuse_seed, [result, chosen], [controls["seed"], randomize], preprocess=False,
                    queue=False, api_visibility="private")
        result.select(tools.select_result, [files, result], [chosen, compare, download], preprocess=False,
                      api_visibility="private")
        # Queued (its own default group, never behind GPU jobs): only queued events can show a toast.
        restored = tuple(p.name for p in parameters(EDIT) if p.restore)  # what a PNG's settings give back
        restore.click(functools.partial(tools.restore_settings, names=restored), stored,
                      [controls[name] for name in restored] + [randomize, restore], api_visibility="private")

        @form_signature([*fields, "canvas", "result", "chosen"])
        def api_call(*args):
            *values, canvas, gallery, index, request = args
            form = dict(zip(fields, values, strict=True))
            return tools.api_call(form, canvas, request, tools.result_seed(gallery, index))

        copy_api.click(api_call, [*edit_inputs, canvas, result, chosen],
                       [snippets, *snippet_code, snippet_inputs], preprocess=False, queue=False,
                       api_visibility="private")
        # Any change of the inputs (upload, removal, an example, a result used as input) redraws the
        # thumbnails.
        files.change(tools.preview_inputs, files, preview, preprocess=False, queue=False,
                     api_visibility="private")
        if family.generates:  # no input image: the button makes one from the prompt
            files.change(lambda paths: gr.update(value="Edit" if paths else "Generate"), files, run,
                         preprocess=False, queue=False, api_visibility="private")
        follow_first_input(files, canvas)
        wire_enhance(settings, manager, files, prompt, enhance_controls, GPU_GROUP)
        # typing sends one count at a time: keystrokes while one is on its way collapse into the last
        prompt.change(tools.prompt_count, prompt, counter, queue=False, preprocess=False,
                      api_visibility="private", trigger_mode="always_last")
        # the last refusal beside Edit is about the last edit: a rewrite starts afresh
        enhance_controls[0].click(lambda: "", None, message, queue=False, api_visibility="private")
        preview.select(tools.chosen_input, None, chosen_input, queue=False, api_visibility="private")
        first.click(tools.make_first, [files, chosen_input], files, preprocess=False, queue=False,
                    api_visibility="private")
        wire_chain(blocks, tools, files, result, chosen, again, chain_controls, prompt)
        add.click(tools.add_result, [files, result, chosen], files, preprocess=False,
                  api_visibility="private")
        # No progress timer over the panel: it is refreshed every 2 s.
        for refresh in (blocks.load, timer.tick):
            refresh(panel, None, [gpu_panel, banner], queue=False, api_visibility="private",
                    show_progress="hidden")
        gr.api(gpu_status, api_name="gpu_status", queue=False)
        if history_api is not None:
            gr.api(history_api, api_name="history", queue=False)
    return blocks
