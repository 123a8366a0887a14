"""Ulysses sequence parallelism inside a worker group, with text padded to the degree.

diffusers' context parallelism (`transformer.enable_parallelism(ContextParallelConfig(...))`) splits
the image and text sequences over the Ulysses ranks and swaps sequence shards for head shards around
every attention (all-to-all). Plain Ulysses needs each sequence divisible by the degree; the image
sequence always is (whole 2x2 patches of a size divisible by 32), the text sequence (the prompt's
length) is not. `ulysses_anything=True` lifts that but costs a `.item()` per attention, which breaks
`torch.compile(fullgraph=True)` and measured only 1.27-1.36x on 2 GPUs instead of 1.45x eager /
2.11x compiled (FACTS.md).

So the text is padded to the next multiple of the degree, and the padding is masked out:
`encoder_hidden_states_mask` is False on the padded positions, the attention processor turns it
into a joint mask, and no real token (text or image) attends to a padded one. Real text tokens keep
their rotary positions (QwenEmbedRope counts text positions from the start), so the prediction
equals the unpadded one up to floating-point rounding (tests/test_parallel_groups.py and the GPU
probe benchmarks/probe_ulysses.py check it). A mask makes SDPA leave its flash/cuDNN kernels for the
memory-efficient one: the probe measures what that costs.

Group layout: a group of `cfg * ulysses` ranks; rank = cfg_index * ulysses + ulysses_index. The
ranks with the same cfg_index form one Ulysses half (one branch of true CFG); ranks with the same
ulysses_index exchange the two branches' predictions (runtime.cfg_parallel.CfgPair over that group).

A CFG pair (PAIR_ULYSSES) holds Ulysses-2 over both its ranks behind a switch (`UlyssesSwitch`): on for
CFG-off jobs, which the pair could not split otherwise (one forward per step: rank 1 sat idle through
every Lightning job), off for CFG-on jobs, which the pair splits by branch (compiled on 2x H200: 0.309
s/step against 0.346-0.389 for Ulysses-2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import ContextParallelConfig
from diffusers.hooks import HookRegistry, ModelHook
from torch.distributed.device_mesh import init_device_mesh

from imgedit.model import internals


def pad_text(hidden: torch.Tensor, mask: torch.Tensor | None, multiple: int = 1,
             length: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pad the text sequence (dim 1) with zeros to a multiple of `multiple` (or to `length`), masked
    out. Returns the inputs unchanged when nothing needs padding."""
    length, current = length or hidden.shape[1], hidden.shape[1]
    extra = length - current + (-length % multiple)
    if extra == 0:
        return hidden, mask
    batch = hidden.shape[0]
    if mask is None:
        mask = torch.ones((batch, current), dtype=torch.bool, device=hidden.device)
    pad = hidden.new_zeros((batch, extra, hidden.shape[2]))
    hidden = torch.cat([hidden, pad], dim=1)
    mask = torch.cat([mask.to(torch.bool), mask.new_zeros((batch, extra), dtype=torch.bool)], dim=1)
    return hidden, mask


class TextPadding(ModelHook):
    """Pads the text of every call to a multiple of `multiple` (while `active()` says so, when given). A
    pre_forward hook stays in the chain when diffusers removes a hook registered before it (group offloading's
    lazy prefetching does after its first forward), where a replaced `forward` is dropped:
    tests/test_batch_cfg.py shows both (the CFG forwards re-install themselves instead:
    runtime.cfg_parallel.ForwardOverride)."""

    NAME = "imgedit_text_padding"

    def __init__(self, multiple: int, active=None):
        super().__init__()
        self.multiple, self.active = multiple, active

    def pre_forward(self, module, *args, **kwargs):
        hidden = kwargs.get("encoder_hidden_states")
        if hidden is not None and (self.active is None or self.active()):
            kwargs["encoder_hidden_states"], kwargs["encoder_hidden_states_mask"] = pad_text(
                hidden, kwargs.get("encoder_hidden_states_mask"), self.multiple)
        return args, kwargs


def install_text_padding(transformer: torch.nn.Module, multiple: int, active=None) -> None:
    """TextPadding on this transformer, registered after diffusers' context-parallel hooks: it runs before
    their split."""
    HookRegistry.check_if_exists_or_initialize(transformer).register_hook(TextPadding(multiple, active),
                                                                           TextPadding.NAME)


@dataclass(frozen=True)
class Layout:
    """Where a rank sits in a group of cfg x ulysses ranks."""

    cfg: int
    ulysses: int
    rank: int

    @property
    def cfg_index(self) -> int:
        return self.rank // self.ulysses

    @property
    def ulysses_index(self) -> int:
        return self.rank % self.ulysses

    def half(self, cfg_index: int) -> list[int]:
        """The ranks of one Ulysses half (one CFG branch)."""
        return [cfg_index * self.ulysses + u for u in range(self.ulysses)]

    def exchange_peers(self, ulysses_index: int) -> list[int]:
        """The ranks that exchange the two branches' predictions (same place in each half)."""
        return [c * self.ulysses + ulysses_index for c in range(self.cfg)]


def enable_ulysses(transformer: torch.nn.Module, layout: Layout, device_type: str, active=None, mesh=None):
    """Turn on diffusers' Ulysses attention for this rank's half of the group, over a
    (cfg, ring=1, ulysses) device mesh (the layout the 4-GPU probe ran: FACTS.md). `active`: see
    install_text_padding. `mesh`: one made for another transformer of this rank, whose communicators it then
    shares (FAST_QUANTIZE's copies: a mesh of their own made NCCL fail on the GPU machine). Returns the
    mesh."""
    if mesh is None:
        mesh = init_device_mesh(device_type, (layout.cfg, 1, layout.ulysses),
                                mesh_dim_names=("cfg", "ring", "ulysses"))
    config = ContextParallelConfig(ulysses_degree=layout.ulysses, mesh=mesh)
    if device_type == "cpu":
        # diffusers picks the rank's device as `rank % torch.accelerator.device_count()`, which is a
        # division by zero on a machine without an accelerator (CPU tests over gloo). Each rank's
        # tensors stay on the CPU either way; only that lookup needs a non-zero count.
        real = torch.accelerator.device_count
        torch.accelerator.device_count = lambda: 1
        try:
            transformer.enable_parallelism(config=config)
        finally:
            torch.accelerator.device_count = real
    else:
        transformer.enable_parallelism(config=config)
    install_text_padding(transformer, layout.ulysses, active)
    return mesh


class UlyssesSwitch:
    """Ulysses-2 over a CFG pair's two ranks, on only while `set(True)`: diffusers' context-parallel
    hooks (split the sequences into block 0 and the rotary tables, gather after proj_out) are bypassed
    through their function references, the attention processors lose their parallel config, and the text
    is not padded; off, the transformer computes what it computes without Ulysses (a CFG-on pair image
    stays the one-GPU image). Under torch.compile each state is its own variant of the block (dynamo
    guards on the processors' config; the hooks run eagerly around the compiled block,
    runtime/block_compile.py), both compiled at the warm-up."""

    def __init__(self, transformer: torch.nn.Module, rank: int, device_type: str, mesh=None):
        self.on = True
        self.mesh = enable_ulysses(transformer, Layout(cfg=1, ulysses=2, rank=rank), device_type,
                                   active=lambda: self.on, mesh=mesh)
        self._processors = [m.processor for m in transformer.modules()
                            if internals.parallel_config(getattr(m, "processor", None)) is not None]
        self._hooks = [hook for m in transformer.modules() for hook in internals.context_parallel_hooks(m)]
        if not self._processors or not self._hooks:  # a diffusers that wires context parallelism otherwise
            raise RuntimeError("PAIR_ULYSSES: diffusers' context-parallel hooks or processors were not found")
        self._config = internals.parallel_config(self._processors[0])
        self.set(False)

    def set(self, on: bool) -> None:
        if on == self.on:
            return
        for processor in self._processors:
            internals.set_parallel_config(processor, self._config if on else None)
        for hook in self._hooks:
            hook.fn_ref.pre_forward = hook.pre_forward if on else _unchanged_inputs
            hook.fn_ref.post_forward = hook.post_forward if on else _unchanged_output
        self.on = on


def _unchanged_inputs(module, *args, **kwargs):
    return args, kwargs


def _unchanged_output(module, output):
    return output
