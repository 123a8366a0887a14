"""Worker processes and CFG-parallel pairs on the CPU: real spawned processes, a real gloo group.

The pair's image must equal the one-process image for the same seed (bit for bit on the CPU), a
cancel must stop both ranks at the same step, a killed worker process must fail only its job and
come back, and stopping the server must leave no process behind.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading

import httpx
import numpy as np
import pytest
from conftest import ROOT, ConcurrencyProbe, alive, cfg_plan, free_port, http, make_manager, picture, wait_for

from imgedit.errors import Cancelled, ImgEditError, OutOfGpuMemory, WorkerFailed
from imgedit.protocol import EditRequest

FAST = dict(num_inference_steps=3, width=64, height=64)


def request(**kw) -> EditRequest:
    args = dict(images=(picture(),), prompt="make it red", seed=5, **FAST)
    args.update(kw)
    return EditRequest(**args)


def pixels(result) -> np.ndarray:
    return np.asarray(result.images[0], dtype=np.int16)


@pytest.fixture(scope="module")
def pair(plus_ckpt):
    return make_manager(plus_ckpt, plan=cfg_plan())


def test_pair_gives_the_one_process_image_and_splits_the_forwards(pair, plus_manager):
    probe = ConcurrencyProbe(pair)
    two = pair.edit(request(negative_prompt="blurry"))
    probe.close()
    one = plus_manager.edit(request(negative_prompt="blurry"))
    assert np.array_equal(pixels(two), pixels(one))
    # 3 steps with CFG: 6 transformer forwards in all, 3 on each rank (one branch each).
    assert probe.forwards["transformer"] == 6
    status = pair.status().workers[0]
    assert status.parallel == "cfg" and status.ranks == 2 and len(set(status.pids)) == 2
    assert status.state == "idle" and status.jobs_done >= 1


def test_a_masked_edit_on_a_pair_is_the_one_process_image(pair, plus_manager):
    """Both ranks blend the same input latents and noise after every step (imgedit.runtime.masking)."""
    from PIL import Image

    mask = Image.new("L", (80, 60), 0)
    mask.paste(255, (8, 8, 48, 40))
    masked = dict(mask=mask, mask_feather=2, width=80, height=64, negative_prompt="blurry")
    two = pair.edit(request(**masked))
    one = plus_manager.edit(request(**masked))
    assert np.array_equal(pixels(two), pixels(one)) and two.images[0].size == (80, 60)
    outside = np.asarray(mask) == 0
    assert (pixels(two)[outside] == np.asarray(picture(), dtype=np.int16)[outside]).all()


def test_an_enhanced_edit_on_a_pair_is_the_one_process_image_and_a_cancelled_rewrite_stops_both(pair, plus_manager):
    """Rank 0 rewrites the prompt and hands the words (or its cancel) to rank 1, which must encode the same
    prompt (imgedit.runtime.runner.Runner._rewrite); a rewrite alone runs on rank 0."""
    words = "Make the whole picture a cold blue night."
    asked = dict(prompt=f"night [rewrite:{words}]", enhance_prompt=True, negative_prompt="blurry")
    two = pair.edit(request(**asked))
    one = plus_manager.edit(request(**asked))
    by_hand = plus_manager.edit(request(prompt=words, negative_prompt="blurry"))
    assert two.prompt == words and np.array_equal(pixels(two), pixels(one))
    assert np.array_equal(pixels(two), pixels(by_hand))
    assert pair.enhance(EditRequest(images=(picture(),), prompt=f"x [rewrite:{words}]")).prompt == words
    cancel = threading.Event()
    threading.Timer(3.0, cancel.set).start()
    with pytest.raises(Cancelled, match="rewrite"):
        pair.edit(request(prompt="slow [rewrite-slow]", enhance_prompt=True, negative_prompt="blurry"), cancel=cancel)
    # Rank 0's rewrite fails or runs out of memory: both ranks stop with its message, in step (no restart).
    for marker, error, says in (("[rewrite-bug]", ImgEditError, "the prompt rewrite failed with an internal error"),
                                ("[rewrite-oom]", OutOfGpuMemory, "while rewriting the prompt")):
        with pytest.raises(error, match=says) as failed:
            pair.edit(request(prompt=f"x {marker}", enhance_prompt=True, negative_prompt="blurry"))
        assert "secret" not in str(failed.value)
    status = pair.status().workers[0]
    assert status.state == "idle" and status.restarts == 0  # rank 1 was not left waiting for the words
    assert pair.edit(request(negative_prompt="blurry")).images  # (a rank stuck in a collective would hang here)


def test_a_step_cache_on_a_pair_is_the_one_process_image(pair, plus_manager):
    """Each rank's cache hooks see only its own branch, as the one-process pipeline's cond and uncond contexts."""
    for cache in ("first-block", "taylorseer"):
        asked = dict(cache=cache, negative_prompt="blurry", num_inference_steps=8)
        assert np.array_equal(pixels(pair.edit(request(**asked))), pixels(plus_manager.edit(request(**asked))))


def test_pair_with_cfg_off_runs_on_one_rank_and_matches(pair, plus_manager):
    probe = ConcurrencyProbe(pair)
    two = pair.edit(request(true_cfg_scale=1.0, seed=9))
    probe.close()
    one = plus_manager.edit(request(true_cfg_scale=1.0, seed=9))
    assert np.array_equal(pixels(two), pixels(one))
    assert probe.forwards["transformer"] == 3  # rank 0 alone, one forward per step


def test_cancel_stops_both_ranks_at_the_same_step_and_the_pair_serves_on(pair):
    cancel = threading.Event()
    seen = []

    def on_step(step, total):
        seen.append(step)
        if step == 2:
            cancel.set()

    with pytest.raises(Cancelled, match="cancelled at step [23] of 30"):
        pair.edit(request(num_inference_steps=30), on_step=on_step, cancel=cancel)
    assert seen[-1] <= 3
    status = pair.status().workers[0]
    assert status.state == "idle" and status.restarts == 0  # no rank left waiting in a collective
    assert pair.edit(request()).images


def test_one_rank_out_of_memory_fails_the_job_and_the_pair_comes_back(pair):
    before = pair.status().workers[0]
    with pytest.raises(OutOfGpuMemory, match="out of GPU memory"):
        pair.edit(request(prompt="[rank1-oom] make it red"))
    wait_for(lambda: pair.status().workers[0].state == "idle", 120)
    after = pair.status().workers[0]
    assert after.restarts == before.restarts + 1 and set(after.pids).isdisjoint(before.pids)
    assert not any(alive(p) for p in before.pids)
    assert pair.edit(request()).images


def test_a_worker_process_killed_mid_job_fails_only_that_job(plus_ckpt):
    manager = make_manager(plus_ckpt)
    victim = manager.status().workers[0].pids[0]
    killed = threading.Event()

    def on_step(step, total):
        if step == 1 and not killed.is_set():
            killed.set()
            os.kill(victim, signal.SIGKILL)

    with pytest.raises(WorkerFailed, match=r"worker-0's process stopped during the job \(rank 0 exit code -9\)"):
        manager.edit(request(prompt="[slow] make it red", num_inference_steps=20), on_step=on_step)
    assert manager.status().workers[0].state in ("loading", "restarting")
    # The next job waits for the restarted worker, then succeeds.
    result = manager.edit(request())
    assert result.images and manager.status().workers[0].restarts == 1
    assert victim not in manager.status().workers[0].pids
    manager.close()
    assert not any(alive(p) for p in manager.status().workers[0].pids)


def test_server_process_holds_no_cuda_or_distributed_state(pair, plus_manager):
    import torch

    assert not torch.cuda.is_initialized()
    assert not (torch.distributed.is_available() and torch.distributed.is_initialized())
    # The whole server side (web, engine, planning, config) imports no torch: its entry modules, in one fresh
    # interpreter (each one a second or more of imports).
    code = ("import sys, imgedit.engine.manager, imgedit.engine.workers.pool, imgedit.web.app, "
            "imgedit.engine.workers.gpus, imgedit.engine.workers.ray_pool, imgedit.engine.workers.inspection; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def test_stopping_the_server_leaves_no_worker_process(plus_ckpt):
    """A SIGTERM to the server's whole process group. (A SIGKILL of the server alone, mid-job: test_shutdown's
    kill -9 test, whose server's workers must follow it out as well; one app.py start there serves both.)"""
    port = free_port()
    env = {**os.environ, "QWEN_MODEL_DIR": str(plus_ckpt), "DEVICE_MAP": "cpu", "GRADIO_SERVER_PORT": str(port),
           "GRADIO_SERVER_NAME": "127.0.0.1", "LOG_LEVEL": "WARNING"}
    # a process group of its own: SIGTERM goes to all of it, server and workers, as Ctrl-C in a terminal, timeout(1)
    # or systemd send theirs (#62: "resource_tracker: ... 1 leaked semaphore" at such a stop)
    server = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        def healthy():
            try:  # a poll that gives up mid-answer leaves the starting server a BrokenPipe traceback in this
                # test's stderr (seen once with the Ray cluster starting beside it): it waits for the answer
                return http.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, 180)
        workers = [p for c in _children(server.pid) for p in [c, *_children(c)]]
        details = http.get(f"http://127.0.0.1:{port}/v1/status").json()  # /health shows no pids
        pids = [p for w in details["workers"] for p in w["pids"]]
        assert pids and set(pids) <= set(workers)
        png = io.BytesIO()
        picture(64, 64).save(png, "PNG")
        edit = http.post(f"http://127.0.0.1:{port}/v1/images/edits", timeout=120,
                         files={"image": ("a.png", png.getvalue(), "image/png")},
                         data={"prompt": "x", "size": "64x64", "num_inference_steps": "2"})
        assert edit.status_code == 200, edit.text  # the workers have run a job: theirs to clean up
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
        wait_for(lambda: not any(alive(p) for p in pids), 10)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
    said = server.stderr.read()
    assert server.returncode == 0, said[-3000:]
    assert "leaked" not in said and "Traceback" not in said, said[-3000:]


def test_health_stays_ready_while_one_of_two_workers_restarts(plus_ckpt):
    from conftest import start_server

    manager = make_manager(plus_ckpt, workers=2)
    with start_server(manager) as server:
        victim = manager.status().workers[0].pids[0]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: manager.status().workers[0].restarts == 1, 30)
        health = http.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "ok"
        states = {w["name"]: (w["state"], w["restarts"]) for w in health.json()["workers"]}
        assert states["worker-1"] == ("idle", 0) and states["worker-0"][1] == 1
        wait_for(lambda: manager.status().workers[0].state == "idle", 120)
        assert not alive(victim)
    manager.close()


def test_a_worker_process_imports_torch_with_dynamos_restart_profile_off(tmp_path):
    """runtime.worker.prepare_process sets what torch reads at import: dynamo's automatic-dynamic profile (local
    PGO) off, which took the fp8 pair's restart from 163 s to 89.3 s on 2x H200; a value the server sets stays."""
    probe = ("import sys; from imgedit.runtime.worker import prepare_process; prepare_process(None, sys.argv[1]); "
             "import os, torch._dynamo.config as c; print(c.automatic_dynamic_local_pgo, "
             "os.environ['TORCHINDUCTOR_CACHE_DIR'])")
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCH_DYNAMO_AUTOMATIC_DYNAMIC_LOCAL_PGO", "TORCHINDUCTOR_CACHE_DIR")}
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=120, check=True).stdout.split()
    assert out == ["False", str(tmp_path)]
    # WORKER_START=forkserver: the forkserver imports torch first (runtime.preload), and its forks inherit that
    forkserver = "import imgedit.runtime.preload, torch._dynamo.config as c; print(c.automatic_dynamic_local_pgo)"
    out = subprocess.run([sys.executable, "-c", forkserver], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=300, check=True).stdout.split()
    assert out == ["False"]
    env["TORCH_DYNAMO_AUTOMATIC_DYNAMIC_LOCAL_PGO"] = "1"
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=120, check=True).stdout.split()
    assert out[0] == "True"


@pytest.mark.parametrize("capped, given, expected", [
    (True, {}, ["expandable_segments:True", "unset"]), (False, {}, ["unset", "unset"]),
    (True, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}, ["max_split_size_mb:64", "unset"]),
    (True, {"PYTORCH_ALLOC_CONF": "pinned_num_register_threads:8"}, ["unset", "pinned_num_register_threads:8"]),
])
def test_a_capped_worker_grows_its_allocator_segments_in_place(capped, given, expected):
    """MAX_MEMORY workers: torch's allocator with expandable segments (2.1 under a 16 GB cap had 1.97 GiB reserved
    but unused with fixed ones); an allocator setting the server has, under either name, stays as it is; an
    uncapped worker keeps torch's default."""
    names = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    probe = ("import os; from imgedit.runtime.worker import prepare_process; "
             f"prepare_process(None, None, capped={capped}); "
             f"print(*(os.environ.get(n, 'unset') for n in {names}))")
    env = {k: v for k, v in os.environ.items() if k not in names} | given
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=120, check=True).stdout.split()
    assert out == expected
