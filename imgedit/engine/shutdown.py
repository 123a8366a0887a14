"""Graceful shutdown: on SIGTERM stop taking jobs, let running ones finish, fail queued ones, exit.

What the manager must provide (the `Drainable` protocol below). `Draining` wraps a manager that
lacks these methods and implements them over its public interface (`run`, `status`); a manager that
has them natively is used as is:

- `stop_accepting(message)`: from now on `run` raises `ShuttingDown(message)`; every job still
  waiting in line fails at once with `ShuttingDown(message)`; jobs already on a worker go on.
- `wait_idle(timeout) -> bool`: block until no job is running (True) or the timeout passed (False).
- `cancel_running(message)`: stop the jobs still running at their next step; their callers get
  `ShuttingDown(message)`. Only used when the grace period ran out.
- `close()`: stop and join every worker process (no orphans); idempotent.

Order on SIGTERM (`Shutdown.run`): the edges answer 503 (`imgedit.web.serving.ShutdownGate`), the manager
stops accepting, running jobs get SHUTDOWN_GRACE_S, stragglers are cancelled, the manager is closed,
then uvicorn exits (closing connections within 5 s). Compose and Kubernetes grace periods must
exceed SHUTDOWN_GRACE_S + 20 s, or the platform's SIGKILL comes first.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from imgedit.errors import Cancelled, ImgEditError
from imgedit.protocol import EditRequest, EditResult

log = logging.getLogger(__name__)

NOT_STARTED = "the server is shutting down; this job was not started: submit it again in a minute"
STOPPED = "the server shut down before this job finished (SHUTDOWN_GRACE_S ran out)"
REFUSED = "the server is shutting down and takes no new jobs: try again in a minute"
STRAGGLER_S = 10  # after the grace period: time for cancelled jobs to reach their next step


class ShuttingDown(ImgEditError):
    kind = "shutting_down"


class Drainable(Protocol):
    """The shutdown interface the manager provides (see the module docstring)."""

    def stop_accepting(self, message: str) -> None: ...
    def wait_idle(self, timeout: float) -> bool: ...
    def cancel_running(self, message: str) -> None: ...
    def close(self) -> None: ...


class _Linked(threading.Event):
    """Set by the drain or by the caller's own cancel flag; the drain never sets the caller's flag
    (a batch's flag set by the drain would read as "cancelled by the user")."""

    def __init__(self, outer: threading.Event | None):
        super().__init__()
        self.outer = outer

    def is_set(self) -> bool:
        return super().is_set() or (self.outer is not None and self.outer.is_set())


class _InFlight:
    __slots__ = ("request_id", "cancel", "reason")

    def __init__(self, request_id: str, cancel: threading.Event):
        self.request_id, self.cancel, self.reason = request_id, cancel, None


class Draining:
    """Today's manager plus the `Drainable` methods, built on its public interface only: every
    `run` is tracked; a job counts as running once a worker reports its id (`status().workers`)."""

    def __init__(self, manager):
        self._manager = manager
        self._cond = threading.Condition()
        self._jobs: dict[int, _InFlight] = {}
        self._refusal: str | None = None

    def __getattr__(self, name: str):  # settings, family, status(), listeners, workers, ...
        return getattr(self._manager, name)

    @property
    def accepting(self) -> bool:
        return self._refusal is None

    async def run(self, req: EditRequest, on_step=None, on_wait=None, cancel: threading.Event | None = None,
                  params=None) -> EditResult:
        return await self._tracked(req, cancel, lambda linked: self._manager.run(
            req, on_step=on_step, on_wait=on_wait, cancel=linked, params=params))

    async def run_enhance(self, req: EditRequest, on_wait=None,
                          cancel: threading.Event | None = None) -> EditResult:
        return await self._tracked(req, cancel, lambda linked: self._manager.run_enhance(
            req, on_wait=on_wait, cancel=linked))

    async def _tracked(self, req: EditRequest, cancel: threading.Event | None, through_line) -> EditResult:
        if self._refusal is not None:
            raise ShuttingDown(self._refusal)
        job = _InFlight(req.request_id, _Linked(cancel))
        with self._cond:
            self._jobs[id(job)] = job
        try:
            return await through_line(job.cancel)
        except Cancelled:
            if job.reason is not None and not (cancel is not None and cancel.is_set()):
                raise ShuttingDown(job.reason) from None
            raise
        finally:
            with self._cond:
                del self._jobs[id(job)]
                self._cond.notify_all()

    def _running_ids(self) -> set[str]:
        return {w.job_id for w in self._manager.status().workers if w.job_id}

    def stop_accepting(self, message: str = NOT_STARTED) -> None:
        with self._cond:
            self._refusal = REFUSED
            running = self._running_ids()
            for job in self._jobs.values():
                if job.request_id not in running:
                    job.reason = message
                    job.cancel.set()  # the manager's line drops a cancelled waiter within 50 ms

    def cancel_running(self, message: str = STOPPED) -> None:
        with self._cond:
            for job in self._jobs.values():
                job.reason = job.reason or message
                job.cancel.set()

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._jobs:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.5))
        return True

    def close(self) -> None:
        close = getattr(self._manager, "close", None)
        if close is not None:
            close()


def drainable(manager) -> Drainable:
    """The manager itself when it implements the protocol, else a `Draining` wrapper."""
    methods = ("stop_accepting", "wait_idle", "cancel_running", "close")
    if all(callable(getattr(manager, m, None)) for m in methods):
        return manager
    return Draining(manager)


class Shutdown:
    """The drain, run once on the first SIGTERM/SIGINT in its own thread."""

    def __init__(self, manager: Drainable, grace_s: float):
        self.manager = manager
        self.grace_s = grace_s
        self.started = threading.Event()
        self.finished = threading.Event()

    @property
    def draining(self) -> bool:
        return self.started.is_set()

    def begin(self, then=lambda: None) -> None:
        if self.started.is_set():
            return
        self.started.set()
        threading.Thread(target=self.run, args=(then,), name="imgedit-shutdown", daemon=True).start()

    def run(self, then=lambda: None) -> None:
        started = time.monotonic()
        try:
            self.manager.stop_accepting(NOT_STARTED)
            log.info("shutting down: no new jobs; waiting up to %ss for running ones", self.grace_s)
            if not self.manager.wait_idle(self.grace_s):
                log.warning("shutting down: grace period over; cancelling the jobs still running")
                self.manager.cancel_running(STOPPED)
                self.manager.wait_idle(STRAGGLER_S)
            self.manager.close()
            log.info("shutting down: drained in %.1fs", time.monotonic() - started)
        except Exception:
            log.exception("shutting down: the drain failed; exiting anyway")
        finally:
            self.finished.set()
            then()
