"""Graceful shutdown: on SIGTERM stop taking jobs, let running ones finish, fail queued ones, exit.

The engine's drain methods (imgedit.engine.interface.Engine: `stop_accepting`, `wait_idle`,
`cancel_running`, `close`) do the work; the manager implements them with the line, which knows every job in
flight (imgedit.engine.line.Line.admit). `cancel_running` is only used when the grace period ran out.

Order on SIGTERM (`Shutdown.run`): the edges answer 503 (`imgedit.web.serving.ShutdownGate`), the manager
stops accepting, running jobs get SHUTDOWN_GRACE_S, stragglers are cancelled, the manager is closed,
then uvicorn exits (closing connections within 5 s). Compose and Kubernetes grace periods must
exceed SHUTDOWN_GRACE_S + 20 s, or the platform's SIGKILL comes first.
"""

from __future__ import annotations

import logging
import threading
import time

from imgedit.engine.interface import Engine
from imgedit.errors import ImgEditError

log = logging.getLogger(__name__)

NOT_STARTED = "the server is shutting down; this job was not started: submit it again in a minute"
STOPPED = "the server shut down before this job finished (SHUTDOWN_GRACE_S ran out)"
REFUSED = "the server is shutting down and takes no new jobs: try again in a minute"
STRAGGLER_S = 10  # after the grace period: time for cancelled jobs to reach their next step


class ShuttingDown(ImgEditError):
    kind = "shutting_down"


class Shutdown:
    """The drain, run once on the first SIGTERM/SIGINT in its own thread."""

    def __init__(self, manager: Engine, grace_s: float):
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
