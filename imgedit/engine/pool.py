"""The worker processes, seen from the server: spawn, watch, restart and stop them.

A `WorkerHandle` is one worker of the plan: one process, or one process per rank for a parallel
group. Each rank has an inbox and an outbox pipe; the handle's pump thread reads the outboxes and
watches the processes (it wakes on a message or on a process's end): a rank that dies fails only
the job it was running (with a clear message), the whole group is stopped and started again (up
to WORKER_RESTARTS times, then the worker is reported failed). No torch here: the server process
never creates a CUDA context.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from imgedit.errors import WorkerFailed
from imgedit.planning.plan import Placement, WorkerPlan
from imgedit.protocol import WorkerState, WorkerStatus
from imgedit.runtime.messages import (
    Cancel,
    Channel,
    Done,
    Failed,
    Job,
    LoadFailed,
    Loading,
    Ready,
    StartupReport,
    Step,
    Stop,
    WorkerSpec,
)

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


class WorkerDied:
    """Put on a job's event queue when its worker process ended mid-job."""

    def __init__(self, message: str):
        self.message = message


def physical_devices(visible: str | None) -> list[str] | None:
    """The entries of the server's CUDA_VISIBLE_DEVICES (None = all GPUs, numbered as found)."""
    if visible is None or not visible.strip():
        return None
    return [part.strip() for part in visible.split(",") if part.strip()]


def localize(plan: WorkerPlan, visible: str | None) -> tuple[WorkerPlan, str | None]:
    """A rank's plan with its GPUs renumbered cuda:0.. as its process sees them, and the
    CUDA_VISIBLE_DEVICES that makes it so (diffusers and NCCL pick `cuda:rank % count`, and a
    process that sees other GPUs may create contexts there)."""
    gpus = rank_gpus(plan)
    if not gpus:
        return plan, visible
    physical = physical_devices(visible)
    mapping = {d: f"cuda:{i}" for i, d in enumerate(gpus)}
    ids = [physical[int(d[5:])] if physical else d[5:] for d in gpus]

    def move(p: Placement) -> Placement:
        return Placement(mapping.get(p.device, p.device), tuple(mapping.get(d, d) for d in p.block_devices))

    local = replace(plan, components={n: move(p) for n, p in plan.components.items()},
                    rank_devices=tuple(mapping.get(d, d) for d in plan.rank_devices))
    return local, ",".join(ids)


def rank_gpus(plan: WorkerPlan) -> list[str]:
    """A rank's GPUs as the server numbers them; its process sees them as cuda:0, cuda:1, ... in this
    order."""
    return [d for d in plan.devices if d.startswith("cuda:")]


def free_port() -> int:
    """A free port for a group's rendezvous, below the ephemeral range when one is free there: the OS hands
    ports of that range to every outgoing connection, and one of them taking the port between this check and
    rank 0's bind failed a group's start (EADDRINUSE, seen under a test's connection flood)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for port in random.sample(range(max(1024, low - 12000), low), 32) if low > 2048 else ():
        with socket.socket() as s:
            try:
                s.bind(("", port))  # every address, as the rendezvous server binds
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerHandle:
    def __init__(self, plan: WorkerPlan, spec: WorkerSpec, *, visible: str | None, cache_dir: str | None,
                 max_restarts: int, log_level: str = "INFO", on_change: Callable[[], None] = lambda: None,
                 max_memory: tuple[int, ...] = (), start_method: str = "spawn"):
        self.plan = plan
        self.name = plan.name
        self.spec = spec  # rank 0's spec with the plan as planned; each rank gets its own at spawn
        self.visible, self.cache_dir, self.log_level = visible, cache_dir, log_level
        self.start_method = start_method  # WORKER_START
        self.max_restarts = max_restarts
        self.max_memory = max_memory  # MAX_MEMORY as set: one value for all GPUs, or one per visible GPU
        self.on_change = on_change
        self.lock = threading.Lock()  # held by the job thread that owns the worker
        self.state = WorkerState.LOADING  # written here only: the pump thread, claim() and release()
        self.detail: str | None = "starting"
        self.error: str | None = None
        self.job_id: str | None = None
        self.job_client: str | None = None
        self.step = self.total_steps = 0
        self.jobs_done = 0
        self.restarts = 0
        self.report: StartupReport | None = None  # rank 0's, once it has loaded (runtime.messages)
        # per GPU (server numbering), as the ranks measured after loading
        self.weights_mib: dict[str, float] = {}
        self.pids: tuple[int, ...] = ()
        self._procs: list = []
        self._inboxes: list[Channel] = []
        self._outboxes: list = []  # the server's read ends, one per rank
        self._events: queue.Queue | None = None  # the current job's events
        self._ready: set[int] = set()
        self._closing = False
        self._pump: threading.Thread | None = None
        # stop() and the pump (a failed load, a death) may reap at once: two closes of one pipe in two
        # threads can close a file descriptor number the process has meanwhile given to another file
        self._reaping = threading.Lock()

    @property
    def state(self) -> WorkerState:
        return self._state

    @state.setter
    def state(self, value: WorkerState | str) -> None:
        self._state = WorkerState(value)  # a test's planted "failed" is the member too

    # ---- life cycle ----
    def start(self) -> None:
        self._spawn()
        self._pump = threading.Thread(target=self._run_pump, name=f"{self.name}-pump", daemon=True)
        self._pump.start()

    def _spawn(self) -> None:
        port = free_port() if self.plan.ranks > 1 else 0
        self._inboxes, self._outboxes, self._procs, self._ready = [], [], [], set()
        self.weights_mib = {}
        for rank in range(self.plan.ranks):
            local, visible = localize(self.plan.for_rank(rank), self.visible)
            spec = replace(self.spec, rank=rank, world=self.plan.ranks, plan=local, master_port=port,
                           devices=self.plan.devices, memory_caps=self._caps(self.plan.for_rank(rank)))
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
                name = f"imgedit-{self.name}-rank{rank}"
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
        log.info("%s: started %d process(es) %s on %s", self.name, len(self._procs), self.pids,
                 self.plan.describe())

    def _caps(self, plan: WorkerPlan) -> tuple[int, ...]:
        """MAX_MEMORY of each GPU of this rank, in the order its process numbers them."""
        if not self.max_memory:
            return ()
        gpus = [int(d[5:]) for d in plan.devices if d.startswith("cuda:")]
        caps = self.max_memory
        return tuple(caps[0] if len(caps) == 1 else caps[i] for i in gpus)

    def stop(self, timeout: float = 5.0) -> None:
        """Ask every rank to stop, then terminate, then kill: no process outlives this call."""
        self._closing = True
        for inbox in self._inboxes:
            try:
                inbox.put(Stop())
            except Exception:  # noqa: BLE001 - a broken queue: terminate below
                pass
        self._reap(timeout)
        self.state, self.detail = WorkerState.STOPPED, None
        if self._pump is not None and self._pump is not threading.current_thread():
            self._pump.join(timeout=2)

    def _reap(self, timeout: float) -> None:
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

    # ---- the manager's line: one job at a time ----
    def claim(self) -> bool:
        """Take this worker for one job if it is idle (the calling job thread then holds `lock`)."""
        if self.state is WorkerState.IDLE and self.lock.acquire(blocking=False):
            self.state = WorkerState.BUSY
            return True
        return False

    def release(self) -> None:
        """Give the worker back after its job (it may have failed or be restarting meanwhile)."""
        self.finish()
        if self.state is WorkerState.BUSY:
            self.state = WorkerState.IDLE
        self.lock.release()

    # ---- jobs (called by the manager's job thread, which holds self.lock) ----
    def submit(self, job: Job) -> queue.Queue:
        events: queue.Queue = queue.Queue()
        self._events = events
        self.job_id, self.step, self.total_steps = job.request_id, 0, job.params.steps
        self.job_client = job.request.client  # who asked: /v1/status shows the job's id to them alone
        for inbox in self._inboxes:
            inbox.put(job)
        return events

    def cancel(self, request_id: str) -> None:
        for inbox in self._inboxes:
            try:
                inbox.put(Cancel(request_id))
            except Exception:  # noqa: BLE001 - the process is gone; the pump reports it
                pass

    def finish(self) -> None:
        self._events = None
        self.job_id = self.job_client = None
        self.step = self.total_steps = 0

    # ---- the pump: messages and process deaths ----
    def _run_pump(self) -> None:
        while not self._closing and not self.state.ended:
            outboxes, procs = list(self._outboxes), list(self._procs)
            try:
                watched = [*outboxes, *(p.sentinel for p in procs)]
                ready = multiprocessing.connection.wait(watched, timeout=0.5)
            except (OSError, ValueError):  # closed by stop()
                time.sleep(0.05)
                continue
            for conn in ready:
                if conn in outboxes:
                    self._receive(conn)
            dead = [p for p in procs if not p.is_alive()]
            if dead and not self._closing and procs == self._procs:
                self._on_death(dead)

    def _receive(self, conn) -> None:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the rank is gone; its sentinel reports it
            if conn in self._outboxes:
                self._outboxes.remove(conn)
            return
        self._handle(message)

    def _handle(self, message) -> None:
        events = self._events
        if isinstance(message, Ready):
            self._ready.add(message.rank)
            if message.rank == 0:
                self.report = message.report
            gpus = rank_gpus(self.plan.for_rank(message.rank))
            for local, mib in message.report.weights_mib.items():
                index = int(local[5:])  # the rank's own numbering: cuda:0 is its first GPU
                if index < len(gpus):
                    self.weights_mib[gpus[index]] = mib
            if len(self._ready) == self.plan.ranks:
                self.state, self.detail = WorkerState.IDLE, None
                log.info("%s ready in %.1fs %s", self.name, message.seconds, self.info)
                self.on_change()
        elif isinstance(message, Loading):
            if message.rank == 0 and self.state is WorkerState.LOADING:  # rank 0 speaks for its group
                self.detail = f"{message.doing} ({message.elapsed:.0f} s)"
        elif isinstance(message, LoadFailed):
            self.state, self.detail = WorkerState.FAILED, None
            self.error = f"rank {message.rank}: {message.message}"
            log.error("%s failed to load: %s", self.name, self.error)
            self._closing = True
            self._reap(2)
            self.on_change()
        elif isinstance(message, Step):
            if message.request_id == self.job_id:
                self.step = message.step
            if events is not None:
                events.put(message)
        elif isinstance(message, (Done, Failed)):
            if isinstance(message, Done) and message.request_id == self.job_id:
                self.jobs_done += 1
            if isinstance(message, Failed) and message.fatal:
                # The rank exits now: no new job may reach this worker before its restart.
                self.state, self.detail = WorkerState.RESTARTING, "a rank failed; restarting"
            if events is not None:
                events.put(message)

    def _on_death(self, dead: list) -> None:
        # Messages a rank sent before it died (its Failed, say) come first.
        for conn in list(self._outboxes):
            try:
                while conn.poll(0):
                    self._handle(conn.recv())
            except (EOFError, OSError):
                continue
        if self.state.ended or self._closing:
            return
        codes = ", ".join(f"rank {self._procs.index(p)} exit code {p.exitcode}" for p in dead)
        was_loading = self.state is WorkerState.LOADING and not self._ready
        log.error("%s: worker process ended (%s)%s", self.name, codes,
                  f" during {self.job_id}" if self.job_id else "")
        self._reap(1)  # the other ranks of a group cannot go on alone
        if self._events is not None:
            self._events.put(WorkerDied(
                f"{self.name}'s process stopped during the job ({codes}); the worker is being restarted"))
        if not self._restart_or_fail("the worker process", codes, was_loading):
            return
        try:
            self._spawn()
        except (OSError, EOFError) as exc:  # e.g. the forkserver is gone (the server is being killed)
            log.error("%s: could not start a new worker process: %r", self.name, exc)
            self._reap(1)
            self.state, self.detail = WorkerState.FAILED, None
            self.error = f"the worker process ended ({codes}) and a new one could not be started: {exc!r}"
            self.on_change()
            return
        self.state = WorkerState.LOADING if self.state is WorkerState.RESTARTING else self.state
        self.detail = f"restarting ({self.restarts} of {self.max_restarts})"

    def _restart_or_fail(self, what: str, reason: str, was_loading: bool) -> bool:
        """The restart policy, one for both transports (processes here, Ray actors): a worker whose first load
        died, or that used up MAX_RESTARTS, is failed; any other death is one more restart (True: respawn)."""
        if was_loading or self.restarts >= self.max_restarts:
            self.state, self.detail = WorkerState.FAILED, None
            self.error = (f"{what} ended while loading ({reason})" if was_loading else
                          f"{what} ended {self.restarts + 1} times; last: {reason}")
            self.on_change()
            return False
        self.restarts += 1
        self.state, self.detail = WorkerState.RESTARTING, f"restart {self.restarts} of {self.max_restarts}"
        self.on_change()
        return True

    # ---- status ----
    @property
    def info(self) -> dict:
        """The start-up report as a plain dict ({} before it came): for logs and tests."""
        return asdict(self.report) if self.report is not None else {}

    def status(self) -> WorkerStatus:
        placement = {n: p.describe() for n, p in self.plan.components.items()}
        if self.plan.parallel != "none":
            placement = {n: ", ".join(self.plan.rank_devices) for n in self.plan.components}
        return WorkerStatus(self.name, self.plan.devices, placement, self.state, self.job_id, self.step,
                            self.total_steps, self.jobs_done, self.error, parallel=self.plan.parallel,
                            ranks=self.plan.ranks, pids=self.pids, restarts=self.restarts,
                            detail=self.detail, weights_mib=dict(self.weights_mib),
                            job_client=self.job_client, **self._loaded())

    def _loaded(self) -> dict:
        """What the status takes from the start-up report; nothing before it came (WorkerStatus's
        defaults)."""
        r = self.report
        if r is None:
            return {}
        return dict(compiled=r.compiled, encode_cache=r.encode_cache, attention=r.attention,
                    components=r.components, fast_weights=r.fast_weights, cpu_threads=r.cpu_threads,
                    fallbacks=tuple(r.fallbacks))


def wait_result(handle: WorkerHandle, events: queue.Queue, cancel: threading.Event,
                on_step: Callable[[int, int], None] | None) -> Done | Failed:
    """Follow one job's events in the job thread: forward steps, pass a cancel on once, and return
    its Done or Failed (a dead worker becomes a WorkerFailed failure)."""
    cancel_sent = False
    while True:
        if cancel.is_set() and not cancel_sent:
            handle.cancel(handle.job_id or "")
            cancel_sent = True
        try:
            event = events.get(timeout=0.05)
        except queue.Empty:
            continue
        if isinstance(event, Step):
            if on_step is not None:
                on_step(event.step, event.total)
        elif isinstance(event, (Done, Failed)):
            if event.request_id == handle.job_id:
                return event
        elif isinstance(event, WorkerDied):
            return Failed(handle.job_id or "", WorkerFailed.kind, event.message)


def _entry(environ: dict[str, str], *args) -> None:
    os.environ.clear()
    os.environ.update(environ)
    from imgedit.runtime.worker import main

    main(*args)
