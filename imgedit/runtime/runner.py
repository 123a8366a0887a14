"""The runner: the only code that calls a pipeline. Lives in a worker process (one rank).

It turns a Job into pipeline arguments, reports each denoising step, stops within one step when
cancelled (all ranks of a group at the same step), and turns failures into typed, user-safe errors.
What a job runs with past the request (its LoRAs, a CFG pair's exchange, a step cache, a masked blend, a
decode in tiles...) are per-job features (imgedit.runtime.features), each entered as a context for the job
and left however it ends.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from imgedit.errors import Cancelled, ImgEditError, OutOfGpuMemory, WorkerFailed
from imgedit.planning.families import FAMILIES, Family
from imgedit.protocol import EditResult
from imgedit.runtime import enhance, grounding
from imgedit.runtime.adapters import Adapters
from imgedit.runtime.group import ParallelGroup, agree_to_stop
from imgedit.runtime.messages import Job
from imgedit.runtime.pause import JobPaused
from imgedit.runtime.turbo import Turbo

log = logging.getLogger(__name__)

StepCallback = Callable[[int, int], None]


class _Abort(Exception):
    """Raised from the step callback to stop a cancelled job (pipe._interrupt would still decode)."""


class _Refused(Exception):
    """The prompt rewrite ended without words (cancelled, out of memory, failed) on every rank of the job
    alike: its error goes to the user as it is (the ranks are still in step)."""

    def __init__(self, error: ImgEditError):
        super().__init__(error.message)
        self.error = error


class FatalError(ImgEditError):
    """The rank cannot go on (GPU fault, or any failure inside a group whose ranks may now be out of
    step): the worker process exits after reporting, and the pool starts a fresh one."""

    def __init__(self, error: ImgEditError):
        super().__init__(error.message)
        self.kind = error.kind
        self.error = error


@dataclass
class Call:
    """One job's pipeline call as the per-job features shape it: each feature's `job(call)` context adds
    pipeline arguments, work at every step's end and work on the result, and undoes its state on exit."""

    job: Job
    cfg_on: bool  # true CFG: a scale above 1 and a negative prompt
    may_split: bool  # a CFG pair may split this CFG-off job's sequence (no step cache)
    kwargs: dict = field(default_factory=dict)  # pipeline arguments past the request's own
    # at each step's end, in order: (step, the callback's tensors) -> tensors to hand back
    step_hooks: list[Callable[[int, dict], dict | None]] = field(default_factory=list)
    # at each step's end, after every step hook: what only records the moment (the time budget's clock)
    step_marks: list[Callable[[], None]] = field(default_factory=list)
    tensor_inputs: list[str] = field(default_factory=list)  # what the step hooks read (callback tensors)
    finish: list[Callable[[list], list]] = field(default_factory=list)  # on the result's images, in order
    together: object = None  # the CPU group whose ranks run this job together (agree on cancel every step)
    weights: str | None = None  # FAST_QUANTIZE's copy, when the job runs on one
    reached: int = 0  # the steps done (a resumed job's steps before its pause among them)
    offset: int = 0  # a resumed job's steps done before its pause (imgedit.runtime.pause)
    pause: threading.Event | None = None  # set: stop at the next step's end if the job can go on later
    timings: dict = field(default_factory=dict)  # seconds per phase (imgedit.runtime.budget)
    compiled_graphs: int = 0  # graphs torch.compile compiled during the job (imgedit.runtime.budget)
    cancel: threading.Event = field(default_factory=threading.Event)  # the job's cancel flag
    outlined: grounding.Found | None = None  # mask_prompt's outline, once Outlining made it


class JobFeature(Protocol):
    """A feature that acts per job (imgedit.runtime.features installs them on the runner, in order)."""

    def job(self, call: Call) -> AbstractContextManager: ...


class Runner:
    def __init__(self, pipe, name: str, devices: tuple[str, ...], rank: int = 0, world: int = 1,
                 auto_cleanup: bool = True, parts: tuple[JobFeature, ...] = ()):
        self.pipe = pipe
        self.name = name
        self.devices = devices
        self.rank, self.world = rank, world
        self.auto_cleanup = auto_cleanup
        self.parts: list[JobFeature] = list(parts)  # entered in this order for every job, left in reverse

    def add(self, part: JobFeature, outermost: bool = False) -> None:
        """`outermost`: entered before every part added so far (the time budget, whose clock then counts
        their own work, such as a prefix cache locking CPU memory)."""
        if outermost:
            self.parts.insert(0, part)
        else:
            self.parts.append(part)

    def part(self, kind: type):
        """The installed per-job feature of this type, or None."""
        return next((p for p in self.parts if isinstance(p, kind)), None)

    @property
    def group(self) -> ParallelGroup | None:
        """A worker of several ranks: its parallel group."""
        return self.part(ParallelGroup)

    @property
    def adapters(self) -> Adapters | None:
        """The job's LoRAs and scheduler."""
        return self.part(Adapters)

    def takes_part(self, job: Job) -> bool:
        """With CFG off a CFG pair has no branches to split: its first rank (or half) runs the job, or both
        ranks split the sequence (PAIR_ULYSSES). A prompt rewrite alone runs on the first rank."""
        if job.params.task in ("enhance", "outline"):
            return self.rank == 0
        return self.group is None or self.group.takes_part(cfg_on(job), may_split(job))

    def run(self, job: Job, cancel: threading.Event, on_step: StepCallback | None = None,
            pause: threading.Event | None = None) -> EditResult:
        """Run one job. Raises Cancelled, OutOfGpuMemory, ImgEditError, FatalError, or JobPaused (`pause` set
        while a job that can go on later runs: imgedit.runtime.pause)."""
        started = time.perf_counter()
        alone = {"enhance": self._enhance_only, "outline": self._outline_only}.get(job.params.task)
        if alone is not None:  # a rewrite or a mask_prompt outline, without an image
            return alone(job, cancel, started)
        call = self._new_call(job)
        call.cancel, call.pause = cancel, pause
        out_of_memory = None
        try:
            with ExitStack() as stack:
                for part in self.parts:
                    stack.enter_context(part.job(call))
                if cancel.is_set() and call.together is None:
                    raise Cancelled("cancelled before it started")
                images, prompt, notice = self._call(call, cancel, on_step)
        except _Abort:
            raise Cancelled(f"cancelled at step {call.reached} of {job.params.steps}") from None
        except _Refused as refused:
            raise refused.error from None
        except JobPaused:
            raise
        except torch.OutOfMemoryError as exc:
            # cleaned up below, once the traceback no longer pins the activations
            out_of_memory = oom_detail(exc)
        except ImgEditError:
            raise
        except Exception as exc:
            raise self._failure(exc, call) from None
        if out_of_memory:
            raise self._out_of_memory(job, call, out_of_memory)
        return self._result(call, images, prompt, notice, time.perf_counter() - started)

    def _result(self, call: Call, images: list, prompt: str, notice: str | None,
                seconds: float) -> EditResult:
        params, req = call.job.params, call.job.request
        outlined = call.outlined.outline if call.outlined else None  # mask_prompt's mask and boxes
        return EditResult(images, params.seed, params.steps, images[0].width, images[0].height, seconds,
                          self.name, self.devices, req.request_id,
                          prompt=prompt if params.enhance_tokens and notice is None else None, notice=notice,
                          weights=call.weights, timings=call.timings, mask=outlined and outlined.mask,
                          boxes=outlined.boxes if outlined else (), compiled_graphs=call.compiled_graphs)

    def _new_call(self, job: Job) -> Call:
        if self.adapters is None and (job.params.adapters or job.params.scheduler != "default"):
            raise ImgEditError("this worker has no LoRAs loaded")
        if job.params.scheduler == "turbo" and self.part(Turbo) is None:  # the server refuses it first
            raise ImgEditError("this worker has no Turbo transformer loaded (TURBO_MODEL_DIR)")
        call = Call(job, cfg_on(job), may_split(job))
        call.offset = job.resume.step if job.resume is not None else 0  # before any part reads the steps left
        family = FAMILIES[job.family]
        # Qwen-Image-2.1: inputs resized to the output's area (1024² unless sized)
        if family.output_resolution:
            call.kwargs["output_resolution"] = output_resolution(family, job.params.width, job.params.height)
        return call

    def _call(self, call: Call, cancel: threading.Event, on_step: StepCallback | None):
        """The rewrite (when asked), then the pipeline call with the features' arguments and step hooks."""
        job = call.job
        params, req = job.params, job.request
        prompt, notice = req.prompt, None
        if params.enhance_tokens:  # the rewrite first, on the same weights (its own cancel check)
            rewritten = self._rewrite(job, cancel, call.together)
            prompt, notice = rewritten.prompt, rewritten.notice

        def step_end(pipe, step, timestep, tensors):
            call.reached = call.offset + step + 1
            stop = cancel.is_set()
            if call.together is not None:  # ranks that run this job together stop at the same step
                stop = agree_to_stop(stop, call.together)
            if on_step is not None:
                on_step(call.reached, params.steps)
            if stop:
                raise _Abort
            out: dict = {}
            for hook in call.step_hooks:
                out.update(hook(step, {**tensors, **out}) or {})
            for mark in call.step_marks:
                mark()
            return out

        family = FAMILIES[job.family]
        images = (list(req.images) or None) if family.images_as_list else req.images[0]
        # CPU generators give the same noise for a seed on every placement, device and rank; one per output
        # image (its own seed), so that any image of a multi-image result can be made again alone.
        generator = [torch.Generator(device="cpu").manual_seed(seed) for seed in params.image_seeds]
        with torch.inference_mode():
            output = self.pipe(
                image=images, prompt=prompt,
                # CFG runs with a negative prompt and a scale above 1;
                # without, the pipelines warn of one unused
                negative_prompt=params.negative_prompt if params.true_cfg_scale > 1 else None,
                true_cfg_scale=params.true_cfg_scale, num_inference_steps=params.steps,
                num_images_per_prompt=params.num_images, width=params.width, height=params.height,
                generator=generator, callback_on_step_end=step_end,
                callback_on_step_end_tensor_inputs=call.tensor_inputs, **call.kwargs,
            )
        result = list(output.images)
        for finish in call.finish:
            result = finish(result)
        return result, prompt, notice

    def _failure(self, exc: Exception, call: Call) -> ImgEditError:
        request_id = call.job.request_id
        if is_device_fault(exc):
            log.exception("%s: device fault in %s", request_id, self.name)
            return FatalError(WorkerFailed(f"{self.name} hit a GPU fault ({type(exc).__name__}); "
                                           "its process is being restarted"))
        log.exception("%s: pipeline call failed", request_id)
        error = ImgEditError(f"the edit failed with an internal error (request {request_id})")
        return FatalError(error) if call.together is not None else error

    def _out_of_memory(self, job: Job, call: Call, detail: str) -> ImgEditError:
        log.warning("%s: out of GPU memory on %s: %s", job.request_id, ",".join(self.devices), detail)
        self.cleanup(force=True)
        error = OutOfGpuMemory(
            f"out of GPU memory on {', '.join(self.devices)}: try a smaller output size, fewer "
            "images per prompt or fewer input images")
        # One rank of a pair may have run out while the other waits in an exchange: start afresh.
        return FatalError(error) if call.together is not None else error

    def _rewrite(self, job: Job, cancel: threading.Event, together):
        """The prompt rewrite (imgedit.runtime.enhance), written by the first rank. Raises _Refused."""
        req = job.request
        return self._first_rank(job, together, "prompt rewrite", "rewriting the prompt",
                                lambda: enhance.rewrite(self.pipe, req.images, req.prompt,
                                                        job.params.enhance_tokens, cancel))

    def outline(self, job: Job, cancel: threading.Event, together) -> grounding.Found:
        """mask_prompt's outline (imgedit.runtime.grounding) of the first image, drawn by the first rank.
        Raises _Refused (an answer without a usable box is an InvalidInput naming mask_prompt)."""
        req = job.request
        phrase = " ".join((req.mask_prompt or "").split())
        return self._first_rank(job, together, "outline of mask_prompt", "outlining mask_prompt",
                                lambda: grounding.outline(self.pipe, req.images[0], phrase,
                                                          job.params.outline_tokens, cancel))

    def _first_rank(self, job: Job, together, what: str, doing: str, work):
        """What the text encoder writes for a job (a rewrite, an outline): `work()` on the first rank, whose
        answer, or refusal (cancel, out of memory, failure, nothing found), the group's other ranks take:
        every rank must go on with the same words and mask, and all of them stop together. Raises _Refused."""
        req = job.request
        box: list = [None]
        out_of_memory = False
        if together is None or self.rank == 0:
            try:
                box[0] = work()
            except torch.OutOfMemoryError:
                out_of_memory = True  # cleaned up below, once the traceback no longer pins generate's tensors
            except ImgEditError as exc:  # Cancelled; an outline that found nothing
                box[0] = exc
            except Exception as exc:
                if is_device_fault(exc):
                    raise FatalError(WorkerFailed(f"{self.name} hit a GPU fault ({type(exc).__name__}); its "
                                                  "process is being restarted")) from None
                log.exception("%s: %s failed", req.request_id, what)
                box[0] = ImgEditError(f"the {what} failed with an internal error (request {req.request_id})")
            if out_of_memory:
                self.cleanup(force=True)
                box[0] = OutOfGpuMemory(f"out of GPU memory on {', '.join(self.devices)} "
                                        f"while {doing}: try fewer or smaller input images")
        if together is not None:
            dist.broadcast_object_list(box, src=0, group=together)
        if isinstance(box[0], ImgEditError):
            raise _Refused(box[0])
        return box[0]

    def _enhance_only(self, job: Job, cancel: threading.Event, started: float) -> EditResult:
        """A rewrite job: the rewritten prompt (or None with a notice: the user's is kept), no image."""
        req = job.request
        try:
            rewritten = self._rewrite(job, cancel, None)
        except _Refused as refused:
            raise refused.error from None
        return EditResult([], job.params.seed, 0, 0, 0, time.perf_counter() - started,
                          self.name, self.devices, req.request_id,
                          prompt=None if rewritten.notice else rewritten.prompt, notice=rewritten.notice)

    def _outline_only(self, job: Job, cancel: threading.Event, started: float) -> EditResult:
        """An outline job: mask_prompt's mask and boxes, no image."""
        try:
            found = self.outline(job, cancel, None)
        except _Refused as refused:
            raise refused.error from None
        mask = found.outline.mask
        return EditResult([], 0, 0, mask.width, mask.height, time.perf_counter() - started, self.name,
                          self.devices, job.request_id, mask=mask, boxes=found.outline.boxes)

    def cleanup(self, force: bool = False) -> None:
        """Drop what the job left behind (the seed guides' AUTO_CLEANUP); always after an OOM."""
        if not (self.auto_cleanup or force):
            return
        if force:  # a full collection walks every object (compiled graphs included): only after an OOM
            gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class Outlining:
    """mask_prompt's per-job part: the job's mask outlined by the text encoder (Runner.outline) before the
    masked edit's part (imgedit.runtime.masking) takes the job's mask; installed just before it."""

    def __init__(self, runner: Runner):
        self.runner = runner

    @contextmanager
    def job(self, call: Call):
        job = call.job
        if job.params.outline_tokens and job.request.mask is None:
            call.outlined = self.runner.outline(job, call.cancel, call.together)
            call.job = replace(job, request=replace(job.request, mask=call.outlined.outline.mask))
        yield


def cfg_on(job: Job) -> bool:
    return job.params.true_cfg_scale > 1 and bool(job.params.negative_prompt)


def may_split(job: Job) -> bool:
    """A pair splits a CFG-off job's sequence only without a step cache: each rank's cache would decide on its
    own part which blocks to skip, and the ranks would leave their collectives out of step."""
    return job.params.cache == "none"


def output_resolution(family: Family, width: int | None, height: int | None) -> int:
    """QwenImage21Pipeline's `output_resolution`, the side of the square whose area every condition image is
    resized to (and a text-to-image's size when none is given): the family's 1024, or the asked output's
    area (sides rounded to 32 as the pipeline rounds them; at least `min_resolution`), so a small output does
    not encode 1 MP inputs."""
    if not (width and height):
        return family.output_resolution
    return max(family.min_resolution, round((width * height) ** 0.5 / 32) * 32)


def oom_detail(exc: BaseException) -> str:
    """The log's account of an out-of-memory error: torch's first sentences (what it tried to allocate, what
    the process holds) and the frame that asked, so that a run on the GPU machine says where memory ran
    out."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/torch/" not in f.filename][-5:]
    # the innermost frames outside torch, innermost first: the library call and the module that made it
    calls = " < ".join(f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno} {f.name}"
                       for f in reversed(frames))
    where = f" (in {calls})" if frames else ""
    return " ".join(str(exc).split(". Of the allocated")[0].split())[:400] + where


def is_device_fault(exc: BaseException) -> bool:
    accelerator_error = getattr(torch, "AcceleratorError", ())
    if accelerator_error and isinstance(exc, accelerator_error):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("CUDA error" in text or "device-side assert" in text)
