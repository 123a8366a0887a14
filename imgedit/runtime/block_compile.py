"""COMPILE for the edit models' transformer: its repeated blocks compiled, each inside the hooks around it
(accelerate's device hooks of a transformer split over GPUs, diffusers' context-parallel hooks of a Ulysses
split), streamed blocks left eager; and undone when a compile fails (runtime/warmup.py falls back to eager).
Qwen-Image-2.1's cached steps compile in runtime/compile21.py."""

from __future__ import annotations

import logging

import torch

from imgedit.model import internals
from imgedit.model.components import block_container
from imgedit.planning.plan import MemoryMode

log = logging.getLogger(__name__)


def compile_transformer(transformer: torch.nn.Module, memory: MemoryMode | None,
                        mode: str = "default") -> None:
    """COMPILE: the repeated blocks, as diffusers' compile_repeated_blocks does, in COMPILE_MODE.
    Streamed blocks stay eager: their offload hooks move weights in functions torch.compile must not
    trace (diffusers marks them torch.compiler.disable, which fullgraph=True refuses).

    Dynamic in the sequence lengths from the first compile: a static first compile is never used again once
    a second size recompiles dynamic (dynamo tries its newest entry first), so it only cost start-up time,
    once per variant of the block (on a CPU pair with a Lightning LoRA and an int8 fast copy: 14 compiles to
    ready, 10 dynamic; on 2x H200 the second warm-up size now compiles nothing). Inductor autotunes fp8's
    `_scaled_mm` against Triton templates even in the default mode (`tuned_scaled_mm`); keeping cuBLAS's
    kernel instead (`max_autotune_gemm_backends=ATEN`) did not make an fp8 block's compile short (182 s for
    one variant, a 2x H200 host alone; 2.3-4.1 min with autotuning on a shared 4x H200 host:
    docs/BENCHMARKS.md), and its step time was not measured, so inductor keeps its own choice until
    benchmarks/probe_fp8_compile.py says more."""
    options: dict = {"fullgraph": True, "dynamic": True} | ({"mode": mode} if mode != "default" else {})
    blocks = transformer.get_submodule(block_container(transformer))
    hooked = any(internals.has_device_hook(block) for block in blocks)
    split = any(internals.context_parallel_hooks(block) for block in blocks)
    if (memory is None or not memory.streams_blocks) and not (hooked or split):
        transformer.compile_repeated_blocks(**options)
        return
    streamed = set(memory.streamed(len(blocks))) if memory is not None and memory.streams_blocks else set()
    for i, block in enumerate(blocks):
        if i not in streamed:
            _compile_block(block, options)
    if streamed:
        log.info("compiled the %d resident transformer blocks; streamed blocks run eager",
                 memory.resident_blocks)
    if hooked:
        log.info("compiled the transformer blocks inside their device hooks "
                 "(the transformer is split over GPUs)")
    if split:
        log.info("compiled the transformer blocks inside their context-parallel hooks (Ulysses)")


def _compile_block(block: torch.nn.Module, options: dict) -> None:
    """Module.compile; under an accelerate device hook, the block's own forward inside the hook. A transformer
    split over GPUs is dispatched with such a hook on every block, whose pre_forward (it moves the inputs to
    the block's GPU) is torch.compiler.disable'd, which fullgraph=True refuses: the 2x 31 GiB split's compile
    warm-up failed on it on 2x H200 and the worker served eager. The hook now runs eager around the compiled
    forward, as accelerate calls `module._old_forward` after pre_forward; the hooks accelerate also puts
    inside the block were dropped at loading (weights.keep_block_hooks).

    Under diffusers' context-parallel hooks (Ulysses: a group's, or a CFG pair's split of CFG-off jobs) the
    block's own forward is compiled inside them too, the hooks run eager. Compiled whole, the hook chain was
    part of every variant: block 0 carries a split hook of its own (diffusers' cp plan splits the sequences
    into `transformer_blocks.0`), a pair switches the hooks' functions per job, and each arrangement was a
    compile of the shared block code (on the CPU pair of tests/test_warmup.py: 6 per rank, 1 without the
    split; on 2x H200 the pair's first split job's warm-up took 76 s of a 174 s first start)."""
    eager = internals.hooked_forward(block)
    if eager is not None:
        block._imgedit_eager_forward = eager
        internals.replace_hooked_forward(block, torch.compile(eager, **options))
    elif internals.context_parallel_hooks(block) and _own_forward(block, internals.innermost_forward(block)):
        inner = internals.innermost_forward(block)
        block._imgedit_eager_inner_forward = inner
        internals.replace_innermost_forward(block, _from_offset_zero(torch.compile(inner, **options)))
    else:
        block.compile(**options)


def _own_forward(block: torch.nn.Module, forward) -> bool:
    """Whether the innermost of the block's diffusers hooks holds the block's own (bound) forward: it does
    when the context-parallel hooks were its first; another hook's wrapper there would be compiled with it."""
    return getattr(forward, "__self__", None) is block


def _from_offset_zero(compiled):
    """`compiled`, its tensor arguments that are views at an offset into a larger tensor copied first.
    A rank's shard of the split sequence (every rank's but the first) is such a view, and dynamo specialises
    a storage offset of 0 or 1 apart from a larger one: block 0 (the shard) and the blocks after it (fresh
    tensors) were two variants of the one block function on those ranks. On the CPU group of two
    (tests/test_warmup.py) rank 1 compiled 6 graphs to rank 0's 3, and a group is ready when its slowest rank
    is. What it copies on rank 1 of that group: block 0's image and text shards (a 1024x1024 edit's: 25 MB)
    and every block's shard of the text mask (its own hook splits it: a few hundred bytes). The rotary tables
    (a tuple, at the same offsets in every block) are passed as they are."""
    def own(value):
        return value.clone() if isinstance(value, torch.Tensor) and value.storage_offset() else value

    def forward(*args, **kwargs):
        return compiled(*(own(a) for a in args), **{k: own(v) for k, v in kwargs.items()})
    return forward


def uncompile_transformer(transformer: torch.nn.Module) -> None:
    """Undo compile_transformer: every module compiled with Module.compile, or inside its device hook or its
    context-parallel hooks, runs its eager forward again."""
    for module in transformer.modules():
        internals.drop_compiled_call(module)
        eager = module.__dict__.pop("_imgedit_eager_forward", None)
        if eager is not None:
            internals.replace_hooked_forward(module, eager)
        inner = module.__dict__.pop("_imgedit_eager_inner_forward", None)
        if inner is not None:
            internals.replace_innermost_forward(module, inner)
