"""The text encoder's vision tower: all windows of a layer in one attention call, not one call per window.

Qwen2.5-VL's vision tower attends within windows (8x8 patches) in 28 of its 32 layers. Without
FlashAttention's variable-length kernel (not installed: it is a download and a build), transformers 5.x runs
SDPA once per window, after a `cu_seqlens.tolist()` that waits for the GPU at every layer: a 384² condition
image (the -2509/-2511 pipelines) is 16 windows, so 448 small attention calls and 32 stalls per prompt, and a
1024² one (the first edit model's) 100 windows a layer. That loop is CPU work, and it was most of the 60 ms
the vision tower took in a 4-step edit (BENCHMARKS.md, "Outside the loop").

Here each layer gathers its windows into one padded batch (windows x longest window), masks the padding out of
the keys, and makes one SDPA call; the result is scattered back in the original order. The window layout is
built once per forward (every windowed layer gets the same `cu_seqlens` tensor; the full-attention layers get
another) and costs one wait for the GPU instead of 32. It computes what the loop computes: the same keys for
each query, a masked key weighs exactly zero; only the kernel's rounding differs
(tests/test_vision_attention.py).

Written here, not taken from a library: transformers offers the batched form only through FlashAttention's
varlen kernel. Installed on the text-encoder instance (its vision attention modules' `forward`); installed
packages stay untouched, and it steps aside where the encoder uses a FlashAttention implementation (which has
no loop) or where the module is not the one this was written against.
"""

from __future__ import annotations

import inspect
import logging
import sys
import types

import torch
import torch.nn.functional as F

from imgedit.model import internals

log = logging.getLogger(__name__)

_EXPECTED = ("hidden_states", "cu_seqlens", "position_embeddings")


class WindowLayout:
    """Where each token of a layer's windows sits in a padded (windows x longest) batch."""

    def __init__(self, cu_seqlens: torch.Tensor):
        bounds = cu_seqlens.tolist()  # the one wait for the GPU, for every layer that shares this tensor
        lengths = [bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)]
        self.windows, self.longest = len(lengths), max(lengths)
        # The rest is built where the tensor lives, from it, in shapes known here: no further wait.
        device, cu = cu_seqlens.device, cu_seqlens.to(torch.long)
        starts, sizes = cu[:-1], cu[1:] - cu[:-1]
        slot = torch.arange(self.longest, device=device)
        valid = slot[None, :] < sizes[:, None]  # (windows, longest)
        self.gather = torch.where(valid, starts[:, None] + slot[None, :], 0).reshape(-1)
        tokens = torch.arange(bounds[-1] - bounds[0], device=device) + bounds[0]
        window = torch.searchsorted(cu[1:], tokens, right=True)
        # each token's row in the padded batch
        self.scatter = window * self.longest + (tokens - starts[window])
        self.key_mask = None if all(n == self.longest for n in lengths) else valid[:, None, None, :]


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: WindowLayout,
                       scale: float) -> torch.Tensor:
    """q, k, v: (tokens, heads, head_dim) → (tokens, heads * head_dim),
    each window attending within itself."""
    heads, dim = q.shape[1], q.shape[2]

    def batch(x):
        return x[layout.gather].reshape(layout.windows, layout.longest, heads, dim).transpose(1, 2)

    out = F.scaled_dot_product_attention(batch(q), batch(k), batch(v), attn_mask=layout.key_mask, scale=scale)
    return out.transpose(1, 2).reshape(layout.windows * layout.longest, heads * dim)[layout.scatter]


class _Layouts:
    """The layouts of the tensors seen last (one forward passes two: windows, and one span per image). Holding
    the tensors keeps their ids from being reused while they are here."""

    def __init__(self, size: int = 4):
        self.size, self.entries = size, []

    def get(self, cu_seqlens: torch.Tensor) -> WindowLayout:
        for tensor, layout in self.entries:
            if tensor is cu_seqlens:
                return layout
        layout = WindowLayout(cu_seqlens)
        self.entries = (self.entries + [(cu_seqlens, layout)])[-self.size:]
        return layout


def _attention_forward(rotary, layouts: _Layouts):
    def forward(module, hidden_states, cu_seqlens, position_embeddings=None, **kwargs):
        tokens = hidden_states.shape[0]
        qkv = module.qkv(hidden_states).reshape(tokens, 3, module.num_heads, -1)
        q, k, v = qkv.permute(1, 0, 2, 3).unbind(0)
        cos, sin = position_embeddings
        q, k = rotary(q, k, cos, sin)
        out = windowed_attention(q, k, v, layouts.get(cu_seqlens), module.scaling)
        return module.proj(out.contiguous())

    return forward


def install_one_call_windows(text_encoder: torch.nn.Module) -> int:
    """Give each vision attention module of `text_encoder` the one-call form. Returns how many it took (0:
    none here, a FlashAttention implementation, or a module unlike the one this was written for)."""
    modules = [m for m in text_encoder.modules() if type(m).__name__ == "Qwen2_5_VLVisionAttention"]
    if not modules:
        return 0
    config = modules[0].config
    implementation = internals.attention_implementation(config)
    if implementation not in ("sdpa", "eager"):
        log.info("vision attention: %s has no per-window loop to replace", implementation)
        return 0
    cls = type(modules[0])
    rotary = getattr(sys.modules[cls.__module__], "apply_rotary_pos_emb_vision", None)
    parameters = tuple(inspect.signature(cls.forward).parameters)[1:4]
    attributes = all(hasattr(m, name) for m in modules for name in ("qkv", "proj", "num_heads", "scaling"))
    if rotary is None or parameters != _EXPECTED or not attributes:
        log.warning("vision attention: %s is not the module this was written for; its own loop stays",
                    cls.__name__)
        return 0
    forward = _attention_forward(rotary, _Layouts())
    forward.one_call_windows = True
    wrapped = [m for m in modules if "forward" in m.__dict__
               and not getattr(getattr(m.forward, "__func__", None), "one_call_windows", False)]
    if wrapped:  # a hook's wrapper (accelerate, diffusers) would be dropped: leave them all as they are
        log.warning("vision attention: %d module(s) already wrapped by a hook; their own loop stays",
                    len(wrapped))
        return 0
    for module in modules:
        module.forward = types.MethodType(forward, module)
    return len(modules)
