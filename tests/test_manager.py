"""The manager on the tiny checkpoint: real pipeline calls on the CPU, faults injected at the lowest seam."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
from conftest import _MANAGERS, ConcurrencyProbe, alive, cpu_plan, make_manager, picture, wait_for

from imgedit.config.settings import load_settings
from imgedit.engine.manager import PipelineManager
from imgedit.errors import Cancelled, ImgEditError, InvalidInput, OutOfGpuMemory, QueueFull, WorkerFailed
from imgedit.protocol import EditRequest, Resolved

FAST = dict(num_inference_steps=2, width=64, height=64)


def request(images=None, **kw) -> EditRequest:
    args = dict(images=(picture(),) if images is None else images, prompt="make it red", seed=7, **FAST)
    args.update(kw)
    return EditRequest(**args)


def pixels(result, index: int = 0) -> np.ndarray:
    return np.asarray(result.images[index], dtype=np.int16)


def test_plus_edit_round_trip_and_status(plus_manager):
    steps_seen = []
    result = plus_manager.edit(request(), on_step=lambda s, t: steps_seen.append((s, t)))
    assert steps_seen == [(1, 2), (2, 2)]
    assert (result.width, result.height) == (64, 64) and result.images[0].mode == "RGB"
    assert result.seed == 7 and result.steps == 2 and result.devices == ("cpu",)
    status = plus_manager.status()
    assert status.ready and status.family == "plus" and status.workers[0].state == "idle"
    assert status.workers[0].jobs_done >= 1


def test_same_seed_same_pixels_different_seed_different(plus_manager):
    a = pixels(plus_manager.edit(request(seed=11)))
    b = pixels(plus_manager.edit(request(seed=11)))
    c = pixels(plus_manager.edit(request(seed=12)))
    assert np.array_equal(a, b)
    assert np.abs(a - c).mean() > 1.0


def test_each_image_of_a_result_has_its_own_seed_and_alone_repeats(plus_manager):
    """Both PNGs of a two-image result once carried the same seed, and that seed with one image made
    image 1 only: image i is now drawn from seed + i, records it, and that seed alone makes it again."""
    both = plus_manager.edit(request(seed=40, num_images=2))
    assert [image.info["seed"] for image in both.images] == ["40", "41"]
    first, second = (plus_manager.edit(request(seed=seed)) for seed in (40, 41))
    assert first.images[0].info["seed"] == "40" and second.images[0].info["seed"] == "41"
    assert np.abs(pixels(both, 0) - pixels(first)).max() <= 1  # batch 2 vs 1: float sums may differ in the last bit
    assert np.abs(pixels(both, 1) - pixels(second)).max() <= 1
    assert np.abs(pixels(both, 0) - pixels(both, 1)).mean() > 1.0
    last = Resolved(steps=4, true_cfg_scale=4.0, negative_prompt=" ", seed=2**32 - 1, num_images=3, width=64,
                    height=64)  # the last seed wraps to 0
    assert last.image_seeds == (2**32 - 1, 0, 1)


def test_plus_takes_two_and_three_images_and_several_outputs(plus_manager):
    two = plus_manager.edit(request(images=(picture(), picture(40, 90, (200, 0, 0)))))
    assert len(two.images) == 1
    three = plus_manager.edit(request(images=(picture(),) * 3, num_images=2))
    assert len(three.images) == 2 and three.images[1].size == (64, 64)


def test_size_follows_input_aspect_when_one_side_is_given(plus_manager):
    result = plus_manager.edit(request(images=(picture(60, 120),), width=64, height=None))
    assert (result.width, result.height) == (64, 128)


def test_edit_model_takes_one_image(edit_manager):
    result = edit_manager.edit(request())
    assert result.images[0].size == (64, 64)
    with pytest.raises(InvalidInput, match="takes at most 1"):
        edit_manager.edit(request(images=(picture(), picture())))


def test_true_cfg_really_runs_two_forwards_per_step(plus_manager):
    """True CFG needs a negative prompt; the manager always passes one (' ' when empty)."""
    probe = ConcurrencyProbe(plus_manager)
    plus_manager.edit(request(negative_prompt="", true_cfg_scale=4.0, num_inference_steps=3))
    probe.close()
    with_cfg = probe.forwards["transformer"]
    probe = ConcurrencyProbe(plus_manager)
    plus_manager.edit(request(true_cfg_scale=1.0, num_inference_steps=3))
    probe.close()
    assert (with_cfg, probe.forwards["transformer"]) == (6, 3)


@pytest.mark.parametrize("kw, error, message", [
    (dict(images=()), InvalidInput, "no input image"),
    (dict(images=(picture(),) * 4), InvalidInput, "at most 3"),
    (dict(prompt="   "), InvalidInput, "prompt is empty"),
    (dict(num_inference_steps=10000), InvalidInput, "num_inference_steps 10000 is out of range"),
    (dict(true_cfg_scale=0.2), InvalidInput, "true_cfg_scale 0.2 is out of range"),
    (dict(num_images=9), InvalidInput, "num_images 9 is out of range"),
    (dict(width=8000, height=8000), InvalidInput, "the limit is 4,194,304 \\(MAX_OUTPUT_PIXELS\\)"),
    (dict(width=16, height=64), InvalidInput, "width 16 is out of range"),
    (dict(num_inference_steps=2.5), InvalidInput, "num_inference_steps must be a whole number"),
    (dict(seed=-3), InvalidInput, "seed -3 is out of range"),
])
def test_bad_requests_get_specific_errors(plus_manager, kw, error, message):
    before = plus_manager.status().workers[0].jobs_done
    with pytest.raises(error, match=message):
        plus_manager.edit(request(**kw))
    assert plus_manager.status().workers[0].jobs_done == before  # nothing ran


def test_two_threads_on_one_worker_never_overlap(plus_manager):
    probe = ConcurrencyProbe(plus_manager)
    results, errors = [], []

    def hammer(seed):
        try:
            results.append(plus_manager.edit(request(seed=seed)))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    try:
        threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        probe.close()
    assert errors == [] and len(results) == 4
    assert probe.max_active == {"worker-0": 1}


def test_cancel_stops_within_one_step_and_returns_no_image(plus_manager):
    cancel = threading.Event()
    seen = []

    def on_step(step, total):
        seen.append(step)
        if step == 2:
            cancel.set()

    # The cancel crosses to the worker process while it may already be in step 3: it stops there.
    with pytest.raises(Cancelled, match="cancelled at step [23] of 20"):
        plus_manager.edit(request(num_inference_steps=20), on_step=on_step, cancel=cancel)
    assert seen in ([1, 2], [1, 2, 3])
    status = plus_manager.status().workers[0]
    # a CPU worker keeps PyTorch's default threads (OMP_NUM_THREADS=1 in the tests); WORKER_THREADS is for GPUs
    assert status.state == "idle" and status.cpu_threads == 1
    assert plus_manager.edit(request()).images  # the worker serves the next job


def test_cancel_while_waiting_leaves_the_line(plus_ckpt):
    manager = make_manager(plus_ckpt)
    started, cancel = threading.Event(), threading.Event()
    outcome = {}

    def long_job():
        manager.edit(request(num_inference_steps=6), on_step=lambda s, t: started.set())

    def waiting_job():
        try:
            manager.edit(request(), cancel=cancel)
        except Cancelled as exc:
            outcome["error"] = exc.message

    first = threading.Thread(target=long_job)
    first.start()
    started.wait(30)
    second = threading.Thread(target=waiting_job)
    second.start()
    deadline = time.time() + 10
    while manager.waiting() != 1 and time.time() < deadline:
        time.sleep(0.01)
    assert manager.waiting() == 1
    cancel.set()
    second.join(10)
    first.join(60)
    assert outcome == {"error": "cancelled while waiting"} and manager.waiting() == 0


def test_queue_full_answers_busy_and_one_client_holds_at_most_its_share(plus_ckpt):
    """QUEUE_MAX_SIZE=2, CLIENT_SHARE=0.5: one place per client. A second waiting edit of the same
    client is refused (it once took the whole line); another client still gets in; then the line is full."""
    manager = make_manager(plus_ckpt, QUEUE_MAX_SIZE="2", CLIENT_SHARE="0.5")
    started = threading.Event()
    runner = threading.Thread(target=lambda: manager.edit(request(num_inference_steps=6, prompt="[slow] x"),
                                                          on_step=lambda s, t: started.set()))
    runner.start()
    started.wait(30)
    waiters = [threading.Thread(target=lambda c=c: manager.edit(replace(request(), client=c))) for c in ("a", "b")]
    waiters[0].start()
    wait_for(lambda: manager.waiting() == 1, 10)
    with pytest.raises(QueueFull, match=r"you already have 1 edit\(s\) waiting; one client may hold at most 1 of "
                                        r"the line's 2 places \(CLIENT_SHARE\)"):
        manager.edit(replace(request(), client="a"))
    waiters[1].start()  # another client is served
    wait_for(lambda: manager.waiting() == 2, 10)
    with pytest.raises(QueueFull, match=r"the server is busy \(2 jobs waiting\)"):
        manager.edit(replace(request(), client="c"))
    for t in (runner, *waiters):
        t.join(60)
    assert manager.waiting() == 0 and manager.workers[0].jobs_done == 3


def test_out_of_memory_keeps_the_worker_in_service(plus_manager):
    before = plus_manager.status().workers[0]
    with pytest.raises(OutOfGpuMemory, match="out of GPU memory on cpu: try a smaller output size"):
        plus_manager.edit(request(prompt="[oom] make it red"))
    after = plus_manager.status().workers[0]
    assert after.state == "idle" and after.pids == before.pids and after.restarts == before.restarts
    assert plus_manager.edit(request()).images


def test_an_out_of_memory_log_line_says_how_much_and_where():
    """The worker's log line for an out-of-memory job (the user's reply stays the short advice above): torch's
    first sentences and the frame outside torch that asked, so a GPU run's log says where memory ran out."""
    import torch

    from imgedit.runtime.runner import oom_detail

    def allocate_the_cache():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.50 GiB. GPU 0 has a total capacity of "
                                     "139.8 GiB of which 2.1 GiB is free. Of the allocated memory 11.2 GiB is "
                                     "allocated by PyTorch, and 0.3 GiB is reserved but unallocated.")
    try:
        allocate_the_cache()
    except torch.OutOfMemoryError as exc:
        detail = oom_detail(exc)
    assert detail == ("CUDA out of memory. Tried to allocate 7.50 GiB. GPU 0 has a total capacity of 139.8 GiB of "
                      "which 2.1 GiB is free (in tests/test_manager.py:"
                      f"{allocate_the_cache.__code__.co_firstlineno + 1} allocate_the_cache < "
                      f"tests/test_manager.py:{allocate_the_cache.__code__.co_firstlineno + 5} "
                      "test_an_out_of_memory_log_line_says_how_much_and_where)")


def test_what_loading_left_in_reference_cycles_is_freed_before_the_first_job(plus_ckpt, tmp_path):
    """On 2x H200 a capped worker's first edit came back 507 and the same request succeeded after the OOM's
    cleanup (a full collection, the allocator's cache emptied). The worker now runs that cleanup once loaded:
    a tensor that faults.leave_garbage leaves in an old reference cycle is freed by the time the worker is ready."""
    freed = tmp_path / "freed"
    os.environ["IMGEDIT_TEST_GARBAGE"] = str(freed)
    try:
        settings = load_settings({"QWEN_MODEL_DIR": str(plus_ckpt), "DEVICE_MAP": "cpu", "WORKER_START": "forkserver",
                                  "OUTPUT_DIR": str(tmp_path / "out")})
        manager = PipelineManager(settings, plan=cpu_plan(1), worker_hook="faults:leave_garbage")
        _MANAGERS.append(manager)
        manager.load()
    finally:
        os.environ.pop("IMGEDIT_TEST_GARBAGE")
    (pid,) = manager.status().workers[0].pids
    assert freed.read_text() == f"freed {pid}\n"
    assert manager.edit(request()).images


def test_cuda_fault_restarts_the_worker_process_and_status_says_so(plus_ckpt):
    manager = make_manager(plus_ckpt, workers=2)
    old = manager.status().workers[0].pids
    with pytest.raises(WorkerFailed, match="worker-0 hit a GPU fault .* being restarted"):
        manager.edit(request(prompt="[cuda-fault] make it red"))
    assert manager.status().healthy_workers >= 1  # the other worker serves meanwhile
    assert manager.edit(request()).images
    wait_for(lambda: manager.status().workers[0].state == "idle", 120)
    status = manager.status().workers[0]
    assert status.restarts == 1 and status.pids != old and not any(alive(p) for p in old)
    manager.close()


def test_other_errors_are_reported_without_internals(plus_manager):
    with pytest.raises(ImgEditError) as info:
        plus_manager.edit(request(prompt="[bug] make it red"))
    assert "internal error" in info.value.message and "secret" not in info.value.message
    assert info.value.kind == "internal"
    assert plus_manager.status().workers[0].state == "idle"


def test_not_ready_before_loading(plus_ckpt):
    from imgedit.errors import NotReady

    # planned from the settings, as app.py plans; its worker forked from the test's forkserver (a spawned one
    # imports torch afresh, as every app.py start in the suite does) and closed with the module
    manager = make_manager(plus_ckpt, plan="planner", load=False)
    with pytest.raises(NotReady, match="still loading"):
        manager.edit(request())
    manager.load()
    assert manager.ready and manager.plan.mode == "cpu"


def test_one_side_only_passes_the_early_check_and_follows_the_aspect(plus_manager):
    from imgedit.engine.validation import check_params

    check_params(request(width=None, height=128), plus_manager.settings, "plus")  # no images decoded yet
    result = plus_manager.edit(request(images=(picture(120, 60),), width=None, height=64))
    assert (result.width, result.height) == (128, 64)


def test_a_waiting_job_is_told_its_place_in_line(plus_ckpt):
    manager = make_manager(plus_ckpt)
    started = threading.Event()
    first = threading.Thread(target=lambda: manager.edit(request(num_inference_steps=6),
                                                         on_step=lambda s, t: started.set()))
    first.start()
    started.wait(30)
    places = []
    result = manager.edit(request(), on_wait=places.append)
    first.join(60)
    assert places and places[0] == 1  # one job (the running one) ahead of it
    assert result.images
