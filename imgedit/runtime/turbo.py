"""Qwen-Image-2.1-Turbo inside a worker (TURBO_MODEL_DIR, imgedit.planning.turbo): its transformer loaded
beside the model's, on the same devices and in the same dtype, with its own scheduler and the sigmas it was
distilled for. Per job, a speed=fast/fastest job (`Resolved.scheduler == "turbo"`) runs the pipeline on them:
the pipeline's transformer and scheduler are swapped in for the call and the sigmas passed
(QwenImage21Pipeline's `sigmas`, diffusers 0.42.1: they set the steps and override the pipeline's
`sample_sigmas`); the model's own are put back however the job ends. The text encoder and the VAE are the
model's: the Turbo checkpoint distils the transformer alone.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from imgedit.errors import ImgEditError
from imgedit.planning.plan import WorkerPlan
from imgedit.planning.turbo import SETTING, TurboCheckpoint
from imgedit.runtime import compile21, loader

log = logging.getLogger(__name__)


class Turbo:
    """A per-job part of the runner (imgedit.runtime.runner.Call): a turbo job runs on the Turbo transformer,
    scheduler and sigmas; every other job is left as it is."""

    def __init__(self, pipe, transformer, scheduler, sigmas: tuple[float, ...]):
        self.pipe = pipe
        self.transformer = transformer
        self.scheduler = scheduler
        self.sigmas = tuple(sigmas)

    @contextmanager
    def job(self, call):
        params = call.job.params
        if params.scheduler != "turbo":
            yield
            return
        if params.steps != len(self.sigmas):  # the server read the same model_index.json: only a bug
            raise ImgEditError(f"a Turbo job of {params.steps} steps, but the Turbo schedule has "
                               f"{len(self.sigmas)}")
        pipe = self.pipe
        transformer, scheduler = pipe.transformer, pipe.scheduler  # the model's (the LoRAs' part set them)
        pipe.transformer, pipe.scheduler = self.transformer, self.scheduler
        call.kwargs["sigmas"] = list(self.sigmas)
        try:
            yield
        finally:
            pipe.transformer, pipe.scheduler = transformer, scheduler


def quantized_as(worker: WorkerPlan) -> str:
    """QUANTIZE's mode for the Turbo transformer's Linear weights: the model's transformer's
    (loader.load_model quantizes both alike), "none" when they stay in the model's dtype."""
    return worker.memory.mode_of("transformer") if worker.memory is not None else "none"


def load(turbo: TurboCheckpoint, pipe, worker: WorkerPlan, dtype: torch.dtype, memoize: bool) -> Turbo:
    """The Turbo transformer onto the devices the plan gives the model's transformer (the planner counted it
    there: imgedit.planning.turbo.with_turbo), its scheduler and sigmas. `memoize`: the model's transformer
    builds its token metadata once a request (runtime.compile21): the Turbo's does too. Raises ImgEditError
    naming TURBO_MODEL_DIR when it cannot be loaded."""
    started = time.perf_counter()
    try:
        transformer = loader.load_model("transformer", turbo.checkpoint, worker, dtype)
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(turbo.folder, subfolder="scheduler")
    except Exception as exc:
        raise ImgEditError(f"{SETTING}: the Turbo checkpoint in {turbo.folder.name} could not be loaded: "
                           f"{type(exc).__name__}: {str(exc)[:300]}") from exc
    if type(transformer) is not type(pipe.transformer):
        raise ImgEditError(f"{SETTING}: {turbo.folder.name} holds a {type(transformer).__name__}, not the "
                           f"model's {type(pipe.transformer).__name__}")
    if memoize:
        compile21.memoize_21_metadata(transformer)
    mode = quantized_as(worker)
    log.info("Turbo transformer loaded from %s on %s in %.1fs (%s; %d steps: %s)", turbo.folder.name,
             worker.components["transformer"].describe(), time.perf_counter() - started,
             "the model's dtype" if mode == "none" else f"{mode} (QUANTIZE)", turbo.steps,
             ", ".join(f"{s:g}" for s in turbo.sigmas))
    return Turbo(pipe, transformer, scheduler, turbo.sigmas)
