"""Assemble the web app: REST routes first, then the Gradio Blocks mounted at "/" on the same port.

`build_app(settings, manager)` takes the manager from outside, so tests hand in one built on the
tiny checkpoint; `serve()` runs it with uvicorn.
"""

from __future__ import annotations

import logging

import gradio as gr
from fastapi import FastAPI

from imgedit.batch import JobService
from imgedit.cancel import build_cancel_router
from imgedit.gpus import GpuMonitor
from imgedit.history import HistoryStore
from imgedit.identity import BrowserCookie
from imgedit.jobs_api import build_jobs_router
from imgedit.metrics import Metrics
from imgedit.rest import build_router
from imgedit.settings import Settings
from imgedit.shutdown import Shutdown, ShutdownGate, drainable
from imgedit.timeouts import BodyReadTimeout
from imgedit.ui import GPU_GROUP, PAGE_HEAD, build_blocks
from imgedit.uploads import EventGuard

log = logging.getLogger(__name__)


def build_app(settings: Settings, manager, demo: bool | None = None, monitor: GpuMonitor | None = None) -> FastAPI:
    monitor = monitor or GpuMonitor()  # tests hand in one reading made-up GPUs
    manager = drainable(manager)  # stop_accepting / wait_idle / close for the SIGTERM drain
    history = HistoryStore.from_settings(settings)
    jobs = JobService(manager, history)
    blocks = build_blocks(manager, demo=settings.demo if demo is None else demo, monitor=monitor,
                          history=history, jobs=jobs)
    # api_open=False: a raw POST to /gradio_api/api/<name> must not skip the line.
    blocks.queue(api_open=False, max_size=settings.queue_max_size)

    def gradio_waiting() -> int:
        """Jobs Gradio still holds before they reach the manager's line (normally none)."""
        queues = getattr(getattr(blocks, "_queue", None), "event_queue_per_concurrency_id", {})
        event_queue = queues.get(GPU_GROUP)
        return len(event_queue.queue) if event_queue is not None else 0

    metrics = Metrics(manager, monitor, gradio_waiting)
    app = FastAPI(title="imgedit", docs_url=None, redoc_url=None)
    app.add_middleware(EventGuard)  # every Gradio event's file paths, before Gradio sees them
    app.add_middleware(BodyReadTimeout, seconds=settings.body_read_timeout)  # outermost: times every read
    app.include_router(build_jobs_router(jobs, metrics))  # before REST's /v1 catch-all (404/405 fallback)
    app.include_router(build_router(manager, metrics, monitor))
    app.include_router(build_cancel_router(blocks))  # ahead of the mount: it replaces Gradio's cancel route
    app.state.metrics = metrics
    app.state.manager = manager
    app.state.history, app.state.jobs = history, jobs
    app.state.shutdown = Shutdown(manager, settings.shutdown_grace_s)
    app.add_middleware(ShutdownGate, shutdown=app.state.shutdown)
    app.add_middleware(BrowserCookie)
    # show_error=False: only gr.Error text (our own messages) reaches users, never Gradio's or Python's.
    app = gr.mount_gradio_app(
        app, blocks, path="/", auth=settings.auth, show_error=False, max_file_size=settings.max_file_size,
        ssr_mode=False, allowed_paths=[], head=PAGE_HEAD, server_name=settings.gradio_server_name,
        server_port=settings.gradio_server_port)
    # Gradio checks that an event's input files were uploaded (and that outputs lie in allowed places)
    # only once `has_launched` is set, which launch() does and mount_gradio_app does not: without this
    # a hand-made request could have any server file copied into the cache and served back.
    blocks.has_launched = True
    return app


def serve(app: FastAPI, settings: Settings) -> None:
    from imgedit.shutdown import serve as serve_until_drained

    log.info("serving on http://%s:%d", settings.gradio_server_name, settings.gradio_server_port)
    serve_until_drained(app, settings, app.state.shutdown)  # SIGTERM: drain, then exit
