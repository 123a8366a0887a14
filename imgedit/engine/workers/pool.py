"""The workers, seen from the server: one supervisor per worker of the plan, over a transport.

A `WorkerHandle` supervises one worker: one process, or one process per rank for a parallel group. It owns the
worker's state (claimed and released by the manager's line, written here only), the current job's events, the
start-up report and the restart policy: a rank that dies fails only the job it was running (with a clear
message), and the whole group is stopped and started again (up to WORKER_RESTARTS times, then the worker is
reported failed). Its pump thread turns what the transport reports (the ranks' messages, a rank's end) into
those. The transport starts the ranks and carries their messages: local processes over pipes
(engine.processes.ProcessTransport, the default) or Ray actors (engine.ray_pool.RayTransport, WORKERS=ray),
one interface as vLLM's executors put uni-process, multi-process and Ray behind one. No torch here: the server
process never creates a CUDA context.
"""

from __future__ import annotations

import logging
import queue
import random
import socket
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Protocol

from imgedit.errors import WorkerFailed
from imgedit.planning.plan import Placement, WorkerPlan
from imgedit.protocol import Progress, WorkerState, WorkerStatus
from imgedit.runtime.messages import (
    Cancel,
    Done,
    Failed,
    Job,
    LoadFailed,
    Loading,
    Pause,
    Paused,
    Ready,
    StartupReport,
    Step,
    Stop,
    WorkerSpec,
)

log = logging.getLogger(__name__)


class WorkerDied:
    """Put on a job's event queue when its worker process ended mid-job."""

    def __init__(self, message: str):
        self.message = message


@dataclass(frozen=True)
class Died:
    """A transport's report that a rank of the worker's current ranks ended."""

    reason: str  # for the worker's error ("rank 1 exit code -9", "its process died")
    log: str  # the log's account ("worker process ended (...)")
    job_message: str  # the running job's, after the worker's name ("process stopped during the job (...)")
    reap_timeout: float  # how long the other ranks get to end before they are killed


class TransportLost(Exception):
    """The transport itself is gone (the connection to the Ray cluster): the worker has failed."""


class SendFailed(Exception):
    """A job could not be handed to a rank (a Ray actor that is gone): that job fails, as in a death."""


class Transport(Protocol):
    """How a worker's ranks run and talk (engine.processes.ProcessTransport, engine.ray_pool.RayTransport)."""

    what: str  # what ended, in the worker's error ("the worker process", "the Ray actor")
    retries_loading_deaths: bool  # a restart that dies while loading is one more restart (else: failed)
    respawn_note: str  # added to the "restarting" detail
    closing: bool
    pids: tuple[int, ...]
    node: str | None

    def spawn(self, specs: list[WorkerSpec]) -> None: ...
    def describe(self) -> str: ...
    def send(self, message, ignore_errors: bool = False) -> None: ...
    def saw_ready(self, message: Ready) -> None: ...
    def poll(self, timeout: float) -> list: ...
    def prepare_respawn(self, died: Died) -> None: ...
    def reap(self, timeout: float) -> None: ...
    def close(self) -> None: ...


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
    def __init__(self, plan: WorkerPlan, spec: WorkerSpec, transport: Transport, *, max_restarts: int,
                 on_change: Callable[[], None] = lambda: None, max_memory: tuple[int, ...] = ()):
        self.plan = plan
        self.name = plan.name
        self.spec = spec  # rank 0's spec with the plan as planned; each rank gets its own at spawn
        self.transport = transport
        self.max_restarts = max_restarts
        self.max_memory = max_memory  # MAX_MEMORY as set: one value for all GPUs, or one per visible GPU
        self.on_change = on_change
        self.lock = threading.Lock()  # held by the job thread that owns the worker
        self.state = WorkerState.LOADING  # written here only: the pump thread, claim() and release()
        self.detail: str | None = "starting"
        self.error: str | None = None
        self.job_id: str | None = None
        self.job_client: str | None = None
        self.progress = Progress()  # the running job's
        self.preview: bytes | None = None  # the running job's newest live preview (a watched job's), a JPEG
        self.jobs_done = 0
        self.restarts = 0
        self.report: StartupReport | None = None  # rank 0's, once it has loaded (runtime.messages)
        # per GPU (server numbering), as the ranks measured after loading
        self.weights_mib: dict[str, float] = {}
        self._events: queue.Queue | None = None  # the current job's events
        self._ready: set[int] = set()
        self._closing = False
        self._pump: threading.Thread | None = None

    @property
    def state(self) -> WorkerState:
        return self._state

    @state.setter
    def state(self, value: WorkerState) -> None:
        if not isinstance(value, WorkerState):
            raise TypeError(f"a worker's state is a WorkerState, not {value!r}")
        self._state = value

    @property
    def pids(self) -> tuple[int, ...]:
        return self.transport.pids

    # ---- life cycle ----
    def start(self) -> None:
        self._spawn()
        self._pump = threading.Thread(target=self._run_pump, name=f"{self.name}-pump", daemon=True)
        self._pump.start()

    def _spawn(self) -> None:
        self._ready, self.weights_mib = set(), {}
        port = free_port() if self.plan.ranks > 1 else 0
        self.transport.spawn([replace(self.spec, rank=rank, world=self.plan.ranks,
                                      plan=self.plan.for_rank(rank), master_port=port,
                                      devices=self.plan.devices,
                                      memory_caps=self._caps(self.plan.for_rank(rank)))
                              for rank in range(self.plan.ranks)])
        log.info("%s: started %s on %s", self.name, self.transport.describe(), self.plan.describe())

    def _caps(self, plan: WorkerPlan) -> tuple[int, ...]:
        """MAX_MEMORY of each GPU of this rank, in the order its process numbers them."""
        if not self.max_memory:
            return ()
        gpus = [int(d[5:]) for d in plan.devices if d.startswith("cuda:")]
        caps = self.max_memory
        return tuple(caps[0] if len(caps) == 1 else caps[i] for i in gpus)

    def stop(self, timeout: float = 5.0) -> None:
        """Ask every rank to stop, then terminate, then kill: no process outlives this call."""
        self._closing = self.transport.closing = True
        self.transport.send(Stop(), ignore_errors=True)
        self.transport.reap(timeout)
        self.state, self.detail = WorkerState.STOPPED, None
        if self._pump is not None and self._pump is not threading.current_thread():
            self._pump.join(timeout=2)
        self.transport.close()

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
        self.job_id, self.progress = job.request_id, Progress(0, job.params.steps)
        self.preview = None
        self.job_client = job.request.client  # who asked: /v1/status shows the job's id to them alone
        try:
            self.transport.send(job)
        except SendFailed as exc:  # a Ray actor that is gone: this job fails, the pump reports the death
            log.error("%s: could not hand %s to it: %s", self.name, job.request_id, exc)
            events.put(WorkerDied(f"{self.name}'s {exc}"))
        return events

    def cancel(self, request_id: str) -> None:
        # a rank that is gone: the pump reports it
        self.transport.send(Cancel(request_id), ignore_errors=True)

    def pause(self, request_id: str) -> None:
        """Ask the running job to pause at its next step's end (a job that cannot pause runs on)."""
        self.transport.send(Pause(request_id), ignore_errors=True)

    def finish(self) -> None:
        self._events = None
        self.job_id = self.job_client = None
        self.progress = Progress()
        self.preview = None

    # ---- the pump: messages and deaths, as the transport reports them ----
    def _run_pump(self) -> None:
        while not self._closing and not self.state.ended:
            try:
                events = self.transport.poll(0.5)
            except TransportLost as exc:
                self.state, self.error = WorkerState.FAILED, str(exc)
                self.on_change()
                return
            for event in events:
                if self._closing:  # a LoadFailed in this batch reaped the ranks, or stop() came
                    break
                if isinstance(event, Died):
                    self._on_death(event)
                    break
                self._handle(event)

    def _handle(self, message) -> None:
        events = self._events
        if isinstance(message, Ready):
            self.transport.saw_ready(message)
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
            self._closing = self.transport.closing = True
            self.transport.reap(2)
            self.on_change()
        elif isinstance(message, Step):
            if message.request_id == self.job_id:
                self.progress = Progress(message.step, self.progress.steps)
                self.preview = message.preview or self.preview
            if events is not None:
                events.put(message)
        elif isinstance(message, (Done, Failed, Paused)):
            if isinstance(message, Done) and message.request_id == self.job_id:
                self.jobs_done += 1
            if isinstance(message, Failed) and message.fatal:
                # The rank exits now: no new job may reach this worker before its restart.
                self.state, self.detail = WorkerState.RESTARTING, "a rank failed; restarting"
            if events is not None:
                events.put(message)

    def _on_death(self, died: Died) -> None:
        if self.state.ended or self._closing:
            return
        # A first load that dies is a fault of the model or the code (no retry); with Ray, a restart that dies
        # while loading (its node going away, say) is one more restart.
        was_loading = (self.state is WorkerState.LOADING and not self._ready
                       and not (self.transport.retries_loading_deaths and self.restarts))
        log.error("%s: %s%s", self.name, died.log, f" during {self.job_id}" if self.job_id else "")
        self.transport.reap(died.reap_timeout)  # the other ranks of a group cannot go on alone
        if self._events is not None:
            self._events.put(WorkerDied(f"{self.name}'s {died.job_message}; the worker is being restarted"))
        if not self._restart_or_fail(self.transport.what, died.reason, was_loading):
            return
        try:
            self.transport.prepare_respawn(died)  # Ray: up to 30 s for its node's verdict
            if self._closing:
                return
            self._spawn()
        except (OSError, EOFError) as exc:  # e.g. the forkserver is gone (the server is being killed)
            log.error("%s: could not start %s again: %r", self.name, self.transport.what, exc)
            self.transport.reap(1)
            self.state, self.detail = WorkerState.FAILED, None
            self.error = (f"{self.transport.what} ended ({died.reason}) and a new one could not be started: "
                          f"{exc!r}")
            self.on_change()
            return
        self.state = WorkerState.LOADING if self.state is WorkerState.RESTARTING else self.state
        self.detail = f"restarting ({self.restarts} of {self.max_restarts}){self.transport.respawn_note}"

    def _restart_or_fail(self, what: str, reason: str, was_loading: bool) -> bool:
        """The restart policy: a worker whose first load died, or that used up MAX_RESTARTS, is failed; any
        other death is one more restart (True: respawn)."""
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
        return WorkerStatus(self.name, self.plan.devices, placement, self.state, self.job_id,
                            **self.progress.view(), jobs_done=self.jobs_done, error=self.error,
                            parallel=self.plan.parallel, ranks=self.plan.ranks, pids=self.pids,
                            restarts=self.restarts, detail=self.detail, weights_mib=dict(self.weights_mib),
                            job_client=self.job_client, node=self.transport.node, **self._loaded())

    def _loaded(self) -> dict:
        """What the status takes from the start-up report; nothing before it came (WorkerStatus's
        defaults)."""
        r = self.report
        if r is None:
            return {}
        return dict(compiled=r.compiled, encode_cache=r.encode_cache, attention=r.attention,
                    components=r.components, fast_weights=r.fast_weights, turbo=r.turbo,
                    cpu_threads=r.cpu_threads, fallbacks=tuple(r.fallbacks), under_cap=tuple(r.under_cap),
                    features=tuple(r.features), phases=dict(r.phases))


def wait_result(handle: WorkerHandle, events: queue.Queue, cancel: threading.Event,
                on_step: Callable[[int, int], None] | None,
                pause: threading.Event | None = None) -> Done | Failed | Paused:
    """Follow one job's events in the job thread: forward steps, pass a cancel and a pause on once each, and
    return its Done, Failed or Paused (a dead worker becomes a WorkerFailed failure)."""
    cancel_sent = pause_sent = False
    while True:
        if cancel.is_set() and not cancel_sent:
            handle.cancel(handle.job_id or "")
            cancel_sent = True
        if pause is not None and pause.is_set() and not pause_sent:
            handle.pause(handle.job_id or "")
            pause_sent = True
        try:
            event = events.get(timeout=0.05)
        except queue.Empty:
            continue
        if isinstance(event, Step):
            if on_step is not None:
                on_step(event.step, event.total)
        elif isinstance(event, (Done, Failed, Paused)):
            if event.request_id == handle.job_id:
                return event
        elif isinstance(event, WorkerDied):
            return Failed(handle.job_id or "", WorkerFailed.kind, event.message)
