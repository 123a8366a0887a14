"""The port's answers while the server starts (imgedit.web.starting), against clients that leave early."""

from __future__ import annotations

import contextlib
import io
import socket
import struct
import time

import httpx

from imgedit.web.starting import StartingServer


def test_clients_that_reset_before_their_answer_print_no_traceback_and_the_port_answers_on():
    """A browser closed mid-request resets its connection: socketserver printed "Exception occurred during
    processing of request" and a BrokenPipe/ConnectionReset traceback for each one on the server's stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        server = StartingServer("127.0.0.1", 0, doing="loading the weights")
        port = server._http.server_address[1]
        try:
            for _ in range(30):  # a request, then a reset (SO_LINGER 0) before the answer is read
                client = socket.create_connection(("127.0.0.1", port))
                client.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.close()
            time.sleep(0.5)
            answer = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        finally:
            server.close()
    assert answer.status_code == 503 and answer.json()["status"] == "loading"
    assert "loading the weights" in answer.json()["detail"]
    assert err.getvalue() == ""
