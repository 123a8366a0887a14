"""Standby processes: worker processes started before the plan is known, so that their imports (12-15 s on
2x H200) run while the server inspects the checkpoint (3-19 s) rather than after it.

app.py starts the pool right after the settings are read and the GPUs found, as many processes as a plan can
use (planning.placement.most_processes), with WORKERS=local and WORKER_START=spawn only: a forked worker
imports little, and Ray starts its own actors. Each one imports what a worker imports
(imgedit.runtime.standby) and waits. ProcessTransport's first spawn takes one for a rank instead of starting
a fresh process; restarts start fresh ones. The pool is closed once every worker has started: the standbys
left are stopped. No torch here: the server process never creates a CUDA context.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from imgedit.config.settings import Settings
from imgedit.planning.placement import most_processes
from imgedit.runtime.messages import StandbyUnfit

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Standby:
    process: BaseProcess
    inbox: Connection  # the server's end of the standby's inbox (an Assignment, then the rank's messages)
    outbox: Connection  # the server's end of its outbox
    capped: bool  # prepared for MAX_MEMORY's allocator setting (runtime.worker.prepare_process)

    @property
    def pid(self) -> int:
        return self.process.pid

    def unfit(self) -> str | None:
        """Why it cannot be given a rank now, or None: it said so (before any assignment a standby sends
        nothing else), or it ended."""
        try:
            if self.outbox.poll(0):
                message = self.outbox.recv()
                if isinstance(message, StandbyUnfit):
                    return message.reason
        except (EOFError, OSError):
            return f"it ended (exit code {self.process.exitcode})"
        if not self.process.is_alive():
            return f"it ended (exit code {self.process.exitcode})"
        return None


class StandbyPool:
    """The standby processes not given a rank yet. `take` hands one out; `close` stops the rest."""

    def __init__(self, count: int, cache_dir: str | None, log_level: str, capped: bool):
        self._free: list[Standby] = []
        self._lock = threading.Lock()
        self._closed = False
        self._warned = False
        ctx = multiprocessing.get_context("spawn")
        for i in range(count):
            inbox_read, inbox_write = ctx.Pipe(duplex=False)
            outbox_read, outbox_write = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_entry, name=f"imgedit-standby-{i}", daemon=True,
                               args=(inbox_read, outbox_write, cache_dir, log_level, capped))
            proc.start()
            inbox_read.close()  # the child's ends: closed here, so a dead child reads as end-of-file
            outbox_write.close()
            self._free.append(Standby(proc, inbox_write, outbox_read, capped))
        if self._free:
            log.info("started %d standby worker process(es) %s: they import torch and the libraries while "
                     "the checkpoint is inspected", count, tuple(s.pid for s in self._free))

    @classmethod
    def for_settings(cls, settings: Settings, gpus: int) -> StandbyPool:
        """The pool for these settings and `gpus` visible GPUs: empty unless WORKERS=local and
        WORKER_START=spawn."""
        s = settings
        count = most_processes(s.device_map, gpus) if (s.workers, s.worker_start) == ("local", "spawn") else 0
        return cls(count, s.compile_cache_dir, s.log_level, capped=bool(s.max_memory))

    def take(self, capped: bool, rank: str) -> Standby | None:
        """A standby for `rank` ("worker-0's rank 1"), prepared as it needs with (`capped`) or without
        MAX_MEMORY's allocator setting, or None (none left, or the pool is closed): a fresh process then. One
        that cannot serve is stopped."""
        with self._lock:
            while not self._closed:
                standby = next((s for s in self._free if s.capped == capped), None)
                if standby is None:
                    return None
                self._free.remove(standby)
                why = standby.unfit()
                if why is None:
                    return standby
                self.passed_over(standby.pid, why, rank)
                stop([standby])
        return None

    def passed_over(self, pid: int, why: str, rank: str) -> None:
        """A standby that cannot serve `rank`: the first said at WARNING, the next at INFO (they import the
        same libraries, so one cause usually strikes them all)."""
        level = logging.INFO if self._warned else logging.WARNING
        self._warned = True
        log.log(level, "standby process %d cannot serve (%s): %s starts in a fresh process", pid, why, rank)

    def close(self) -> None:
        """Stop the standbys no rank took (at once: one still importing would use the CPU for nothing)."""
        with self._lock:
            left, self._free, self._closed = self._free, [], True
        if left:
            stop(left)
            log.info("stopped %d unused standby process(es) %s", len(left), tuple(s.pid for s in left))


def stop(standbys: list[Standby]) -> None:
    """End standby processes not given a rank: SIGTERM ends one at once (runtime.standby), then kill."""
    for standby in standbys:
        standby.inbox.close()
        if standby.process.is_alive():
            standby.process.terminate()
    for standby in standbys:
        standby.process.join(2)
        if standby.process.is_alive():
            standby.process.kill()
            standby.process.join(2)
        standby.outbox.close()


def _entry(*args) -> None:
    # In the child process only (it imports torch)
    from imgedit.runtime.standby import main

    main(*args)
