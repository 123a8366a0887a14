"""A transformer split over GPUs compiles whole blocks (#44): accelerate's dispatch hooks every submodule with
weights inside a block, and a block compiled with fullgraph=True failed on those hooks (the 2x 31 GiB split
served eager on 2x H200). On the CPU the same hooks come from the same call, `dispatch_model` with a
block-by-block device map (force_hooks: one device would otherwise get none); the GPU machine runs the split
itself (tests/test_gpu.py, the acceptance run's split31 row).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from accelerate import dispatch_model
from conftest import LocalPipeline, picture
from torch._dynamo.utils import counters

from imgedit.model.components import block_container
from imgedit.planning.plan import Placement
from imgedit.runtime import block_compile, weights


def split_like_a_gpu_split(transformer: torch.nn.Module) -> None:
    blocks = len(transformer.get_submodule(block_container(transformer)))
    device_map = weights.module_device_map(transformer, Placement("cpu", ("cpu",) * blocks))
    dispatch_model(transformer, device_map=device_map, force_hooks=True)


def hooked(module: torch.nn.Module) -> set[str]:
    return {name for name, m in module.named_modules() if hasattr(m, "_hf_hook")}


def run(pipe) -> np.ndarray:
    return pipe(image=[picture(64, 64)], prompt="make it red", num_inference_steps=2, width=64, height=64,
                true_cfg_scale=1.0, generator=torch.Generator().manual_seed(0), output_type="np").images


def test_a_split_transformer_compiles_whole_blocks_inside_their_own_device_hooks(plus_ckpt):
    # this process may have compiled the block's code for other tests: past dynamo's recompile limit a frame
    # runs eager without a word, which would hide both the failure and the compile below
    torch._dynamo.reset()
    pipe = LocalPipeline(plus_ckpt, memo=0).pipe
    transformer = pipe.transformer
    split_like_a_gpu_split(transformer)
    eager = run(pipe)
    inner = {name for name in hooked(transformer) if name.startswith("transformer_blocks.0.")}
    assert "transformer_blocks.0.img_mod" in inner, inner  # what accelerate does: the cause

    # with accelerate's inner hooks, a block compiled inside its own hook fails (the worker's fallback on the GPU)
    for block in transformer.transformer_blocks:
        block_compile._compile_block(block, {"fullgraph": True, "dynamic": True})
    with pytest.raises(Exception, match="disable"):
        run(pipe)
    block_compile.uncompile_transformer(transformer)
    torch._dynamo.reset()

    dropped = weights.keep_block_hooks(transformer)  # the loader's call for a split
    left = hooked(transformer)
    blocks = {f"transformer_blocks.{i}" for i in range(len(transformer.transformer_blocks))}
    assert blocks <= left and not any(name.startswith("transformer_blocks.0.") for name in left), left
    assert dropped >= len(inner)
    block_compile.compile_transformer(transformer, None)
    graphs = counters["stats"]["unique_graphs"]
    compiled = run(pipe)
    assert counters["stats"]["unique_graphs"] > graphs  # the blocks compiled (not a silent eager fallback)
    assert all(b._old_forward is not b._imgedit_eager_forward for b in transformer.transformer_blocks)
    np.testing.assert_allclose(compiled, eager, atol=1e-5)


def test_a_block_with_a_weight_off_its_hooks_device_keeps_the_hooks_inside_it(plus_ckpt):
    """Only where every weight of the module sits on its hook's device are the inner hooks redundant."""
    transformer = LocalPipeline(plus_ckpt, memo=0).pipe.transformer
    split_like_a_gpu_split(transformer)
    block = transformer.transformer_blocks[1]
    block._hf_hook.execution_device = torch.device("meta")  # as if its hook moved inputs to another device
    weights.keep_block_hooks(transformer)
    assert "transformer_blocks.1.img_mod" in hooked(transformer)
    assert "transformer_blocks.0.img_mod" not in hooked(transformer)


def test_hooks_that_move_weights_or_guard_other_devices_are_kept():
    """An offloading hook (weights loaded per call) keeps the hooks inside its module, and so does a module
    with a buffer on another device than its hook's; a module with no tensors has nothing to vouch for."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    def hooked_pair():
        outer = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2)))
        add_hook_to_module(outer, AlignDevicesHook(execution_device="cpu"))
        add_hook_to_module(outer[1][0], AlignDevicesHook(execution_device="cpu"))
        return torch.nn.ModuleDict({"block": outer})

    plain = hooked_pair()
    assert weights.keep_block_hooks(plain) == 1 and "block.1.0" not in hooked(plain)
    offloading = hooked_pair()
    offloading.block._hf_hook.offload = True  # set after init, which would move the weights to meta as well
    assert weights.keep_block_hooks(offloading) == 0 and "block.1.0" in hooked(offloading)
    elsewhere = hooked_pair()
    elsewhere.block.register_buffer("scale", torch.ones(1, device="meta"))
    assert weights.keep_block_hooks(elsewhere) == 0 and "block.1.0" in hooked(elsewhere)
    empty = torch.nn.ModuleDict({"block": torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Sequential(torch.nn.ReLU()))})
    add_hook_to_module(empty.block, AlignDevicesHook(execution_device="cpu"))
    add_hook_to_module(empty.block[1][0], AlignDevicesHook(execution_device="cpu"))
    assert weights.keep_block_hooks(empty) == 0 and "block.1.0" in hooked(empty)
