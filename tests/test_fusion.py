"""FUSE_LORA (imgedit.runtime.fusion): a job's one LoRA fused into the weights from an exact copy, on a
pipeline of the test process (the runner as a worker runs it), against the unfused adapter of test_loras."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_loras import Local, linears, local, lora_dir  # noqa: F401  (the LoRA files and the unfused runner)

from imgedit.errors import ImgEditError
from imgedit.runtime.fusion import PARTIAL


@pytest.fixture(scope="module")
def fused(plus_ckpt, lora_dir):  # noqa: F811  (the fixture imported above)
    return Local(plus_ckpt, lora_dir, fuse="auto")



def test_a_fused_lora_edits_as_the_unfused_one_and_gives_the_base_weights_back_bit_for_bit(local, fused):  # noqa: F811
    """FUSE_LORA (imgedit.runtime.fusion): a job with exactly one LoRA runs on W + scale * B @ A with peft's
    layers off; a job that wants other weights first gets the base weights back, the same bits."""
    base = {n: p.detach().clone() for n, p in fused.pipe.transformer.named_parameters() if "lora_" not in n}
    fusion = fused.adapters.fusion
    assert fusion is not None and fusion.where == "beside" and len(fusion.layers) == 3
    assert np.array_equal(fused.edit(), fused.baseline)
    for asked in (dict(lora="style"), dict(lora="style", lora_scale=0.3), dict(speed="fastest"), dict(speed="fast")):
        image = fused.edit(**asked)
        assert fusion.fused is not None and fusion.fused[1] == asked.get("lora_scale", 1.0), asked
        assert not fused.any_adapter_active()  # fused: the forward is the base layers' alone
        # float32 on the CPU: fused and unfused differ by rounding only
        assert np.abs(image - local.edit(**asked)).max() <= 1, asked
    both = fused.edit(speed="fast", lora="style")  # two adapters: unfused, on the base weights given back
    assert fusion.fused is None and np.abs(both - local.edit(speed="fast", lora="style")).max() <= 1
    fastest = fused.edit(speed="fastest")  # from peft's layers on (two adapters) to fused: they go off first
    assert not fused.any_adapter_active() and np.abs(fastest - local.edit(speed="fastest")).max() <= 1
    assert np.array_equal(fused.edit(), fused.baseline)  # restored for a job without LoRA
    assert all(torch.equal(p, base[n]) for n, p in fused.pipe.transformer.named_parameters() if n in base)


def test_a_failed_fused_job_leaves_the_base_weights_for_the_next_job(fused):
    def fail(module, args):
        raise KeyError("fault injected inside a fused LoRA job")

    hook = fused.pipe.transformer.register_forward_pre_hook(fail)
    try:
        with pytest.raises(ImgEditError):
            fused.edit(lora="style")
    finally:
        hook.remove()
    fusion = fused.adapters.fusion
    assert fusion.fused is not None  # the weights stay fused until a job wants others
    assert np.array_equal(fused.edit(), fused.baseline)
    layers = fusion.layers[fused.adapters.adapter_names["style"]]
    layer, scaling = layers[len(layers) // 2], layers[len(layers) // 2].scaling
    layer.scaling = {}  # the next fuse stops at this layer, half of the weights written
    try:
        with pytest.raises(ImgEditError):
            fused.edit(lora="style", lora_scale=0.7)
    finally:
        layer.scaling = scaling
    assert fusion.fused == PARTIAL
    assert np.array_equal(fused.edit(), fused.baseline)
