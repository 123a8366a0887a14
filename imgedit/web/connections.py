"""The limits uvicorn lacks on connections themselves: a deadline for a request's headers, and caps on the
connections open at once, per client address and in all, shared out so that a flood does not shut out
everyone else.

uvicorn times a request body (our BodyReadTimeout) and an idle keep-alive connection, but nothing between:
a client that opens sockets and sends headers without their final blank line held each socket for ever,
and 20,000 of them exhausted the server's file descriptors. Here every connection that waits for a
request's headers has HEADER_READ_TIMEOUT seconds to finish them, or it is answered 408 and closed; a
connection beyond MAX_CONNECTIONS_PER_CLIENT (from one address) is answered 503 and closed at once.

When the server holds MAX_CONNECTIONS, a newcomer is not simply refused (three addresses sending partial
headers, or two trickling bodies, had everyone else and /health at 503; issue 63): the address holding the
most connections gives one up, its longest-waiting connection that is idle, still sending headers, or
sending a body slower than BODY_MIN_RATE (with API keys set, one without a valid key first). Where none can
go, a few places (RESERVE) beyond the cap are kept for `/health` and requests with a valid key, each with a
short deadline for its first line.

A connection closed while its client is still sending a request body (a 408 for a slow body) is
closed gracefully, as Apache and nginx do ("lingering close"): the answer and a FIN go out, what the client
still sends is read and dropped, and the socket closes at the client's EOF or LINGER_S later. Closed at once,
its next bytes met a closed socket, whose kernel answers with a reset; a TCP stack that follows RFC 793 then
flushes what it received, the 408 with it, and the client saw "connection reset" instead of why.

Written here as a subclass of uvicorn's own protocol (uvicorn.Config(http=...)): the ASGI app only sees a
request once its headers are complete, so no middleware can time them or choose which connection goes.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Callable

import h11
from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string

from imgedit.web.identity import bearer_token

log = logging.getLogger(__name__)

RESERVE = 16  # places beyond MAX_CONNECTIONS for /health and key holders
RESERVE_PER_CLIENT = 2  # of which one address may hold
RESERVE_DEADLINE_S = 3.0  # a reserved place's headers must arrive within this
HEAD_LIMIT = 16384  # bytes of a request's head read to find its path and key (uvicorn's h11 limit is 64 KB)
LINGER_S = 2.0  # how long a connection closed mid-body reads and drops what its client still sends


def _raw_answer(status: str, message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "server_error", "param": None,
                                 "code": status.split()[0]}}).encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode() + body


def guarded_protocol(header_timeout: float, max_connections: int, max_per_client: int,
                     min_rate: int = 0, keys: tuple[str, ...] = ()) -> type:
    """uvicorn's HTTP protocol class (h11, or httptools where installed) with the deadline, the caps and their
    sharing. 0 turns a cap (or the body rate) off; `keys`: the API keys (a request carrying one is trusted).
    Each call makes a class with its own book of connections (one per server)."""
    base = import_from_string(HTTP_PROTOCOLS["auto"])
    book: dict[str, dict] = {}  # address -> its counted connections, oldest first (a dict as an ordered set)
    reserved: dict[str, int] = {}  # address -> its connections in the reserve
    counts = {"open": 0, "reserve": 0}
    late = _raw_answer("408 Request Timeout",
                       f"the request's headers did not arrive within {header_timeout:g} "
                       "seconds (HEADER_READ_TIMEOUT)")
    full = _raw_answer("503 Service Unavailable", f"the server has {max_connections} connections open "
                       "(MAX_CONNECTIONS); this one waited longest")
    late_reserved = _raw_answer("408 Request Timeout", f"the request's headers did not arrive within "
                                f"{RESERVE_DEADLINE_S:g} seconds (a reserved place: the server is full)")
    key_ok = _key_check(keys)

    class GuardedHTTPProtocol(base):
        def connection_made(self, transport: asyncio.Transport) -> None:
            self._closing = _LingeringClose(transport, self)
            super().connection_made(self._closing)  # every close uvicorn makes goes through it
            self._guard_client = self.client[0] if self.client else "?"
            self._header_timer: asyncio.TimerHandle | None = None
            self._counted = self._trusted = False
            self._reserve: str | None = None  # "waiting" for its head, then "admitted": a reserved place
            self._head = b""
            self._started, self._received = time.monotonic(), 0
            mine = len(book.get(self._guard_client, ()))
            if max_per_client and mine >= max_per_client:
                self._refuse(f"this address has {max_per_client} connections open "
                             "(MAX_CONNECTIONS_PER_CLIENT)")
            elif max_connections and counts["open"] >= max_connections and not _evict_one(mine):
                if counts["reserve"] < RESERVE and reserved.get(self._guard_client, 0) < RESERVE_PER_CLIENT:
                    self._reserve = "waiting"  # /health or a key holder only: decided on its headers
                    counts["reserve"] += 1
                    reserved[self._guard_client] = reserved.get(self._guard_client, 0) + 1
                    self._header_timer = self.loop.call_later(RESERVE_DEADLINE_S, self._expire, None)
                else:
                    self._refuse(f"the server has {max_connections} connections open (MAX_CONNECTIONS)")
            else:
                self._count()

        def data_received(self, data: bytes) -> None:
            if self._closing.lingering:
                return  # the answer is out: what the client still sends is dropped
            waiting = self._waiting_for_headers()
            if waiting and not self._head:  # a request starts: its body's rate is counted from here
                self._started, self._received = time.monotonic(), 0
            self._received += len(data)
            if waiting and (self._reserve or keys) and len(self._head) < HEAD_LIMIT:
                self._head += data[:HEAD_LIMIT - len(self._head)]
                if self._reserve == "waiting" and not self._admit_reserved():
                    return
                if keys and b"\r\n\r\n" in self._head:
                    self._trusted = key_ok(self._head)
            super().data_received(data)
            if not self._waiting_for_headers():
                self._head = b""  # the headers are in: the next request's head starts afresh
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._closing.lost()
            self._release()
            super().connection_lost(exc)

        def eof_received(self) -> None:
            if self._closing.lingering:
                self._closing.close_now()  # the client has stopped sending: nothing left to wait for
            return super().eof_received()

        def body_coming(self) -> bool:
            """Whether the client is still sending a request body (a close now would meet its next bytes), as
            h11 tracks it: not after a malformed body (ERROR) nor once the body is in, even where the answer
            came first (the cycle's more_body stays set then). False under httptools (not installed here)."""
            conn = getattr(self, "conn", None)
            return isinstance(conn, h11.Connection) and conn.their_state is h11.SEND_BODY

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to bytes h11 cannot parse, unless the app has answered already: a malformed
            chunk after the app's own error made uvicorn send a second response, which h11 refused with a
            traceback in the log ("Fatal error: protocol.data_received() call failed"); now it just closes."""
            conn = getattr(self, "conn", None)
            if isinstance(conn, h11.Connection) and conn.our_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED):
                log.info("%s: malformed request data after the answer; closing the connection",
                         self._guard_client)
                self._closing.close_now()
                return
            super().send_400_response(msg)

        # the socket now belongs to the WebSocket protocol
        def handle_websocket_upgrade(self, *args, **kwargs):
            self._release()
            return super().handle_websocket_upgrade(*args, **kwargs)

        # ---- the deadline and the count ----
        def _waiting_for_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _count(self) -> None:
            self._counted = True
            book.setdefault(self._guard_client, {})[self] = None
            counts["open"] += 1
            self._arm()

        def _arm(self) -> None:
            """Start the headers' clock when the connection waits for a request and none is timed yet."""
            if (self._header_timer is None and (self._counted or self._reserve == "admitted")
                    and self._waiting_for_headers()):
                self._header_timer = self.loop.call_later(header_timeout, self._expire, self.cycle)

        def _expire(self, cycle) -> None:
            self._header_timer = None
            if self._reserve == "waiting":
                log.info("%s: a reserved connection sent no request headers within %gs; closing it",
                         self._guard_client, RESERVE_DEADLINE_S)
                self.transport.write(late_reserved)
                self.transport.close()
                return
            if self.cycle is not cycle or not self._waiting_for_headers() or self.transport.is_closing():
                self._arm()  # a request came (and maybe went) meanwhile: time the next one from now
                return
            log.info("%s: no complete request headers within %gs; closing the connection", self._guard_client,
                     header_timeout)
            self.transport.write(late)
            self.transport.close()

        def _admit_reserved(self) -> bool:
            """A reserved place serves `/health` and requests with a valid key, once their headers are in;
            others get the 503 then. An admitted one keeps its reserved place (not a capped one) until it
            closes."""
            if b"\r\n\r\n" not in self._head and len(self._head) < HEAD_LIMIT:
                return True  # not whole yet (RESERVE_DEADLINE_S runs)
            parts = self._head.split(b"\r\n", 1)[0].split()
            health = (len(parts) >= 2 and parts[0] in (b"GET", b"HEAD")
                      and parts[1].split(b"?")[0] == b"/health")
            if health or (keys and key_ok(self._head)):
                if self._header_timer is not None:
                    self._header_timer.cancel()
                    self._header_timer = None
                self._reserve = "admitted"
                return True
            self._refuse(f"the server has {max_connections} connections open (MAX_CONNECTIONS); its reserved "
                         "places serve /health and API key holders")
            return False

        def _evictable(self, now: float) -> bool:
            """Idle, still sending headers, sending a body slower than the minimum rate, or answered and
            lingering."""
            if self._closing.lingering:
                return True
            if self.transport.is_closing():
                return False
            if self._waiting_for_headers():
                return True
            slow = min_rate and self._received < min_rate * (now - self._started)
            return bool(slow and getattr(self.cycle, "more_body", False)
                        and not getattr(self.cycle, "response_started", True))

        def _evict(self) -> None:
            log.warning("%s: closed a connection to make room (MAX_CONNECTIONS, this address holds %d)",
                        self._guard_client, len(book.get(self._guard_client, ())))
            if self._waiting_for_headers() and not self._closing.lingering:
                self.transport.write(full)
            self._release()
            self._closing.close_now()  # the room is wanted now: no lingering

        def _refuse(self, why: str) -> None:
            log.warning("refused a connection from %s: %s", self._guard_client, why)
            self.transport.write(_raw_answer("503 Service Unavailable", why))
            self._reserve_release()
            self.transport.close()

        def _reserve_release(self) -> None:
            if self._reserve:
                self._reserve = None
                counts["reserve"] -= 1
                reserved[self._guard_client] -= 1
                if reserved[self._guard_client] <= 0:
                    del reserved[self._guard_client]

        def _release(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            self._reserve_release()
            if self._counted:
                self._counted = False
                counts["open"] -= 1
                mine = book[self._guard_client]
                del mine[self]
                if not mine:
                    del book[self._guard_client]  # the memory of an address goes with its last connection

    def _evict_one(newcomer_holds: int) -> bool:
        """Room for a newcomer whose address holds `newcomer_holds`: the biggest holder (holding more) gives
        up its longest-waiting evictable connection, one without a valid key first. False: none could go."""
        holders = sorted(book.items(), key=lambda item: len(item[1]), reverse=True)
        now = time.monotonic()
        for _, connections in holders:
            if len(connections) <= newcomer_holds + 1:
                return False  # no address holds more than the newcomer would: nobody's share is taken
            candidates = [c for c in connections if c._evictable(now)]
            if candidates:
                victim = min(candidates, key=lambda c: c._trusted)  # the oldest untrusted, else the oldest
                victim._evict()
                return True
        return False

    return GuardedHTTPProtocol


class _LingeringClose:
    """A connection's transport as uvicorn's protocol sees it (all else is the real transport's): close()
    while the client is still sending a body half-closes instead, and the socket closes LINGER_S later or at
    the client's EOF (the protocol drops what comes meanwhile). Without TCP half-close (TLS) it closes at
    once."""

    def __init__(self, transport: asyncio.Transport, protocol):
        self._transport = transport
        self._protocol = protocol
        self._timer: asyncio.TimerHandle | None = None
        self.lingering = False

    def __getattr__(self, name: str):
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        if self.lingering:
            return
        transport = self._transport
        if transport.is_closing() or not transport.can_write_eof() or not self._protocol.body_coming():
            transport.close()
            return
        try:
            transport.write_eof()  # the answer, then FIN
            transport.resume_reading()  # uvicorn may have paused reading for a body its app did not take
        except OSError:  # reset meanwhile (the shutdown's ENOTCONN): nothing to linger for
            transport.close()
            return
        self.lingering = True
        self._timer = asyncio.get_running_loop().call_later(LINGER_S, self.close_now)

    def close_now(self) -> None:
        self.lost()
        self._transport.close()

    def lost(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _key_check(keys: tuple[str, ...]) -> Callable[[bytes], bool]:
    """Whether a request's head carries one of the keys, read as the REST routes read it
    (identity.bearer_token)."""
    wanted = [key.encode() for key in keys if key]

    def key_ok(head: bytes) -> bool:
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"authorization":
                # as the REST routes compare it: the header read as latin-1 (as Starlette reads it), the key
                # and the token compared as UTF-8
                token = bearer_token(value.decode("latin-1")).encode()
                return bool(token) and any(hmac.compare_digest(token, key) for key in wanted)
        return False

    return key_ok


def uvicorn_options(settings) -> dict:
    """What every uvicorn server of the app is given (app.py's and the tests' alike)."""
    keys = tuple(key for key in (settings.api_key, *(key for _, key in settings.api_keys)) if key)
    return {"http": guarded_protocol(settings.header_read_timeout, settings.max_connections,
                                     settings.max_connections_per_client, settings.body_min_rate, keys)}
