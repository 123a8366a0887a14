"""A worker process (one rank): load the pipeline onto its GPUs, warm it up, then serve jobs.

Started by imgedit.engine.workers.pool with the spawn method and CUDA_VISIBLE_DEVICES holding only this rank's
GPUs, or run by a standby process given this rank (imgedit.runtime.standby). A reader thread takes messages
off the inbox (jobs to a local queue, cancels and pauses to flags) so either reaches a running job at its next
step.
The process exits on Stop, on a fatal error (the pool restarts it) and when its parent, the server, is gone
(no orphans even after a SIGKILL).

torch, and every module of ours that imports it, is imported inside the functions below, not at the top:
this module is the first the child process imports, and main() sets CUDA_VISIBLE_DEVICES and the compile
cache and quiets the libraries' known import-time noise (imgedit.model.KNOWN_NOISE) before any of them loads.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

from imgedit.errors import ImgEditError
from imgedit.model import quiet_known_noise
from imgedit.runtime.messages import (
    Cancel,
    Channel,
    Done,
    Failed,
    Job,
    LoadFailed,
    Loading,
    Pause,
    Paused,
    Ready,
    Step,
    Stop,
    WorkerSpec,
)

log = logging.getLogger(__name__)


def main(spec: WorkerSpec, inbox, outbox, visible_devices: str | None, cache_dir: str | None,
         log_level: str = "INFO") -> None:
    # what /health's "(N s)" counts from: the imports below included (a standby process's were done before its
    # assignment, runtime.standby: its clock starts there)
    started = time.perf_counter()
    prepare_process(visible_devices, cache_dir, capped=bool(spec.memory_caps))
    # The server stops its workers (Stop, then terminate, then kill; a rank whose server is gone exits on its
    # own: watch_parent). Ctrl-C in a terminal, timeout(1) or systemd signal the whole process group: a rank
    # dying of that would end a job the server's drain lets finish, and it left its semaphores to
    # multiprocessing's resource tracker ("1 leaked semaphore" at the stop, tests/test_workers.py). A Ray
    # actor runs this in a thread: Ray owns its signals.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    inbox, outbox = Channel(inbox), Channel(outbox)
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s %(levelname)s {spec.name}.{spec.rank}: %(message)s")
    if log_level != "DEBUG":
        quiet_known_noise()  # imgedit.model.KNOWN_NOISE
        from transformers.utils import logging as transformers_logging  # quieted first (docstring)

        transformers_logging.disable_progress_bar()  # "Loading weights: 100%" bars in the server's log
    watch_parent(os.getppid())

    def say(doing: str) -> None:  # what /health and the page show while this rank loads
        outbox.put(Loading(spec.rank, doing, round(time.perf_counter() - started, 1)))

    try:
        from imgedit.runtime.phases import build_worker  # imports torch: after prepare_process (docstring)

        runner, report, seconds = build_worker(spec, say)
    except BaseException as exc:  # noqa: BLE001 - reported, then the process ends
        log.error("loading failed:\n%s", traceback.format_exc())
        # Only our own words leave the process (the panel and /health show them): details are in the log
        # above.
        message = (exc.message if isinstance(exc, ImgEditError)
                   else f"{type(exc).__name__} (see the server log)")
        outbox.put(LoadFailed(spec.rank, message))
        return
    outbox.put(Ready(spec.rank, os.getpid(), seconds, report))
    _serve(spec, runner, inbox, outbox)
    if spec.world > 1:  # a clean stop: every rank got Stop and left its last collective
        from imgedit.runtime.group import close_group  # imports torch: after main() (docstring)

        close_group()


def prepare_process(visible_devices: str | None, cache_dir: str | None, capped: bool = False) -> None:
    """The environment torch reads when it is imported (after this). Dynamo's automatic-dynamic profile
    (local PGO, kept beside inductor's cache) is off: our blocks compile dynamic from the first size
    already, and with the profile a restart compiled other variants than the first start (14 vs 10) and
    missed inductor's cache: the fp8 pair's restart took 163 s, and 89.3 s with it off (2x H200,
    docs/BENCHMARKS.md).

    `capped` (MAX_MEMORY): the allocator grows its segments in place (expandable_segments) instead of
    keeping fixed-size ones, so memory freed in one size serves another under the cap. Under a 16 GB cap,
    2.1's 10-reference edit failed with 1.97 GiB reserved but unused (fixed segments); with expandable ones,
    0.28 GiB (2x H200; that edit still needs more than the cap). An allocator setting made for the server
    (PYTORCH_CUDA_ALLOC_CONF, or PYTORCH_ALLOC_CONF, which torch reads first) is kept, as the profile's is."""
    if visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
    if cache_dir:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.expanduser(cache_dir))
    os.environ.setdefault("TORCH_DYNAMO_AUTOMATIC_DYNAMIC_LOCAL_PGO", "0")
    if capped and not (os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


def watch_parent(parent: int) -> None:
    """Exit when `parent`, the server, is gone (this process is re-parented then): no orphan outlives a
    server killed with SIGKILL. A worker and a standby process (runtime.standby) watch from their start."""

    def watch():
        while True:
            if os.getppid() != parent:
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class Inbox:
    """This rank's inbox, read on a thread of its own: jobs and Stop queue up in order, and a Cancel sets its
    job's flag at once, so a running job stops at its next step (a job not yet started begins cancelled). A
    Pause sets the job's pause flag (imgedit.runtime.pause), also when it comes before the job starts."""

    def __init__(self, channel: Channel):
        self.channel = channel
        self.jobs: queue.Queue = queue.Queue()
        self._cancelled: set[str] = set()
        self._current: dict[str, threading.Event] = {}
        self._pauses: dict[str, threading.Event] = {}
        self._pause_asked: set[str] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name="inbox", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                message = self.channel.get()
            except (EOFError, OSError):
                message = Stop()
            if isinstance(message, Cancel):
                self._cancel(message.request_id)
                continue
            if isinstance(message, Pause):
                self._pause(message.request_id)
                continue
            self.jobs.put(message)
            if isinstance(message, Stop):
                return

    def _cancel(self, request_id: str) -> None:
        self._mark(self._cancelled, self._current, request_id)

    def _pause(self, request_id: str) -> None:
        self._mark(self._pause_asked, self._pauses, request_id)

    def _mark(self, asked: set[str], flags: dict[str, threading.Event], request_id: str) -> None:
        """Keep the request for the job (a job that starts later begins with its flag set), and set the
        flag of the job running now."""
        with self._lock:
            if len(asked) > 1000:  # asked for jobs this rank skipped or that had ended
                asked.clear()
            asked.add(request_id)
            if request_id in flags:
                flags[request_id].set()

    def next(self) -> Job | None:
        """The next job, or None on Stop."""
        while not isinstance(message := self.jobs.get(), Stop):
            if isinstance(message, Job):
                return message
        return None

    def skip(self, request_id: str) -> None:
        with self._lock:
            self._cancelled.discard(request_id)
            self._pause_asked.discard(request_id)

    @contextmanager
    def running(self, request_id: str) -> Iterator[tuple[threading.Event, threading.Event]]:
        """The job's cancel flag (set already if its Cancel came first) and pause flag while it runs."""
        cancel, pause = threading.Event(), threading.Event()
        with self._lock:
            self._current[request_id], self._pauses[request_id] = cancel, pause
            if request_id in self._cancelled:
                cancel.set()
            if request_id in self._pause_asked:
                pause.set()
        try:
            yield cancel, pause
        finally:
            with self._lock:
                self._current.pop(request_id, None)
                self._pauses.pop(request_id, None)
                self._pause_asked.discard(request_id)
                self._cancelled.discard(request_id)


def _serve(spec: WorkerSpec, runner, inbox: Channel, outbox: Channel) -> None:
    jobs = Inbox(inbox)
    while (job := jobs.next()) is not None:
        if not runner.takes_part(job):
            jobs.skip(job.request_id)
            continue
        with jobs.running(job.request_id) as (cancel, pause):
            _run(spec, runner, job, cancel, outbox, pause)
        runner.cleanup()
    log.info("stopping")


def _run(spec: WorkerSpec, runner, job: Job, cancel: threading.Event, outbox: Channel,
         pause: threading.Event | None = None) -> None:
    """One job: its steps and result (or where it paused) from rank 0; a failure from any rank (a fatal one
    ends the process, and the pool starts a fresh one)."""
    from imgedit.runtime.pause import JobPaused  # imports torch: after main() (docstring)
    from imgedit.runtime.preview import LivePreview  # imports torch: after main() (docstring)
    from imgedit.runtime.runner import FatalError  # imports torch: after main() (docstring)

    preview = runner.part(LivePreview) if job.request.watch else None

    def on_step(step: int, total: int) -> None:
        if spec.rank == 0:  # a watched job's newest preview goes with the step (imgedit.runtime.preview)
            outbox.put(Step(job.request_id, step, total, preview.take() if preview is not None else None))

    try:
        result = runner.run(job, cancel, on_step, pause)
        if spec.rank == 0:
            outbox.put(Done(job.request_id, result))
    except JobPaused as paused:  # only a job one rank runs alone pauses (imgedit.runtime.pause)
        outbox.put(Paused(job.request_id, paused.resume))
    except FatalError as exc:
        outbox.put(Failed(job.request_id, exc.kind, exc.message, spec.rank, fatal=True))
        os._exit(1)
    except ImgEditError as exc:  # Cancelled too
        if spec.rank == 0:
            outbox.put(Failed(job.request_id, exc.kind, exc.message, spec.rank, field=exc.field))
    except BaseException:  # noqa: BLE001 - a bug of ours: report it, and start afresh
        log.exception("%s: unexpected failure", job.request_id)
        outbox.put(Failed(job.request_id, "internal",
                          f"the edit failed with an internal error (request {job.request_id})",
                          spec.rank, fatal=True))
        os._exit(1)
