"""LoRA adapters and the Lightning scheduler inside a worker (one rank).

Every configured LoRA is loaded once at start-up as a named peft adapter of the transformer
(diffusers' `load_lora_weights(..., adapter_name=...)`) and left disabled. Per job the runner calls
`use(params)` and, whatever happens, `reset()`: a job runs with exactly its own adapters and
strengths (`set_adapters`) or with LoRA layers disabled (`disable_lora`: peft then calls the base
layer alone, so a no-LoRA job computes what it would without any LoRA loaded), and the scheduler
its preset asks for. Adapters stay unfused: fusing writes into the base weights and unfusing in
bf16 does not restore them bit for bit, so a quality job after a fast one would drift.
"""

from __future__ import annotations

import logging
import time

from imgedit.config.loras import LIGHTNING_SCHEDULER, LoraFile
from imgedit.errors import ImgEditError

log = logging.getLogger(__name__)


class Adapters:
    def __init__(self, pipe, files: tuple[LoraFile, ...] = ()):
        self.pipe = pipe
        self.files = {f.name: f for f in files}
        # peft adapter names end up as module names, which may not contain "." (a file stem such as
        # ...-V1.0-bf16 does): each LoRA gets an internal name.
        self.adapter_names = {f.name: f"lora_{i}" for i, f in enumerate(files)}
        self.default_scheduler = pipe.scheduler
        self._lightning = None
        self.active: tuple[tuple[str, float], ...] = ()
        self._configured: tuple[tuple[str, float], ...] = ()  # what set_adapters last set (kept while disabled)
        for file in files:
            started = time.perf_counter()
            try:
                pipe.load_lora_weights(file.path, adapter_name=self.adapter_names[file.name])
            except Exception as exc:
                raise ImgEditError(f"LoRA {file.name!r} ({file.path}) could not be loaded: "
                                   f"{type(exc).__name__}: {str(exc)[:200]}") from exc
            log.info("LoRA %s loaded in %.2fs", file.name, time.perf_counter() - started)
        if files:
            pipe.disable_lora()

    @property
    def lightning_scheduler(self):
        """The checkpoint's own scheduler config with the Lightning recipe's overrides, built once."""
        if self._lightning is None:
            from diffusers import FlowMatchEulerDiscreteScheduler

            self._lightning = FlowMatchEulerDiscreteScheduler.from_config(
                self.default_scheduler.config, **LIGHTNING_SCHEDULER)
        return self._lightning

    def use(self, adapters: tuple[tuple[str, float], ...], scheduler: str = "default") -> None:
        """Activate exactly these adapters (or none) and the job's scheduler."""
        unknown = [name for name, _ in adapters if name not in self.files]
        if unknown:  # the server checked the name against the same settings: only a bug gets here
            raise ImgEditError(f"LoRA {unknown[0]!r} is not loaded in this worker")
        self.pipe.scheduler = self.lightning_scheduler if scheduler == "lightning" else self.default_scheduler
        self.active = adapters  # first: should enabling fail half-way, reset() still disables
        if adapters:
            if adapters != self._configured:  # each call walks every module: skip it when nothing changes
                names, weights = [self.adapter_names[n] for n, _ in adapters], [w for _, w in adapters]
                self.pipe.set_adapters(names, weights)
                self._configured = adapters
            self.pipe.enable_lora()
        elif self.files:
            self.pipe.disable_lora()

    def reset(self) -> None:
        """No adapter active and the default scheduler: the state every job starts from."""
        self.pipe.scheduler = self.default_scheduler
        if self.files and self.active:
            self.pipe.disable_lora()
        self.active = ()
