"""A body-read timeout for every HTTP request (uvicorn has none): a stalled or trickling upload loses its
socket.

Once a request's headers are in, its body must keep coming: when no bytes arrive for BODY_READ_TIMEOUT
seconds, or once that long has passed the body averages under BODY_MIN_RATE bytes a second since its first
read (a byte every 2 s held a connection for ever, and two addresses doing it filled the server: issue 63),
the client gets a 408 in OpenAI's error shape and the connection is closed; the handler that was reading
sees the client as gone. Nothing is timed once the body is complete.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from starlette.requests import ClientDisconnect

log = logging.getLogger(__name__)


class BodyReadTimeout:
    """Pure ASGI middleware (no exceptions thrown through the app: it answers, then reports a disconnect)."""

    def __init__(self, app, seconds: float, min_rate: int = 0):
        self.app = app
        self.seconds = seconds
        self.min_rate = min_rate

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_done = timed_out = response_started = False
        started, received = None, 0

        async def timed_receive():
            nonlocal body_done, timed_out, started, received
            if timed_out:
                return {"type": "http.disconnect"}
            if body_done:
                return await receive()
            now = time.monotonic()
            started = started or now
            wait = self.seconds
            if self.min_rate:  # min_rate bytes for every second past the first `seconds`, or it is cut off
                wait = min(wait, self.seconds + received / self.min_rate - (now - started))
            try:
                if wait <= 0:
                    raise asyncio.TimeoutError
                message = await asyncio.wait_for(receive(), wait)
            except asyncio.TimeoutError:
                timed_out = True
                slow = wait < self.seconds
                why = (f"the request body came slower than {self.min_rate} bytes a second (BODY_MIN_RATE)"
                       if slow else
                       f"the request body stalled: no bytes for {self.seconds:g} seconds (BODY_READ_TIMEOUT)")
                log.warning("%s %s: %s; closing the connection", scope.get("method"), scope.get("path"), why)
                if not response_started:
                    await _answer_408(send, why)
                return {"type": "http.disconnect"}
            received += len(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def guarded_send(message):
            nonlocal response_started
            if timed_out:
                return  # the app's late answer to a client that has been answered and hung up on
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, timed_receive, guarded_send)
        except ClientDisconnect:  # a client that left mid-body: nobody to answer (was an ERROR, a traceback)
            log.info("%s %s: the client left before its body was sent", scope.get("method"),
                     scope.get("path"))


async def _answer_408(send, why: str) -> None:
    body = json.dumps({"error": {
        "message": why,
        "type": "invalid_request_error", "param": None, "code": "body_timeout"}}).encode()
    await send({"type": "http.response.start", "status": 408, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
