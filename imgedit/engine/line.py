"""The one FIFO line in front of the workers: jobs from the page, the gradio API, REST and batches wait here
together, in arrival order, for a free worker. QUEUE_MAX_SIZE bounds the line and CLIENT_SHARE one client's
places in it. No torch; the workers' handles (imgedit.engine.workers.pool) are claimed and released here only.

Edits someone waits on (the page, the gradio API, REST) start before the waiting items of jobs (/v1/jobs,
the Batch tab: `EditRequest.background`), each kind in arrival order. And for INTERACTIVE_RESERVE_S after the
last such edit arrived, an item never takes the last idle worker of two or more: the next edit finds it free
instead of waiting for an item's 40 steps (the p99/p50 of interactive edits while a batch runs,
benchmarks/load.py). With PREEMPT_ITEMS=on an edit that is next but finds no worker free asks a running item
to pause at its next step's end (imgedit.runtime.pause): the edit takes its worker, and the item goes back
into the line before the items not yet started (`acquire(resumed=True)`), to go on from that step. One item
is asked for each edit waiting; an item that cannot pause runs on. A paused item was running: the reserve,
the line's size and a closed line (the drain) do not hold it back.

The line also knows every job in flight, from its arrival to its worker's release (`admit`), which is all
the SIGTERM drain needs (imgedit.engine.shutdown): `close` refuses new jobs and fails the waiting ones,
`wait_empty` waits for the running ones, `cancel_all` stops them at their next step.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator

from imgedit.config.settings import Settings
from imgedit.engine.shutdown import REFUSED, ShuttingDown
from imgedit.engine.workers.pool import WorkerHandle
from imgedit.errors import Cancelled, QueueFull, WorkerFailed
from imgedit.protocol import WorkerState

WaitCallback = Callable[[int], None]  # jobs ahead of this one (running ones included)


class _Ticket:
    """A place in the line (compared by identity), whose it is, and whether it is a job's item."""

    __slots__ = ("client", "background", "resumed")

    def __init__(self, client: str | None, background: bool, resumed: bool = False):
        self.client = client
        self.background = background
        self.resumed = resumed  # an item that paused for an edit: it was running


class Admitted(threading.Event):
    """A job in flight: its cancel flag, set by the drain or read through from the caller's own (the drain
    never sets the caller's flag: a batch's flag set by the drain would read as "cancelled by the user"), and
    why the drain stopped it. An item of a job also has its pause flag, set by the line while the item runs
    on a worker (`on_worker`) and an edit waits for one."""

    def __init__(self, outer: threading.Event | None, background: bool = False):
        super().__init__()
        self.outer = outer
        self.reason: str | None = None
        self.background = background
        self.on_worker = False  # claimed a worker and runs there (set by the job's thread)
        self.pausable = False  # the run there may pause (imgedit.runtime.messages.may_pause, one rank)
        self.pause = threading.Event()

    def is_set(self) -> bool:
        return super().is_set() or (self.outer is not None and self.outer.is_set())

    def stop(self, reason: str) -> None:
        self.reason = self.reason or reason
        self.set()


class Line:
    """`workers()`: the handles jobs wait for (the manager's list, read at each look). The line's condition is
    also what start-up waits on: `changed()` wakes everyone when a worker's state changes."""

    def __init__(self, settings: Settings, workers: Callable[[], list[WorkerHandle]]):
        self.settings = settings
        self._workers = workers
        self._cond = threading.Condition()
        self._tickets: collections.deque[_Ticket] = collections.deque()
        self._in_flight: list[Admitted] = []
        self._closed: str | None = None  # why jobs still waiting were dropped (`close`)
        self._waited_on_at = float("-inf")  # when the last edit someone waits on arrived (time.monotonic)

    @contextlib.contextmanager
    def admit(self, cancel: threading.Event | None, background: bool = False) -> Iterator[Admitted]:
        """A job in flight, until the block ends (its worker released): its cancel flag, linked to the
        caller's. Refused (ShuttingDown) once the line is closed; a job the drain stopped raises
        ShuttingDown with the drain's reason instead of Cancelled. `background`: an item of a job, which an
        edit waiting may ask to pause (module docstring)."""
        job = Admitted(cancel, background)
        with self._cond:
            if self._closed is not None:
                raise ShuttingDown(REFUSED)
            self._in_flight.append(job)
        try:
            yield job
        except Cancelled:
            if job.reason is not None and not (cancel is not None and cancel.is_set()):
                raise ShuttingDown(job.reason) from None
            raise
        finally:
            with self._cond:
                self._in_flight.remove(job)
                self._cond.notify_all()

    def close(self, message: str) -> None:
        """No new job from now on; every job still waiting for a worker fails at once with `message` (jobs
        on a worker go on)."""
        with self._cond:
            self._closed = message
            for job in self._in_flight:  # no item pauses for an edit that will not start
                job.pause.clear()
            self._cond.notify_all()

    def cancel_all(self, message: str) -> None:
        """Stop every job in flight at its next step; its caller gets ShuttingDown(message)."""
        with self._cond:
            for job in self._in_flight:
                job.stop(message)

    def wait_empty(self, timeout: float) -> bool:
        """Wait until no job is in flight (True), or `timeout` seconds (False)."""
        return self.wait_while(lambda: bool(self._in_flight), timeout)

    def __len__(self) -> int:
        with self._cond:
            return len(self._tickets)

    def client_places(self) -> int:
        """The most places in the line one client may hold (CLIENT_SHARE of QUEUE_MAX_SIZE, at least one)."""
        return max(1, int(self.settings.queue_max_size * self.settings.client_share))

    def changed(self) -> None:
        """A worker's state changed (or the workers stop): every waiter looks again."""
        with self._cond:
            self._cond.notify_all()

    def wait_while(self, condition: Callable[[], bool], timeout: float) -> bool:
        """Wait while `condition()` holds, looking again at each change (at least every 0.1 s); False when
        `timeout` seconds passed first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while condition():
                if time.monotonic() > deadline:
                    return False
                self._cond.wait(0.1)
        return True

    def acquire(self, cancel: threading.Event | None, on_wait: WaitCallback | None,
                client: str | None = None, background: bool = False, resumed: bool = False) -> WorkerHandle:
        """Wait in line for a free worker and claim it (WorkerHandle.claim). Refused at once when the line is
        full or the client holds its share of it; Cancelled when `cancel` is set while waiting; WorkerFailed
        when no worker is left alive. `background`: a job's item, served after the edits waiting (module
        docstring). `resumed`: an item that paused, back before the items that have not started, in the order
        the resumed ones paused; it is never refused, nor held back by the reserve or a closed line (the drain
        waits for it as for a running job)."""
        with self._cond:
            if not resumed:
                self._may_wait(client)
            ticket = _Ticket(client, background, resumed)
            if resumed:
                first_new = next((i for i, t in enumerate(self._tickets) if t.background and not t.resumed),
                                 len(self._tickets))
                self._tickets.insert(first_new, ticket)
            else:
                self._tickets.append(ticket)
            if not background:
                self._waited_on_at = time.monotonic()
            reported = -1
            try:
                while True:
                    workers = self._workers()
                    if self._closed is not None and not resumed:
                        raise ShuttingDown(self._closed)
                    if cancel is not None and cancel.is_set():
                        raise Cancelled("cancelled while waiting")
                    if not any(not w.state.ended for w in workers):
                        raise WorkerFailed("no healthy GPU worker is left; see /health")
                    if self._next(ticket) and (not background or resumed or self._item_may_start(workers)):
                        for worker in workers:
                            if worker.claim():
                                return worker
                        if not background:
                            self._ask_items_to_pause()
                    ahead = self._ahead(ticket) + sum(w.state is WorkerState.BUSY for w in workers)
                    if on_wait is not None and ahead != reported:
                        reported = ahead
                        on_wait(ahead)
                    self._cond.wait(timeout=0.05)
            finally:
                self._tickets.remove(ticket)
                self._cond.notify_all()

    def _may_wait(self, client: str | None) -> None:
        """QueueFull where the line is full, or the client holds its share of it, and no worker is idle."""
        idle = [w for w in self._workers() if w.state is WorkerState.IDLE]
        size = self.settings.queue_max_size
        waiting = [t for t in self._tickets if not t.resumed]  # a paused item does not take a new job's place
        if len(waiting) >= size and not idle:
            raise QueueFull(f"the server is busy ({len(waiting)} jobs waiting); try again later")
        held = sum(t.client == client for t in waiting) if client is not None else 0
        if held >= self.client_places() and not idle:
            raise QueueFull(f"you already have {held} edit(s) waiting; one client may hold at most "
                            f"{self.client_places()} of the line's {size} places (CLIENT_SHARE); "
                            "try again when one has started")

    def _ask_items_to_pause(self) -> None:
        """PREEMPT_ITEMS: one running item asked to pause for each edit waiting (module docstring)."""
        if self.settings.preempt_items != "on" or self._closed is not None:
            return
        running = [job for job in self._in_flight if job.background and job.on_worker and job.pausable]
        asked = sum(job.pause.is_set() for job in running)
        edits = sum(not t.background for t in self._tickets)
        for job in running:
            if asked >= edits:
                return
            if not job.pause.is_set():
                job.pause.set()
                asked += 1

    def _next(self, ticket: _Ticket) -> bool:
        """Whether `ticket` starts next: the first edit waiting, or with none waiting the first item."""
        for waiting in self._tickets:
            if not waiting.background:
                return waiting is ticket
        return self._tickets[0] is ticket

    def _ahead(self, ticket: _Ticket) -> int:
        """The tickets that start before this one: every edit waiting comes before an item."""
        before = itertools.takewhile(lambda t: t is not ticket, self._tickets)
        if not ticket.background:
            return sum(not t.background for t in before)
        return sum(t.background for t in before) + sum(not t.background for t in self._tickets)

    def _item_may_start(self, workers: list[WorkerHandle]) -> bool:
        """An item may take an idle worker unless it is the last one of two or more serving while edits came
        in the last INTERACTIVE_RESERVE_S (module docstring)."""
        window = self.settings.interactive_reserve_s
        if window <= 0 or time.monotonic() - self._waited_on_at > window:
            return True
        if sum(w.state.serving for w in workers) < 2:
            return True
        return sum(w.state is WorkerState.IDLE for w in workers) >= 2

    def release(self, worker: WorkerHandle, job: Admitted | None = None) -> None:
        """Give a claimed worker back; the first in line takes it. `job`: the one that ran there, no longer
        on a worker (under the line's lock: an edit waiting counts the items running as it asks them to
        pause)."""
        with self._cond:
            if job is not None:
                job.on_worker = False
            worker.release()
            self._cond.notify_all()
