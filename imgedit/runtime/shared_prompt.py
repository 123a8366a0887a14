"""A pair that splits a CFG-off job encodes its prompt once: rank 0 runs the text encoder, rank 1 receives.

Both ranks of a PAIR_ULYSSES split need the same prompt embeddings. Each used to encode them itself (the same
work twice, in parallel), and the job waited for the slower copy: on 2x H200 rank 1 reached the first forward
0.054-0.060 s after rank 0 in every stamped run, its CPU-bound encoding 1.5x slower (docs/BENCHMARKS.md). Now
rank 0 encodes (through the encode memo, when on) and broadcasts the tensors; rank 1's text encoder stays idle
while it resizes the inputs, and both ranks go on to the VAE with the same embeddings they computed before.

The shapes cross the control group (gloo) first, then the tensors the default group (NCCL on GPUs; ~2 MB for a
300-token prompt). A failure on rank 0 crosses too: rank 1 then fails alike instead of waiting in a collective
rank 0 never reaches. CFG-on jobs, where each rank runs its own branch, encode on both ranks as before.
Written here: diffusers' context parallelism leaves everything outside the transformer to each rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from imgedit.model import internals

FAILED = "failed"


class PromptNotShared(RuntimeError):
    """Rank 0 could not encode the prompt; the pair's other rank stops the job with it."""


def install(pipe, rank: int, active: Callable[[], bool], control_group=None) -> None:
    """Wrap this pipeline's `encode_prompt` (this instance only): while `active()`, rank 0 encodes and the
    other rank receives."""
    encode = pipe.encode_prompt

    def encode_prompt(*args, **kwargs):
        if not active():
            return encode(*args, **kwargs)
        return _shared(encode, pipe, rank, control_group, args, kwargs)

    pipe.encode_prompt = encode_prompt


def _shared(encode, pipe, rank: int, control_group, args, kwargs):
    box: list = [None]
    embeds = mask = None
    if rank == 0:
        try:
            embeds, mask = encode(*args, **kwargs)
            embeds, mask = embeds.contiguous(), None if mask is None else mask.contiguous()
        except BaseException:
            box[0] = FAILED
            dist.broadcast_object_list(box, src=0, group=control_group)
            raise
        mask_meta = None if mask is None else (tuple(mask.shape), mask.dtype)
        box[0] = (tuple(embeds.shape), embeds.dtype, mask_meta)
    dist.broadcast_object_list(box, src=0, group=control_group)
    if box[0] == FAILED:
        raise PromptNotShared("the pair's first rank could not encode the prompt")
    shape, dtype, mask_meta = box[0]
    if rank != 0:
        device = kwargs.get("device") or internals.execution_device(pipe)
        embeds = torch.empty(shape, dtype=dtype, device=device)
        mask = None if mask_meta is None else torch.empty(mask_meta[0], dtype=mask_meta[1], device=device)
    dist.broadcast(embeds, src=0)
    if mask is not None:
        dist.broadcast(mask, src=0)
    return embeds, mask
