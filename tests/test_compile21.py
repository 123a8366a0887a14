"""Qwen-Image-2.1's worker-side speed-ups outside the compile itself (imgedit.runtime.compile21): the rotary table
and token metadata built once a request give the same image bit for bit, with and without CFG and references,
and a request never reuses another's; the compiled-steps routing installs and comes off. (No recompile after the
warm-up, in a worker: tests/test_warmup.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import LocalPipeline
from PIL import Image

from imgedit.model import attention21
from imgedit.model.demo_checkpoint import build_checkpoint
from imgedit.runtime import compile21


@pytest.fixture(scope="module")
def pipe21(tmp_path_factory):
    return LocalPipeline(build_checkpoint(tmp_path_factory.mktemp("c21") / "q21", kind="21", seed=0), memo=0).pipe


def run(pipe, refs: int, prompt: str, cfg: float = 1.0, seed: int = 3) -> np.ndarray:
    images = [Image.new("RGB", (64 + 16 * i, 64), (40 * i, 120, 200)) for i in range(refs)] or None
    out = pipe(image=images, prompt=prompt, negative_prompt=" " if cfg > 1 else None, true_cfg_scale=cfg,
               num_inference_steps=3, width=320, height=320, output_resolution=320, output_type="np",
               generator=torch.Generator().manual_seed(seed))
    return out.images[0]


def test_metadata_once_a_request_is_the_same_image_bit_for_bit(pipe21, monkeypatch):
    asks = [(0, "a red apple", 1.0), (2, "blend the two", 1.0), (1, "paint it", 4.0), (3, "all three", 1.0)]
    before = [run(pipe21, *ask) for ask in asks]
    calls = []
    cls = type(pipe21.transformer)
    build = cls.build_token_metadata
    monkeypatch.setattr(cls, "build_token_metadata", staticmethod(lambda *a: calls.append(1) or build(*a)))
    compile21.memoize_21_metadata(pipe21.transformer)
    try:
        after = [run(pipe21, *ask) for ask in asks]
        # three steps a request: built at the first and reused (CFG's other branch: its own, once)
        assert len(calls) == 1 + 1 + 2 + 1, calls
    finally:
        compile21.unmemoize_21_metadata(pipe21.transformer)
    for b, a in zip(before, after, strict=True):
        assert np.array_equal(b, a)
    assert not np.array_equal(before[1], before[3])  # the requests differ: no stale table was reused


def test_the_compiled_steps_routing_installs_on_every_block_and_comes_off(pipe21):
    transformer = pipe21.transformer
    assert not compile21.is_compiled_21(transformer)
    assert compile21.compile_21(transformer) == len(transformer.transformer_blocks)
    assert compile21.is_compiled_21(transformer)
    compile21.uncompile_21(transformer)
    assert not compile21.is_compiled_21(transformer)
    reference = run(pipe21, 1, "paint it")
    assert np.array_equal(run(pipe21, 1, "paint it"), reference)  # eager again, the same image


ASKS = [(0, "a red apple", 1.0), (2, "blend the two", 1.0), (1, "paint it", 4.0)]


@pytest.mark.parametrize("chunk", [None, 7])
def test_the_real_arithmetic_rope_and_its_chunks_give_diffusers_image(pipe21, chunk):
    """imgedit.model.attention21 against diffusers' own processor: text to image, references (the prefix
    cached), CFG with a padded negative prompt, and every step running the prefix (use_kv_cache=False, as
    under a cap); with `chunk`, Q/K/V and the feed-forward 7 tokens at a time."""
    before = [run(pipe21, *ask) for ask in ASKS]
    uncached = pipe21(image=[Image.new("RGB", (64, 80), (9, 99, 199))], prompt="x", use_kv_cache=False,
                      num_inference_steps=2, width=320, height=320, output_resolution=320, output_type="np",
                      generator=torch.Generator().manual_seed(5)).images[0]
    assert attention21.install(pipe21.transformer, chunk) == len(pipe21.transformer.transformer_blocks)
    try:
        assert all(isinstance(b.attn.processor, attention21.Attention21) for b in pipe21.transformer.transformer_blocks)
        after = [run(pipe21, *ask) for ask in ASKS]
        again = pipe21(image=[Image.new("RGB", (64, 80), (9, 99, 199))], prompt="x", use_kv_cache=False,
                       num_inference_steps=2, width=320, height=320, output_resolution=320, output_type="np",
                       generator=torch.Generator().manual_seed(5)).images[0]
    finally:
        attention21.uninstall(pipe21.transformer)
    for b, a in zip([*before, uncached], [*after, again], strict=True):
        assert np.isfinite(a).all()
        assert np.abs(b - a).max() < 1e-4, np.abs(b - a).max()
    assert not np.array_equal(before[0], before[1])


def test_rotate_is_the_complex_product():
    x = torch.randn(2, 5, 3, 8)
    table = torch.polar(torch.ones(5, 4), torch.randn(5, 4))
    want = torch.view_as_real(torch.view_as_complex(x.reshape(2, 5, 3, 4, 2)) * table[None, :, None]).flatten(3)
    assert torch.allclose(attention21.rotate(x, table), want, atol=1e-6)
    assert torch.allclose(attention21.rotate(x, torch.view_as_real(table)), want, atol=1e-6)
