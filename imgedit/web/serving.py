"""Serving: uvicorn with the SIGTERM drain (imgedit.engine.shutdown), and the middleware that
answers 503 while the server drains."""

from __future__ import annotations

import logging
import signal

import uvicorn
from starlette.responses import JSONResponse

from imgedit.config.settings import Settings
from imgedit.engine.shutdown import REFUSED, Shutdown
from imgedit.web import logs
from imgedit.web.connections import uvicorn_options

log = logging.getLogger(__name__)

UVICORN_CLOSE_S = 5  # uvicorn's timeout_graceful_shutdown: open connections after the drain


class ShutdownGate:
    """ASGI middleware: while draining, `/health` says 503 and new REST jobs get a 503 JSON error.
    Reads (job status, results) still work; the page's own calls reach the handlers, which answer
    with the ShuttingDown message."""

    def __init__(self, app, shutdown: Shutdown):
        self.app = app
        self.shutdown = shutdown

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.shutdown.draining:
            path, method = scope.get("path", ""), scope.get("method", "GET")
            if path == "/health":
                response = JSONResponse({"status": "shutting_down", "message": REFUSED}, status_code=503)
                return await response(scope, receive, send)
            if path.startswith("/v1/") and method in ("POST", "PUT", "PATCH"):
                body = {"error": {"message": REFUSED, "type": "server_error", "param": None,
                                  "code": "shutting_down"}}
                response = JSONResponse(body, status_code=503, headers={"Retry-After": "60"})
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


def serve(app, settings: Settings, shutdown: Shutdown, sock=None) -> None:
    """uvicorn, except that the first SIGTERM/SIGINT starts the drain instead of closing at once;
    a second SIGINT (Ctrl-C twice) quits without waiting. `sock`: a listening socket to serve from (else
    uvicorn binds GRADIO_SERVER_NAME:GRADIO_SERVER_PORT)."""

    class GracefulServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            if shutdown.draining:
                if sig == signal.SIGINT:
                    self.should_exit = self.force_exit = True
                return
            log.info("received %s", signal.Signals(sig).name)
            shutdown.begin(then=lambda: setattr(self, "should_exit", True))

    config = uvicorn.Config(app, host=settings.gradio_server_name, port=settings.gradio_server_port,
                            log_level=settings.log_level.lower(), timeout_graceful_shutdown=UVICORN_CLOSE_S,
                            **uvicorn_options(settings))  # the headers' deadline, the connection caps
    logs.calm(*(logging.getLogger(name) for name in logs.UVICORN_LOGGERS))  # handlers uvicorn just made
    GracefulServer(config).run(sockets=[sock] if sock is not None else None)
