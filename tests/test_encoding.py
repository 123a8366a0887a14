"""The mm_token_type_ids correction (diffusers#14194), weight-free on the tiny checkpoint.

The prompt embeddings the pipeline computes must equal those from calling the text encoder directly
with the processor's full output (mm_token_type_ids included), and must differ when the correction
is removed: so this fails if the correction goes away.
"""

from __future__ import annotations

import pytest
import torch
from conftest import picture

from imgedit.model.encoding import install_token_type_fix, token_type_ids


class RecordingProcessor:
    """Wraps the real processor and keeps its last full output (nothing is changed)."""

    def __init__(self, processor):
        self.processor, self.last = processor, None

    def __call__(self, *args, **kwargs):
        self.last = self.processor(*args, **kwargs)
        return self.last

    def __getattr__(self, name):
        return getattr(self.processor, name)


def encode(pipe, images):
    """Run the pipeline's own prompt encoding and capture the encoder's last hidden states."""
    captured = {}

    def keep(module, args, kwargs, output):
        captured["hidden"] = output.hidden_states[-1].detach().clone()

    handle = pipe.text_encoder.register_forward_hook(keep, with_kwargs=True)
    try:
        with torch.no_grad():
            # the class's own method: the test pipelines' encode memo would hand back the first result
            embeds = type(pipe).encode_prompt(pipe, prompt="make the sky red", image=images,
                                              device=torch.device("cpu"))[0]
    finally:
        handle.remove()
    return embeds, captured["hidden"]


@pytest.mark.parametrize("family, n_images", [("edit", 1), ("plus", 2)])
def test_pipeline_embeddings_match_the_encoder_with_full_processor_output(family, n_images, request):
    worker = request.getfixturevalue(f"{family}_pipe")
    pipe = worker.pipe
    images = [picture(64, 48), picture(48, 64, (200, 20, 20))][:n_images]
    images = images if family == "plus" else images[0]
    recorder = RecordingProcessor(pipe.processor)
    pipe.processor = recorder
    try:
        fixed_embeds, fixed_hidden = encode(pipe, images)
        full = {k: v for k, v in recorder.last.items()}
        assert "mm_token_type_ids" in full and int((full["mm_token_type_ids"] == 1).sum()) > 0
        with torch.no_grad():
            direct = pipe.text_encoder(**full, output_hidden_states=True).hidden_states[-1]
        torch.testing.assert_close(fixed_hidden, direct)

        # Without the correction the encoder falls back to 1-D positions: different embeddings.
        worker.encoding_fix.remove()
        plain_embeds, plain_hidden = encode(pipe, images)
        assert not torch.allclose(plain_hidden, direct, atol=1e-4)
        assert not torch.allclose(plain_embeds, fixed_embeds, atol=1e-4)
    finally:
        pipe.processor = recorder.processor
        worker.encoding_fix = install_token_type_fix(pipe.text_encoder)


def test_ids_derived_from_tokens_equal_the_processors(plus_pipe):
    pipe = plus_pipe.pipe
    out = pipe.processor(text=["<|vision_start|><|image_pad|><|vision_end|> hi"], images=[picture(64, 64)],
                         return_tensors="pt")
    cfg = pipe.text_encoder.config
    derived = token_type_ids(out["input_ids"], cfg.image_token_id, cfg.video_token_id)
    assert torch.equal(derived, out["mm_token_type_ids"].to(derived.dtype))


def test_the_hook_steps_aside_when_the_caller_passes_the_ids(plus_pipe):
    """Once diffusers forwards mm_token_type_ids itself, the hook must not pass them twice or change them."""
    pipe = plus_pipe.pipe
    out = pipe.processor(text=["<|vision_start|><|image_pad|><|vision_end|> hi"], images=[picture(64, 64)],
                         return_tensors="pt")
    zeros = torch.zeros_like(out["mm_token_type_ids"])  # deliberately "wrong": the hook must keep them
    args = {**out, "mm_token_type_ids": zeros}
    seen = {}
    probe = pipe.text_encoder.register_forward_pre_hook(
        lambda m, a, kw: seen.update(ids=kw["mm_token_type_ids"]), with_kwargs=True)
    try:
        with torch.no_grad():
            pipe.text_encoder(**args, output_hidden_states=True)
    finally:
        probe.remove()
    assert seen["ids"] is zeros


@pytest.fixture(scope="module")
def pipe21(tmp_path_factory):
    from conftest import LocalPipeline

    from imgedit.model.demo_checkpoint import build_checkpoint

    return LocalPipeline(build_checkpoint(tmp_path_factory.mktemp("e21") / "q21", kind="21", seed=0), memo=0)


@pytest.mark.parametrize("family", ["plus", "21"])
def test_prompt_encoding_is_lean_and_gives_the_same_embeddings(family, request):
    """install_no_logits: the pipeline's encoding asks for hidden states only, so the encoder computes the last
    token's logits alone (not 152,064 per token), keeps no cache and returns one hidden state, not one a layer;
    the embeddings are those of the full computation (2.1: its own hook on the final norm included)."""
    pipe = request.getfixturevalue("plus_pipe" if family == "plus" else "pipe21").pipe
    images = [picture(64, 48)]
    seen = []
    probe = pipe.text_encoder.register_forward_hook(
        lambda m, a, kw, out: seen.append((out.logits.shape[1], len(out.hidden_states), kw.get("use_cache"))),
        with_kwargs=True)
    try:
        hooked, _ = encode(pipe, images)
        hooks = pipe.text_encoder._forward_pre_hooks
        mine = [k for k, hook in hooks.items() if getattr(hook, "__name__", "") == "lean"]
        assert len(mine) == 1, "the loader installs it once"
        removed = hooks.pop(mine[0])
        try:
            full, _ = encode(pipe, images)
        finally:
            hooks[mine[0]] = removed
    finally:
        probe.remove()
    assert seen[0] == (1, 1, False) and seen[1][0] > 10 and seen[1][1] > 2, seen  # lean, then every token's
    assert torch.equal(hooked, full)


def test_the_lean_hidden_state_comes_back_where_a_device_hook_returns_the_output(plus_pipe):
    """An encoder on another GPU than the latents (the balanced placement) carries accelerate's hook inside its
    forward, which moves the output back to the caller's device before torch's forward hooks run. The kept
    hidden state must follow the logits there: on 2x H200 it stayed on the encoder's GPU and every edit failed
    in the pipeline's `_extract_masked_hidden`. The CPU stand-in for "the caller's GPU" is the meta device."""
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
    from accelerate.utils import send_to_device

    class BackToTheCaller(ModelHook):
        def post_forward(self, module, output):
            return send_to_device(output, torch.device("meta"))

    pipe = plus_pipe.pipe
    inputs = pipe.processor(text=["<|vision_start|><|image_pad|><|vision_end|> hi"], images=[picture(64, 64)],
                            return_tensors="pt")
    add_hook_to_module(pipe.text_encoder, BackToTheCaller())
    try:
        with torch.no_grad():
            out = pipe.text_encoder(**inputs, output_hidden_states=True)
    finally:
        remove_hook_from_module(pipe.text_encoder)
    assert out.logits.shape[1] == 1 and len(out.hidden_states) == 1  # the lean call
    assert out.logits.device.type == "meta" and out.hidden_states[-1].device.type == "meta"
