"""A half-open connection flood against the demo server, as an attacker would send it: the server's file
descriptors and memory during and after (HEADER_READ_TIMEOUT, MAX_CONNECTIONS, MAX_CONNECTIONS_PER_CLIENT).

    python benchmarks/flood.py [--connections 3000] [--addresses 50] [--rounds 2] [--port 7931]

Starts `python app.py --demo`, opens --connections sockets from --addresses loopback addresses (127.0.1.x),
each sending request headers without their final blank line, holds them 3 s, reads the server's open
descriptors and resident memory (/proc), closes them, waits past HEADER_READ_TIMEOUT and reads again.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=3000)
    parser.add_argument("--addresses", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=7931)
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    env = {**os.environ, "GRADIO_SERVER_PORT": str(args.port), "OUTPUT_DIR": tempfile.mkdtemp(), "LOG_LEVEL": "WARNING"}
    with open(Path(tempfile.gettempdir()) / "flood-server.log", "w") as log:
        server = subprocess.Popen([sys.executable, "app.py", "--demo"], cwd=ROOT, env=env, stdout=log, stderr=log)

    def reading() -> str:
        status = Path(f"/proc/{server.pid}/status").read_text()
        rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS")) // 1024
        return f"resident {rss} MB, {len(os.listdir(f'/proc/{server.pid}/fd'))} descriptors"

    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        print("ready:", reading(), flush=True)
        per_address = -(-args.connections // args.addresses)
        for round_ in range(args.rounds):
            socks = []
            for k in range(args.connections):
                sock = socket.socket()
                sock.bind((f"127.0.1.{1 + k // per_address}", 0))
                sock.settimeout(5)
                try:
                    sock.connect(("127.0.0.1", args.port))
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
                except OSError:
                    pass
                socks.append(sock)
            time.sleep(3)
            health = httpx.get(f"{url}/health", timeout=10).status_code
            print(f"round {round_ + 1}, {args.connections} held: {reading()}; /health {health}", flush=True)
            for sock in socks:
                sock.close()
            time.sleep(12)
            print(f"round {round_ + 1}, after: {reading()}", flush=True)
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
