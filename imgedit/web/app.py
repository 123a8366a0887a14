"""The application: the one place that wires the server's parts. `Application.build` makes the job
store, history, metrics, GPU monitor and shutdown around the engine (the line and its pool of
workers); `build_app` hands each web part only what it uses and returns the ASGI app (REST routes
first, then the Gradio Blocks mounted at "/" on the same port).

The engine comes from outside (`app.py` builds it from the settings; tests hand in one built on the
tiny checkpoint); `serve()` runs the app with uvicorn and the SIGTERM drain.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import gradio as gr
from fastapi import FastAPI

from imgedit import __version__
from imgedit.config.settings import Settings
from imgedit.engine.interface import Engine
from imgedit.engine.jobs.batch import JobService
from imgedit.engine.jobs.history import HistoryStore
from imgedit.engine.shutdown import Shutdown
from imgedit.engine.workers.gpus import GpuMonitor
from imgedit.web.api import errors as api_errors
from imgedit.web.api.jobs import build_jobs_router
from imgedit.web.api.rest import build_router
from imgedit.web.identity import BrowserCookie, merge_login_keys
from imgedit.web.metrics import Metrics
from imgedit.web.page.assets import page_head
from imgedit.web.page.blocks import GPU_GROUP, build_blocks
from imgedit.web.page.cancel import build_cancel_router
from imgedit.web.page.uploads import EventGuard, PartialUploadSweeper, guard_gradio_cleanup
from imgedit.web.serving import ShutdownGate
from imgedit.web.serving import serve as serve_until_drained
from imgedit.web.sessions import PageWatch, SessionSweeper
from imgedit.web.timeouts import BodyReadTimeout

log = logging.getLogger(__name__)
API_DESCRIPTION = ("OpenAI-style REST for image edits with the Qwen image models: every `/v1` route and "
                   "`/metrics` take `Authorization: Bearer <key>` when the server has keys (Authorize, "
                   "above). The guide: docs/api.md.")


@dataclass(frozen=True)
class Application:
    """The server's parts, built once. Nothing reaches through another part for settings: each part
    was handed the settings (or the values) it uses when it was built."""

    settings: Settings
    engine: Engine  # the line in front of the workers (engine.manager.PipelineManager), and its drain
    monitor: GpuMonitor  # NVML readings (no CUDA context)
    history: HistoryStore
    jobs: JobService  # batch and /v1/jobs items, through the engine's line
    shutdown: Shutdown

    @classmethod
    def build(cls, settings: Settings, engine: Engine, monitor: GpuMonitor | None = None) -> Application:
        history = HistoryStore.from_settings(settings)
        jobs = JobService(settings, engine, history)
        merge_login_keys(settings, history, jobs.records)  # a key named as a login owns as that user
        return cls(settings=settings, engine=engine, monitor=monitor or GpuMonitor(), history=history,
                   jobs=jobs, shutdown=Shutdown(engine, settings.shutdown_grace_s))


def build_app(settings: Settings, engine: Engine, demo: bool | None = None,
              monitor: GpuMonitor | None = None) -> FastAPI:
    """The ASGI app for `engine` (tests hand in a monitor reading made-up GPUs)."""
    parts = Application.build(settings, engine, monitor)
    blocks = build_blocks(settings, parts.engine, demo=settings.demo if demo is None else demo,
                          monitor=parts.monitor, history=parts.history, jobs=parts.jobs)
    # api_open=False: a raw POST to /gradio_api/api/<name> must not skip the line.
    blocks.queue(api_open=False, max_size=settings.queue_max_size)
    _calm(getattr(blocks, "_queue", None))

    def gradio_waiting() -> int:
        """Jobs Gradio still holds before they reach the engine's line (normally none)."""
        queues = getattr(getattr(blocks, "_queue", None), "event_queue_per_concurrency_id", {})
        event_queue = queues.get(GPU_GROUP)
        return len(event_queue.queue) if event_queue is not None else 0

    metrics = Metrics(parts.engine, parts.monitor, gradio_waiting)
    # /docs: FastAPI's browsable page of the REST routes (open, as the routes' names are; each route still
    # asks for the key); Gradio's own routes are a mounted app's, not in the schema.
    app = FastAPI(title="imgedit", version=__version__, description=API_DESCRIPTION, docs_url="/docs",
                  redoc_url=None, openapi_url="/openapi.json")
    api_errors.install(app)  # every REST route's errors in OpenAI's shape
    app.add_middleware(EventGuard)  # every Gradio event's file paths, before Gradio sees them
    # outermost: times every read
    app.add_middleware(BodyReadTimeout, seconds=settings.body_read_timeout, min_rate=settings.body_min_rate)
    # before REST's /v1 catch-all (404/405 fallback)
    app.include_router(build_jobs_router(settings, parts.engine, parts.jobs, metrics))
    app.include_router(build_router(settings, parts.engine, metrics, parts.monitor, parts.history))
    # ahead of the mount: it replaces Gradio's cancel route
    app.include_router(build_cancel_router(blocks, bool(settings.auth)))
    # abandoned partial uploads (Gradio keeps them): deleted now and every few seconds
    PartialUploadSweeper(settings.body_read_timeout).start()
    guard_gradio_cleanup()  # one bad entry never stops Gradio's own sweep nor the shutdown
    # what outlives the build: the drain (serve), the history (tests read it)
    app.state.shutdown, app.state.history = parts.shutdown, parts.history
    sessions = app.state.sessions = SessionSweeper()  # Gradio's per-session state (tests read it)
    app.add_middleware(ShutdownGate, shutdown=parts.shutdown)
    app.add_middleware(BrowserCookie)
    app.add_middleware(PageWatch, sweeper=sessions)  # which Gradio sessions a page holds open
    # show_error=False: only gr.Error text (our own messages) reaches users, never Gradio's or Python's.
    app = gr.mount_gradio_app(
        app, blocks, path="/", auth=settings.auth, show_error=False, max_file_size=settings.max_file_size,
        ssr_mode=False, allowed_paths=[], head=page_head(settings), server_name=settings.gradio_server_name,
        server_port=settings.gradio_server_port)
    # Gradio checks that an event's input files were uploaded (and that outputs lie in allowed places)
    # only once `has_launched` is set, which launch() does and mount_gradio_app does not: without this
    # a hand-made request could have any server file copied into the cache and served back.
    blocks.has_launched = True
    # the mounted Gradio app, whose login cookie our own Gradio routes check (web.page.cancel)
    app.state.gradio_app = next((r.app for r in app.routes if hasattr(getattr(r, "app", None), "tokens")),
                                None)
    sessions.start(blocks)  # Gradio's per-session state: API calls' dropped, idle pages' after a while
    return app


# Gradio's queue polls its event list every 1 ms and its progress list every 10 ms while idle (Linux values
# of gradio.queueing.Queue, 6.x): measured on the 2-core machine, an idle server spent 0.085 CPU-s per second
# on it, with or without a page open. At 20 ms / 50 ms it spends 0.017: a page event starts at most 20 ms
# later (an edit takes seconds; REST jobs do not pass Gradio's queue) and progress is sent at most 20 times
# a second.
QUEUE_IDLE_POLL_S, PROGRESS_POLL_S = 0.02, 0.05


def _calm(queue) -> None:
    """Slower idle polling for Gradio's queue (private attributes: left alone, with a warning, if a Gradio
    lacks them)."""
    for name, value in (("sleep_when_free", QUEUE_IDLE_POLL_S),
                        ("progress_update_sleep_when_free", PROGRESS_POLL_S)):
        if isinstance(getattr(queue, name, None), float):
            setattr(queue, name, max(getattr(queue, name), value))
        else:
            log.warning("gradio's queue has no %s: it polls at its own rate", name)


def serve(app: FastAPI, settings: Settings, sock=None) -> None:
    """`sock`: the port, already listening (web.starting answered on it while the server started)."""
    log.info("serving on http://%s:%d", settings.gradio_server_name, settings.gradio_server_port)
    serve_until_drained(app, settings, app.state.shutdown, sock)  # SIGTERM: drain, then exit
