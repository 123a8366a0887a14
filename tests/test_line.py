"""The line's order: edits someone waits on start before waiting items of jobs, and an item leaves the last idle
worker of two or more free for INTERACTIVE_RESERVE_S after an edit (imgedit.engine.line). The line over
stand-in worker handles (its own seam: `state`, `claim`, `release`), then the same through a real server with
two CPU workers and the jobs API."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import http, make_manager, start_server
from test_jobs_api import FIELDS, A, B, png, wait_finished

from imgedit.config.settings import load_settings
from imgedit.engine.line import Line
from imgedit.errors import Cancelled
from imgedit.protocol import WorkerState


class Handle:
    """What the line reads of a worker handle (engine.workers.pool.WorkerHandle)."""

    def __init__(self, name: str):
        self.name, self.state = name, WorkerState.IDLE

    def claim(self) -> bool:
        if self.state is WorkerState.IDLE:
            self.state = WorkerState.BUSY
            return True
        return False

    def release(self) -> None:
        self.state = WorkerState.IDLE


def line_of(workers: list[Handle], reserve_s: float = 120) -> Line:
    return Line(load_settings({"INTERACTIVE_RESERVE_S": str(reserve_s)}), lambda: workers)


def in_thread(line: Line, background: bool, got: list, cancel: threading.Event | None = None) -> threading.Thread:
    def take():
        try:
            got.append((background, line.acquire(cancel, None, background=background)))
        except Cancelled:
            got.append((background, None))

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    return thread


def settle(line: Line, waiting: int) -> None:
    deadline = time.monotonic() + 5
    while len(line) != waiting:
        assert time.monotonic() < deadline, f"{len(line)} waiting, expected {waiting}"
        time.sleep(0.01)


def test_an_edit_waiting_starts_before_an_item_that_came_first():
    worker = Handle("w0")
    line = line_of([worker])
    assert line.acquire(None, None) is worker  # a running edit
    got: list = []
    item = in_thread(line, True, got)
    settle(line, 1)
    edit = in_thread(line, False, got)
    settle(line, 2)
    line.release(worker)
    edit.join(5)
    assert got == [(False, worker)], "the edit took the worker first"
    line.release(worker)
    item.join(5)
    assert got[1] == (True, worker)


def test_an_item_leaves_the_last_idle_worker_to_edits_after_one_came():
    workers = [Handle("w0"), Handle("w1")]
    line = line_of(workers)
    first = line.acquire(None, None)  # an edit came: the reserve holds for the next 120 s
    line.release(first)
    assert line.acquire(None, None, background=True) in workers  # two idle: an item may take one
    stop, got = threading.Event(), []
    second = in_thread(line, True, got, stop)
    time.sleep(0.3)
    assert got == [] and sum(w.state is WorkerState.IDLE for w in workers) == 1, "the last idle worker is kept"
    assert line.acquire(None, None) in workers, "an edit takes the kept worker at once"
    stop.set()
    second.join(5)
    assert got == [(True, None)]


@pytest.mark.parametrize("reserve_s, edit_came", [(0, True), (120, False)])
def test_items_take_every_worker_with_the_reserve_off_or_no_edit_seen(reserve_s, edit_came):
    workers = [Handle("w0"), Handle("w1")]
    line = line_of(workers, reserve_s)
    if edit_came:
        line.release(line.acquire(None, None))
    taken = {line.acquire(None, None, background=True) for _ in workers}
    assert taken == set(workers)


def test_one_worker_is_never_kept_from_an_item():
    worker = Handle("w0")
    line = line_of([worker])
    line.release(line.acquire(None, None))
    assert line.acquire(None, None, background=True) is worker


@pytest.fixture(scope="module")
def two_workers(plus_ckpt):
    manager = make_manager(plus_ckpt, workers=2)
    with start_server(manager) as live:
        yield live


def test_a_job_on_two_workers_leaves_one_to_the_edits_and_an_edit_does_not_wait(two_workers):
    """After an edit, a job of 2 long items runs one at a time on two workers (its items never hold both), and a
    short edit sent while an item runs is answered before that item ends: it found the kept worker idle (without
    the reserve the job holds both workers and the edit waits for an item's end)."""
    url = two_workers.url
    edit = [("image", ("s.png", png(), "image/png"))]
    assert http.post(f"{url}/v1/images/edits", files=edit, data=FIELDS, headers=B, timeout=300).status_code == 200
    files = [("batch", (f"p{i}.png", png(), "image/png")) for i in range(2)]
    r = http.post(f"{url}/v1/jobs", files=files, data={**FIELDS, "num_inference_steps": "30"}, headers=A,
                  timeout=60)
    job_id = r.json()["id"]
    most, beside = 0, None
    while (view := http.get(f"{url}/v1/jobs/{job_id}", headers=A, timeout=30).json())["state"] in (
            "queued", "running"):
        running = [i for i, item in enumerate(view["items"]) if item["state"] == "running"]
        most = max(most, len(running))
        if running and beside is None and view["items"][running[0]]["step"] <= 8:
            answer = http.post(f"{url}/v1/images/edits", files=edit, data=FIELDS, headers=B, timeout=300)
            after = http.get(f"{url}/v1/jobs/{job_id}", headers=A, timeout=30).json()
            beside = (answer.status_code, after["items"][running[0]]["state"])
        time.sleep(0.05)
    assert wait_finished(url, job_id)["state"] == "succeeded"
    assert most == 1, f"the job's items held {most} workers at once"
    assert beside == (200, "running"), f"the edit's answer and the item running when it was sent: {beside}"
