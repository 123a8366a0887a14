"""runtime.pixels: the pipeline's pre- and postprocessing with the arithmetic where the VAE is, exactly.

Checked against the processor's own methods (diffusers' VaeImageProcessor) on every byte value, on floats at
the rounding boundaries, on float32 and bfloat16, and through a real edit on the tiny checkpoint (a worker on
the CPU keeps the processor's own path; here `install` is told the CPU is the device, to run this code).
tests/test_gpu.py checks the same on a GPU.
"""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest
import torch
from conftest import LocalPipeline, picture

from imgedit.runtime import pixels


@pytest.fixture(scope="module")
def bare(plus_ckpt) -> LocalPipeline:
    return LocalPipeline(plus_ckpt, memo=0)


@pytest.fixture
def installed(bare):
    processor = bare.pipe.image_processor
    assert "preprocess" not in vars(processor)  # the class's own methods before
    done = pixels.install(bare.pipe, torch.device("cpu"))
    try:
        yield bare.pipe, done
    finally:
        del processor.preprocess, processor.postprocess


def test_a_vae_on_the_cpu_keeps_the_processors_own_path(bare):
    assert pixels.vae_device(bare.pipe.vae) is None
    assert pixels.install(bare.pipe) is None and "preprocess" not in vars(bare.pipe.image_processor)


def test_every_byte_and_every_rounding_boundary_match_the_processor(installed):
    pipe, done = installed
    processor = pipe.image_processor
    rng = np.random.default_rng(0)
    photo = PIL.Image.fromarray(rng.integers(0, 256, (48, 80, 3), dtype=np.uint8))
    ramp = PIL.Image.fromarray(np.arange(256, dtype=np.uint8).reshape(16, 16)).convert("RGB")
    cases = ((photo, (48, 80)), (ramp, (16, 16)), ([photo, photo], (32, 64)), (photo.convert("L"), (48, 80)))
    for image, size in cases:
        assert done._plain_input(image, None, "default") == (image is not cases[-1][0])  # grayscale: their path
        mine = processor.preprocess(image, *size)
        theirs = done.preprocess(image, *size)
        assert mine.dtype == theirs.dtype == torch.float32 and torch.equal(mine, theirs)
    # out: every float32 whose byte is a tie ((k + 0.5) / 255 after denormalizing), its neighbours, and noise
    k = torch.arange(256, dtype=torch.float64)
    ties = ((k + 0.5) / 255 - 0.5) / 0.5
    values = torch.cat([ties, torch.nextafter(ties.float(), torch.tensor(2.0)).double(),
                        torch.nextafter(ties.float(), torch.tensor(-2.0)).double(),
                        torch.linspace(-1.2, 1.2, 4096, dtype=torch.float64)]).float()
    values = values[: values.numel() // 48 * 48]
    for dtype in (torch.float32, torch.bfloat16):
        decoded = values.to(dtype).reshape(1, 3, -1, 16)
        mine, theirs = processor.postprocess(decoded), done.postprocess(decoded)
        assert len(mine) == len(theirs) == 1 and np.array_equal(np.asarray(mine[0]), np.asarray(theirs[0]))
    assert isinstance(processor.postprocess(decoded, output_type="pt"), torch.Tensor)  # other outputs: as before


def test_an_edit_gives_the_same_picture_through_either_path(bare, installed):
    pipe, _ = installed
    photo = picture(96, 64)

    def edit():
        return pipe(image=[photo], prompt="make it red", true_cfg_scale=1.0, num_inference_steps=2, width=64,
                    height=64, generator=torch.Generator().manual_seed(3)).images[0]

    mine = edit()
    processor = pipe.image_processor
    saved = processor.preprocess, processor.postprocess
    del processor.preprocess, processor.postprocess
    try:
        theirs = edit()
    finally:
        processor.preprocess, processor.postprocess = saved
    assert mine.size == theirs.size == (64, 64)
    assert np.array_equal(np.asarray(mine), np.asarray(theirs)) and np.asarray(mine).std() > 0
