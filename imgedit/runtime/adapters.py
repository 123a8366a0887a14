"""LoRA adapters and the Lightning scheduler inside a worker (one rank).

Every configured LoRA is loaded once at start-up as a named peft adapter of the transformer
(diffusers' `load_lora_weights(..., adapter_name=...)`) and left disabled. Per job the runner calls
`use(params)` and, whatever happens, `reset()`: a job runs with exactly its own adapters and
strengths (`set_adapters`) or with LoRA layers disabled (`disable_lora`: peft then calls the base
layer alone, so a no-LoRA job computes what it would without any LoRA loaded), and the scheduler
its preset asks for. diffusers' fuse/unfuse would not give the base weights back bit for bit (a quality
job after a fast one would drift), so a job whose adapters are exactly one LoRA has it fused by
imgedit.runtime.fusion (FUSE_LORA), which keeps an exact copy of the weights it writes; every other
job runs its adapters unfused, on the base weights restored first.
"""

from __future__ import annotations

import gc
import logging
import time
from contextlib import contextmanager

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from imgedit.config.loras import LIGHTNING_SCHEDULER, LoraFile
from imgedit.errors import ImgEditError
from imgedit.runtime.fallback import agreed, cause
from imgedit.runtime.fast_weights import FastWeights
from imgedit.runtime.fusion import Fusion

log = logging.getLogger(__name__)


class Adapters:
    def __init__(self, pipe, files: tuple[LoraFile, ...] = (), fuse: str = "off", reserve: int = 0,
                 caps: tuple[int, ...] = (), agree=None,
                 fast: str = "none", fast_steps: tuple[int, ...] = (4, 8), fast_agree=None):
        self.pipe = pipe
        self.base = pipe.transformer  # the quality weights; a fast job may run on a copy (FAST_QUANTIZE)
        self.files = {f.name: f for f in files}
        # peft adapter names end up as module names, which may not contain "." (a file stem such as
        # ...-V1.0-bf16 does): each LoRA gets an internal name.
        self.adapter_names = {f.name: f"lora_{i}" for i, f in enumerate(files)}
        self.default_scheduler = pipe.scheduler
        self._lightning = None
        self.active: tuple[tuple[str, float], ...] = ()
        # what set_adapters last set (kept while disabled)
        self._configured: tuple[tuple[str, float], ...] = ()
        # peft's LoRA layers on, as enable_lora last left them (None: unknown)
        self._enabled: bool | None = False
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
        self.fallbacks: list[str] = []  # what failed to build, and what runs instead (/health shows it)
        # imgedit.runtime.fast_weights.FastWeights: the Lightning LoRAs' own quantized copies
        self.fast = None
        self.weights: str | None = None  # the copy's mode while a job runs on one
        if fast != "none":
            lightning = {f.name: self.adapter_names[f.name] for f in files if f.steps in fast_steps}
            failure = None
            try:
                self.fast = FastWeights(pipe.transformer, lightning, fast, reserve, caps)
            except Exception as exc:  # noqa: BLE001 - an optimisation never takes the worker down
                failure = exc
            # the ranks of a group that all build copies (a pair splitting fast jobs) keep all or none
            failure = agreed(failure, fast_agree, "its fast-mode copies")
            if failure is not None:
                self.fast = None
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                reason = cause(failure)
                log.warning("fast-mode %s copies failed → bf16: %s", fast, reason)
                self.fallbacks.append(f"fast-mode {fast} copies failed → bf16: {reason}")
            pipe.imgedit_fast_copies = self.copies  # for worker hooks that watch every transformer
        self.fusion = None  # imgedit.runtime.fusion.Fusion: a job's one LoRA written into the weights
        if files and fuse != "off":
            # every LoRA, the Lightning ones too (a preset's LoRA at another strength runs here), if the room
            # is left
            self.fusion = Fusion(pipe.transformer, self.adapter_names.values(), fuse, reserve, caps, agree)

    @property
    def copies(self) -> tuple:
        """FAST_QUANTIZE's copies of the transformer this
        rank holds (compiled, wrapped and warmed like it)."""
        return tuple(self.fast.copies.values()) if self.fast is not None else ()

    @property
    def lightning_scheduler(self):
        """The checkpoint's own scheduler config with the Lightning recipe's overrides, built once."""
        if self._lightning is None:
            self._lightning = FlowMatchEulerDiscreteScheduler.from_config(
                self.default_scheduler.config, **LIGHTNING_SCHEDULER)
        return self._lightning

    def use(self, adapters: tuple[tuple[str, float], ...], scheduler: str = "default", cache: str = "none",
            cfg: bool = False) -> None:
        """Activate exactly these adapters (or none) and the job's scheduler; a Lightning job runs on its own
        copy of the transformer when FAST_QUANTIZE made one (the quality weights are left as they are)."""
        unknown = [name for name, _ in adapters if name not in self.files]
        if unknown:  # the server checked the name against the same settings: only a bug gets here
            raise ImgEditError(f"LoRA {unknown[0]!r} is not loaded in this worker")
        self.pipe.scheduler = self.lightning_scheduler if scheduler == "lightning" else self.default_scheduler
        self.active = adapters
        copy = None
        if self.fast is not None:
            copy = self.fast.for_job(adapters, self.adapter_names, scheduler, cache, cfg)
        self._transformer(copy if copy is not None else self.base)
        self.weights = self.fast.mode if copy is not None else None  # the job's result says so (the PNG too)
        if copy is None:
            self._on_base(adapters)

    def _on_base(self, adapters: tuple[tuple[str, float], ...]) -> None:
        """A job on the quality weights: its lone LoRA fused where FUSE_LORA can, else peft's layers on with
        exactly its adapters and strengths, or off."""
        one = self.adapter_names[adapters[0][0]] if len(adapters) == 1 else None
        fused = one is not None and self.fusion is not None and self.fusion.can_fuse(one)
        if self.fusion is not None and not fused:
            self.fusion.restore()  # this job runs on the base weights: the exact copy back first
        if adapters:
            if adapters != self._configured:  # each call walks every module: skip it when nothing changes
                names, weights = [self.adapter_names[n] for n, _ in adapters], [w for _, w in adapters]
                self.pipe.set_adapters(names, weights)
                self._configured = adapters
            if fused:  # peft's layers off: the no-LoRA forward (and compiled variant) on fused weights
                self._layers(False)
                self.fusion.fuse(one, adapters[0][1])
            else:
                self._layers(True)
        else:
            self._layers(False)

    def _transformer(self, transformer) -> None:
        """The transformer the pipeline calls (diffusers registers
        a component on assignment: only on a change)."""
        if self.pipe.transformer is not transformer:
            self.pipe.transformer = transformer

    def _layers(self, on: bool) -> None:
        """peft's LoRA layers on or off, only when that changes: diffusers' enable_lora/disable_lora walk all
        ~13,800 modules of the real transformer, 60-90 ms each on the CI machine's CPU with the 720 layers of
        a Lightning LoRA (a meta-device model), and on one H100 a LoRA job spent 0.21 s outside its pipeline
        call. Back-to-back jobs of one LoRA, or without any, walk nothing."""
        if not self.files or self._enabled is on:
            return
        self._enabled = None  # unknown while walking: a walk stopped half-way is walked again by the next job
        (self.pipe.enable_lora if on else self.pipe.disable_lora)()
        self._enabled = on

    @contextmanager
    def job(self, call):
        """A job's part (imgedit.runtime.runner.Call): exactly its adapters and scheduler; after a failed or
        cancelled job no adapter is left on."""
        params = call.job.params
        self.use(params.adapters, params.scheduler, params.cache, call.cfg_on)
        call.weights = self.weights  # FAST_QUANTIZE's copy, when the job runs on one
        try:
            yield
        except BaseException:
            self.reset(keep=False)
            raise
        self.reset(keep=True)

    def reset(self, keep: bool = False) -> None:
        """The default scheduler, and no adapter for a job that failed or was cancelled. After a finished job
        (`keep`) peft's layers stay as they are, and a fused LoRA's weights too, until the next job's `use`
        sets what it needs: back-to-back fast jobs switch nothing."""
        self.pipe.scheduler = self.default_scheduler
        self.weights = None
        if not keep:
            self._transformer(self.base)
            self._layers(False)
        self.active = ()
