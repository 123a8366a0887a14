"""The default transport of a worker (engine.pool.WorkerHandle): its ranks as local processes.

Each rank is one process, started with WORKER_START (forkserver or spawn) and CUDA_VISIBLE_DEVICES set to
its GPUs, with an inbox and an outbox pipe; at the first start, a standby process started with the rank's GPUs
that has imported everything meanwhile (engine.workers.standby) is taken for it where there is one, and sent
its assignment.
`poll` wakes on a message or on a process's end: what a rank sent before it died comes first, then one `Died`
for the whole group (the supervisor reaps the other ranks: they cannot go on alone). A standby that cannot
serve after all (an import failed: runtime.standby) is no death: its rank starts again in a fresh process.
No torch here: the server process never creates a CUDA context.
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
from imgedit.engine.workers.standby import Standby, StandbyPool, stop, visible_devices
from imgedit.runtime.messages import Assignment, Channel, StandbyUnfit, WorkerSpec

log = logging.getLogger(__name__)
_PRELOAD = "imgedit.runtime.preload"  # named, not imported: the server process never imports torch


def start_context(how: str):
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
                 start_method: str = "spawn", standbys: StandbyPool | None = None):
        self.name = name
        self.visible, self.cache_dir, self.log_level = visible, cache_dir, log_level
        self.start_method = start_method  # WORKER_START
        self.standbys = standbys  # taken from at the first spawn only: a restart starts fresh processes
        self._first = True
        self.closing = False
        self.pids: tuple[int, ...] = ()
        self._procs: list = []
        self._inboxes: list[Channel] = []
        self._outboxes: list = []  # the server's read ends, one per rank
        # each rank's spec, CUDA_VISIBLE_DEVICES and outbox (_outboxes loses a rank's once it reads its end)
        self._ranks: list[tuple[WorkerSpec, str | None, object]] = []
        # stop() and the pump (a failed load, a death) may reap at once: two closes of one pipe in two
        # threads can close a file descriptor number the process has meanwhile given to another file
        self._reaping = threading.Lock()

    def spawn(self, specs: list[WorkerSpec]) -> None:
        self._inboxes, self._outboxes, self._procs, self._ranks = [], [], [], []
        standbys = self.standbys if self._first else None
        self._first = False
        for spec in specs:
            local, visible = localize(spec.plan, self.visible)
            spec = replace(spec, plan=local)
            rank = f"{self.name}'s rank {spec.rank}"
            standby = standbys.take(visible, bool(spec.memory_caps), rank) if standbys is not None else None
            started = self._assign(standby, spec, visible, rank) if standby is not None else None
            proc, inbox, outbox = started or self._start(spec, visible)
            self._inboxes.append(inbox)
            self._outboxes.append(outbox)
            self._procs.append(proc)
            self._ranks.append((spec, visible, outbox))
        self.pids = tuple(p.pid for p in self._procs)

    def _start(self, spec: WorkerSpec, visible: str | None) -> tuple:
        """A fresh process for the rank: (process, inbox, outbox)."""
        ctx = start_context(self.start_method)
        inbox_read, inbox_write = ctx.Pipe(duplex=False)
        outbox_read, outbox_write = ctx.Pipe(duplex=False)
        with visible_devices(visible):  # CUDA_VISIBLE_DEVICES must be right before the child imports anything
            # A forked worker inherits the forkserver's environment, not ours: it gets ours as of now.
            args = (dict(os.environ), spec, inbox_read, outbox_write, visible, self.cache_dir, self.log_level)
            name = f"imgedit-{self.name}-rank{spec.rank}"
            proc = ctx.Process(target=_entry, name=name, daemon=True, args=args)
            proc.start()
        inbox_read.close()  # the child's ends: closed here, so a dead child reads as end-of-file
        outbox_write.close()
        return proc, Channel(inbox_write), outbox_read

    def _assign(self, standby: Standby, spec: WorkerSpec, visible: str | None, rank: str) -> tuple | None:
        """The standby made this rank, as `_start` would start it: (process, inbox, outbox), or None when
        it is gone meanwhile. The assignment (a few KB) waits in the pipe while the standby still imports."""
        with visible_devices(None):  # the environment as `_start` gives it: not while a start changes it
            environ = dict(os.environ)
        if visible is not None:
            environ["CUDA_VISIBLE_DEVICES"] = visible
        inbox = Channel(standby.inbox)
        try:
            inbox.put(Assignment(environ, spec, visible, self.cache_dir, self.log_level))
        except OSError:  # it ended since it was taken
            self.standbys.passed_over(standby.pid, "it ended", rank)
            stop([standby])
            return None
        log.info("%s given the standby process %d", rank, standby.pid)
        return standby.process, inbox, standby.outbox

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
        ours = not self.closing and procs == self._procs  # stop() reaps these pipes meanwhile
        if dead and ours:
            events.extend(self._drain())  # messages a rank sent before it died (its Failed, say) come first
        unfit = [e for e in events if isinstance(e, StandbyUnfit)]
        if unfit:  # the standbys given a rank that cannot serve after all: no death, a fresh process each
            for message in unfit:
                self._replace(message)
            return [e for e in events if not isinstance(e, StandbyUnfit)]  # other deaths: the next poll
        if dead and ours:
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

    def _replace(self, unfit: StandbyUnfit) -> None:
        """Start the rank of a standby that cannot serve (it exits) again, in a fresh process."""
        with self._reaping:
            rank = next((i for i, p in enumerate(self._procs) if p.pid == unfit.pid), None)
            if rank is None or self.closing:
                return
            spec, visible, outbox = self._ranks[rank]
            self.standbys.passed_over(unfit.pid, unfit.reason, f"{self.name}'s rank {rank}")
            old = self._procs[rank]
            old.join(2)
            if old.is_alive():
                old.kill()
                old.join(2)
            self._inboxes[rank].close()
            if outbox in self._outboxes:
                self._outboxes.remove(outbox)
            outbox.close()
            self._procs[rank], self._inboxes[rank], outbox = self._start(spec, visible)
            self._outboxes.append(outbox)
            self._ranks[rank] = (spec, visible, outbox)
            self.pids = tuple(p.pid for p in self._procs)

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
