"""A job's one LoRA fused into the transformer's weights, and the base weights given back exactly (FUSE_LORA).

An unfused adapter runs two thin matmuls beside every Linear layer it adapts: +9 % per compiled step and
+15 % eager on one H200 for the 720 layers of a Lightning LoRA, where the same adapter fused into the
weights cost +0.2 % (docs/BENCHMARKS.md, fast mode). diffusers' fuse_lora/unfuse_lora (peft's
merge/unmerge) add the update in bf16 and subtract it again, which does not give the base weights back
bit for bit, and peft keeps a `merged` state of its own: compiled blocks guard on it (one more variant to
compile) and peft's forward unmerges by itself when adapters are disabled.

So the fusing is done here, beside peft. At start-up every base weight that a fusable LoRA adapts is
copied once, on its own device, when that fits with ACTIVATION_RESERVE left over (else nothing is fused:
a host copy would cost a PCIe crossing of 25 GiB, ~0.5 s, for every job after a fused one). A job whose
adapters are exactly one LoRA gets `W + scale * (B @ A)` written into those weights (`addmm_`: one
rounding) and runs with peft's LoRA layers disabled, which is the compiled variant of a no-LoRA job:
nothing new to compile, and the strength is no graph input. A job that needs other weights first copies
the originals back, the same bits, so a job without LoRA after a fused one still gives the pixels of a
server without LoRAs. Restoring is lazy: back-to-back jobs with the same LoRA and strength fuse once.

An adapter is not fused (it runs unfused, as before) when a weight it adapts is quantized (torchao's
tensor subclasses take no in-place add) or not floating point, or it is a LoRA variant (DoRA, ...) or
carries a bias.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch
from peft.tuners.lora import LoraLayer

from imgedit.planning.placement import allocator_budget

log = logging.getLogger(__name__)

FLOATS = (torch.bfloat16, torch.float16, torch.float32)
PARTIAL = ("", 0.0)  # a fuse or restore stopped half-way: the next restore() copies back all it touched


def fusable_layers(transformer: torch.nn.Module, adapter: str) -> list | None:
    """The peft LoRA layers that carry `adapter`, or None when one of them cannot be fused in place."""
    layers = [m for m in transformer.modules() if isinstance(m, LoraLayer) and adapter in m.lora_A]
    for layer in layers:
        weight = layer.get_base_layer().weight
        if (type(weight.data) is not torch.Tensor or weight.dtype not in FLOATS
                or weight.device.type == "meta"
                or not isinstance(layer.lora_A[adapter], torch.nn.Linear)
                or getattr(layer, "fan_in_fan_out", False)
                or adapter in getattr(layer, "lora_variant", {})
                or layer.lora_bias.get(adapter, False)):
            return None
    return layers or None


class Fusion:
    """Fuses one adapter at a time into the weights; `restore()` gives the base weights back exactly."""

    def __init__(self, transformer: torch.nn.Module, adapters: Iterable[str], mode: str, reserve: int = 0,
                 caps: tuple[int, ...] = (), agree=None):
        self.layers = {a: found for a in adapters if (found := fusable_layers(transformer, a))}
        weights = {id(w): w for found in self.layers.values()
                   for w in (x.get_base_layer().weight for x in found)}
        self.nbytes = sum(w.numel() * w.element_size() for w in weights.values())
        self.fused: tuple[str, float] | None = None  # (adapter, strength) now in the weights
        self._touched: list[torch.Tensor] = []  # weights written since the last restore
        self._store: dict[int, torch.Tensor] = {}
        self.where = _where(list(weights.values()), mode, reserve, caps)
        # The ranks of a group decide together (`agree`: true only if true on every rank): a rank that fuses
        # beside one that does not would run another compiled variant, and the image would drift by rounding.
        if agree is not None and not agree(self.where is not None):
            self.where = None
        if self.where is None:
            self.layers = {}
            return
        started = time.perf_counter()
        with torch.no_grad():
            for key, weight in weights.items():
                self._store[key] = weight.detach().clone()
        log.info("FUSE_LORA: %s in %.1fs", self.describe(), time.perf_counter() - started)

    def describe(self) -> str:
        if self.where is None:
            return "off (no room for the copy, or nothing fusable)"
        return (f"{len(self.layers)} LoRA(s) fusable; "
                f"a copy of the weights they adapt: {self.nbytes / 2**30:.2f} GiB")

    def can_fuse(self, adapter: str) -> bool:
        return adapter in self.layers

    def fuse(self, adapter: str, strength: float) -> None:
        """Write `adapter` into the weights at the scale peft holds for it (set_adapters has just set it
        from `strength`). Its LoRA layers stay disabled: each forward is the base layer's alone."""
        if self.fused == (adapter, strength):
            return
        self.restore()
        self.fused = PARTIAL
        with torch.no_grad():
            for layer in self.layers[adapter]:
                weight = layer.get_base_layer().weight
                self._touched.append(weight)
                add_lora(weight, layer, adapter, layer.scaling[adapter])
        self.fused = (adapter, strength)

    def restore(self) -> None:
        """The base weights back, bit for bit, from the copy (nothing to do when none is fused)."""
        if self.fused is None:
            return
        self.fused = PARTIAL
        with torch.no_grad():
            while self._touched:
                weight = self._touched[-1]
                weight.copy_(self._store[id(weight)])
                self._touched.pop()
        self.fused = None


def add_lora(weight: torch.Tensor, layer, adapter: str, scaling: float) -> None:
    """W += scaling * (B @ A) in W's own dtype (`addmm_`: one rounding). Also FAST_QUANTIZE's copies
    (imgedit.runtime.fast_weights)."""
    down, up = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
    weight.addmm_(up.to(weight.dtype), down.to(weight.dtype), alpha=scaling)


def _where(weights: list[torch.Tensor], mode: str, reserve: int, caps: tuple[int, ...]) -> str | None:
    """"beside" (the copy of the base weights goes on their own devices), or None (nothing is fused:
    FUSE_LORA=off, nothing fusable, or the copy does not fit there). CPU weights (tests, the demo) always
    fit."""
    if mode == "off" or not weights:
        return None
    need: dict[int, int] = {}
    for w in (w for w in weights if w.is_cuda):
        need[w.device.index] = need.get(w.device.index, 0) + w.numel() * w.element_size()
    for index, nbytes in sorted(need.items()):
        room = gpu_room(index, caps)
        if nbytes + reserve > room:
            log.warning("FUSE_LORA=auto: a copy of the adapted weights (%.1f GiB on cuda:%d) does not fit in "
                        "%.1f GiB free with ACTIVATION_RESERVE %.1f GiB kept; LoRAs run unfused (+9 %% per "
                        "compiled step)", nbytes / 2**30, index, room / 2**30, reserve / 2**30)
            return None
    return "beside"


def gpu_room(index: int, caps: tuple[int, ...]) -> int:
    """Bytes this process may still allocate on cuda:index: what the driver has free plus torch's unused
    cache, under MAX_MEMORY's cap when one is set (imgedit.runtime.phases.cap_memory)."""
    free, _ = torch.cuda.mem_get_info(index)
    allocated = torch.cuda.memory_allocated(index)
    room = free + torch.cuda.memory_reserved(index) - allocated
    if index < len(caps):
        room = min(room, allocator_budget(caps[index]) - allocated)
    return room
