"""What a worker's start-up has built so far (imgedit.runtime.phases fills it, phase by phase; the features of
imgedit.runtime.features read it to decide whether they apply and install on it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from imgedit.runtime.adapters import Adapters
from imgedit.runtime.messages import StartupReport, WorkerSpec
from imgedit.runtime.runner import Runner


@dataclass
class Build:
    """What a worker's start-up has built so far: the phases fill it in order."""

    spec: WorkerSpec
    say: Callable[[str], None]  # what /health and the page show while this rank loads
    report: StartupReport = field(default_factory=StartupReport)
    cuda: bool = False
    dtype: torch.dtype = torch.bfloat16
    cpu_group: object = None  # a group's CPU process group (cancel agreement, votes)
    agree: Callable[[bool], bool] | None = None  # a group's vote: true only if true on every rank
    pipe: object = None
    adapters: Adapters | None = None
    runner: Runner | None = None
    turbo: object = None  # imgedit.runtime.turbo.Turbo: TURBO_MODEL_DIR's transformer, scheduler and sigmas

    @property
    def plan(self):
        return self.spec.plan

    @property
    def capped(self) -> bool:
        """MAX_MEMORY caps this rank's GPUs."""
        return self.cuda and bool(self.spec.memory_caps)

    @property
    def late_cap(self) -> bool:
        """A random-weight benchmark checkpoint is built in bf16 on the GPU before it is quantized or
        offloaded: the allocator is capped once loading is done (the cap still holds for every job)."""
        return self.plan.memory is not None and self.spec.checkpoint.random_weights

    @property
    def transformers(self) -> tuple:
        """The quality transformer, FAST_QUANTIZE's copies of it and TURBO_MODEL_DIR's transformer (compiled,
        wrapped and warmed alike)."""
        copies = self.adapters.copies if self.adapters is not None else ()
        turbo = (self.turbo.transformer,) if self.turbo is not None else ()
        return (self.pipe.transformer, *copies, *turbo)
