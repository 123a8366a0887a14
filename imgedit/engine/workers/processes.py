"""The default transport of a worker (engine.pool.WorkerHandle): its ranks as local processes.

Each rank is one process, started with WORKER_START (forkserver or spawn) and CUDA_VISIBLE_DEVICES set to
its GPUs, with an inbox and an outbox pipe. `poll` wakes on a message or on a process's end: what a rank sent
before it died comes first, then one `Died` for the whole group (the supervisor reaps the other ranks: they
cannot go on alone). No torch here: the server process never creates a CUDA context.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from dataclasses import replace

from imgedit.engine.workers.pool import Died, localize
from imgedit.runtime.messages import Channel, WorkerSpec

log = logging.getLogger(__name__)
_START_LOCK = threading.Lock()
_PRELOAD = "imgedit.runtime.preload"  # named, not imported: the server process never imports torch


def _context(how: str):
    """WORKER_START: "forkserver" forks every worker from one process that imported torch, diffusers
    and our worker code once (imgedit.runtime.preload); "spawn" starts a fresh interpreter each time."""
    ctx = multiprocessing.get_context(how)
    if how == "forkserver":
        ctx.set_forkserver_preload([_PRELOAD])
    return ctx


class ProcessTransport:
    what = "the worker process"  # what ended, in the worker's error
    retries_loading_deaths = False  # a process that dies while loading has failed: no restart
    respawn_note = ""
    node = None

    def __init__(self, name: str, visible: str | None, cache_dir: str | None, log_level: str = "INFO",
                 start_method: str = "spawn"):
        self.name = name
        self.visible, self.cache_dir, self.log_level = visible, cache_dir, log_level
        self.start_method = start_method  # WORKER_START
        self.closing = False
        self.pids: tuple[int, ...] = ()
        self._procs: list = []
        self._inboxes: list[Channel] = []
        self._outboxes: list = []  # the server's read ends, one per rank
        # stop() and the pump (a failed load, a death) may reap at once: two closes of one pipe in two
        # threads can close a file descriptor number the process has meanwhile given to another file
        self._reaping = threading.Lock()

    def spawn(self, specs: list[WorkerSpec]) -> None:
        self._inboxes, self._outboxes, self._procs = [], [], []
        for spec in specs:
            local, visible = localize(spec.plan, self.visible)
            spec = replace(spec, plan=local)
            ctx = _context(self.start_method)
            inbox_read, inbox_write = ctx.Pipe(duplex=False)
            outbox_read, outbox_write = ctx.Pipe(duplex=False)
            with _START_LOCK:  # CUDA_VISIBLE_DEVICES must be right before the child imports anything
                saved = os.environ.get("CUDA_VISIBLE_DEVICES")
                if visible is not None:
                    os.environ["CUDA_VISIBLE_DEVICES"] = visible
                # A forked worker inherits the forkserver's environment, not ours: it gets ours as of now.
                args = (dict(os.environ), spec, inbox_read, outbox_write, visible, self.cache_dir,
                        self.log_level)
                name = f"imgedit-{self.name}-rank{spec.rank}"
                proc = ctx.Process(target=_entry, name=name, daemon=True, args=args)
                try:
                    proc.start()
                finally:
                    if saved is None:
                        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                    else:
                        os.environ["CUDA_VISIBLE_DEVICES"] = saved
            inbox_read.close()  # the child's ends: closed here, so a dead child reads as end-of-file
            outbox_write.close()
            self._inboxes.append(Channel(inbox_write))
            self._outboxes.append(outbox_read)
            self._procs.append(proc)
        self.pids = tuple(p.pid for p in self._procs)

    def describe(self) -> str:
        return f"{len(self._procs)} process(es) {self.pids}"

    def send(self, message, ignore_errors: bool = False) -> None:
        """To every rank, in rank order."""
        for inbox in self._inboxes:
            try:
                inbox.put(message)
            except Exception:  # noqa: BLE001 - a broken pipe: the process is gone, the pump reports it
                if not ignore_errors:
                    raise

    def saw_ready(self, message) -> None:
        """A rank's Ready: its pid is known from the start."""

    def poll(self, timeout: float) -> list:
        """The ranks' messages, and a `Died` last when a rank of this generation ended."""
        outboxes, procs = list(self._outboxes), list(self._procs)
        try:
            ready = multiprocessing.connection.wait([*outboxes, *(p.sentinel for p in procs)],
                                                    timeout=timeout)
        except (OSError, ValueError):  # closed by reap()
            time.sleep(0.05)
            return []
        events = []
        for conn in ready:
            if conn in outboxes:
                events.extend(self._receive(conn))
        dead = [p for p in procs if not p.is_alive()]
        if dead and not self.closing and procs == self._procs:  # stop() reaps these pipes meanwhile
            events.extend(self._drain())  # messages a rank sent before it died (its Failed, say) come first
            codes = ", ".join(f"rank {self._procs.index(p)} exit code {p.exitcode}" for p in dead)
            events.append(Died(codes, f"worker process ended ({codes})",
                               f"process stopped during the job ({codes})", reap_timeout=1))
        return events

    def _receive(self, conn) -> list:
        try:
            return [conn.recv()]
        except (EOFError, OSError):  # the rank is gone; its sentinel reports it
            if conn in self._outboxes:
                self._outboxes.remove(conn)
            return []

    def _drain(self) -> list:
        messages = []
        for conn in list(self._outboxes):
            try:
                while conn.poll(0):
                    messages.append(conn.recv())
            except (EOFError, OSError):
                continue
        return messages

    def prepare_respawn(self, died: Died) -> None:
        """Nothing to do before a process group starts again."""

    def reap(self, timeout: float) -> None:
        """Wait up to `timeout` for the ranks to end, then terminate, then kill; close the pipes once."""
        with self._reaping:
            deadline = time.monotonic() + timeout
            for proc in self._procs:
                proc.join(max(0.0, deadline - time.monotonic()))
            for proc in self._procs:
                if proc.is_alive():
                    proc.terminate()
                    proc.join(2)
                if proc.is_alive():
                    proc.kill()
                    proc.join(2)
            for channel in self._inboxes:
                channel.close()  # a second close is a no-op (multiprocessing forgets the handle)
            for conn in self._outboxes:
                conn.close()

    def close(self) -> None:
        """After stop(): nothing is left to release."""


def _entry(environ: dict[str, str], *args) -> None:
    os.environ.clear()
    os.environ.update(environ)
    # In the child process only (torch), once the server's environment is set above
    from imgedit.runtime.worker import main

    main(*args)
