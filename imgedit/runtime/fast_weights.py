"""Fast mode on its own weights (FAST_QUANTIZE): a copy of the transformer per Lightning LoRA, the LoRA fused
in and the Linear layers quantized, which `fast`/`fastest` jobs run on instead of the quality weights.

Why a copy: peft cannot merge a LoRA into torchao's quantized weights, so a quantized fast mode needs the LoRA
fused in bf16 first, for good; the quality weights must stay bf16 and exact for quality edits and other LoRAs.
Measured on one H100 (docs/BENCHMARKS.md, 2026-11-27): `fastest` on the fp8 copy 1.362 s, 0.2345 s per step,
against 1.798 s and 0.3408 s on the bf16 weights (the LoRA unfused there: FUSE_LORA's copy does not fit on an
80 GB card); the copy holds 19 GiB, and compiling its fp8 blocks took ~5 min at start-up.

How: the copy is built block by block on the transformer's own device, so at most one bf16 block exists
beside the quality weights at any time: deep-copy the block (with its peft layers), write each adapted base
weight `W + scaling * (B @ A)` (`addmm_`, one rounding, as imgedit.runtime.fusion does at strength 1), put
the plain Linear back in place of peft's layer, then quantize the block (torchao, imgedit.runtime.offload).
The rest of the transformer (embedders, norms, output projection) is copied and treated the same way.

A job runs on a copy when it is a speed preset's job (the Lightning scheduler, CFG off) whose adapters are
exactly that Lightning LoRA at strength 1, without a step cache (the hooks sit on the quality weights); every
other job, a `fastest` one with an added LoRA or the Lightning LoRA picked for a quality edit
included, runs on the quality weights as before. Workers of one GPU, and CFG pairs (each rank
holds the copies, with the pair's Ulysses switch for CFG-off jobs like the quality transformer:
imgedit.runtime.group); not a transformer split over GPUs (the copy is made on one device) or a
Ulysses group (imgedit.planning.modes.fast_refusal says so at start-up). Worker hooks (the
tests' faults, the benchmarks' finite check) find the copies as `pipe.imgedit_fast_copies`.
"""

from __future__ import annotations

import copy
import logging
import math
import time

import torch
from peft.tuners.lora import LoraLayer

from imgedit.errors import ImgEditError, PlacementError
from imgedit.model import internals
from imgedit.model.components import block_container
from imgedit.runtime.fusion import add_lora, fusable_layers, gpu_room
from imgedit.runtime.offload import quantize_module

log = logging.getLogger(__name__)
GIB = 1024**3


def fused_copy(transformer: torch.nn.Module, adapter: str, mode: str) -> torch.nn.Module:
    """A copy of `transformer` with peft's `adapter` fused into its weights at strength 1, every peft layer
    replaced by its base layer, and each Linear quantized in `mode` (fp8 | int8; "none" keeps bf16, for
    tests)."""
    name = block_container(transformer)
    blocks = transformer.get_submodule(name)
    parent, _, attr = name.rpartition(".")
    owner = transformer.get_submodule(parent) if parent else transformer
    setattr(owner, attr, torch.nn.ModuleList())  # the shell first: everything but the blocks
    try:
        shell = copy.deepcopy(transformer)
    finally:
        setattr(owner, attr, blocks)
    shell.__dict__.pop("peft_config", None)
    internals.unmark_peft(shell)
    _fuse(shell, adapter)
    if mode != "none":
        quantize_module(shell, mode)
    copied = torch.nn.ModuleList()
    for block in blocks:
        block = copy.deepcopy(block)
        _fuse(block, adapter)
        if mode != "none":
            quantize_module(block, mode)
        copied.append(block)
    setattr(shell.get_submodule(parent) if parent else shell, attr, copied)
    return shell.eval().requires_grad_(False)


@torch.no_grad()
def _fuse(module: torch.nn.Module, adapter: str) -> None:
    """Replace each peft LoRA layer inside `module` by its base layer, `adapter` written into its weight."""
    for fqn, layer in [(n, m) for n, m in module.named_modules() if isinstance(m, LoraLayer)]:
        base = layer.get_base_layer()
        if adapter in layer.lora_A:  # FastWeights checked it with fusion.fusable_layers
            rank = layer.r[adapter]
            scaling = layer.lora_alpha[adapter] / (math.sqrt(rank) if layer.use_rslora.get(adapter) else rank)
            add_lora(base.weight.data, layer, adapter, scaling)  # strength 1, as peft scales it
        parent, _, attr = fqn.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, attr, base)


def copy_bytes(transformer: torch.nn.Module, mode: str) -> int:
    """About what a copy holds: each Linear weight at one byte per value (fp8, int8) plus a scale per row,
    everything else in its own dtype."""
    total = 0
    for fqn, module in transformer.named_modules():
        if "lora_" in fqn:  # peft's adapter weights stay with the quality transformer
            continue
        for key, p in module.named_parameters(recurse=False):
            linear = isinstance(module, torch.nn.Linear) and key == "weight" and mode != "none"
            total += p.numel() + 4 * p.shape[0] if linear else p.numel() * p.element_size()
    return total


class FastWeights:
    """The copies, keyed by peft adapter name; `for_job` says
    which one a job runs on (None: the quality weights)."""

    def __init__(self, transformer: torch.nn.Module, adapters: dict[str, str], mode: str, reserve: int = 0,
                 caps: tuple[int, ...] = ()):
        """`adapters`: LoRA name -> peft adapter name, one per Lightning LoRA."""
        self.mode = mode
        self.nbytes = 0
        self.copies: dict[str, torch.nn.Module] = {}
        self.names = dict(adapters)
        if not adapters:
            return
        device = next(transformer.parameters()).device
        one = copy_bytes(transformer, mode)
        if device.type == "cuda":
            blocks = transformer.get_submodule(block_container(transformer))
            building = max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks)
            need, room = one * len(adapters) + building, gpu_room(device.index or 0, caps) - reserve
            if need > room:
                raise PlacementError(
                    f"FAST_QUANTIZE={mode} needs {need / GIB:.1f} GiB on {device} for {len(adapters)} "
                    "copy(ies) of the transformer (one per Lightning LoRA), "
                    f"and {max(room, 0) / GIB:.1f} GiB is free there with ACTIVATION_RESERVE kept; "
                    "set FAST_QUANTIZE_SPEEDS=fastest (one copy), or FAST_QUANTIZE=none")
        for name, adapter in adapters.items():
            if fusable_layers(transformer, adapter) is None:
                raise ImgEditError(f"FAST_QUANTIZE={mode}: LoRA {name!r} cannot be fused into the weights "
                                   "(a LoRA variant such as DoRA, a bias, or weights that are not plain "
                                   "floating point); set FAST_QUANTIZE=none")
            started = time.perf_counter()
            self.copies[adapter] = fused_copy(transformer, adapter, mode)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            log.info("FAST_QUANTIZE=%s: %s fused into a copy of the transformer, %s, in %.1fs", mode, name,
                     f"{one / GIB:.2f} GiB", time.perf_counter() - started)
        self.nbytes = one * len(adapters)

    def for_job(self, adapters: tuple[tuple[str, float], ...], internal: dict[str, str], scheduler: str,
                cache: str, cfg: bool = False):
        """The copy a job runs on: a speed preset's job (the Lightning scheduler, CFG off) whose adapters are
        exactly one Lightning LoRA at strength 1, without a step cache; None: the quality weights. (A pair
        splits CFG-on jobs by branch on the quality transformer only: a copy has no CFG exchange.)"""
        if len(adapters) != 1 or adapters[0][1] != 1.0 or scheduler != "lightning" or cache != "none" or cfg:
            return None
        return self.copies.get(internal.get(adapters[0][0], ""))

    def describe(self) -> str:
        if not self.copies:
            return "none"
        return (f"{self.mode}: {', '.join(self.names)} (a copy of the transformer each, LoRA fused in, "
                f"{self.nbytes / GIB:.2f} GiB in all)")
