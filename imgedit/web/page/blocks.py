"""The Gradio Blocks page and its API (`/edit`, `/gpu_status`, `/history`, `/batch`), built by part: the Edit
tab (its layout: web.page.editor; its events and `/edit`: web.page.edit_events), the GPU panel (below), the
Batch and History tabs (web.page.batch_tab, web.page.history_tab).

The page's Edit button and the `/edit` API are two events on one handler's work: the API's inputs are hidden
components without ranges (so gradio_client's values reach our own checks and messages), and the page raises
every problem as a gr.Error, which the page always shows.
"""

from __future__ import annotations

import gradio as gr

from imgedit.config.settings import Settings
from imgedit.engine.interface import Engine
from imgedit.engine.workers.gpus import GpuMonitor
from imgedit.planning.families import FAMILIES
from imgedit.web.page.assets import INPUT_PREVIEW_CSS
from imgedit.web.page.batch_tab import PanelRefresh, build_batch_tab
from imgedit.web.page.edit_events import GPU_GROUP, EditEvents, build_edit_api, wire_editor
from imgedit.web.page.editor import Editor, build_editor
from imgedit.web.page.history_tab import build_history_tab
from imgedit.web.page.panel import banner_html, panel_html
from imgedit.web.page.tools import PageTools
from imgedit.web.public import open_snapshot

__all__ = ["GPU_GROUP", "build_blocks"]
UPLOAD_CACHE_SWEEP_S = 600
UPLOAD_CACHE_AGE_S = 2 * 3600  # a result on a page left open longer is in History
DEMO_BANNER = ("**Demo mode**: a tiny random-weight model runs on the CPU, so outputs are noise. "
               "Set `QWEN_MODEL` or `QWEN_MODEL_DIR` to serve a real checkpoint.")


def build_blocks(settings: Settings, manager: Engine, demo: bool = False, monitor: GpuMonitor | None = None,
                 history=None, jobs=None) -> gr.Blocks:
    monitor = monitor or GpuMonitor()
    family = FAMILIES[manager.family]
    cache_refused = manager.cache_refusal()  # the Step cache control is hidden, and its value unused, then
    tools = PageTools(settings, manager.family, manager.prompt_tokens, cache_offered=not cache_refused)
    events = EditEvents(settings, manager, tools, history)
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
        editor = build_editor(settings, manager.family, demo, cache_refused)
        # GPUs, Batch and History: tabs of one strip, the GPU panel's open (below the panel, with the Batch
        # tab open, they made the page 2,700 px tall before any result)
        with gr.Tabs(elem_id="page-tabs"):
            with gr.Tab("GPUs", id="gpus"):
                panel = build_panel(blocks, manager, monitor, jobs, banner)
            if jobs is not None:  # Batch and History tabs (web.page.batch_tab, web.page.history_tab)
                history_api = build_tabs(settings, manager, history, jobs, editor, events, cache_refused,
                                         panel)
        if jobs is not None:
            gr.api(history_api, api_name="history", queue=False)
        gr.HTML(INPUT_PREVIEW_CSS, padding=False)  # a style block: here it leaves no gap in the form
        build_edit_api(events)
        wire_editor(blocks, settings, manager, events, editor)
    return blocks


def build_panel(blocks: gr.Blocks, manager: Engine, monitor: GpuMonitor, jobs,
                banner: gr.HTML) -> PanelRefresh:
    """The GPUs panel (and the banner above the editor), refreshed every 2 s, and the `/gpu_status` API.
    Returns what an event that ends a job shows them with in its last update (PanelRefresh)."""
    gpu_panel = gr.HTML(elem_id="gpu-panel")  # filled on every page load (below)
    timer = gr.Timer(2.0)

    def gpu_status() -> dict:
        """Per GPU: index, name, used/total MiB, utilisation, what is placed on it, the step it runs
        (the open view: no job ids, process ids or paths; see imgedit.web.public)."""
        return open_snapshot(monitor, manager.status())

    def panel() -> tuple[str, str]:
        data = open_snapshot(monitor, manager.status(), history=True)
        # Batch items wait in their job (one at a time enters the line): "waiting: 0" alone hid them.
        data["batch_items"] = jobs.pending_items() if jobs is not None else 0
        return panel_html(data), banner_html(data)

    # No progress timer over the panel: it is refreshed every 2 s.
    for refresh in (blocks.load, timer.tick):
        refresh(panel, None, [gpu_panel, banner], queue=False, api_visibility="private",
                show_progress="hidden")
    gr.api(gpu_status, api_name="gpu_status", queue=False)
    return PanelRefresh(panel, (gpu_panel, banner))


def build_tabs(settings: Settings, manager: Engine, history, jobs, editor: Editor, events: EditEvents,
               cache_refused: str | None, panel: PanelRefresh):
    """The Batch and History tabs, over the editor's controls; History's re-run is the Edit button's edit.
    Returns the `/history` API's function."""
    build_batch_tab(settings, manager, jobs, editor.controls, panel)
    history_api = build_history_tab(settings, history, editor.controls, editor.outputs, events.page,
                                    GPU_GROUP, cache_offered=not cache_refused, family=manager.family)
    return history_api
