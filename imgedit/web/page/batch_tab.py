"""The page's Batch tab: many images (or a zip) x one prompt, a gallery filling in, a zip at the end.

The batch is a job of the shared `JobService` (so it waits in the one line like everything else and
is stored in the history); the handler only watches it and shows what it finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import html
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from imgedit.config.parsers import human_size
from imgedit.config.settings import Settings
from imgedit.engine.interface import Engine
from imgedit.engine.jobs.batch import Job, JobService, expand_uploads, results_zip
from imgedit.errors import ImgEditError, InputTooLarge, InvalidInput
from imgedit.protocol import BATCH, EditRequest, ItemState, parameters, request_kwargs
from imgedit.web.identity import page_owner
from imgedit.web.page.exports import download_name
from imgedit.web.page.requests import api_signature, event_fields
from imgedit.web.page.speed import parse_cache_input
from imgedit.web.page.tools import refusal, user_error

log = logging.getLogger(__name__)
BATCH_GROUP = "batch"  # unlimited in Gradio: the manager's line and JOBS_MAX_PENDING bound batches


@dataclass(frozen=True)
class PanelRefresh:
    """The GPU panel's and the banner's values now (`values()`) and their components (web.page.blocks). A
    batch sets them in its last update: left to the panel's 2 s tick, the panel still showed the worker busy
    ("a job preparing", "batch items not yet done: 3") when the tab already said done."""
    values: Callable[[], tuple[str, str]]
    outputs: tuple[gr.HTML, gr.HTML]


def _report(job: Job) -> str:
    done = sum(i.state is ItemState.SUCCEEDED for i in job.items)
    failed = [i for i in job.items if i.state in (ItemState.FAILED, ItemState.CANCELLED)]
    lines = [f"**{job.state}**: {done} of {len(job.items)} done"
             + (f", {len(failed)} failed" if failed else "")]
    running = [i for i in job.items if i.state is ItemState.RUNNING]
    if running:
        steps = ", ".join(f"{html.escape(i.name)} ({i.progress.text()})" for i in running)
        lines.append(f"running: {steps}")
    elif job.position is not None:
        lines.append(f"in line: {job.position} job(s) ahead")
    lines += [f"- {html.escape(i.name)}: {html.escape(i.error or i.state)}" for i in failed]
    return "\n".join(lines)


def progress_line(job: Job) -> str:
    """The batch's one progress line: a bar, items finished of all (failed ones count: they are over), the
    running item's step, and the time since the batch was sent. Gradio's own progress overlay is off for
    the batch (it covered every output with "0.0%", its bar did not move and its timer restarted at each
    update)."""
    finished = sum(i.state.finished for i in job.items)
    total = len(job.items)
    elapsed = int((job.finished_at if job.finished and job.finished_at else time.time()) - job.created)
    parts = [f"{finished} of {total} image(s) finished"]
    running = [i for i in job.items if i.state is ItemState.RUNNING]
    if running and running[0].progress.steps:
        parts.append(f"{html.escape(running[0].name)}: {running[0].progress.text()}")
    elif not job.finished and job.position is not None:
        parts.append(f"in line: {job.position} job(s) ahead")
    parts.append(f"{elapsed // 60}:{elapsed % 60:02d}")
    return (f'<div class="batch-line"><progress value="{finished}" max="{total}"></progress> '
            f'<span>{" · ".join(parts)}</span></div>')


BATCH_CSS = """<style>
#batch-progress .batch-line { display: flex; align-items: center; gap: 10px; font-size: 14px; }
#batch-progress progress { flex: 0 0 40%; height: 12px; accent-color: var(--color-accent); }
</style>"""


def build_batch_tab(settings: Settings, manager: Engine, jobs: JobService, controls: dict,
                    panel: PanelRefresh) -> None:
    """Inside a `gr.Tabs`: the Batch tab. `controls` are the Edit tab's ({declared parameter: its control}):
    every item runs with the ones the declaration gives the batch (protocol.PARAMETERS' "batch": the advanced
    settings, Speed, LoRA, strength and Step cache; the tab has its own files and prompt), as a single edit
    would."""
    names = [p.name for p in parameters(BATCH)]  # `/batch`'s parameters after its files
    with gr.Tab("Batch", id="batch"):
        gr.Markdown("One prompt over many images, with the editor's settings above (speed, LoRA, steps, "
                    "seed, size). Each image is its own edit in the shared line, so single edits are not "
                    "held up by a batch.")
        files = gr.File(label=f"Images or a .zip of images (up to {settings.batch_max_items})",
                        file_count="multiple", file_types=["image", ".zip"], elem_id="batch-files")
        prompt = gr.Textbox(label="What to change in every image", lines=2, elem_id="batch-prompt")
        with gr.Row():
            run = gr.Button("Run batch", variant="primary", elem_id="batch-button")
            stop = gr.Button("Cancel batch", variant="stop", elem_id="batch-cancel", interactive=False)
        gallery = gr.Gallery(label="Results", format="png", columns=4, elem_id="batch-gallery",
                             interactive=False)
        # the line's style, once (the line itself is replaced at each update)
        gr.HTML(BATCH_CSS, padding=False)
        line = gr.HTML(elem_id="batch-progress", padding=False)
        report = gr.Markdown(elem_id="batch-report", label="report")
        download = gr.File(label="All results (zip)", elem_id="batch-zip", interactive=False)
        api_only = gr.Button(visible=False, elem_id="batch-api")  # /batch's trigger: never shown

    @api_signature(BATCH, leading=("files",), progress=False)  # names and defaults: the declaration's
    async def run_batch(*args):
        """Run one prompt over every uploaded image; yields (gallery, report, zip) as items finish."""
        async with contextlib.aclosing(updates(*args)) as values:
            # closed with this one (a cancel stops the job)
            async for shown, report_text, archive, _, _ in values:
                yield shown, report_text, archive

    @functools.wraps(run_batch)  # the same parameters (names, defaults, the request) as the API's
    async def run_batch_in_page(*args):
        """The page's: the API's three values, the progress line, and with the last update the GPU panel and
        the banner (the worker is back in the line by then)."""
        async with contextlib.aclosing(updates(*args)) as values:
            async for *update, finished in values:
                shown = (gr.skip(), gr.skip())
                if finished:
                    try:
                        shown = await asyncio.to_thread(panel.values)
                    except Exception:  # e.g. NVML: the next tick shows the panel; the batch ends
                        log.exception("the GPU panel could not be refreshed after a batch")
                yield *update, *shown

    async def updates(files, *args):
        *values, request = args
        try:
            fields = event_fields(dict(zip(names, values, strict=True)))
            # "default": the server's
            fields["cache"] = parse_cache_input(fields.get("cache"), fields["speed"])
            template = EditRequest(images=(), **request_kwargs(fields), source="ui")
            # the cheap fields, and whether these workers can run them, before any file is read
            manager.check(template)
            uploads = await asyncio.to_thread(read_uploads, files, settings.batch_max_items,
                                              settings.max_file_size)
            items = expand_uploads(uploads, settings.batch_max_items, settings.max_file_size)
            owner = page_owner(request, settings.auth is not None) or f"session:{request.session_hash}"
            job = jobs.submit(owner, template, [(name, [raw]) for name, raw in items], source="ui")
        except ImgEditError as exc:
            raise user_error(exc) from None
        except OSError:
            raise refusal("the uploaded files could not be read") from None
        folder = Path(tempfile.mkdtemp(prefix="imgedit-batch-"))
        shown: list[tuple[str, str]] = []
        try:
            while True:
                shown = await asyncio.to_thread(_export, job, folder)
                if job.finished:
                    break
                yield shown, _report(job), None, progress_line(job), False
                await job.wait_change(1.0)
            rows = [(i.name, i.entry, i.error) for i in job.items]
            archive = None
            if job.entries():
                # named as single downloads are, from the prompt (it was job_<id>.zip)
                archive = folder / f"{download_name(template.prompt, None)}-{len(job.entries())}-results.zip"
                archive.write_bytes(await asyncio.to_thread(results_zip, rows))
            yield shown, _report(job), str(archive) if archive else None, progress_line(job), True
        finally:
            job.cancel.set()  # a no-op once finished; stops the rest when the user cancelled
            shutil.rmtree(folder, ignore_errors=True)

    # the tab's files and prompt, the editor's controls for the rest
    inputs = [files, *(prompt if name == "prompt" else controls[name] for name in names)]
    active, idle = gr.update(interactive=True), gr.update(interactive=False)  # Cancel only while a batch runs
    started = run.click(lambda: active, None, stop, queue=False, api_visibility="private")
    event = started.then(run_batch_in_page, inputs, [gallery, report, download, line, *panel.outputs],
                         api_visibility="private", concurrency_id=BATCH_GROUP, concurrency_limit=None,
                         show_progress="hidden")
    event.then(lambda: idle, None, stop, queue=False, api_visibility="private")
    stop.click(lambda: idle, None, stop, cancels=[event], queue=False, api_visibility="private")
    # The gradio API's /batch: (gallery, report, zip), without the page's progress line.
    api_only.click(
        run_batch, inputs, [gallery, report, download], api_name="batch", concurrency_id=BATCH_GROUP,
        concurrency_limit=None, show_progress="hidden")


def read_uploads(files, max_items: int, max_file_size: int) -> list[tuple[str, bytes]]:
    """The event's files as (name, bytes), counted before any is read (one upload named 150 times in
    one event is refused unread); a file named several times is read once and its bytes shared."""
    paths = [f if isinstance(f, str) else getattr(f, "path", None) or getattr(f, "name", str(f))
             for f in files or []]
    if len(paths) > max_items:
        raise InvalidInput(f"{len(paths)} files; a batch takes at most {max_items} images (BATCH_MAX_ITEMS)",
                           "images")
    read: dict[str, bytes] = {}
    for path in dict.fromkeys(str(p) for p in paths):
        with open(path, "rb") as f:
            raw = f.read(max_file_size + 1)
        if len(raw) > max_file_size:
            raise InputTooLarge(f"{Path(path).name} is larger than {human_size(max_file_size)} "
                                "(MAX_FILE_SIZE)")
        read[path] = raw
    return [(Path(p).name, read[str(p)]) for p in paths]


def _export(job: Job, folder: Path) -> list[tuple[str, str]]:
    """Finished outputs copied where Gradio may serve them from (OUTPUT_DIR is never served)."""
    shown = []
    for item in job.items:
        if item.entry is None:
            continue
        for k, path in enumerate(item.entry.output_paths):
            target = folder / f"{item.index:03d}-{k}.png"
            if not target.exists():
                shutil.copyfile(path, target)
            shown.append((str(target), f"{item.name} · seed {item.seed}"))
    return shown
