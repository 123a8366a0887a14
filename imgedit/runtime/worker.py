"""A worker process (one rank): load the pipeline onto its GPUs, warm it up, then serve jobs.

Started by imgedit.engine.pool with the spawn method and CUDA_VISIBLE_DEVICES holding only this rank's
GPUs. A reader thread takes messages off the inbox (jobs to a local queue, cancels to flags) so a
cancel reaches a running job at its next step. The process exits on Stop, on a fatal error (the
pool restarts it) and when its parent, the server, is gone (no orphans even after a SIGKILL).

torch, and every module of ours that imports it, is imported inside the functions below, not at the top:
this module is the first the child process imports, and main() sets CUDA_VISIBLE_DEVICES and the compile
cache and quiets the libraries' known import-time noise (imgedit.model.KNOWN_NOISE) before any of them loads.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import traceback

from imgedit.errors import Cancelled, ImgEditError
from imgedit.model import quiet_known_noise
from imgedit.runtime.messages import (
    Cancel,
    Channel,
    Done,
    Failed,
    Job,
    LoadFailed,
    Loading,
    Ready,
    Step,
    Stop,
    WorkerSpec,
)

log = logging.getLogger(__name__)


def main(spec: WorkerSpec, inbox, outbox, visible_devices: str | None, cache_dir: str | None,
         log_level: str = "INFO") -> None:
    prepare_process(visible_devices, cache_dir, capped=bool(spec.memory_caps))
    inbox, outbox = Channel(inbox), Channel(outbox)
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s %(levelname)s {spec.name}.{spec.rank}: %(message)s")
    if log_level != "DEBUG":
        quiet_known_noise()  # imgedit.model.KNOWN_NOISE
        from transformers.utils import logging as transformers_logging  # quieted first (docstring)

        transformers_logging.disable_progress_bar()  # "Loading weights: 100%" bars in the server's log
    _watch_parent(os.getppid())
    started = time.perf_counter()

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


def _watch_parent(parent: int) -> None:
    def watch():
        while True:
            if os.getppid() != parent:
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _serve(spec: WorkerSpec, runner, inbox, outbox) -> None:
    from imgedit.runtime.runner import FatalError  # imports torch: after main() (docstring)

    jobs: queue.Queue = queue.Queue()
    cancelled: set[str] = set()
    current: dict[str, threading.Event] = {}
    lock = threading.Lock()

    def read():
        while True:
            try:
                message = inbox.get()
            except (EOFError, OSError):
                message = Stop()
            if isinstance(message, Cancel):
                with lock:
                    if len(cancelled) > 1000:  # cancels of jobs this rank skipped
                        cancelled.clear()
                    cancelled.add(message.request_id)
                    if message.request_id in current:
                        current[message.request_id].set()
                continue
            jobs.put(message)
            if isinstance(message, Stop):
                return

    threading.Thread(target=read, name="inbox", daemon=True).start()
    while True:
        message = jobs.get()
        if isinstance(message, Stop):
            log.info("stopping")
            return
        if not isinstance(message, Job):
            continue
        job: Job = message
        if not runner.takes_part(job):
            with lock:
                cancelled.discard(job.request_id)
            continue
        cancel = threading.Event()
        with lock:
            current[job.request_id] = cancel
            if job.request_id in cancelled:
                cancel.set()

        def on_step(step: int, total: int, request_id: str = job.request_id) -> None:
            if spec.rank == 0:
                outbox.put(Step(request_id, step, total))

        try:
            result = runner.run(job, cancel, on_step)
            if spec.rank == 0:
                outbox.put(Done(job.request_id, result))
        except FatalError as exc:
            outbox.put(Failed(job.request_id, exc.kind, exc.message, spec.rank, fatal=True))
            os._exit(1)
        except Cancelled as exc:
            if spec.rank == 0:
                outbox.put(Failed(job.request_id, exc.kind, exc.message, spec.rank))
        except ImgEditError as exc:
            if spec.rank == 0:
                outbox.put(Failed(job.request_id, exc.kind, exc.message, spec.rank))
        except BaseException:  # noqa: BLE001 - a bug of ours: report it, and start afresh
            log.exception("%s: unexpected failure", job.request_id)
            outbox.put(Failed(job.request_id, "internal",
                              f"the edit failed with an internal error (request {job.request_id})",
                              spec.rank, fatal=True))
            os._exit(1)
        finally:
            with lock:
                current.pop(job.request_id, None)
                cancelled.discard(job.request_id)
        runner.cleanup()
