"""Connections that never finish their headers, and floods of them (imgedit.web.connections), over real sockets:
each half-open connection is answered 408 and closed after HEADER_READ_TIMEOUT, connections past
MAX_CONNECTIONS_PER_CLIENT (one address) or MAX_CONNECTIONS (in all) get a 503 at once, and the server keeps
answering everyone else. Attackers come from other loopback addresses (127.0.0.2, ...) than the test's own client."""

from __future__ import annotations

import select
import socket
import time

import httpx
import pytest
from conftest import make_manager, start_server, wait_for

HALF_OPEN = b"GET /health HTTP/1.1\r\nHost: x\r\n"  # no final blank line: the headers never end


@pytest.fixture(scope="module")
def guarded_server(plus_ckpt):
    manager = make_manager(plus_ckpt, HEADER_READ_TIMEOUT="2", MAX_CONNECTIONS_PER_CLIENT="30",
                           MAX_CONNECTIONS="100")
    with start_server(manager) as server:
        yield server


def half_open(port: int, source: str) -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    try:
        sock.sendall(HALF_OPEN)
    except OSError:  # already answered and closed
        pass
    return sock


def answer(sock: socket.socket, wait: float) -> bytes | None:
    """What the server sent before closing, or None if the socket is still open after `wait` seconds."""
    deadline = time.monotonic() + wait
    data = b""
    while True:
        readable, _, _ = select.select([sock], [], [], max(0.0, deadline - time.monotonic()))
        if not readable:
            return None
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def answers_now(socks: list[socket.socket]) -> list[bytes | None]:
    """Each socket's answer if the server has answered and closed it by now (a moment after the last one opened)."""
    time.sleep(0.5)
    return [answer(s, 0.0) for s in socks]


def test_half_open_connections_are_capped_per_client_and_closed_at_the_deadline(guarded_server):
    url, port = guarded_server.url, guarded_server.port
    started = time.monotonic()
    socks = [half_open(port, "127.0.0.2") for _ in range(80)]
    try:
        answers = answers_now(socks)
        refused = [a for a in answers if a is not None]
        held = [s for s, a in zip(socks, answers, strict=True) if a is None]
        assert len(refused) == 50 and len(held) == 30, (len(refused), len(held), {a[:40] for a in refused})
        assert all(a.startswith(b"HTTP/1.1 503") and b"MAX_CONNECTIONS_PER_CLIENT" in a for a in refused), refused[0]
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200  # another address is served meanwhile
        closed = [answer(s, 5) for s in held]
        assert time.monotonic() - started < 9
        assert all(a is not None and a.startswith(b"HTTP/1.1 408") and b"HEADER_READ_TIMEOUT" in a
                   for a in closed), closed[:2]
    finally:
        for s in socks:
            s.close()
    # the count is given back: the same address may connect again, and a whole request is served
    with socket.create_connection(("127.0.0.1", port), timeout=10) as again:
        again.sendall(HALF_OPEN + b"Connection: close\r\n\r\n")
        assert answer(again, 10).startswith(b"HTTP/1.1 200")


def test_a_flood_from_many_addresses_meets_the_servers_cap(guarded_server):
    port = guarded_server.port
    socks = [half_open(guarded_server.port, f"127.0.0.{3 + k // 30}") for k in range(120)]  # 4 addresses x 30
    try:
        answers = answers_now(socks)
        refused = [a for a in answers if a is not None]
        assert 20 <= len(refused) <= 22 and sum(a is None for a in answers) <= 100, len(refused)
        assert all(b"(MAX_CONNECTIONS)" in a for a in refused), refused[0]
    finally:
        for s in socks:
            s.close()
    def serves() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    # the server lets go of the closed sockets, then serves again
    wait_for(serves, 10, "the server did not serve again after the flood")
