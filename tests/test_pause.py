"""Items of jobs paused for an edit someone waits on, and resumed from the step they reached
(imgedit.runtime.pause, imgedit.engine.line, PREEMPT_ITEMS): the real pipeline on the tiny checkpoints, the real
line, and a real server whose one worker an edit takes from a running item."""

from __future__ import annotations

import base64
import io
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
from conftest import http, picture, start_server
from PIL import Image
from test_jobs_api import FIELDS, A, B, png, wait_finished
from test_line import Handle, settle
from test_phases import job_for, spec_for

from imgedit.config.settings import load_settings
from imgedit.engine.line import Line
from imgedit.engine.validation import resolve
from imgedit.protocol import EditRequest
from imgedit.runtime import phases
from imgedit.runtime.messages import Job
from imgedit.runtime.pause import JobPaused, latents_of, resume_of

STEPS = 6


@pytest.fixture(scope="module")
def runner(plus_ckpt):
    return phases.build_worker(spec_for(plus_ckpt), lambda doing: None)[0]


@pytest.fixture(scope="module")
def runner21(ckpt21):
    return phases.build_worker(spec_for(ckpt21), lambda doing: None)[0]


def pixels(result) -> np.ndarray:
    return np.asarray(result.images[0], dtype=np.int16)


def paused_then_resumed(runner, job, after: int) -> tuple[np.ndarray, list[int], int]:
    """Run `job` asked to pause once `after` steps are done, then resumed: its image, the steps the resumed
    run reported, and the step it paused after."""
    pause = threading.Event()

    def on_step(step: int, total: int) -> None:
        if step == after:
            pause.set()

    with pytest.raises(JobPaused) as paused:
        runner.run(job, threading.Event(), on_step, pause)
    reported: list[int] = []
    result = runner.run(replace(job, resume=paused.value.resume), threading.Event(),
                        lambda step, total: reported.append(step), threading.Event())
    return pixels(result), reported, paused.value.resume.step


@pytest.mark.parametrize("adapters", [False, True], ids=["default", "lightning"])
def test_an_item_paused_and_resumed_makes_the_image_it_makes_unpaused(runner, plus_ckpt, adapters):
    kw = dict(background=True, num_inference_steps=STEPS, true_cfg_scale=4.0, negative_prompt="blurry")
    job = job_for(plus_ckpt, **kw)
    if adapters:  # the Lightning schedule (its exponential dynamic shift) continued from a tail of its sigmas
        job = replace(job, params=replace(job.params, scheduler="lightning", true_cfg_scale=1.0))
        if runner.adapters is None:
            pytest.skip("the tiny checkpoint's worker has no LoRAs: the Lightning schedule needs Adapters")
    whole = pixels(runner.run(job, threading.Event()))
    again, reported, step = paused_then_resumed(runner, job, after=2)
    assert step == 2
    assert reported == [3, 4, 5, 6], "the resumed run counts on from the step it paused after"
    assert np.array_equal(again, whole), f"max difference {np.abs(again - whole).max()}"


def test_a_2_1_text_to_image_item_paused_and_resumed_makes_the_same_image(runner21, ckpt21):
    req = EditRequest(images=(), prompt="a red boat", seed=5, num_inference_steps=STEPS, width=64, height=64,
                      background=True)
    job = Job(req, resolve(req, load_settings({"QWEN_MODEL_DIR": str(ckpt21)}), "21", None, 0), "21")
    whole = pixels(runner21.run(job, threading.Event()))
    again, _, step = paused_then_resumed(runner21, job, after=4)
    assert step == 4
    assert np.array_equal(again, whole), f"max difference {np.abs(again - whole).max()}"


@pytest.mark.parametrize("kind", ["edit someone waits on", "masked item", "step-cached item"])
def test_a_job_that_cannot_go_on_later_runs_on_when_asked_to_pause(runner, plus_ckpt, kind):
    kw: dict = dict(num_inference_steps=4, background=kind != "edit someone waits on")
    if kind == "masked item":
        mask = Image.new("L", picture().size, 0)
        mask.paste(255, (16, 16, 48, 48))
        kw["mask"] = mask
    job = job_for(plus_ckpt, **kw)
    if kind == "step-cached item":
        job = replace(job, params=replace(job.params, cache="taylorseer"))
    pause = threading.Event()
    pause.set()
    result = runner.run(job, threading.Event(), None, pause)
    assert result.steps == 4 and result.images


def test_the_latents_cross_as_bytes_in_their_dtype():
    torch = pytest.importorskip("torch")
    for dtype in (torch.bfloat16, torch.float32):
        latents = torch.randn(2, 16, 64, dtype=torch.float32).to(dtype)
        resume = resume_of(3, latents)
        assert (resume.step, resume.shape, resume.dtype) == (3, (2, 16, 64), str(dtype)[6:])
        assert isinstance(resume.latents, bytes)
        assert torch.equal(latents_of(resume), latents)


def test_a_workers_inbox_sets_the_pause_of_its_job_also_when_asked_before_it_started():
    """runtime.worker.Inbox: a Pause sets the running job's flag; one that came before the job started (the
    server sends it as soon as the line asks) is kept for it, and neither touches another job's flag."""
    import multiprocessing

    from imgedit.runtime.messages import Channel, Pause
    from imgedit.runtime.worker import Inbox

    reader, writer = multiprocessing.Pipe(duplex=False)
    inbox, send = Inbox(Channel(reader)), Channel(writer)
    send.put(Pause("early"))
    time.sleep(0.2)
    with inbox.running("early") as (cancel, pause):
        assert pause.is_set() and not cancel.is_set()
    with inbox.running("later") as (cancel, pause):
        assert not pause.is_set()
        send.put(Pause("someone-else"))
        send.put(Pause("later"))
        deadline = time.monotonic() + 5
        while not pause.is_set():
            assert time.monotonic() < deadline, "the Pause did not reach the running job"
            time.sleep(0.01)
    with inbox.running("early") as (cancel, pause):  # the same id again (a resumed run): a fresh flag
        assert not pause.is_set()


def test_an_edit_finding_every_worker_busy_asks_one_running_item_to_pause():
    worker = Handle("w0")
    line = Line(load_settings({}), lambda: [worker])
    with line.admit(None, background=True) as item:
        assert line.acquire(item, None, background=True) is worker
        item.on_worker = item.pausable = True
        got: list = []
        threading.Thread(target=lambda: got.append(line.acquire(None, None)), daemon=True).start()
        deadline = time.monotonic() + 5
        while not item.pause.is_set():
            assert time.monotonic() < deadline, "the running item was not asked to pause"
            time.sleep(0.01)
        # the item pauses: it gives the worker back and waits again, first among the items; the edit takes it
        item.on_worker = False
        line.release(worker)
        deadline = time.monotonic() + 5
        while not got:
            assert time.monotonic() < deadline, "the edit did not take the worker the item gave back"
            time.sleep(0.01)
        assert got == [worker]


def test_of_two_running_items_the_one_that_can_pause_is_asked():
    workers = [Handle("w0"), Handle("w1")]
    line = Line(load_settings({}), lambda: workers)
    with line.admit(None, background=True) as fixed, line.admit(None, background=True) as free:
        for item, pausable in ((fixed, False), (free, True)):
            line.acquire(item, None, background=True)
            item.on_worker, item.pausable = True, pausable
        threading.Thread(target=lambda: line.acquire(None, None), daemon=True).start()
        deadline = time.monotonic() + 5
        while not free.pause.is_set():
            assert time.monotonic() < deadline, "the item that can pause was not asked"
            time.sleep(0.01)
        assert not fixed.pause.is_set()
        for worker in workers:
            line.release(worker)


def test_a_paused_item_goes_on_through_the_drain_and_no_item_is_asked_after_it():
    """SIGTERM's drain (imgedit.engine.shutdown) closes the line: edits waiting fail, but an item that paused
    was running, and goes on (the drain waits for it); a pause asked before is withdrawn."""
    worker = Handle("w0")
    line = Line(load_settings({}), lambda: [worker])
    with line.admit(None, background=True) as item, line.admit(None, background=True) as other:
        line.acquire(item, None, background=True)
        item.on_worker = item.pausable = other.pausable = other.on_worker = True
        other.pause.set()
        line.close("the server is stopping")
        assert not other.pause.is_set()
        line.release(worker, item)  # the item paused: it waits again
        got: list = []
        threading.Thread(target=lambda: got.append(line.acquire(item, None, background=True, resumed=True)),
                         daemon=True).start()
        deadline = time.monotonic() + 5
        while not got:
            assert time.monotonic() < deadline, "a paused item was dropped by the drain"
            time.sleep(0.01)
        assert got == [worker]
        line._ask_items_to_pause()
        assert not item.pause.is_set()


def test_resumed_items_go_in_the_order_they_paused_and_past_the_reserve():
    """Two items paused (in that order) wait before an item that has not started; on two workers with an edit
    just seen, a resumed item still takes the last idle worker (it was running: the reserve is for new
    items)."""
    workers = [Handle("w0"), Handle("w1")]
    line = Line(load_settings({"INTERACTIVE_RESERVE_S": "120"}), lambda: workers)
    held = [line.acquire(None, None), line.acquire(None, None)]  # edits: the reserve's window is open
    order: list[str] = []

    def wait(name: str, **kw) -> threading.Thread:
        thread = threading.Thread(target=lambda: (line.acquire(None, None, background=True, **kw),
                                                  order.append(name)), daemon=True)
        thread.start()
        return thread

    wait("new")
    settle(line, 1)
    wait("paused first", resumed=True)
    settle(line, 2)
    wait("paused second", resumed=True)
    settle(line, 3)
    line.release(held[0])
    deadline = time.monotonic() + 5
    while len(order) < 1:
        assert time.monotonic() < deadline, "a resumed item was held back by the reserve"
        time.sleep(0.01)
    assert order == ["paused first"]
    line.release(workers[0])
    line.release(held[1])
    while len(order) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert order == ["paused first", "paused second"]


def test_a_paused_item_takes_no_place_of_the_line_from_new_jobs():
    worker = Handle("w0")
    line = Line(load_settings({"QUEUE_MAX_SIZE": "1", "CLIENT_SHARE": "1"}), lambda: [worker])
    held = line.acquire(None, None)
    threading.Thread(target=lambda: line.acquire(None, None, "owner", background=True, resumed=True),
                     daemon=True).start()
    settle(line, 1)
    got: list = []
    threading.Thread(target=lambda: got.append(line.acquire(None, None, "owner")), daemon=True).start()
    settle(line, 2)  # the owner's edit waits: not refused for the paused item's place
    line.release(held)
    deadline = time.monotonic() + 5
    while not got:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_with_preempt_items_off_an_edit_waits_and_no_item_is_asked():
    worker = Handle("w0")
    line = Line(load_settings({"PREEMPT_ITEMS": "off"}), lambda: [worker])
    with line.admit(None, background=True) as item:
        line.acquire(item, None, background=True)
        item.on_worker = item.pausable = True
        threading.Thread(target=lambda: line.acquire(None, None), daemon=True).start()
        settle(line, 1)
        time.sleep(0.3)
        assert not item.pause.is_set()
        line.release(worker)


def test_a_resumed_item_goes_before_the_items_waiting_and_is_never_refused_for_a_full_line():
    worker = Handle("w0")
    line = Line(load_settings({"QUEUE_MAX_SIZE": "1"}), lambda: [worker])
    held = line.acquire(None, None)
    order: list[str] = []
    first = threading.Thread(target=lambda: (line.acquire(None, None, background=True), order.append("item")),
                             daemon=True)
    first.start()
    settle(line, 1)
    resumed = threading.Thread(target=lambda: (line.acquire(None, None, background=True, resumed=True),
                                               order.append("resumed")), daemon=True)
    resumed.start()
    settle(line, 2)  # past QUEUE_MAX_SIZE: a resumed item is not refused
    line.release(held)
    deadline = time.monotonic() + 5
    while not order:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert order == ["resumed"]
    line.release(worker)
    first.join(5)
    assert order == ["resumed", "item"]


@pytest.fixture(scope="module")
def one_worker(plus_manager):
    """conftest's shared one-worker manager (PREEMPT_ITEMS at its default, on) behind a server of this module's."""
    with start_server(plus_manager) as live:
        yield live


def test_an_edit_takes_the_one_worker_from_a_running_item_which_ends_as_it_would_have(one_worker):
    """One worker, a job of one 40-step item; an edit sent while the item runs is answered before the item
    ends (the item paused for it, as /metrics counts), and the item's image is the one the same request makes
    unpaused."""
    url = one_worker.url
    edit = [("image", ("s.png", png(), "image/png"))]
    fields = {**FIELDS, "num_inference_steps": "40"}
    alone = http.post(f"{url}/v1/images/edits", files=edit, data={**fields, "response_format": "b64_json"},
                      headers=A, timeout=300)
    assert alone.status_code == 200, alone.text
    r = http.post(f"{url}/v1/jobs", files=[("batch", ("p0.png", png(), "image/png"))], data=fields, headers=A,
                  timeout=60)
    job_id = r.json()["id"]
    answered = None
    while (view := http.get(f"{url}/v1/jobs/{job_id}", headers=A, timeout=30).json())["state"] in (
            "queued", "running"):
        item = view["items"][0]
        if answered is None and item["state"] == "running" and 2 <= item["step"] <= 20:
            answer = http.post(f"{url}/v1/images/edits", files=edit, data=FIELDS, headers=B, timeout=300)
            after = http.get(f"{url}/v1/jobs/{job_id}", headers=A, timeout=30).json()["items"][0]
            answered = (answer.status_code, after["state"], after["step"])
        time.sleep(0.05)
    assert wait_finished(url, job_id)["state"] == "succeeded"
    assert answered is not None, "the item ran too fast to send an edit beside it"
    # the item had not ended: running again, or in line again after its pause (queued)
    assert answered[0] == 200 and answered[1] in ("running", "queued") and answered[2] < 40, answered
    result = http.get(f"{url}/v1/jobs/{job_id}/result", headers=A, timeout=30)
    item_pixels = np.asarray(Image.open(io.BytesIO(result.content)).convert("RGB"), dtype=np.int16)
    alone_pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(alone.json()["data"][0]["b64_json"])))
                              .convert("RGB"), dtype=np.int16)
    assert np.array_equal(item_pixels, alone_pixels), "the paused item's image is not the unpaused one's"
    metrics = http.get(f"{url}/metrics", timeout=30).text
    counted = [line for line in metrics.splitlines() if line.startswith("imgedit_item_pauses_total ")]
    assert counted and float(counted[0].split()[1]) >= 1, counted
