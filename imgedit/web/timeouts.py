"""A body-read timeout for every HTTP request (uvicorn has none): a stalled upload loses its socket.

Once a request's headers are in, its body must keep coming: when no bytes arrive for
BODY_READ_TIMEOUT seconds, the client gets a 408 in OpenAI's error shape and the connection is
closed; the handler that was reading sees the client as gone. A slow but moving upload is never cut
off (the timer restarts with every chunk), and nothing is timed once the body is complete.
"""

from __future__ import annotations

import asyncio
import json
import logging

log = logging.getLogger(__name__)


class BodyReadTimeout:
    """Pure ASGI middleware (no exceptions thrown through the app: it answers, then reports a disconnect)."""

    def __init__(self, app, seconds: float):
        self.app = app
        self.seconds = seconds

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_done = timed_out = response_started = False

        async def timed_receive():
            nonlocal body_done, timed_out
            if timed_out:
                return {"type": "http.disconnect"}
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.seconds)
            except asyncio.TimeoutError:
                timed_out = True
                log.warning("%s %s: request body stalled for %ss; closing the connection",
                            scope.get("method"), scope.get("path"), self.seconds)
                if not response_started:
                    await _answer_408(send, self.seconds)
                return {"type": "http.disconnect"}
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

        await self.app(scope, timed_receive, guarded_send)


async def _answer_408(send, seconds: float) -> None:
    body = json.dumps({"error": {
        "message": f"the request body stalled: no bytes for {seconds:g} seconds (BODY_READ_TIMEOUT)",
        "type": "invalid_request_error", "param": None, "code": "body_timeout"}}).encode()
    await send({"type": "http.response.start", "status": 408, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
