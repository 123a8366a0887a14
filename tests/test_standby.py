"""Standby worker processes (engine.workers.standby, runtime.standby): `python app.py` starts them before it
inspects the checkpoint, each with the GPUs of the rank it may become, they import what a worker imports
meanwhile, and each rank is given the one of its GPUs; one whose imports fail is passed over for a fresh
process. A real server on the tiny checkpoint (DEVICE_MAP=cpu, WORKER_START=spawn), and the pool alone."""

from __future__ import annotations

import io
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import ROOT, alive, free_port, http, picture, processes, wait_for

from imgedit.engine.workers.standby import StandbyPool, stop

BROKEN_PEFT = """
import multiprocessing, os, sys
if multiprocessing.current_process().name.startswith("imgedit-standby"):
    raise ImportError("broken in standby processes, for the test")
sys.path.remove(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
del sys.modules["peft"]
import peft  # the installed one, which takes this one's place in sys.modules
"""


@pytest.fixture(scope="module")
def broken_peft(tmp_path_factory) -> Path:
    """A folder whose `peft` fails to import in a standby process (named imgedit-standby-N) and is the
    installed peft everywhere else: the lowest seam of a standby's import failure."""
    folder = tmp_path_factory.mktemp("broken")
    (folder / "peft").mkdir()
    (folder / "peft" / "__init__.py").write_text(BROKEN_PEFT)
    return folder


@pytest.fixture(scope="module")
def sizes_cache(tmp_path_factory) -> Path:
    """The module's servers' sizes cache: empty for the first, which inspects the checkpoint in its
    subprocess; the second finds the sizes there and plans at once."""
    return tmp_path_factory.mktemp("sizes")


class Server:
    """`python app.py` in a process group of its own, its log in a file."""

    def __init__(self, ckpt: Path, tmp: Path, sizes: Path, path: Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "QWEN_MODEL_DIR": str(ckpt), "DEVICE_MAP": "cpu", "WORKER_START": "spawn",
               "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(self.port),
               "OUTPUT_DIR": str(tmp / "outputs"), "IMGEDIT_SIZES_CACHE": str(sizes), "TORCH_DTYPE": "float32"}
        if path is not None:
            env["PYTHONPATH"] = os.pathsep.join([str(path), *filter(None, [env.get("PYTHONPATH")])])
        self.log = open(tmp / "server.log", "w+")
        self.proc = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self) -> None:
        def ready() -> bool:
            assert self.proc.poll() is None, self.output()
            try:
                return http.get(f"{self.url}/health", timeout=10).json().get("status") == "ok"
            except (httpx.HTTPError, ValueError):
                return False

        wait_for(ready, 180, "the server did not get ready")

    def pids(self) -> list[int]:
        return [p for w in http.get(f"{self.url}/v1/status", timeout=10).json()["workers"] for p in w["pids"]]

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def standby(self) -> int:
        """The pid of the standby process the server said it started."""
        found = re.findall(r"started 1 standby worker process\(es\) \((\d+)\)", self.output())
        assert len(found) == 1, self.output()
        return int(found[0])

    def stop(self) -> None:
        """SIGTERM to the server alone: it stops its workers, and nothing of its process group outlives it."""
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(60) == 0, self.output()
        wait_for(lambda: not in_group(self.proc.pid), 10, f"left in the server's group: {in_group(self.proc.pid)}")
        log = self.output()
        assert "Traceback" not in log and "leaked" not in log, log[-4000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.log.close()


def in_group(group: int) -> list[int]:
    """The live processes of a process group."""
    return [pid for pid, state, _, pgrp in processes() if pgrp == group and state != "Z"]


def test_the_rank_is_served_by_the_standby_started_before_the_inspection(plus_ckpt, tmp_path, sizes_cache):
    """The process the server started before it inspected the checkpoint (no sizes cached: the inspection's
    subprocess runs) is the one that serves: the log names it at its start, before the plan, and when the
    rank is given it; /v1/status lists it; an edit runs on it."""
    server = Server(plus_ckpt, tmp_path, sizes_cache)
    try:
        server.wait_ready()
        standby = server.standby()
        log = server.output()
        given = log.index(f"worker-0's rank 0 given the standby process {standby}")
        assert log.index("started 1 standby worker process(es)") < log.index("placement mode=cpu") < given
        assert "cannot serve" not in log, log
        assert server.pids() == [standby]
        with open(f"/proc/{standby}/stat") as f:
            assert int(f.read().rsplit(")", 1)[1].split()[1]) == server.proc.pid  # the server's own child
        png = io.BytesIO()
        picture(64, 64).save(png, "PNG")
        edit = http.post(f"{server.url}/v1/images/edits", timeout=120,
                         files={"image": ("a.png", png.getvalue(), "image/png")},
                         data={"prompt": "x", "size": "64x64", "num_inference_steps": "2"})
        assert edit.status_code == 200, edit.text
        assert server.pids() == [standby]
        server.stop()
    finally:
        server.kill()


def test_a_standby_whose_imports_fail_gives_way_to_a_fresh_process(plus_ckpt, tmp_path, sizes_cache,
                                                                   broken_peft):
    """peft fails to import in the standby only (the sizes are cached, so the plan may come before its imports
    end): the rank starts in a fresh process that serves, with one WARNING that says why."""
    server = Server(plus_ckpt, tmp_path, sizes_cache, broken_peft)
    try:
        server.wait_ready()
        standby = server.standby()
        warnings = [line for line in server.output().splitlines() if " WARNING " in line]
        assert len(warnings) == 1 and re.search(
            rf"standby process {standby} cannot serve \(importing \w+ failed \(ImportError: broken in standby "
            r"processes, for the test\)\): worker-0's rank 0 starts in a fresh process", warnings[0]), warnings
        (fresh,) = server.pids()
        assert fresh != standby and alive(fresh) and not alive(standby)
        server.stop()
    finally:
        server.kill()


def test_a_standby_is_given_only_to_a_rank_of_its_gpus(monkeypatch, caplog):
    """Started with CUDA_VISIBLE_DEVICES=0 from its first instruction (an import may fix the GPUs a process
    sees): not given to a rank of GPU 1, of the server's own GPUs (None) or one that needs MAX_MEMORY's
    allocator setting; given to a rank of GPU 0."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    caplog.set_level(logging.INFO, "imgedit.engine.workers.standby")
    pool = StandbyPool(["0"], None, "INFO", capped=False)
    taken = None
    try:
        (standby,) = map(int, re.findall(r"standby worker process\(es\) \((\d+) on GPU\(s\) 0\)", caplog.text))
        # as its interpreter was started (read once it has exec'd: the file is empty before)
        wait_for(lambda: Path(f"/proc/{standby}/environ").read_bytes(), 30, "the standby did not start")
        assert b"CUDA_VISIBLE_DEVICES=0" in Path(f"/proc/{standby}/environ").read_bytes().split(b"\0")
        assert "CUDA_VISIBLE_DEVICES" not in os.environ  # the server's own is as it was
        for visible, capped in (("1", False), (None, False), ("0", True)):
            assert pool.take(visible, capped, "worker-0's rank 0") is None
        taken = pool.take("0", False, "worker-0's rank 0")
        assert taken is not None and taken.pid == standby
    finally:
        pool.close()
        if taken is not None:
            stop([taken])


def test_the_pool_passes_over_a_standby_whose_imports_failed(broken_peft, monkeypatch, caplog):
    """Taken after it said it cannot serve (and exited): no standby, a fresh process for the rank, and the
    reason logged once at WARNING."""
    monkeypatch.syspath_prepend(str(broken_peft))  # a spawned child starts with this process's sys.path
    monkeypatch.delitem(sys.modules, "peft", raising=False)
    caplog.set_level(logging.INFO, "imgedit.engine.workers.standby")
    pool = StandbyPool([None], None, "INFO", capped=False)
    try:
        (standby,) = map(int, re.findall(r"standby worker process\(es\) \((\d+)\)", caplog.text))
        wait_for(lambda: not alive(standby), 120, "the standby did not exit")  # imports, message, exit
        assert pool.take(None, False, "worker-0's rank 0") is None
    finally:
        pool.close()
    assert re.search(rf"standby process {standby} cannot serve \(importing \w+ failed \(ImportError: broken",
                     caplog.text), caplog.text
    assert [r.levelname for r in caplog.records if "cannot serve" in r.message] == ["WARNING"]
    assert "unused" not in caplog.text  # nothing left to stop


def test_the_standbys_no_rank_took_are_stopped_at_once(caplog, capfd):
    """Closed while its standby still imports (a start-up that failed early, say): the standby ends at once,
    silently, and the pool gives out no more."""
    caplog.set_level(logging.INFO, "imgedit.engine.workers.standby")
    pool = StandbyPool([None], None, "INFO", capped=False)
    (standby,) = map(int, re.findall(r"standby worker process\(es\) \((\d+)\)", caplog.text))
    time.sleep(1)  # into its imports
    pool.close()
    assert not alive(standby)
    assert f"stopped 1 unused standby process(es) ({standby},)" in caplog.text
    assert pool.take(None, False, "worker-0's rank 0") is None
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err, out + err
