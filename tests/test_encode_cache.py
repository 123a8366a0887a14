"""ENCODE_CACHE: a worker keeps its last input encodings and hands them back, exactly, for a repeated input;
and runtime.pixels: the pictures' pre- and postprocessing on the VAE's device, exactly.

Checked on the tiny checkpoint's real pipeline (the same code as a worker's): the pixels of an edit
are the same bit for bit with the memo missing, hitting and off; a new image, prompt or size is
encoded afresh; the VAE encode at about 1 MP is what a repeated photo saves (most of a small edit's
CPU time here).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from conftest import LocalPipeline, decoder_outputs, picture
from PIL import Image

from imgedit.runtime import encode_cache, pixels


@pytest.fixture(scope="module")
def bare(plus_ckpt) -> LocalPipeline:
    """A pipeline of this module's own without a memo (the session's test pipelines have one)."""
    return LocalPipeline(plus_ckpt, memo=0)


@pytest.fixture
def memo_pipe(bare):
    """The bare pipeline with a memo of 2 entries, taken off again after the test."""
    pipe = bare.pipe
    memo = encode_cache.install(pipe, 2)
    try:
        yield pipe, memo
    finally:
        del pipe._encode_vae_image, pipe.encode_prompt  # the class's own methods again


def edit(pipe, image, prompt="make it red", seed=3, size=64):
    out = pipe(image=[image], prompt=prompt, negative_prompt=" ", true_cfg_scale=4.0, num_inference_steps=2,
               width=size, height=size, generator=torch.Generator().manual_seed(seed), output_type="np")
    return out.images[0]


def test_off_means_no_memo(bare):
    assert encode_cache.install(bare.pipe, 0) is None
    assert "_encode_vae_image" not in vars(bare.pipe) and "encode_prompt" not in vars(bare.pipe)


def test_a_repeated_input_gives_the_same_pixels_without_encoding_again(memo_pipe):
    photo, other = picture(120, 90), picture(120, 90, (200, 40, 40))
    pipe, memo = memo_pipe
    reference = edit(_uncached(pipe), photo)
    started = time.perf_counter()
    first = edit(pipe, photo)
    cold = time.perf_counter() - started
    assert memo.counts() == {"vae_hits": 0, "vae_misses": 1, "prompt_hits": 0, "prompt_misses": 2}
    started = time.perf_counter()
    again = edit(pipe, photo)
    warm = time.perf_counter() - started
    assert memo.counts() == {"vae_hits": 1, "vae_misses": 1, "prompt_hits": 2, "prompt_misses": 2}
    assert np.array_equal(first, reference) and np.array_equal(again, reference)  # bit for bit
    assert warm < cold  # the 1 MP VAE encode was skipped (the figure is in the closing note, not asserted here)
    # Another seed and size: both encodings reused, a different image.
    other_seed = edit(pipe, photo, seed=4, size=96)
    assert memo.counts()["vae_hits"] == 2 and memo.counts()["prompt_hits"] == 4
    assert other_seed.shape == (96, 96, 3)
    # A new prompt: the image's latents reused, the prompt encoded; the same as without the memo.
    new_prompt = edit(pipe, photo, prompt="make it blue")
    assert memo.counts()["vae_hits"] == 3 and memo.counts()["prompt_misses"] == 3
    assert not np.array_equal(new_prompt, reference)
    # Another image: encoded afresh (never a near match), its own result.
    changed = edit(pipe, other)
    assert memo.counts()["vae_misses"] == 2 and not np.array_equal(changed, reference)


def test_the_oldest_entry_goes_first_and_matches_are_exact():
    memo = encode_cache.EncodeMemo(2)
    a, b, c = torch.zeros(4), torch.ones(4), torch.full((4,), 2.0)
    for value in (a, b):
        memo.vae.put("k", value, value * 10)
    assert torch.equal(memo.vae.find("k", lambda stored: torch.equal(stored, a)), a * 10)  # a is now the newest
    memo.vae.put("k", c, c * 10)  # b, the least recently used, leaves
    assert memo.vae.find("k", lambda stored: torch.equal(stored, b)) is None
    assert memo.vae.find("k", lambda stored: torch.equal(stored, a + 1e-7)) is None  # close is not equal
    assert memo.vae.find("other", lambda stored: True) is None  # another shape, dtype or device
    assert memo.counts()["vae_hits"] == 1 and memo.counts()["vae_misses"] == 3


class _uncached:
    """The same pipeline object with its class's own encoders (the memo bypassed)."""

    def __init__(self, pipe):
        self.pipe = pipe

    def __call__(self, **kwargs):
        saved = {k: vars(self.pipe).pop(k) for k in ("_encode_vae_image", "encode_prompt")}
        try:
            return self.pipe(**kwargs)
        finally:
            vars(self.pipe).update(saved)


# ---- runtime.pixels: checked against the processor's own methods (diffusers' VaeImageProcessor) on every byte,
# every finite bfloat16 and float32 values at the rounding ties, and through a real edit on the tiny checkpoint (a
# worker on the CPU keeps the processor's own path: here `install` is told the CPU is the device, to run this
# code). tests/test_gpu.py checks the same on a GPU.
@pytest.fixture
def installed(bare):
    processor = bare.pipe.image_processor
    assert "preprocess" not in vars(processor)  # the class's own methods before
    done = pixels.install(bare.pipe, torch.device("cpu"))
    try:
        yield bare.pipe, done
    finally:
        del processor.preprocess, processor.postprocess


def test_a_vae_on_the_cpu_keeps_the_processors_own_pixels(bare):
    assert pixels.vae_device(bare.pipe.vae) is None
    assert pixels.install(bare.pipe) is None and "preprocess" not in vars(bare.pipe.image_processor)


def test_pictures_as_bytes_give_the_processors_own_floats_and_bytes(installed):
    pipe, done = installed
    processor = pipe.image_processor
    photo = Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 80, 3), dtype=np.uint8))
    ramp = Image.fromarray(np.arange(256, dtype=np.uint8).reshape(16, 16)).convert("RGB")  # every byte
    cases = ((photo, (48, 80)), (ramp, (16, 16)), ([photo, photo], (32, 64)), (photo.convert("L"), (48, 80)))
    for image, size in cases:
        assert done._plain_input(image, None, "default") == (image is not cases[-1][0])  # grayscale: their path
        mine, theirs = processor.preprocess(image, *size), done.preprocess(image, *size)
        assert mine.dtype == theirs.dtype == torch.float32 and torch.equal(mine, theirs)
        assert mine.stride() == theirs.stride()  # the same layout too: a convolution may pick kernels by it
    for values in decoder_outputs():  # out: every finite bfloat16, float32 at and beside the rounding ties
        mine, theirs = processor.postprocess(values), done.postprocess(values)
        assert len(mine) == len(theirs) == 1 and np.array_equal(np.asarray(mine[0]), np.asarray(theirs[0]))
    assert isinstance(processor.postprocess(values, output_type="pt"), torch.Tensor)  # other outputs: as before


def test_an_edit_gives_the_same_picture_with_its_pictures_as_bytes(installed):
    pipe, _ = installed
    photo = picture(96, 64)

    def run():
        return pipe(image=[photo], prompt="make it red", true_cfg_scale=1.0, num_inference_steps=2, width=64,
                    height=64, generator=torch.Generator().manual_seed(3)).images[0]

    mine = run()
    processor = pipe.image_processor
    saved = processor.preprocess, processor.postprocess
    del processor.preprocess, processor.postprocess
    try:
        theirs = run()
    finally:
        processor.preprocess, processor.postprocess = saved
    assert mine.size == theirs.size == (64, 64)
    assert np.array_equal(np.asarray(mine), np.asarray(theirs)) and np.asarray(mine).std() > 0
