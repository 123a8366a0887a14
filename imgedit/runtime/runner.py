"""The runner: the only code that calls a pipeline. Lives in a worker process (one rank).

It turns a Job into pipeline arguments, reports each denoising step, stops within one step when
cancelled (all ranks of a group at the same step), and turns failures into typed, user-safe errors.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from imgedit.errors import Cancelled, ImgEditError, OutOfGpuMemory, WorkerFailed
from imgedit.planning.families import FAMILIES, Family
from imgedit.protocol import EditResult
from imgedit.runtime import enhance, shared_prompt
from imgedit.runtime.cfg_batch import CfgBatch
from imgedit.runtime.group import ParallelGroup, agree_to_stop
from imgedit.runtime.masking import MaskedEdit
from imgedit.runtime.messages import Job
from imgedit.runtime.step_cache import StepCache

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


class Runner:
    def __init__(self, pipe, name: str, devices: tuple[str, ...], rank: int = 0, world: int = 1,
                 parallel: str = "none", group=None, auto_cleanup: bool = True, ulysses: int = 1,
                 cuda: bool = False, adapters=None, batch_cfg: bool = False, pair_ulysses: bool = False):
        self.pipe = pipe
        self.name = name
        self.devices = devices
        self.rank, self.world, self.parallel = rank, world, parallel
        self.auto_cleanup = auto_cleanup
        self.group = None
        if parallel != "none":
            self.group = ParallelGroup(pipe.transformer, parallel, rank, world, ulysses, cuda, group,
                                       pair_ulysses, adapters.copies if adapters is not None else ())
            if self.group.splits_cfg_off:  # a split job's prompt: encoded on rank 0, sent to rank 1
                shared_prompt.install(pipe, rank, lambda: self.group.switch.on, self.group.cpu_group)
        self.adapters = adapters  # imgedit.runtime.adapters.Adapters: the job's LoRAs and scheduler
        self.step_cache = StepCache(pipe.transformer)  # CACHE / a request's cache (quality edits)
        self.cfg_batch = None  # BATCH_CFG: both CFG branches in one forward (a group splits them instead)
        if batch_cfg and self.group is None:
            self.cfg_batch = CfgBatch(pipe.transformer)
        # runtime.prefix_cache.PrefixCache: Qwen-Image-2.1 under a cap (set by the worker)
        self.prefix_cache = None
        # runtime.decode_room.DecodeRoom: the VAE's decode under a cap (set by the worker)
        self.decode_room = None

    def takes_part(self, job: Job) -> bool:
        """With CFG off a CFG pair has no branches to split: its first rank (or half) runs the job, or both
        ranks split the sequence (PAIR_ULYSSES). A prompt rewrite alone runs on the first rank."""
        if job.params.task == "enhance":
            return self.rank == 0
        return self.group is None or self.group.takes_part(self._cfg_on(job), self._may_split(job))

    @staticmethod
    def _cfg_on(job: Job) -> bool:
        return job.params.true_cfg_scale > 1 and bool(job.params.negative_prompt)

    @staticmethod
    def _may_split(job: Job) -> bool:
        """A pair splits a CFG-off job's sequence only without a step cache: each rank's cache would decide
        on its own part which blocks to skip, and the ranks would leave their collectives out of step."""
        return job.params.cache == "none"

    def run(self, job: Job, cancel: threading.Event, on_step: StepCallback | None = None) -> EditResult:
        """Run one job. Raises Cancelled, OutOfGpuMemory, ImgEditError, or FatalError."""
        started = time.perf_counter()
        params, req = job.params, job.request
        if params.task == "enhance":
            return self._enhance_only(job, cancel, started)
        together = None
        if self.group is not None:
            together = self.group.begin(self._cfg_on(job), self._may_split(job))
        collective = together is not None  # ranks that run this job together agree on cancel each step
        reached = 0
        masked = None  # imgedit.runtime.masking.MaskedEdit, built inside the try below

        def step_end(pipe, step, timestep, callback_kwargs):
            nonlocal reached
            reached = step + 1
            stop = cancel.is_set()
            if collective:
                stop = agree_to_stop(stop, together)
            if on_step is not None:
                on_step(step + 1, params.steps)
            if stop:
                raise _Abort
            if self.decode_room is not None:  # what the decode will share the GPU with is allocated now
                self.decode_room.decide(params.width, params.height, params.num_images)
            if masked is not None:
                return {"latents": masked.blend(step, callback_kwargs["latents"])}
            return {}

        if cancel.is_set() and not collective:
            raise Cancelled("cancelled before it started")
        family = FAMILIES[job.family]
        images = (list(req.images) or None) if family.images_as_list else req.images[0]
        extra = {}
        # Qwen-Image-2.1: inputs resized to the output's area (1024² unless sized)
        if family.output_resolution:
            extra["output_resolution"] = output_resolution(family, params.width, params.height)
            if self.prefix_cache is not None:
                extra.update(self.prefix_cache.kwargs(len(req.images), extra["output_resolution"]))
        # CPU generators give the same noise for a seed on every placement, device and rank; one per output
        # image (its own seed), so that any image of a multi-image result can be made again alone.
        generator = [torch.Generator(device="cpu").manual_seed(seed) for seed in params.image_seeds]
        out_of_memory = finished = False
        prompt, notice, weights = req.prompt, None, None
        try:
            if params.enhance_tokens:  # the rewrite first, on the same weights (its own cancel check)
                rewritten = self._rewrite(job, cancel, together)
                prompt, notice = rewritten.prompt, rewritten.notice
            if self.adapters is not None:
                self.adapters.use(params.adapters, params.scheduler, params.cache, self._cfg_on(job))
                weights = self.adapters.weights  # FAST_QUANTIZE's copy, when the job runs on one
            elif params.adapters or params.scheduler != "default":
                raise ImgEditError("this worker has no LoRAs loaded")
            if self.cfg_batch is not None:
                self.cfg_batch.begin(self._cfg_on(job))
            self.step_cache.use(params.cache, params.cache_threshold)
            with torch.inference_mode():
                if req.mask is not None:
                    masked = MaskedEdit(self.pipe, req.images[0], req.mask, params.width, params.height,
                                        params.mask_grow, params.mask_feather, params.strength, params.steps,
                                        params.image_seeds, rgba=family.rgba)
                output = self.pipe(
                    image=images, prompt=prompt,
                    # CFG runs with a negative prompt and a scale above 1;
                    # without, the pipelines warn of one unused
                    negative_prompt=params.negative_prompt if params.true_cfg_scale > 1 else None,
                    true_cfg_scale=params.true_cfg_scale, num_inference_steps=params.steps,
                    num_images_per_prompt=params.num_images, width=params.width, height=params.height,
                    generator=generator, callback_on_step_end=step_end,
                    callback_on_step_end_tensor_inputs=["latents"] if masked is not None else [], **extra,
                )
            finished = True
        except _Abort:
            raise Cancelled(f"cancelled at step {reached} of {params.steps}") from None
        except _Refused as refused:
            raise refused.error from None
        except torch.OutOfMemoryError as exc:
            # cleaned up below, once the traceback no longer pins the activations
            out_of_memory = oom_detail(exc)
        except Exception as exc:
            if is_device_fault(exc):
                log.exception("%s: device fault in %s", req.request_id, self.name)
                raise FatalError(WorkerFailed(f"{self.name} hit a GPU fault ({type(exc).__name__}); "
                                              "its process is being restarted")) from None
            log.exception("%s: pipeline call failed", req.request_id)
            error = ImgEditError(f"the edit failed with an internal error (request {req.request_id})")
            raise FatalError(error) if collective else error from None
        finally:
            if self.group is not None:
                self.group.end()
            if self.cfg_batch is not None:
                self.cfg_batch.begin(False)
            if self.adapters is not None:  # no adapter outlives a failed or cancelled job
                self.adapters.reset(keep=finished)
            self.step_cache.end()  # nor a step cache's state
            if self.decode_room is not None:
                self.decode_room.end()
        if out_of_memory:
            log.warning("%s: out of GPU memory on %s: %s",
                        req.request_id, ",".join(self.devices), out_of_memory)
            self.cleanup(force=True)
            error = OutOfGpuMemory(
                f"out of GPU memory on {', '.join(self.devices)}: try a smaller output size, fewer "
                "images per prompt or fewer input images")
            # One rank of a pair may have run out while the other waits in an exchange: start afresh.
            raise FatalError(error) if collective else error
        result = list(output.images)
        if masked is not None:  # the first image's size, its own pixels outside the mask
            result = masked.composite(result)
        return EditResult(result, params.seed, params.steps, result[0].width, result[0].height,
                          time.perf_counter() - started, self.name, self.devices, req.request_id,
                          prompt=prompt if params.enhance_tokens and notice is None else None, notice=notice,
                          weights=weights)

    def _rewrite(self, job: Job, cancel: threading.Event, together):
        """The prompt rewrite (imgedit.runtime.enhance). In a group the first rank writes it and the others
        take its words, or its refusal (cancel, out of memory, failure): every rank must encode the same
        prompt, and all of them stop together. Raises _Refused."""
        req = job.request
        box: list = [None]
        out_of_memory = False
        if together is None or self.rank == 0:
            try:
                box[0] = enhance.rewrite(self.pipe, req.images, req.prompt, job.params.enhance_tokens, cancel)
            except torch.OutOfMemoryError:
                out_of_memory = True  # cleaned up below, once the traceback no longer pins generate's tensors
            except ImgEditError as exc:  # Cancelled
                box[0] = exc
            except Exception as exc:
                if is_device_fault(exc):
                    raise FatalError(WorkerFailed(f"{self.name} hit a GPU fault ({type(exc).__name__}); its "
                                                  "process is being restarted")) from None
                log.exception("%s: prompt rewrite failed", req.request_id)
                box[0] = ImgEditError("the prompt rewrite failed with an internal error "
                                      f"(request {req.request_id})")
            if out_of_memory:
                self.cleanup(force=True)
                box[0] = OutOfGpuMemory(f"out of GPU memory on {', '.join(self.devices)} "
                                        "while rewriting the prompt: try fewer or smaller input images")
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

    def cleanup(self, force: bool = False) -> None:
        """Drop what the job left behind (the seed guides' AUTO_CLEANUP); always after an OOM."""
        if not (self.auto_cleanup or force):
            return
        if force:  # a full collection walks every object (compiled graphs included): only after an OOM
            gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


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
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/torch/" not in f.filename]
    where = f" (in {Path(frames[-1].filename).name}:{frames[-1].lineno}, {frames[-1].name})" if frames else ""
    return " ".join(str(exc).split(". Of the allocated")[0].split())[:400] + where


def is_device_fault(exc: BaseException) -> bool:
    accelerator_error = getattr(torch, "AcceleratorError", ())
    if accelerator_error and isinstance(exc, accelerator_error):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("CUDA error" in text or "device-side assert" in text)
