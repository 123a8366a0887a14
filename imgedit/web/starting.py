"""The port while the server gets ready to serve: answered from the first second, never closed.

Before the app can be built, `app.py` opens the checkpoint and inspects it and the LoRA files in a
subprocess (torch and diffusers import there: a minute on a slow first start), and starts the worker
processes. `StartingServer` binds the port first and answers every request meanwhile with a 503 that
says what the server is doing, with the seconds elapsed: `/health` in the shape the real one has while
loading (`status` "loading", a `detail`), `/v1/...` an OpenAI-shaped error with Retry-After, anything
else a small page that reloads itself. Then `handover()` stops answering and returns the listening
socket, which uvicorn serves from (connections waiting in its backlog are answered by the app): the
port is never closed between the two.

Written on the standard library's threading HTTP server, not on uvicorn or Gradio: it must be up
before either is imported, and it answers four fixed things.
"""

from __future__ import annotations

import html
import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

RETRY_AFTER_S = 5


class StartingServer:
    """Binds host:port at once (an OSError if it cannot: the port is busy); `doing` is shown to callers."""

    def __init__(self, host: str, port: int, doing: str = "starting"):
        self.doing = doing
        self.started = time.monotonic()
        outer = self

        class Handler(_Handler):
            server_state = outer

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_class = type("_Http", (_QuietHttp,), {"address_family": family})
        self._http = server_class((host, port), Handler)
        self._thread = threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="imgedit-starting", daemon=True)
        self._thread.start()

    def say(self, doing: str) -> None:
        self.doing = doing

    def detail(self) -> str:
        return f"{self.doing} ({time.monotonic() - self.started:.0f} s)"

    def handover(self) -> socket.socket:
        """Stop answering; the still-listening socket, for the real server to serve from."""
        if self._thread.is_alive():
            self._http.shutdown()
            self._thread.join()
        return self._http.socket

    def close(self) -> None:
        """Stop answering and close the port (the server did not start, or has stopped). Idempotent."""
        self.handover().close()


class _QuietHttp(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        """A client that left before its answer (BrokenPipe, reset) is not an error: socketserver would print
        its traceback to stderr. Anything else is printed as before."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    server_state: StartingServer
    protocol_version = "HTTP/1.1"
    timeout = 10  # a client that sends nothing does not hold a thread

    def do_GET(self) -> None:  # noqa: N802 - the standard library's name
        detail = self.server_state.detail()
        if self.path.split("?")[0] == "/health":
            self._send({"status": "loading", "detail": detail, "workers": []})
        elif self.path.startswith("/v1/"):
            self._send({"error": {"message": f"the server is starting: {detail}; try again shortly",
                                  "type": "server_error", "param": None, "code": "not_ready"}})
        else:
            page = (f"<!doctype html><html><head><meta charset='utf-8'><title>imgedit is starting</title>"
                    f"<meta http-equiv='refresh' content='{RETRY_AFTER_S}'></head>"
                    "<body style='font-family:sans-serif'>"
                    f"<h1>imgedit is starting</h1><p>{html.escape(detail)}</p>"
                    "<p>This page reloads itself; the editor appears when the server is ready.</p>"
                    "</body></html>")
            self._send(page.encode(), "text/html; charset=utf-8")

    do_HEAD = do_GET

    def do_POST(self) -> None:  # noqa: N802 - the body is not read: the connection closes after the answer
        self.do_GET()

    do_PUT = do_DELETE = do_PATCH = do_POST

    def _send(self, body: dict | bytes, content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(503)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Retry-After", str(RETRY_AFTER_S))
        self.send_header("Cache-Control", "no-store")
        # every connection closes after one answer: a kept-alive one would stay with this server (its
        # handler thread) after the handover, and never reach the app
        self.send_header("Connection", "close")
        self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - quiet: the app logs its own start-up
        pass
