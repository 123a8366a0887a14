"""Several real servers on one machine (#46 items 1, 8, 13): one server's stop never deletes another's files,
and a busy port stops a start before anything claims to serve."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from conftest import ROOT, free_port, wait_for


def start(port: int, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "app.py", "--demo", "--port", str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def ready(server: subprocess.Popen, port: int) -> None:
    def healthy() -> bool:
        assert server.poll() is None, server.stderr.read()[-3000:]
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(healthy, 180)


def example_files(cache: str) -> set[str]:
    """Every example picture a server drew into the shared upload cache."""
    return {str(p) for p in Path(cache).glob("imgedit-examples*/*.png")}


def watch_the_start(server: subprocess.Popen, url: str) -> tuple[list[str], list[httpx.Response]]:
    """Poll /health from the process's first moment until it is ready: what the starting server said it was
    doing, and its page and a REST call while it did so. The port, once it answered, never closes."""
    details, answered, pages = [], False, []
    deadline = time.monotonic() + 240
    with httpx.Client(timeout=5) as http:
        while time.monotonic() < deadline:
            time.sleep(0.05)
            assert server.poll() is None, server.stderr.read()[-3000:]
            try:
                health = http.get(f"{url}/health")
            except httpx.TransportError as exc:
                assert not answered, f"the port closed after it had answered: {exc!r}"
                continue
            answered = True
            body = health.json()
            if health.status_code == 200:
                return details, pages
            assert health.status_code == 503 and body["status"] == "loading", (health.status_code, body)
            if "detail" in body and "workers" in body and not body["workers"]:  # the starting server's
                details.append(body["detail"])
                if not pages:
                    pages.append(http.get(url))
                    pages.append(http.post(f"{url}/v1/images/edits", data={"prompt": "x"}))
    raise AssertionError(f"not ready; seen: {details}")


def test_the_port_answers_from_the_start_and_one_servers_stop_or_a_busy_port_leaves_the_others_examples(tmp_path):
    """While app.py builds the demo checkpoint and starts its workers (before the app exists) the port is already
    open: /health says "loading" with what it does, the page is a notice that reloads itself, REST says 503
    with Retry-After; the app then serves on the same socket, which is never closed in between (#44 item 4).
    A second server sharing the upload cache draws its own examples, and neither its stop nor a start refused on
    the first one's port takes the first one's examples (#46 items 1, 8, 13). One first server serves both
    halves: each app.py start imports torch in a worker of its own."""
    cache = tempfile.mkdtemp(prefix="gradio-shared-")  # both servers' upload cache, as /tmp/gradio is by default
    env = {**os.environ, "GRADIO_TEMP_DIR": cache,
           "DEMO_DIR": str(tmp_path / "demo"), "OUTPUT_DIR": str(tmp_path / "outputs"), "LOG_LEVEL": "WARNING"}
    first_port, second_port = free_port(), free_port()
    first = start(first_port, env)
    try:
        details, pages = watch_the_start(first, f"http://127.0.0.1:{first_port}")
        assert details, "the starting server was never seen"
        assert any(d.startswith(("building the demo checkpoint (", "inspecting the checkpoint")) for d in details), \
            details
        assert all(d.endswith(" s)") for d in details), details
        page, rest = pages
        assert page.status_code == 503 and "imgedit is starting" in page.text and "http-equiv='refresh'" in page.text
        assert rest.status_code == 503 and rest.headers["retry-after"] == "5"
        error = rest.json()["error"]
        assert error["code"] == "not_ready" and "the server is starting" in error["message"], error
        examples = example_files(cache)
        assert len(examples) >= 4, examples
        second = start(second_port, env)
        ready(second, second_port)
        assert len(example_files(cache) - examples) >= 4  # the second server draws its own
        second.send_signal(signal.SIGTERM)
        assert second.wait(60) == 0
        busy = start(first_port, env)  # the first one's port: refused before anything starts
        assert busy.wait(60) == 2
        said = busy.stderr.read()
        assert f"port {first_port} is in use" in said and "serving on" not in said, said[-2000:]
        for path in examples:  # the first server's examples are all still there, and served
            assert os.path.isfile(path), path
            assert httpx.get(f"http://127.0.0.1:{first_port}/gradio_api/file={path}", timeout=30).status_code == 200
        first.send_signal(signal.SIGTERM)
        assert first.wait(60) == 0
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGTERM)
            first.wait(60)


def test_help_offers_host_and_port_and_names_their_variables():
    out = subprocess.run([sys.executable, "app.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert "--host" in out.stdout and "GRADIO_SERVER_NAME" in out.stdout
    assert "--port" in out.stdout and "GRADIO_SERVER_PORT" in out.stdout


def test_outside_its_environment_or_on_another_machines_address_app_py_says_so_in_one_line(tmp_path):
    """#62: `python app.py` without the project's packages (here: no site-packages) printed a traceback ending
    in "No module named 'pynvml'"; `--host` with an address of another machine said its port was in use."""
    bare = subprocess.run([sys.executable, "-S", "-E", "app.py", "--demo"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert bare.returncode == 2 and "Traceback" not in bare.stderr, bare.stderr[-2000:]
    said = bare.stderr.strip()
    assert len(said.splitlines()) == 1 and "pip install -r requirements.txt" in said and ".venv" in said, said
    env = {**os.environ, "OUTPUT_DIR": str(tmp_path / "outputs"), "DEMO_DIR": str(tmp_path / "demo")}
    away = subprocess.run([sys.executable, "app.py", "--demo", "--host", "10.255.255.1", "--port", str(free_port())],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert away.returncode == 2 and "in use" not in away.stderr, away.stderr[-2000:]
    assert "10.255.255.1 is not an address of this machine" in away.stderr, away.stderr[-2000:]
