"""The limits uvicorn lacks on connections themselves: a deadline for a request's headers, and caps on the
connections open at once, per client address and in all.

uvicorn times a request body (our BodyReadTimeout) and an idle keep-alive connection, but nothing between:
a client that opens sockets and sends headers without their final blank line held each socket for ever,
and 20,000 of them exhausted the server's file descriptors (it answered nothing after "Too many open
files"). Here every connection that waits for a request's headers has HEADER_READ_TIMEOUT seconds to
finish them, or it is answered 408 and closed; a connection beyond MAX_CONNECTIONS_PER_CLIENT (from one
address) or MAX_CONNECTIONS (in all) is answered 503 and closed at once. A flood of half-open connections
then costs a bounded number of file descriptors, and everyone else is served.

Written here as a subclass of uvicorn's own protocol (uvicorn.Config(http=...)): the ASGI app only sees a
request once its headers are complete, so no middleware can time them.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter

from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string

log = logging.getLogger(__name__)


def _raw_answer(status: str, message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "server_error", "param": None,
                                 "code": status.split()[0]}}).encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode() + body


def guarded_protocol(header_timeout: float, max_connections: int, max_per_client: int) -> type:
    """uvicorn's HTTP protocol class (h11, or httptools where installed) with the deadline and the caps.
    0 turns a cap off. Each call makes a class with its own count (one per server)."""
    base = import_from_string(HTTP_PROTOCOLS["auto"])
    per_client: Counter = Counter()  # the connections let in and not yet gone, per address ("" its sum)
    late = _raw_answer("408 Request Timeout",
                       f"the request's headers did not arrive within {header_timeout:g} "
                       "seconds (HEADER_READ_TIMEOUT)")

    class GuardedHTTPProtocol(base):
        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._guard_client = self.client[0] if self.client else "?"
            self._header_timer: asyncio.TimerHandle | None = None
            self._counted = False
            if max_connections and per_client[""] >= max_connections:
                self._refuse(f"the server has {max_connections} connections open (MAX_CONNECTIONS)")
            elif max_per_client and per_client[self._guard_client] >= max_per_client:
                self._refuse(f"this address has {max_per_client} connections open "
                             "(MAX_CONNECTIONS_PER_CLIENT)")
            else:
                self._counted = True
                per_client[self._guard_client] += 1
                per_client[""] += 1
                self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._release()
            super().connection_lost(exc)

        # the socket now belongs to the WebSocket protocol
        def handle_websocket_upgrade(self, *args, **kwargs):
            self._release()
            return super().handle_websocket_upgrade(*args, **kwargs)

        # ---- the deadline and the count ----
        def _waiting_for_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            """Start the headers' clock when the connection waits for a request and none is timed yet."""
            if self._header_timer is None and self._counted and self._waiting_for_headers():
                self._header_timer = self.loop.call_later(header_timeout, self._expire, self.cycle)

        def _expire(self, cycle) -> None:
            self._header_timer = None
            if self.cycle is not cycle or not self._waiting_for_headers() or self.transport.is_closing():
                self._arm()  # a request came (and maybe went) meanwhile: time the next one from now
                return
            log.info("%s: no complete request headers within %gs; closing the connection", self._guard_client,
                     header_timeout)
            self.transport.write(late)
            self.transport.close()

        def _refuse(self, why: str) -> None:
            log.warning("refused a connection from %s: %s", self._guard_client, why)
            self.transport.write(_raw_answer("503 Service Unavailable", why))
            self.transport.close()

        def _release(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            if self._counted:
                self._counted = False
                per_client[""] -= 1
                per_client[self._guard_client] -= 1
                if per_client[self._guard_client] <= 0:
                    # the memory of an address goes with its last connection
                    del per_client[self._guard_client]

    return GuardedHTTPProtocol


def uvicorn_options(settings) -> dict:
    """What every uvicorn server of the app is given (app.py's and the tests' alike)."""
    return {"http": guarded_protocol(settings.header_read_timeout, settings.max_connections,
                                     settings.max_connections_per_client)}
