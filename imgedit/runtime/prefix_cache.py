"""Qwen-Image-2.1's prefix KV cache (QwenImage21Pipeline's `use_kv_cache`) on a GPU with little room.

With `causal_condition`, the text and the condition images (the prefix) are step-independent, so the pipeline
keeps their keys and values of every block after the first step and later steps run the target image alone.
That cache lives on the GPU for the whole job: per prefix token, 2 (keys, values) x inner dim x 2 bytes in
each of the 32 blocks, 512 KiB a token. A condition image at the output's area (1024²) is 4,096 latent tokens
plus its 1,024 vision tokens in the text, so 3 references hold ~7.7 GiB and 10 ~25 GiB. On the GPU machine's
16 GB plan (14.5 GiB cap: 6.1 GiB of resident weights) every edit with a reference came back out of memory;
an H200 alone ran them all.

A worker whose GPU has a cap (MAX_MEMORY) asks, per job, whether the cache fits in what the cap leaves after
its weights and ACTIVATION_RESERVE; where it does not, the job runs without it (every step runs the prefix
again: slower, the same result up to rounding, as the pipeline's docstring says) and the worker logs it.
Uncapped workers keep the pipeline's default.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

log = logging.getLogger(__name__)

VAE_FACTOR = 16  # Qwen-Image-2.1's VAE: 16x, patch size 1
VISION_FACTOR = 32  # Qwen3-VL: 16-pixel patches, 2x2 merged
TEXT_TOKENS = 512  # the prompt and the chat template, an upper estimate


def prefix_tokens(images: int, side: int) -> int:
    """Estimated prefix tokens: every condition image at side x side (the pipeline's output_resolution),
    in the latent sequence and in the text encoder's, and the prompt."""
    per_image = (side // VAE_FACTOR) ** 2 + (side // VISION_FACTOR) ** 2
    return images * per_image + TEXT_TOKENS


def cache_bytes(config, tokens: int, item: int = 2) -> int:
    """What the cache of `tokens` prefix tokens holds: keys and values of every block."""
    inner = config.num_attention_heads * config.attention_head_dim
    return config.num_layers * 2 * inner * tokens * item


class PrefixCache:
    """Decides `use_kv_cache` per job. `room()` gives the bytes a job may still take on the GPU (None:
    uncapped, the pipeline's default); the worker passes its cap minus its weights and ACTIVATION_RESERVE."""

    def __init__(self, transformer, room):
        self.config = transformer.config
        self.room = room

    @contextmanager
    def job(self, call):
        """A job's part (imgedit.runtime.runner.Call): `use_kv_cache` off where the cache would not fit."""
        call.kwargs.update(self.kwargs(len(call.job.request.images), call.kwargs["output_resolution"]))
        yield

    def kwargs(self, images: int, side: int) -> dict:
        room = self.room()
        if room is None:
            return {}
        need = cache_bytes(self.config, prefix_tokens(images, side))
        if need <= room:
            return {}
        log.info("prefix KV cache off for this job: %d condition image(s) at %dx%d need ~%.1f GiB, "
                 "%.1f GiB left under the cap",
                 images, side, side, need / 1024**3, max(room, 0) / 1024**3)
        return {"use_kv_cache": False}
