"""Exact memos of a worker's input encodings (ENCODE_CACHE): a repeated input is not encoded again.

People edit the same photo many times: a new prompt, another seed, more images per prompt, a batch
of prompts. Every edit encodes each input with the VAE at about 1 MP (whatever the output size), and
the prompt with the inputs in view through the text encoder. The memo keeps the last ENCODE_CACHE
results of each and hands them back when exactly the same input comes again: the tensors the
component gave (lossless). Inputs are matched exactly (`torch.equal` on the VAE's input tensor; the
prompt's text and the condition images' pixels), so a match is never a near one.

Written here, not taken from a library: diffusers' caching hooks (FirstBlockCache, TaylorSeer, ...)
approximate denoising steps; nothing in diffusers keeps encodings across pipeline calls. The
pipeline stays unmodified: the memo wraps its `_encode_vae_image` and `encode_prompt` on this one
instance. Nothing in it depends on a LoRA (adapters touch the transformer only), a seed or the output
size; the components' weights never change while a worker runs.
"""

from __future__ import annotations

import torch

from imgedit.model import internals


class _Lru:
    """The last `size` (key, input, value) entries, the most recently used last."""

    def __init__(self, size: int):
        self.size, self.entries, self.hits, self.misses = size, [], 0, 0

    def find(self, key, same):
        """The value stored for `key` whose input `same` accepts (most recent first), or None."""
        for k in range(len(self.entries) - 1, -1, -1):
            stored_key, stored_input, value = self.entries[k]
            if stored_key == key and same(stored_input):
                self.entries.append(self.entries.pop(k))
                self.hits += 1
                return value
        self.misses += 1
        return None

    def put(self, key, inputs, value) -> None:
        self.entries.append((key, inputs, value))
        del self.entries[:-self.size]


class EncodeMemo:
    """The worker's two memos (VAE latents of an input image; prompt embeddings) and their counts."""

    def __init__(self, entries: int):
        self.vae = _Lru(entries)
        self.prompt = _Lru(entries)

    def counts(self) -> dict:
        return {"vae_hits": self.vae.hits, "vae_misses": self.vae.misses,
                "prompt_hits": self.prompt.hits, "prompt_misses": self.prompt.misses}


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    return value


def _pixels(images) -> tuple | None:
    """The condition images as comparable values (mode, size, bytes); None when they are not PIL images."""
    if images is None:
        return ()
    images = images if isinstance(images, (list, tuple)) else [images]
    out = []
    for image in images:
        if not hasattr(image, "tobytes"):
            return None
        out.append((image.mode, image.size, image.tobytes()))
    return tuple(out)


def install(pipe, entries: int) -> EncodeMemo | None:
    """Wrap this pipeline's VAE encode and prompt encode with exact memos of `entries` results each."""
    if entries <= 0:
        return None
    memo = EncodeMemo(entries)
    encode_image = internals.vae_encode(pipe)
    encode_prompt = pipe.encode_prompt

    def _encode_vae_image(image: torch.Tensor, generator=None):
        key = (tuple(image.shape), image.dtype, image.device)
        found = memo.vae.find(key, lambda stored: torch.equal(stored, image))
        if found is not None:
            return found.clone()
        latents = encode_image(image=image, generator=generator)  # argmax of the latent distribution: no draw
        memo.vae.put(key, image, latents.clone())
        return latents

    def _encode_prompt(*args, **kwargs):
        # the pipelines call it by keyword; anything else: as is
        if args or kwargs.get("prompt_embeds") is not None:
            return encode_prompt(*args, **kwargs)
        prompt, images = kwargs.get("prompt"), kwargs.get("image")
        pixels = _pixels(images)
        if pixels is None or not isinstance(prompt, (str, list)):
            return encode_prompt(**kwargs)
        text = prompt if isinstance(prompt, str) else tuple(prompt)
        key = (text, kwargs.get("num_images_per_prompt", 1), kwargs.get("max_sequence_length"),
               str(kwargs.get("device")))
        found = memo.prompt.find(key, lambda stored: stored == pixels)
        if found is not None:
            return _clone(found)
        result = encode_prompt(**kwargs)
        memo.prompt.put(key, pixels, _clone(result))
        return result

    internals.replace_vae_encode(pipe, _encode_vae_image)
    pipe.encode_prompt = _encode_prompt
    return memo
