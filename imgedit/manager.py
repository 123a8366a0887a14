"""The pipeline manager: owns the workers and is the only code that calls a pipeline.

A worker is one pipeline and the devices it owns (one GPU for a replica, several for a balanced or
split placement). Jobs wait in one FIFO line for a free worker; each worker's lock is held for the
whole pipeline call, so no GPU ever runs two jobs, even when an edge gives up on a job early.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import gc
import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from imgedit import loader
from imgedit.encoding import install_token_type_fix
from imgedit.errors import Cancelled, ImgEditError, NotReady, OutOfGpuMemory, QueueFull, WorkerFailed
from imgedit.jobs import EditRequest, EditResult, JobRecord, ManagerStatus, WorkerStatus
from imgedit.placement import GpuSpec, Plan, WorkerPlan, plan_placement
from imgedit.settings import Settings
from imgedit.validation import resolve

log = logging.getLogger(__name__)

StepCallback = Callable[[int, int], None]  # (step, total)
WaitCallback = Callable[[int], None]  # jobs ahead of this one (running ones included)


class _Abort(Exception):
    """Raised from the step callback to stop a cancelled job (pipe._interrupt would still decode)."""


class Worker:
    def __init__(self, plan: WorkerPlan):
        self.plan = plan
        self.name = plan.name
        self.pipe = None
        self.lock = threading.Lock()
        self.state = "loading"
        self.job_id: str | None = None
        self.step = 0
        self.total_steps = 0
        self.jobs_done = 0
        self.error: str | None = None
        self.encoding_fix = None  # the mm_token_type_ids hook handle (imgedit.encoding)

    def status(self) -> WorkerStatus:
        return WorkerStatus(self.name, self.plan.devices,
                            {n: p.describe() for n, p in self.plan.components.items()},
                            self.state, self.job_id, self.step, self.total_steps, self.jobs_done, self.error)


def discover_gpus() -> list[GpuSpec]:
    """Visible CUDA GPUs (CUDA_VISIBLE_DEVICES applies) with their free memory now."""
    if not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        gpus.append(GpuSpec(i, torch.cuda.get_device_name(i), total, free))
    return gpus


class PipelineManager:
    def __init__(self, settings: Settings, plan: Plan | None = None, gpus: Sequence[GpuSpec] | None = None):
        self.settings = settings
        self._plan = plan
        self._gpus = gpus
        self.workers: list[Worker] = []
        self.checkpoint: loader.Checkpoint | None = None
        self.load_error: str | None = None
        self._cond = threading.Condition()
        self._line: collections.deque[object] = collections.deque()
        self._loaded = threading.Event()
        self.listeners: list[Callable[[JobRecord], None]] = []
        self.dtype = loader.DTYPES[settings.torch_dtype]
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    # ---- loading ----
    @property
    def plan(self) -> Plan | None:
        return self._plan

    @property
    def family(self) -> str:
        return self.checkpoint.family if self.checkpoint else "plus"

    @property
    def ready(self) -> bool:
        return self._loaded.is_set() and any(w.state in ("idle", "busy") for w in self.workers)

    @property
    def capacity(self) -> int:
        return max(1, len(self._plan.workers)) if self._plan else 1

    def prepare(self) -> PipelineManager:
        """Open the checkpoint and plan the placement (seconds, no weights): the edges need the
        model family and the number of workers before they are built."""
        if self.checkpoint is not None:
            return self
        try:
            self.checkpoint = loader.open_checkpoint(self.settings.model_source)
            if self._plan is None:
                gpus = discover_gpus() if self._gpus is None else list(self._gpus)
                self._plan = plan_placement(
                    loader.component_specs(self.checkpoint, self.dtype), gpus, self.settings.device_map,
                    self.settings.max_memory, self.settings.gpu_memory_reserve, self.settings.activation_reserve)
        except Exception as exc:
            self._fail_load(exc)
            raise
        for line in self._plan.describe():
            log.info("%s", line)
        self.workers = [Worker(w) for w in self._plan.workers]
        return self

    def load(self) -> PipelineManager:
        """Plan if not done yet, then load every worker's pipeline. A worker that fails to load is
        marked failed and the others serve; raises only when none could be loaded."""
        try:
            self.prepare()
            for worker in self.workers:
                started = time.perf_counter()
                dtype = self.dtype
                if worker.plan.execution_device == "cpu" and dtype != torch.float32:
                    # bf16/fp16 convolutions are emulated on CPUs and many times slower.
                    log.info("%s runs on the CPU: using float32 instead of %s", worker.name, self.settings.torch_dtype)
                    dtype = torch.float32
                try:
                    worker.pipe = loader.load_pipeline(self.checkpoint, worker.plan, dtype)
                except Exception as exc:
                    log.exception("%s failed to load", worker.name)
                    worker.state, worker.error = "failed", _safe_text(exc)
                    continue
                worker.encoding_fix = install_token_type_fix(worker.pipe.text_encoder)
                worker.state = "idle"
                log.info("%s loaded on %s in %.1fs", worker.name, ",".join(worker.plan.devices),
                         time.perf_counter() - started)
            if not any(w.state == "idle" for w in self.workers):
                errors = "; ".join(f"{w.name}: {w.error}" for w in self.workers)
                raise WorkerFailed(f"no worker could be loaded ({errors})")
        except Exception as exc:
            self._fail_load(exc)
            raise
        finally:
            self._loaded.set()
        return self

    def _fail_load(self, exc: Exception) -> None:
        self.load_error = _safe_text(exc)

    def start(self) -> threading.Thread:
        """Load in the background (the server answers /health with 503 meanwhile)."""

        def run():
            try:
                self.load()
            except Exception:
                log.exception("loading the model failed")

        thread = threading.Thread(target=run, name="imgedit-loader", daemon=True)
        thread.start()
        return thread

    # ---- the line ----
    def waiting(self) -> int:
        with self._cond:
            return len(self._line)

    def _acquire(self, cancel: threading.Event | None, on_wait: WaitCallback | None) -> Worker:
        with self._cond:
            idle = [w for w in self.workers if w.state == "idle"]
            if len(self._line) >= self.settings.queue_max_size and not idle:
                raise QueueFull(f"the server is busy ({len(self._line)} jobs waiting); try again later")
            ticket = object()
            self._line.append(ticket)
            reported = -1
            try:
                while True:
                    if cancel is not None and cancel.is_set():
                        raise Cancelled("cancelled while waiting")
                    if not any(w.state in ("idle", "busy") for w in self.workers):
                        raise WorkerFailed("no healthy GPU worker is left; see /health")
                    if self._line[0] is ticket:
                        for worker in self.workers:
                            if worker.state == "idle" and worker.lock.acquire(blocking=False):
                                worker.state = "busy"
                                return worker
                    ahead = self._line.index(ticket) + sum(w.state == "busy" for w in self.workers)
                    if on_wait is not None and ahead != reported:
                        reported = ahead
                        on_wait(ahead)
                    self._cond.wait(timeout=0.05)
            finally:
                self._line.remove(ticket)
                self._cond.notify_all()

    def _release(self, worker: Worker) -> None:
        with self._cond:
            if worker.state == "busy":
                worker.state = "idle"
            worker.job_id = None
            worker.lock.release()
            self._cond.notify_all()

    async def run(self, req: EditRequest, on_step: StepCallback | None = None,
                  on_wait: WaitCallback | None = None, cancel: threading.Event | None = None) -> EditResult:
        """`edit` for async edges. It runs on the manager's own threads (sized to hold every job the
        line may take, so waiting jobs never starve the event loop's executor) with the caller's
        context variables, so a Gradio progress bar fed from the callbacks reaches its page. If the
        caller is cancelled (Cancel button, gradio_client cancel, client gone), the job is told to
        stop at its next step; the worker stays locked until it has."""
        if self._executor is None:
            with self._cond:
                if self._executor is None:
                    size = self.settings.queue_max_size + self.capacity + 2
                    self._executor = concurrent.futures.ThreadPoolExecutor(size, thread_name_prefix="imgedit-job")
        cancel = cancel or threading.Event()
        context = contextvars.copy_context()
        job = asyncio.wrap_future(self._executor.submit(context.run, self.edit, req, on_step, on_wait, cancel))
        job.add_done_callback(lambda f: f.cancelled() or f.exception())  # no "never retrieved" noise
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            cancel.set()
            raise

    # ---- the edit ----
    def edit(self, req: EditRequest, on_step: StepCallback | None = None, on_wait: WaitCallback | None = None,
             cancel: threading.Event | None = None) -> EditResult:
        """Wait in line for a worker, run the pipeline, give the worker back. Raises ImgEditError."""
        started = time.perf_counter()
        worker: Worker | None = None
        outcome, steps = "error", 0
        try:
            if not self.ready:
                if self.load_error:
                    raise NotReady("the model failed to load; see /health and the server log")
                if self._loaded.is_set():
                    raise WorkerFailed("no healthy GPU worker is left; see /health")
                raise NotReady("the model is still loading; try again shortly")
            params = resolve(req, self.settings, self.family, req.images[-1].size if req.images else None,
                             len(req.images))
            steps = params.steps
            worker = self._acquire(cancel, on_wait)
            result = self._run(worker, req, params, on_step, cancel, started)
            outcome = "ok"
            return result
        except ImgEditError as exc:
            outcome = exc.kind
            raise
        finally:
            if worker is not None:
                try:
                    self._cleanup(worker)
                except Exception:  # a sticky CUDA error can make cleanup raise too
                    log.exception("%s: cleanup after the job failed", worker.name)
                finally:
                    self._release(worker)
            seconds = time.perf_counter() - started
            log.info("%s source=%s outcome=%s worker=%s steps=%d %.2fs", req.request_id, req.source, outcome,
                     worker.name if worker else "-", steps, seconds)
            record = JobRecord(req.request_id, req.source, outcome, seconds, steps, worker.name if worker else None)
            for listener in self.listeners:
                listener(record)

    def _run(self, worker: Worker, req: EditRequest, params, on_step: StepCallback | None,
             cancel: threading.Event | None, started: float) -> EditResult:
        if cancel is not None and cancel.is_set():
            raise Cancelled("cancelled before it started")
        worker.job_id, worker.step, worker.total_steps = req.request_id, 0, params.steps

        def step_end(pipe, step, timestep, callback_kwargs):
            worker.step = step + 1
            if on_step is not None:
                on_step(step + 1, params.steps)
            if cancel is not None and cancel.is_set():
                raise _Abort
            return {}

        family_images = list(req.images) if self.family == "plus" else req.images[0]
        # A CPU generator gives the same noise for a seed on every placement and device.
        generator = torch.Generator(device="cpu").manual_seed(params.seed)
        out_of_memory = False
        try:
            with torch.inference_mode():
                output = worker.pipe(
                    image=family_images, prompt=req.prompt, negative_prompt=params.negative_prompt,
                    true_cfg_scale=params.true_cfg_scale, num_inference_steps=params.steps,
                    num_images_per_prompt=params.num_images, width=params.width, height=params.height,
                    generator=generator, callback_on_step_end=step_end, callback_on_step_end_tensor_inputs=[],
                )
        except _Abort:
            raise Cancelled(f"cancelled at step {worker.step} of {params.steps}") from None
        except torch.OutOfMemoryError:
            out_of_memory = True  # cleaned up below, once the traceback no longer pins the activations
        except ImgEditError:
            raise
        except Exception as exc:
            if _is_device_fault(exc):
                worker.state, worker.error = "failed", f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                log.exception("%s: device fault; %s retired", req.request_id, worker.name)
                raise WorkerFailed(f"{worker.name} hit a GPU fault and was taken out of service") from None
            log.exception("%s: pipeline call failed", req.request_id)
            raise ImgEditError(f"the edit failed with an internal error (request {req.request_id})") from None
        if out_of_memory:
            log.warning("%s: out of GPU memory on %s", req.request_id, ",".join(worker.plan.devices))
            self._cleanup(worker, force=True)
            raise OutOfGpuMemory(
                f"out of GPU memory on {', '.join(worker.plan.devices)}: try a smaller output size, fewer "
                "images per prompt or fewer input images")
        worker.jobs_done += 1
        images = list(output.images)
        return EditResult(images, params.seed, params.steps, images[0].width, images[0].height,
                          time.perf_counter() - started, worker.name, worker.plan.devices, req.request_id)

    def _cleanup(self, worker: Worker, force: bool = False) -> None:
        """Drop what the job left behind (the seed guides' AUTO_CLEANUP); always after an OOM."""
        if not (self.settings.auto_cleanup or force):
            return
        gc.collect()
        if torch.cuda.is_available():
            for device in worker.plan.devices:
                if device.startswith("cuda"):
                    with torch.cuda.device(device):
                        torch.cuda.empty_cache()

    # ---- status ----
    def status(self) -> ManagerStatus:
        plan = self._plan
        return ManagerStatus(
            ready=self.ready, model=self.settings.model_source, family=self.family,
            mode=plan.mode if plan else "-", reason=plan.reason if plan else "planning",
            waiting=self.waiting(), workers=tuple(w.status() for w in self.workers), error=self.load_error)


def _safe_text(exc: BaseException) -> str:
    """Our own errors carry user-safe text; others are named by type only (details go to the log)."""
    return exc.message if isinstance(exc, ImgEditError) else f"{type(exc).__name__} (see the server log)"


def _is_device_fault(exc: BaseException) -> bool:
    accelerator_error = getattr(torch, "AcceleratorError", ())
    if accelerator_error and isinstance(exc, accelerator_error):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("CUDA error" in text or "device-side assert" in text)
