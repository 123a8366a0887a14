"""Qwen-Image-2.1's attention processor with its rotary embedding in real arithmetic, and, on a GPU with
little room, its projections and feed-forward run a slice of the sequence at a time.

Written against diffusers 0.42.1's `QwenImage21AttnProcessor` (transformer_qwenimage21.py): the same
projections, Q/K RMSNorm, prefix key/value cache bookkeeping, decode and block-causal prefill (one attention
call per prefix segment, then the target) — `tests/test_compile21.py` compares the two on every path
(prefill with and without the cache, the cached steps, a padded prompt, CFG's batch of 2). What differs:

- **RoPE without complex tensors.** diffusers rotates Q and K as complex64 (`view_as_complex`, a complex
  multiply, `view_as_real`): inductor does not generate code for complex arithmetic, so a compiled step ran
  the rotation as separate eager kernels around the fused norm, each reading and writing the whole of Q or K
  in float32. Here the pairs rotate as `(a·cos − b·sin, a·sin + b·cos)` in float32, the same arithmetic, which
  inductor fuses with the norm and the cast into one kernel per tensor. The table may come as diffusers makes
  it (complex, S × d/2) or as its `view_as_real` (S × d/2 × 2, float32).
- **Slices of the sequence under a cap** (`chunk`): a step that runs the prefix (every step where the prefix
  cache did not fit) holds the whole joint sequence — 10 references at 1024² are ~45,000 tokens, and one
  block's float32 norm and rotation of Q and K, or its feed-forward's 12,288-wide hidden layer, then take
  GiBs. With `chunk` set, Q, K and V are computed `chunk` tokens at a time into their bf16 tensors, and
  `chunked_feed_forward` does the same for the block's SwiGLU (a diffusers ModelHook). Each token's result
  is its own row's arithmetic: the same up to the matmul's choice of kernel for a shorter matrix.
- **The text segment as a causal call.** In the prefill the text segment starts the sequence, so where no
  prompt key is padded its mask is exactly SDPA's causal flag: it runs as one, through PyTorch's
  FlashAttention-2 on a GPU (`_causal`: no graph built per prompt length, as cuDNN's masked call did).
- **A group's split** (`SPLIT_ATTR`, imgedit.runtime.split21): on a rank that holds the prefix and a share of
  the target's rows, the keys and values are gathered from every rank's share before the attention. Each
  gather starts as soon as its tensor is ready (V after its projection, K after its norm and rotation) and
  is waited for after Q's projection, norm and rotation, so in an eager block the exchange runs beside that
  work (a compiled block waits where the gather starts: imgedit.model.internals.all_gather_start; under a cap,
  `chunk`'s projections gather once at the end).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21AttnProcessor

from imgedit.model import internals

FEED_FORWARD_HOOK = "imgedit_chunked_feed_forward"
# On every attention module of a transformer split over a group (imgedit.runtime.split21): the split, whose
# `on` says this forward is split and whose `start(tensor, prefix)` then `finish(...)` make this rank's keys
# or values whole (`gather` both at once).
SPLIT_ATTR = "imgedit_split21"
# Tokens at a time under a cap: 8,192 x 12,288 bf16 is 192 MiB for each of the feed-forward's two hidden
# layers (45,000 tokens at once: 1.05 GiB each), and Q/K's float32 norm and rotation 128 MiB a tensor.
CHUNK = 8192


def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x (B, S, H, D) with its last dimension in (real, imaginary) pairs, rotated by `table`: (S, D/2)
    complex, or its view as real pairs (S, D/2, 2)."""
    if table.is_complex():
        table = torch.view_as_real(table)
    cos, sin = table[None, :, None, :, 0], table[None, :, None, :, 1]
    real, imag = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1).flatten(3).type_as(x)


class Attention21(QwenImage21AttnProcessor):
    """One instance serves every block (`transformer.set_attn_processor(Attention21(...))`); diffusers'
    `set_attention_backend` sets `_attention_backend` on it as on its own processor."""

    def __init__(self, chunk: int | None = None):
        self.chunk = chunk

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        attention_mask: Any | None = None,
        rotary_emb: torch.Tensor | None = None,
        layer_cache=None,
        kv_cache_mode: str | None = None,
        cache_write_slice: slice | None = None,
        segments: list[tuple[int, int, bool]] | None = None,
        key_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        split = getattr(attn, SPLIT_ATTR, None)
        if split is not None and split.on:  # this rank holds the prefix and a share of the target's rows
            exchange = (split, segments[-1][1] if segments else 0)
        else:
            exchange = None
        query, key, value = self.project(attn, hidden_states, rotary_emb, exchange)
        if layer_cache is not None:
            if kv_cache_mode == "extract" and cache_write_slice is not None:
                # a copy: at batch 1 the prefix slice is contiguous, and a view would pin the whole K/V
                layer_cache.store(key[:, cache_write_slice].clone(), value[:, cache_write_slice].clone())
            elif kv_cache_mode == "cached":
                cached_k, cached_v = layer_cache.get()
                key = torch.cat([cached_k, key], dim=1)
                value = torch.cat([cached_v, value], dim=1)
        rows = query.shape[1]
        if segments is None:  # a cached step: the target's rows see the whole prefix and themselves
            out = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, dropout_p=0.0,
                                        backend=self._attention_backend,
                                        parallel_config=self._parallel_config)
        else:
            out = self._prefill(query, key, value, segments, key_valid)
        out = out[:, :rows].flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))

    def project(self, attn, hidden_states: torch.Tensor, rotary_emb: torch.Tensor | None, exchange=None):
        """Q, K, V (B, S, H, D): projected, Q and K normed and rotated; `chunk` rows at a time if set. With
        `exchange` (a split and its prefix length), K and V come back gathered over the split's ranks."""
        rows = hidden_states.shape[1]
        if not self.chunk or rows <= self.chunk:
            return self._project(attn, hidden_states, rotary_emb, exchange)
        out = None
        for start in range(0, rows, self.chunk):
            end = min(start + self.chunk, rows)
            table = None if rotary_emb is None else rotary_emb[start:end]
            parts = self._project(attn, hidden_states[:, start:end], table)
            if out is None:
                out = [p.new_empty(p.shape[0], rows, *p.shape[2:]) for p in parts]
            for whole, part in zip(out, parts, strict=True):
                whole[:, start:end] = part
        query, key, value = out
        if exchange is not None:
            split, prefix = exchange
            key, value = split.gather(key, prefix), split.gather(value, prefix)
        return query, key, value

    @staticmethod
    def _project(attn, hidden_states: torch.Tensor, rotary_emb: torch.Tensor | None, exchange=None):
        # by head_dim: a tensor-parallel rank holds a share of the heads
        head_dim = attn.inner_dim // attn.heads
        key = attn.to_k(hidden_states).unflatten(-1, (-1, head_dim))
        value = attn.to_v(hidden_states).unflatten(-1, (-1, head_dim))
        dtype = value.dtype
        if exchange is not None:  # V travels while K is normed and rotated and Q is computed, then K while Q
            split, prefix = exchange
            value = split.start(value, prefix)
        key = attn.norm_k(key).to(dtype)
        if rotary_emb is not None:
            key = rotate(key, rotary_emb)
        if exchange is not None:
            key = split.start(key, prefix)
        query = attn.norm_q(attn.to_q(hidden_states).unflatten(-1, (-1, head_dim))).to(dtype)
        if rotary_emb is not None:
            query = rotate(query, rotary_emb)
        if exchange is not None:
            key, value = split.finish(key), split.finish(value)
        return query, key, value

    def _prefill(self, query, key, value, segments, key_valid):
        """The block-causal prefill: each prefix segment attends to the keys before its end (a text segment
        causally over its own keys); the target to every key; padded prompt keys never."""
        prefix_len = segments[-1][1] if segments else 0
        outputs = []
        for start, end, is_text in segments:
            # its triangle is SDPA's causal flag (diffusers' context-parallel attention takes no causal flag)
            if is_text and start == 0 and key_valid is None and self._parallel_config is None:
                outputs.append(self._causal(query[:, :end], key[:, :end], value[:, :end]))
                continue
            mask = None
            if is_text:
                length = end - start
                ones = functools.partial(torch.ones, dtype=torch.bool, device=query.device)
                mask = torch.cat([ones(length, start), torch.tril(ones(length, length))], dim=1)[None, None]
            if key_valid is not None:
                valid = key_valid[:, None, None, :end]
                mask = valid if mask is None else (mask & valid)
            outputs.append(dispatch_attention_fn(query[:, start:end], key[:, :end], value[:, :end],
                                                 attn_mask=mask, dropout_p=0.0, backend=None,
                                                 parallel_config=self._parallel_config))
        valid = None if key_valid is None else key_valid[:, None, None, :]
        outputs.append(dispatch_attention_fn(query[:, prefix_len:], key, value, attn_mask=valid,
                                             dropout_p=0.0, backend=None,
                                             parallel_config=self._parallel_config))
        return torch.cat(outputs, dim=1)

    @staticmethod
    def _causal(query, key, value):
        """The text segment when it starts the sequence and no prompt key is padded: causal over its own
        keys, as SDPA's flag. On a GPU that has PyTorch's FlashAttention-2 (Ampere or later), through it,
        which takes the flag without a mask: the masked call went to cuDNN, which builds a graph for each new
        prompt length (~75 ms) and, for some lengths, compiles a kernel (0.9-1.9 s); FlashAttention-2 builds
        nothing and was also faster for every length measured, 36 to 10,300 tokens (H200,
        benchmarks/probe_first_call.py). Elsewhere PyTorch picks the kernel for the flag."""
        fast = (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and query.shape[-1] <= 256
                and _has_flash(query.device))
        return dispatch_attention_fn(query, key, value, dropout_p=0.0, is_causal=True,
                                     backend=internals.native_flash_backend() if fast else None)


@functools.cache
def _has_flash(device: torch.device) -> bool:
    """PyTorch's FlashAttention-2 runs on compute capability 8.0 and later."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


class _ChunkedFeedForward(ModelHook):
    """The block's SwiGLU `chunk` tokens at a time, into one output tensor."""

    def __init__(self, chunk: int):
        super().__init__()
        self.chunk = chunk

    def new_forward(self, module, hidden_states: torch.Tensor) -> torch.Tensor:
        forward = self.fn_ref.original_forward
        rows = hidden_states.shape[1]
        if rows <= self.chunk:
            return forward(hidden_states)
        out = None
        for start in range(0, rows, self.chunk):
            part = forward(hidden_states[:, start:start + self.chunk])
            if out is None:
                out = part.new_empty(part.shape[0], rows, *part.shape[2:])
            out[:, start:start + part.shape[1]] = part
        return out


def install(transformer: torch.nn.Module, chunk: int | None = None) -> int:
    """Attention21 on every block of a QwenImage21Transformer2DModel, and with `chunk` the chunked
    feed-forward; the blocks' count. Keeps the attention backend the processors had."""
    blocks = transformer.transformer_blocks
    backend = internals.attention_backend(blocks[0].attn.processor) if len(blocks) else None
    processor = Attention21(chunk)
    if backend is not None:
        internals.set_attention_backend(processor, backend)
    transformer.set_attn_processor(processor)
    if chunk:
        for block in blocks:
            registry = HookRegistry.check_if_exists_or_initialize(block.img_mlp)
            registry.register_hook(_ChunkedFeedForward(chunk), FEED_FORWARD_HOOK)
    return len(blocks)


def uninstall(transformer: torch.nn.Module) -> None:
    """diffusers' own processor back on every block (the backend kept), the chunked feed-forward off."""
    blocks = transformer.transformer_blocks
    backend = internals.attention_backend(blocks[0].attn.processor) if len(blocks) else None
    processor = QwenImage21AttnProcessor()
    if backend is not None:
        internals.set_attention_backend(processor, backend)
    transformer.set_attn_processor(processor)
    for block in blocks:
        registry = internals.hook_registry(block.img_mlp)
        if registry is not None and registry.get_hook(FEED_FORWARD_HOOK) is not None:
            registry.remove_hook(FEED_FORWARD_HOOK)
