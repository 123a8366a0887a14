"""Standby processes: worker processes started before the plan is known, so that their imports (12-15 s on
2x H200) run while the server inspects the checkpoint (3-19 s) rather than after it.

app.py starts the pool right after the settings are read and the GPUs found, one process for each set of
GPUs a rank of the plan may own (planning.placement.standby_gpus: each GPU, or all of them), with
WORKERS=local and WORKER_START=spawn only: a forked worker imports little, and Ray starts its own actors.
Each is started with its CUDA_VISIBLE_DEVICES already set to those GPUs, imports what a worker imports
(imgedit.runtime.standby) and waits. ProcessTransport's first spawn gives a rank the standby of exactly its
GPUs (and of its MAX_MEMORY allocator setting) instead of starting a fresh process; restarts start fresh
ones. The pool is closed once every worker has started: the standbys left are stopped. No torch here: the
server process never creates a CUDA context.

Why the GPUs are fixed from the start: an import may initialise CUDA, and the driver reads
CUDA_VISIBLE_DEVICES once, then. On 2x H200 (2026-11-30) torchao's mx_formats kernels, imported through peft
and transformers' quantizers, call torch's has_triton(), which asks the current device's properties: every
standby that imported with its GPUs still open was unusable for a rank of one GPU.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from imgedit.config.settings import Settings
from imgedit.engine.workers.pool import physical_devices
from imgedit.planning.placement import standby_gpus
from imgedit.runtime.messages import StandbyUnfit

log = logging.getLogger(__name__)
START_LOCK = threading.Lock()  # CUDA_VISIBLE_DEVICES is set while a child starts (`visible_devices`)


@contextlib.contextmanager
def visible_devices(visible: str | None) -> Iterator[None]:
    """This process's CUDA_VISIBLE_DEVICES is `visible` (None: as it was) while a child process starts, so
    that the child has it from its first instruction; one child starts at a time."""
    with START_LOCK:
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved


@dataclass(frozen=True)
class Standby:
    process: BaseProcess
    inbox: Connection  # the server's end of the standby's inbox (an Assignment, then the rank's messages)
    outbox: Connection  # the server's end of its outbox
    visible: str | None  # the CUDA_VISIBLE_DEVICES it was started with (None: the server's, no GPU asked)
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

    def __init__(self, visibles: list[str | None], cache_dir: str | None, log_level: str, capped: bool):
        """One standby for each entry of `visibles`, started with that CUDA_VISIBLE_DEVICES (None: the
        server's own)."""
        self._free: list[Standby] = []
        self._lock = threading.Lock()
        self._closed = False
        self._warned = False
        ctx = multiprocessing.get_context("spawn")
        for i, visible in enumerate(visibles):
            inbox_read, inbox_write = ctx.Pipe(duplex=False)
            outbox_read, outbox_write = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_entry, name=f"imgedit-standby-{i}", daemon=True,
                               args=(inbox_read, outbox_write, visible, cache_dir, log_level, capped))
            with visible_devices(visible):
                proc.start()
            inbox_read.close()  # the child's ends: closed here, so a dead child reads as end-of-file
            outbox_write.close()
            self._free.append(Standby(proc, inbox_write, outbox_read, visible, capped))
        if self._free:
            gpus = ", ".join(f"{s.pid} on GPU(s) {s.visible}" if s.visible is not None else str(s.pid)
                             for s in self._free)
            log.info("started %d standby worker process(es) (%s): they import torch and the libraries while "
                     "the checkpoint is inspected", len(self._free), gpus)

    @classmethod
    def for_settings(cls, settings: Settings, gpus: int) -> StandbyPool:
        """The pool for these settings and `gpus` visible GPUs: empty unless WORKERS=local and
        WORKER_START=spawn. Each standby's CUDA_VISIBLE_DEVICES is what engine.workers.pool.localize gives a
        rank of its GPUs."""
        s = settings
        if (s.workers, s.worker_start) != ("local", "spawn"):
            return cls([], s.compile_cache_dir, s.log_level, capped=bool(s.max_memory))
        physical = physical_devices(s.cuda_visible_devices)
        visibles = [",".join(physical[i] if physical else str(i) for i in indices) if indices
                    else s.cuda_visible_devices for indices in standby_gpus(s.device_map, gpus)]
        return cls(visibles, s.compile_cache_dir, s.log_level, capped=bool(s.max_memory))

    def take(self, visible: str | None, capped: bool, rank: str) -> Standby | None:
        """A standby for `rank` ("worker-0's rank 1"), started with its CUDA_VISIBLE_DEVICES (`visible`) and
        prepared as it needs with (`capped`) or without MAX_MEMORY's allocator setting, or None (none, or the
        pool is closed): a fresh process then. One that cannot serve is stopped."""
        with self._lock:
            while not self._closed:
                standby = next((s for s in self._free if (s.visible, s.capped) == (visible, capped)), None)
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
        """A standby that cannot serve `rank` (an import failed, or it ended): the first said at WARNING, the
        next at INFO (they import the same libraries, so one cause usually strikes them all)."""
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
