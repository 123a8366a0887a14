"""The vision tower's windows in one attention call (imgedit.model.vision_attention), on the tiny checkpoint.

The tiny text encoder has the real window layout (112-pixel windows of 14-pixel patches; layer 0 windowed,
layer 1 full), so a 384² picture is 16 windows of unequal length (padding in the batch), and two pictures give
the full-attention layer two spans. The vision tower's output and the pipeline's prompt embeddings must equal
those of transformers' own per-window loop, and each layer must make exactly one attention call.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import picture
from torch.overrides import TorchFunctionMode

from imgedit.model.vision_attention import WindowLayout, install_one_call_windows, windowed_attention


class CountAttention(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def vision_modules(pipe):
    return [m for m in pipe.text_encoder.modules() if type(m).__name__ == "Qwen2_5_VLVisionAttention"]


def tower_output(pipe, images):
    inputs = pipe.processor(text=["<|vision_start|><|image_pad|><|vision_end|>" * len(images)], images=images,
                            return_tensors="pt")
    visual = pipe.text_encoder.model.visual
    with torch.no_grad(), CountAttention() as counter:
        out = visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
    return out.pooler_output, counter.calls, inputs["image_grid_thw"]


def loop_forms(pipe):
    """transformers' own forward again on every vision attention module (the instance attribute removed)."""
    for module in vision_modules(pipe):
        module.__dict__.pop("forward", None)


@pytest.mark.parametrize("sizes", [[(384, 384)], [(384, 384), (300, 200)]], ids=["one-picture", "two-pictures"])
def test_one_call_per_layer_computes_what_the_window_loop_computes(plus_pipe, sizes):
    pipe = plus_pipe.pipe
    images = [picture(w, h, (40 * k, 120, 200)) for k, (w, h) in enumerate(sizes)]
    modules = vision_modules(pipe)
    assert modules and all("forward" in m.__dict__ for m in modules), "the worker's loader installs the form"
    one_call, calls, grid = tower_output(pipe, images)
    try:
        loop_forms(pipe)
        looped, loop_calls, _ = tower_output(pipe, images)
    finally:
        assert install_one_call_windows(pipe.text_encoder) == len(modules)
    assert calls == len(modules)  # one per layer
    patches = int(grid.prod(dim=1).sum())
    assert loop_calls > 8 * len(modules), (loop_calls, patches)  # the loop made one per window (16 or more)
    torch.testing.assert_close(one_call, looped, rtol=1e-5, atol=1e-6)  # a window-blind form is 6e-5 off


def test_prompt_embeddings_equal_the_loops(plus_pipe):
    pipe = plus_pipe.pipe
    images = [picture(384, 384), picture(256, 320, (200, 20, 20))]

    def embeds():
        with torch.no_grad():  # the class's own method: the memo would hand back the first result
            return type(pipe).encode_prompt(pipe, prompt="make the sky red", image=images,
                                            device=torch.device("cpu"))[0]

    fast = embeds()
    try:
        loop_forms(pipe)
        slow = embeds()
    finally:
        install_one_call_windows(pipe.text_encoder)
    assert torch.isfinite(fast).all()
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-6)


def test_windowed_attention_keeps_each_window_to_itself():
    """Windows of 3, 1 and 2 tokens: a token's output is the attention over its own window alone."""
    torch.manual_seed(0)
    cu = torch.tensor([0, 3, 4, 6], dtype=torch.int32)
    q, k, v = (torch.randn(6, 2, 4) for _ in range(3))
    layout = WindowLayout(cu)
    assert (layout.windows, layout.longest) == (3, 3) and layout.key_mask is not None
    out = windowed_attention(q, k, v, layout, scale=0.5).reshape(6, 2, 4)
    for a, b in ((0, 3), (3, 4), (4, 6)):
        want = F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1) for x in (q, k, v)), scale=0.5)
        torch.testing.assert_close(out[a:b], want.transpose(0, 1))
    equal = WindowLayout(torch.tensor([0, 2, 4]))
    assert equal.key_mask is None  # equal windows: no mask, so SDPA may take its flash or cuDNN kernel
