"""The manager: the one FIFO line in front of the worker processes. No torch, no CUDA context.

`prepare()` opens the checkpoint and plans the placement; `start()` spawns one worker per planned
worker (imgedit.engine.pool) and returns at once (the workers load in their own processes, /health says
503 until they are ready). Jobs from the page, the gradio API and REST wait together in arrival
order for a free worker; one job per worker at a time; cancel, progress, results and typed errors
cross the process boundary as small messages (imgedit.runtime.messages).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import logging
import threading
import time
from collections.abc import Callable, Sequence

from imgedit.config.settings import Settings
from imgedit.engine import startup
from imgedit.engine.gpus import discover_gpus, host_memory
from imgedit.engine.images import stamp_result
from imgedit.engine.inspection import inspect_checkpoint
from imgedit.engine.pool import WorkerHandle, wait_result
from imgedit.engine.prompt_tokens import MAX_PROMPT_TOKENS, PromptTokens
from imgedit.engine.validation import check_enhance, resolve, resolve_enhance
from imgedit.errors import (
    Cancelled,
    ImgEditError,
    InvalidInput,
    NotReady,
    OutOfGpuMemory,
    PlacementError,
    QueueFull,
    WorkerFailed,
    user_text,
)
from imgedit.planning import modes
from imgedit.planning.checkpoint import Checkpoint, open_checkpoint
from imgedit.planning.memory import bytes_item, plan_memory
from imgedit.planning.plan import GpuSpec, Plan
from imgedit.protocol import EditRequest, EditResult, JobRecord, ManagerStatus, Resolved, WorkerState
from imgedit.runtime.messages import Done, Job

log = logging.getLogger(__name__)

StepCallback = Callable[[int, int], None]  # (step, total)
WaitCallback = Callable[[int], None]  # jobs ahead of this one (running ones included)
ERRORS = {cls.kind: cls for cls in (Cancelled, OutOfGpuMemory, WorkerFailed, NotReady, QueueFull)}
# Sizes warmed at start-up: the default square and a portrait one (the blocks compile dynamic from the
# first; the second checks that no guard specialised a length: imgedit.runtime.warmup).
WARMUP_SIZES = ((1024, 1024), (832, 1248))


class _Ticket:
    """A place in the line (compared by identity), and whose it is."""

    __slots__ = ("client",)

    def __init__(self, client: str | None):
        self.client = client


class PipelineManager:
    def __init__(self, settings: Settings, plan: Plan | None = None, gpus: Sequence[GpuSpec] | None = None,
                 worker_hook: str | None = None, warmup_sizes: tuple[tuple[int, int], ...] = WARMUP_SIZES):
        self.settings = settings
        self._plan = plan
        self._gpus = gpus
        self.worker_hook = worker_hook  # "module:function" run in every worker after loading (tests)
        self.warmup_sizes = warmup_sizes
        self.workers: list[WorkerHandle] = []
        self.checkpoint: Checkpoint | None = None
        self.load_error: str | None = None
        self._cond = threading.Condition()
        self._line: collections.deque[_Ticket] = collections.deque()
        self.listeners: list[Callable[[JobRecord], None]] = []
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._started = False
        self._nodes: dict[str, str] = {}  # WORKERS=ray: each planned worker's Ray node id
        self.loras: tuple = ()  # imgedit.config.loras.LoraFile: the LoRAs every worker loads, checked in prepare()
        self.prompt_tokens = PromptTokens()  # the checkpoint's tokenizer once prepare() opened it

    # ---- planning and start-up ----
    @property
    def plan(self) -> Plan | None:
        return self._plan

    @property
    def family(self) -> str:
        return self.checkpoint.family if self.checkpoint else "plus"

    @property
    def ready(self) -> bool:
        return any(w.state.serving for w in self.workers)

    @property
    def capacity(self) -> int:
        return max(1, len(self._plan.workers)) if self._plan else 1

    def compile_enabled(self, plan) -> bool:
        return modes.compile_enabled(self.settings, plan)

    def cache_refusal(self) -> str | None:
        return modes.cache_refusal(self.settings, self._plans)

    def check_cache(self, cache: str | None) -> None:
        """InvalidInput (400) when a job asks for a step cache these workers cannot run."""
        if cache not in (None, "none") and (refusal := self.cache_refusal()) is not None:
            raise InvalidInput(f"cache {cache} is not available on this server: {refusal}", "cache")

    @property
    def _plans(self) -> list:
        return [w.plan for w in self.workers]

    def prepare(self) -> PipelineManager:
        """Open the checkpoint and plan the placement (seconds, no weights): the edges need the
        model family and the number of workers before they are built."""
        if self.checkpoint is not None:
            return self
        try:
            self.checkpoint = open_checkpoint(self.settings.model_source)
            self.prompt_tokens = PromptTokens.from_checkpoint(self.checkpoint.folder)
            log.info("prompts are counted by %s: at most %d tokens", self.prompt_tokens.source, MAX_PROMPT_TOKENS)
            s = self.settings
            if s.workers == "ray":
                if s.quantize or s.offload:
                    raise PlacementError("QUANTIZE and OFFLOAD work with WORKERS=local only for now; "
                                         "leave them at auto (or none) with WORKERS=ray")
                from imgedit.engine import ray_pool

                try:
                    ray_pool.connect(s.ray_address, s.ray_connect_timeout)
                except WorkerFailed as exc:  # the page and /health still come up, and say why
                    log.error("%s", exc.message)
                    self.load_error = exc.message
                    self._plan = Plan("ray", (), exc.message)
                    return self
            # Sizes (from the configs) and the LoRA check, measured on the worker side in a subprocess:
            # this process never imports torch.
            sizes, self.loras = inspect_checkpoint(self.checkpoint, s.quantize_skip, s.lora_entries,
                                                   sizes=self._plan is None)
            if self._plan is None:
                item = bytes_item(s.torch_dtype)  # QUANTIZE / OFFLOAD: the planner sizes each mode
                if s.workers == "ray":
                    specs = [c.spec("none", item) for c in sizes]
                    self._plan, self._nodes = ray_pool.plan_cluster(specs, s, ray_pool.alive_nodes())
                else:
                    gpus = discover_gpus() if self._gpus is None else list(self._gpus)
                    self._plan = plan_memory(sizes, gpus, s, item, host_memory() if gpus else None)
        except Exception as exc:
            self.load_error = user_text(exc)
            raise
        for line in self._plan.describe():
            log.info("%s", line)
        self.workers = [self._handle(w) for w in self._plan.workers]
        for w in self.workers:
            log.info("%s: %d process(es), compile %s, encode cache %s, CPU threads %s", w.name, w.plan.ranks,
                     "on" if self.compile_enabled(w.plan) else "off", f"{s.encode_cache} input(s)" if s.encode_cache
                     else "off", w.spec.cpu_threads or "PyTorch's default")
        if (refused := startup.refusal(s, self._plans, self.checkpoint, self.loras)) is not None:
            self.load_error = refused
            raise PlacementError(refused)
        return self

    def _handle(self, plan) -> WorkerHandle:
        s = self.settings
        spec = startup.worker_spec(s, plan, self._plan.workers, self.checkpoint, self.loras, self.worker_hook,
                                   self.warmup_sizes)
        common = dict(cache_dir=s.compile_cache_dir, max_restarts=s.worker_restarts, log_level=s.log_level,
                      on_change=self._changed, max_memory=s.max_memory)
        if s.workers == "ray":
            from imgedit.engine.ray_pool import RayWorkerHandle

            return RayWorkerHandle(plan, spec, node_id=self._nodes.get(plan.name), visible=None, **common)
        return WorkerHandle(plan, spec, visible=s.cuda_visible_devices, start_method=s.worker_start, **common)

    def _changed(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def start(self) -> PipelineManager:
        """Spawn the worker processes; they load in the background."""
        self.prepare()
        if not self._started:
            self._started = True
            for worker in self.workers:
                worker.start()
        return self

    def load(self, timeout: float = 600) -> PipelineManager:
        """start(), then wait until no worker is loading. Raises when none could be loaded."""
        self.start()
        deadline = time.monotonic() + timeout
        with self._cond:
            while any(w.state.coming for w in self.workers):
                if time.monotonic() > deadline:
                    raise WorkerFailed(f"the workers did not load within {timeout:.0f}s")
                self._cond.wait(0.1)
        if self.load_error and not self.workers:
            raise WorkerFailed(self.load_error)
        if not self.ready:
            errors = "; ".join(f"{w.name}: {w.error}" for w in self.workers)
            self.load_error = f"no worker could be loaded ({errors})"
            raise WorkerFailed(self.load_error)
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop every worker process (Stop, then terminate, then kill)."""
        threads = [threading.Thread(target=w.stop, args=(timeout,)) for w in self.workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with self._cond:
            self._cond.notify_all()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- the line ----
    def waiting(self) -> int:
        with self._cond:
            return len(self._line)

    def _alive(self) -> bool:
        return any(not w.state.ended for w in self.workers)

    def client_places(self) -> int:
        """The most places in the line one client may hold (CLIENT_SHARE of QUEUE_MAX_SIZE, at least one)."""
        return max(1, int(self.settings.queue_max_size * self.settings.client_share))

    def _acquire(self, cancel: threading.Event | None, on_wait: WaitCallback | None,
                 client: str | None = None) -> WorkerHandle:
        with self._cond:
            idle = [w for w in self.workers if w.state is WorkerState.IDLE]
            if len(self._line) >= self.settings.queue_max_size and not idle:
                raise QueueFull(f"the server is busy ({len(self._line)} jobs waiting); try again later")
            held = sum(t.client == client for t in self._line) if client is not None else 0
            if held >= self.client_places() and not idle:
                raise QueueFull(f"you already have {held} edit(s) waiting; one client may hold at most "
                                f"{self.client_places()} of the line's {self.settings.queue_max_size} places "
                                "(CLIENT_SHARE); try again when one has started")
            ticket = _Ticket(client)
            self._line.append(ticket)
            reported = -1
            try:
                while True:
                    if cancel is not None and cancel.is_set():
                        raise Cancelled("cancelled while waiting")
                    if not self._alive():
                        raise WorkerFailed("no healthy GPU worker is left; see /health")
                    if self._line[0] is ticket:
                        for worker in self.workers:
                            if worker.claim():
                                return worker
                    ahead = self._line.index(ticket) + sum(w.state is WorkerState.BUSY for w in self.workers)
                    if on_wait is not None and ahead != reported:
                        reported = ahead
                        on_wait(ahead)
                    self._cond.wait(timeout=0.05)
            finally:
                self._line.remove(ticket)
                self._cond.notify_all()

    def _release(self, worker: WorkerHandle) -> None:
        with self._cond:
            worker.release()
            self._cond.notify_all()

    async def run(self, req: EditRequest, on_step: StepCallback | None = None,
                  on_wait: WaitCallback | None = None, cancel: threading.Event | None = None,
                  task: str = "edit", params: Resolved | None = None) -> EditResult:
        """`edit` for async edges. It runs on the manager's own threads (sized to hold every job the
        line may take, so waiting jobs never starve the event loop's executor) with the caller's
        context variables, so a Gradio progress bar fed from the callbacks reaches its page. If the
        caller is cancelled (Cancel button, gradio_client cancel, client gone), the job is told to
        stop at its next step; the worker stays taken until it has."""
        if self._executor is None:
            with self._cond:
                if self._executor is None:
                    size = self.settings.queue_max_size + self.capacity + 2
                    self._executor = concurrent.futures.ThreadPoolExecutor(size, thread_name_prefix="imgedit-job")
        cancel = cancel or threading.Event()
        context = contextvars.copy_context()
        job = asyncio.wrap_future(self._executor.submit(context.run, self.edit, req, on_step, on_wait, cancel, task,
                                                       params))
        job.add_done_callback(lambda f: f.cancelled() or f.exception())  # no "never retrieved" noise
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            cancel.set()
            raise

    def enhance(self, req: EditRequest, on_wait: WaitCallback | None = None,
                cancel: threading.Event | None = None) -> EditResult:
        """A prompt rewrite alone (imgedit.runtime.enhance), through the same line as edits: the result's
        `prompt` is the rewrite, or None with a `notice` when the user's prompt is kept."""
        return self.edit(req, None, on_wait, cancel, task="enhance")

    def resolve(self, req: EditRequest, task: str = "edit") -> Resolved:
        """The exact parameters of a decoded request, or InvalidInput naming the field: every check, done once
        (an edge resolves and hands them to `run`/`edit`, which then take them as they are)."""
        if task == "enhance":
            params = resolve_enhance(req, self.settings, self.family, len(req.images), self.prompt_tokens)
        else:
            params = resolve(req, self.settings, self.family, req.images[-1].size if req.images else None,
                             len(req.images), self.prompt_tokens)
            self.check_cache(params.cache)
        check_enhance(params, self._plans)
        return params

    def edit(self, req: EditRequest, on_step: StepCallback | None = None, on_wait: WaitCallback | None = None,
             cancel: threading.Event | None = None, task: str = "edit", params: Resolved | None = None) -> EditResult:
        """Wait in line for a worker, run the job in its process(es), give the worker back. `params`: the
        request as `resolve` made it at the edge (resolved here when absent)."""
        started = time.perf_counter()
        worker: WorkerHandle | None = None
        outcome, steps = "error", 0
        cancel = cancel or threading.Event()
        try:
            restarting = any(w.state is WorkerState.RESTARTING or (w.state is WorkerState.LOADING and w.restarts)
                             for w in self.workers)
            if not self.ready and not restarting:  # a restarting worker is waited for, in line
                if self.load_error and not self.workers:
                    raise NotReady(f"no worker is available: {self.load_error}")
                if self.load_error or (self.workers and not self._alive()):
                    raise NotReady("the model failed to load; see /health and the server log")
                raise NotReady("the model is still loading; try again shortly")
            params = params or self.resolve(req, task)
            steps = params.steps
            worker = self._acquire(cancel, on_wait, req.client)
            if cancel.is_set():
                raise Cancelled("cancelled before it started")
            events = worker.submit(Job(req, params, self.family))
            answer = wait_result(worker, events, cancel, on_step)
            if not isinstance(answer, Done):
                raise ERRORS.get(answer.kind, ImgEditError)(answer.message)
            outcome = "ok"
            result = answer.result
            # The one place every edge's results pass: each PNG returned or stored carries its settings.
            if task == "enhance":
                return result
            stamp_result(result, req, params, self.settings.model_name)
            return result
        except ImgEditError as exc:
            outcome = exc.kind
            raise
        finally:
            if worker is not None:
                self._release(worker)
            seconds = time.perf_counter() - started
            log.info("%s %s source=%s outcome=%s worker=%s steps=%d %.2fs", req.request_id, task, req.source,
                     outcome, worker.name if worker else "-", steps, seconds)
            record = JobRecord(req.request_id, req.source, outcome, seconds, steps, worker.name if worker else None,
                               task)
            for listener in self.listeners:
                listener(record)

    # ---- status ----
    def status(self) -> ManagerStatus:
        plan = self._plan
        return ManagerStatus(
            ready=self.ready, model=self.settings.model_source, family=self.family,
            mode=plan.mode if plan else "-", reason=plan.reason if plan else "planning",
            waiting=self.waiting(), workers=tuple(w.status() for w in self.workers), error=self.load_error,
            loras=tuple(f.describe() for f in self.loras), weights_mib=self._planned_weights(),
            cache=self.settings.cache if self.settings.cache != "first-block"
            else f"first-block (threshold {self.settings.cache_threshold:g})", attention=self.settings.attention,
            compile_mode=modes.compile_mode(self.settings, self._plans), fast_quantize=self.settings.fast_quantize)

    def _planned_weights(self) -> dict[str, float]:
        """The plan's weights on each local GPU (the panel's until a worker measured its own). Ray plans name
        GPUs of other machines: not these."""
        return {} if self._plan is None or self.settings.workers == "ray" else self._plan.gpu_weights_mib()
