"""The manager: jobs through the one FIFO line (imgedit.engine.line) to the worker processes, started as
imgedit.engine.workers.startup plans them. No torch, no CUDA context.

`prepare()` opens the checkpoint and plans the placement (engine.startup); `start()` spawns one worker per
planned worker (engine.workers.pool) and returns at once (the workers load in their own processes, /health
says 503 until they are ready). Jobs from the page, the gradio API and REST wait together in arrival
order for a free worker; one job per worker at a time; cancel, progress, results and typed errors
cross the process boundary as small messages (imgedit.runtime.messages).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from imgedit.config.settings import Settings
from imgedit.engine import heap
from imgedit.engine.canvas import expanded
from imgedit.engine.images import Encoded, decoded
from imgedit.engine.interface import Engine, StepCallback, WaitCallback
from imgedit.engine.line import Admitted, Line
from imgedit.engine.outputs import stamp_result
from imgedit.engine.prompt_tokens import MAX_PROMPT_TOKENS, PromptTokens
from imgedit.engine.shutdown import NOT_STARTED, STOPPED
from imgedit.engine.validation import check_params, model_defaults, resolve, resolve_enhance, resolve_outline
from imgedit.engine.workers import startup
from imgedit.engine.workers.pool import WorkerHandle, wait_result
from imgedit.engine.workers.standby import StandbyPool
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
from imgedit.planning.families import FAMILIES, not_built
from imgedit.planning.plan import GpuSpec, Plan
from imgedit.protocol import EditRequest, EditResult, JobRecord, ManagerStatus, Resolved, WorkerState
from imgedit.runtime.messages import Done, Failed, Job, Paused, Resume, may_pause

log = logging.getLogger(__name__)

# a worker's failure as the error it was (InvalidInput: a mask_prompt outlined nothing, naming the parameter)
ERRORS = {cls.kind: cls
          for cls in (Cancelled, OutOfGpuMemory, WorkerFailed, NotReady, QueueFull, InvalidInput)}
# Sizes warmed at start-up: the default square and a portrait one (the blocks compile dynamic from the
# first; the second checks that no guard specialised a length: imgedit.runtime.warmup).
WARMUP_SIZES = ((1024, 1024), (832, 1248))
# freed memory given back at least this often, besides after each job (imgedit.engine.heap)
HEAP_EVERY_S = 10.0


class PipelineManager(Engine):
    def __init__(self, settings: Settings, plan: Plan | None = None, gpus: Sequence[GpuSpec] | None = None,
                 worker_hook: str | None = None, warmup_sizes: tuple[tuple[int, int], ...] = WARMUP_SIZES,
                 standbys: StandbyPool | None = None):
        self.settings = settings
        self._plan = plan
        self._gpus = gpus
        self._standbys = standbys  # processes started before the plan, for the workers' ranks (app.py)
        self.worker_hook = worker_hook  # "module:function" run in every worker after loading (tests)
        self.warmup_sizes = warmup_sizes
        self.workers: list[WorkerHandle] = []
        self.checkpoint: Checkpoint | None = None
        self.load_error: str | None = None
        self.line = Line(settings, lambda: self.workers)  # the one FIFO line (imgedit.engine.line)
        self._executor_lock = threading.Lock()
        self.listeners: list[Callable[[JobRecord], None]] = []
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._started = False
        self._giving_back: threading.Event | None = None  # stops heap.keep_giving_back's thread
        self._nodes: dict[str, str] = {}  # WORKERS=ray: each planned worker's Ray node id
        # imgedit.config.loras.LoraFile: the LoRAs every worker loads, checked in prepare()
        self.loras: tuple = ()
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
        """Why these workers cannot run a step cache (the family, then the plan's modes), or None: the page
        hides its Step cache control then."""
        return not_built(self.family, "cache") or modes.cache_refusal(self.settings, self._plans)

    def can_run(self, params: Resolved) -> InvalidInput | None:
        """Whether these workers can run a job with these parameters: the refusal (a 400 naming the
        parameter) or None. What the plan decides and the value checks cannot know (a step cache on compiled
        workers or a Ulysses group, a prompt rewrite where the text encoder is streamed); `resolve` and
        `check`, which every edge calls, end here."""
        if params.cache != "none" and (refusal := self.cache_refusal()) is not None:
            return InvalidInput(f"cache {params.cache} is not available on this server: {refusal}", "cache")
        if params.task == "enhance" or params.enhance_tokens:
            if (refusal := modes.enhance_refusal(self._plans)) is not None:
                return InvalidInput(f"prompt rewriting is not available on this server: {refusal}",
                                    None if params.task == "enhance" else "enhance_prompt")
        if params.outline_tokens:  # the text encoder writes the boxes, as it writes a rewrite
            if (refusal := modes.enhance_refusal(self._plans)) is not None:
                return InvalidInput(f"mask_prompt is not available on this server: {refusal}", "mask_prompt")
        return None

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
            self.settings = startup.family_settings(self.settings, self.checkpoint.family)
            self.prompt_tokens = PromptTokens.from_checkpoint(self.checkpoint.folder)
            log.info("prompts are counted by %s: at most %d tokens", self.prompt_tokens.source,
                     MAX_PROMPT_TOKENS)
            planned = startup.plan_workers(self.settings, self.checkpoint, self._plan, self._gpus)
            self._plan, self._nodes, self.loras = planned.plan, planned.nodes, planned.loras
        except Exception as exc:
            self.load_error = user_text(exc)
            raise
        if planned.error is not None:  # the page and /health still come up, and say why
            self.load_error = planned.error
            return self
        s = self.settings
        for line in self._plan.describe():
            log.info("%s", line)
        self.workers = [self._handle(w) for w in self._plan.workers]
        for w in self.workers:
            encode_cache = f"{s.encode_cache} input(s)" if s.encode_cache else "off"
            log.info("%s: %d process(es), compile %s, encode cache %s, CPU threads %s (%s)", w.name,
                     w.plan.ranks, "on" if self.compile_enabled(w.plan) else "off", encode_cache,
                     w.spec.cpu_threads or "PyTorch's default",
                     f"{w.spec.copy_threads} while streamed weights are copied" if w.spec.copy_threads
                     else "the same for streamed weights' copies")
        if (refused := startup.refusal(s, self._plans, self.checkpoint, self.loras)) is not None:
            self.load_error = refused
            raise PlacementError(refused)
        return self

    def _handle(self, plan) -> WorkerHandle:
        spec = startup.worker_spec(self.settings, plan, self._plan.workers, self.checkpoint, self.loras,
                                   self.worker_hook, self.warmup_sizes)
        return startup.worker_handle(self.settings, plan, spec, self._nodes.get(plan.name), self._changed,
                                     self._standbys)

    def _changed(self) -> None:
        self.line.changed()

    def start(self) -> PipelineManager:
        """Spawn the worker processes; they load in the background."""
        self.prepare()
        if not self._started:
            self._started = True
            self._giving_back = heap.keep_giving_back(HEAP_EVERY_S)
            for worker in self.workers:
                worker.start()
        return self

    def load(self, timeout: float = 600) -> PipelineManager:
        """start(), then wait until no worker is loading. Raises when none could be loaded."""
        self.start()
        if not self.line.wait_while(lambda: any(w.state.coming for w in self.workers), timeout):
            raise WorkerFailed(f"the workers did not load within {timeout:.0f}s")
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
        self.line.changed()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self._giving_back is not None:
            self._giving_back.set()

    # ---- the SIGTERM drain (imgedit.engine.shutdown), through the line that knows every job in flight ----
    def stop_accepting(self, message: str = NOT_STARTED) -> None:
        self.line.close(message)

    def wait_idle(self, timeout: float) -> bool:
        return self.line.wait_empty(timeout)

    def cancel_running(self, message: str = STOPPED) -> None:
        self.line.cancel_all(message)

    # ---- the line (imgedit.engine.line) ----
    def waiting(self) -> int:
        return len(self.line)

    async def run(self, req: EditRequest, on_step: StepCallback | None = None,
                  on_wait: WaitCallback | None = None, cancel: threading.Event | None = None,
                  params: Resolved | None = None) -> EditResult:
        """`edit` for async edges. It runs on the manager's own threads (sized to hold every job the
        line may take, so waiting jobs never starve the event loop's executor) with the caller's
        context variables, so a Gradio progress bar fed from the callbacks reaches its page. If the
        caller is cancelled (Cancel button, gradio_client cancel, client gone), the job is told to
        stop at its next step; the worker stays taken until it has."""
        cancel = cancel or threading.Event()
        return await self._in_thread(cancel, self.edit, req, on_step, on_wait, cancel, params)

    async def run_enhance(self, req: EditRequest, on_wait: WaitCallback | None = None,
                          cancel: threading.Event | None = None) -> EditResult:
        """`enhance` for async edges, as `run` is `edit`'s."""
        cancel = cancel or threading.Event()
        return await self._in_thread(cancel, self.enhance, req, on_wait, cancel)

    async def run_outline(self, req: EditRequest, on_wait: WaitCallback | None = None,
                          cancel: threading.Event | None = None) -> EditResult:
        """`outline` for async edges, as `run` is `edit`'s."""
        cancel = cancel or threading.Event()
        return await self._in_thread(cancel, self.outline, req, on_wait, cancel)

    async def _in_thread(self, cancel: threading.Event, call, *args) -> EditResult:
        with self._executor_lock:
            if self._executor is None:
                size = self.settings.queue_max_size + self.capacity + 2
                self._executor = concurrent.futures.ThreadPoolExecutor(size, thread_name_prefix="imgedit-job")
        context = contextvars.copy_context()
        job = asyncio.wrap_future(self._executor.submit(context.run, call, *args))
        job.add_done_callback(lambda f: f.cancelled() or f.exception())  # no "never retrieved" noise
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            cancel.set()
            raise

    def resolve(self, req: EditRequest) -> Resolved:
        """The exact parameters of a decoded edit, or InvalidInput naming the field: every check, done once
        (an edge resolves and hands them to `run`/`edit`, which then take them as they are)."""
        params = resolve(req, self.settings, self.family, req.images[-1].size if req.images else None,
                         len(req.images), self.prompt_tokens)
        return self._runnable(params)

    def check(self, req: EditRequest) -> Resolved:
        """`resolve` for a request whose images are not decoded (Gradio's validator: their headers) or not
        there yet (a job's template, checked before its files are read): every check that needs no pixels,
        and whether these workers can run it (`can_run`)."""
        return self._runnable(check_params(req, self.settings, self.family, self.prompt_tokens))

    def resolve_enhance(self, req: EditRequest) -> Resolved:
        """A prompt rewrite's parameters (the images and the instruction), or InvalidInput naming the
        field."""
        return self._runnable(resolve_enhance(req, self.settings, self.family, len(req.images),
                                              self.prompt_tokens))

    def resolve_outline(self, req: EditRequest) -> Resolved:
        """mask_prompt's outline alone (the images and the phrase), or InvalidInput naming the field."""
        return self._runnable(resolve_outline(req, self.family, len(req.images)))

    def _runnable(self, params: Resolved) -> Resolved:
        if (refusal := self.can_run(params)) is not None:
            raise refusal
        return params

    def edit(self, req: EditRequest, on_step: StepCallback | None = None, on_wait: WaitCallback | None = None,
             cancel: threading.Event | None = None, params: Resolved | None = None) -> EditResult:
        """Wait in line for a worker, run the edit in its process(es), give the worker back. `params`: the
        request as `resolve` made it at the edge (resolved here when absent). Each result image carries its
        settings: this is the one place every edge's results pass."""
        result, params = self._through_line(req, "edit", params, on_step, on_wait, cancel)
        # a mask_prompt's outline is recorded as the mask it made (its hash, how it was applied)
        stamp_result(result, req if result.mask is None else replace(req, mask=result.mask), params,
                     self.settings.model_name)
        return result

    def enhance(self, req: EditRequest, on_wait: WaitCallback | None = None,
                cancel: threading.Event | None = None) -> EditResult:
        """A prompt rewrite alone (imgedit.runtime.enhance), through the same line as edits: the result's
        `prompt` is the rewrite, or None with a `notice` when the user's prompt is kept."""
        return self._through_line(req, "enhance", None, None, on_wait, cancel)[0]

    def outline(self, req: EditRequest, on_wait: WaitCallback | None = None,
                cancel: threading.Event | None = None) -> EditResult:
        """mask_prompt's outline alone (imgedit.runtime.grounding), through the same line as edits: the
        result's `mask` and `boxes`, no image; InvalidInput (mask_prompt) when the model found nothing."""
        return self._through_line(req, "outline", None, None, on_wait, cancel)[0]

    def _through_line(self, req: EditRequest, task: str, params: Resolved | None,
                      on_step: StepCallback | None, on_wait: WaitCallback | None,
                      cancel: threading.Event | None) -> tuple[EditResult, Resolved]:
        # in flight until its worker is released: what the drain waits for, or stops (a ShuttingDown then)
        with self.line.admit(cancel, background=req.background) as admitted:
            return self._on_worker(req, task, params, on_step, on_wait, admitted)

    def _on_worker(self, req: EditRequest, task: str, params: Resolved | None, on_step: StepCallback | None,
                   on_wait: WaitCallback | None, cancel: Admitted) -> tuple[EditResult, Resolved]:
        """Checked, in line, on a worker, and back: one job, logged and reported to the listeners."""
        started = time.perf_counter()
        worker: WorkerHandle | None = None
        outcome, steps, pauses, compiled = "error", 0, 0, 0
        timings: dict[str, float] = {}  # seconds per phase: the queue here, the worker's from its result
        try:
            restarting = any(w.state is WorkerState.RESTARTING
                             or (w.state is WorkerState.LOADING and w.restarts)
                             for w in self.workers)
            if not self.ready and not restarting:  # a restarting worker is waited for, in line
                if self.load_error and not self.workers:
                    raise NotReady(f"no worker is available: {self.load_error}")
                if self.load_error or (self.workers and not any(not w.state.ended for w in self.workers)):
                    raise NotReady("the model failed to load; see /health and the server log")
                raise NotReady("the model is still loading; try again shortly")
            by_task = {"enhance": self.resolve_enhance, "outline": self.resolve_outline}
            params = params or by_task.get(task, self.resolve)(req)
            steps = params.steps
            resume: Resume | None = None
            while True:  # once, or again from where an item paused for an edit (imgedit.runtime.pause)
                waited = time.perf_counter()
                worker = self.line.acquire(cancel, on_wait, req.client, background=req.background,
                                           resumed=resume is not None)
                timings["queue"] = round(timings.get("queue", 0.0) + time.perf_counter() - waited, 4)
                answer = self._submit(worker, req, task, params, resume, on_step, cancel)
                if not isinstance(answer, Paused):
                    break
                self._give_back(worker, cancel)
                worker, resume, pauses = None, answer.resume, pauses + 1
                log.info("%s paused after step %d of %d for an edit waiting", req.request_id, resume.step,
                         steps)
            if not isinstance(answer, Done):
                raise ERRORS.get(answer.kind, ImgEditError)(answer.message, answer.field)
            outcome, compiled = "ok", answer.result.compiled_graphs
            timings.update(answer.result.timings)
            return answer.result, params
        except ImgEditError as exc:
            outcome = exc.kind
            raise
        finally:
            if worker is not None:
                self._give_back(worker, cancel)
            if any(isinstance(image, Encoded) for image in req.images):
                heap.give_back()  # the pixels decoded for the job are gone: their pages too
            seconds = time.perf_counter() - started
            log.info("%s %s source=%s outcome=%s worker=%s steps=%d %.2fs", req.request_id, task, req.source,
                     outcome, worker.name if worker else "-", steps, seconds)
            if timings:
                log.debug("%s time budget: %s", req.request_id,
                          ", ".join(f"{phase} {value:.3f}s" for phase, value in timings.items()))
            record = JobRecord(req.request_id, req.source, outcome, seconds, steps,
                               worker.name if worker else None, task, timings, pauses, compiled)
            for listener in self.listeners:
                listener(record)

    def _submit(self, worker: WorkerHandle, req: EditRequest, task: str, params: Resolved,
                resume: Resume | None, on_step: StepCallback | None,
                cancel: Admitted) -> Done | Failed | Paused:
        """One run of the job on its claimed worker: from the start, or from where it paused."""
        if cancel.is_set():
            raise Cancelled("cancelled before it started")
        # the inputs decoded now that the job has a worker; an expanded canvas runs as a masked edit of the
        # padded image (the request keeps the original)
        job_req = _with_pixels(req)
        job = Job(expanded(job_req) if task == "edit" else job_req, params, self.family, resume)
        cancel.pause.clear()
        # the line asks only an item that can pause, on a worker of one process (a group's ranks may run it
        # together, which does not pause)
        cancel.pausable = may_pause(job) and worker.plan.ranks == 1
        cancel.on_worker = True
        return wait_result(worker, worker.submit(job), cancel, on_step, cancel.pause)

    def _give_back(self, worker: WorkerHandle, job: Admitted) -> None:
        self.line.release(worker, job)

    def preview(self, request_id: str) -> bytes | None:
        for worker in self.workers:
            if worker.job_id == request_id:
                return worker.preview
        return None

    # ---- status ----
    def status(self) -> ManagerStatus:
        plan = self._plan
        cache = self.settings.cache
        if cache == "first-block":
            cache = f"first-block (threshold {self.settings.cache_threshold:g})"
        return ManagerStatus(
            ready=self.ready, model=self.settings.model_source, family=self.family,
            mode=plan.mode if plan else "-", reason=plan.reason if plan else "planning",
            waiting=self.waiting(), workers=tuple(w.status() for w in self.workers), error=self.load_error,
            loras=tuple(f.describe() for f in self.loras), weights_mib=self._planned_weights(),
            cache=cache, attention=self.settings.attention,
            compile_mode=modes.compile_mode(self.settings, self._plans),
            fast_quantize=self.settings.fast_quantize, defaults=self.defaults())

    def defaults(self) -> dict:
        """What a request gets when it leaves a value out, and what the model takes (planning.families)."""
        family = FAMILIES[self.family]
        return {**model_defaults(self.settings, self.family), "max_images": family.max_images,
                "text_to_image": family.generates, "output_resolution": family.output_resolution,
                "transparency": family.rgba}

    def _planned_weights(self) -> dict[str, float]:
        """The plan's weights on each local GPU (the panel's until a worker measured its own). Ray plans name
        GPUs of other machines: not these."""
        return {} if self._plan is None or self.settings.workers == "ray" else self._plan.gpu_weights_mib()


def _with_pixels(req: EditRequest) -> EditRequest:
    """The request as the worker takes it: inputs that waited in line as their bytes (images.Encoded) decoded
    now that the job has a worker, so a waiting request costs its compressed size."""
    if not any(isinstance(image, Encoded) for image in req.images):
        return req
    return replace(req, images=tuple(decoded(image) for image in req.images))
