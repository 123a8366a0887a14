"""Correct prompt encoding: give the Qwen2.5-VL text encoder the `mm_token_type_ids` it needs.

With transformers 5.x the text encoder computes its 3-D M-RoPE positions for image tokens only when
it receives `mm_token_type_ids` (0 text, 1 image, 2 video). diffusers 0.42.1's edit pipelines do not
forward them (diffusers issue #14194, PR #14189), so the encoder silently falls back to 1-D
positions: no error, different prompt embeddings, worse edits. We add them with a forward pre-hook
on the text-encoder instance (installed packages stay untouched). The hook steps aside when the
caller passes the ids itself, so it becomes a no-op once diffusers forwards them.

`install_no_logits` spares the same calls the logits of every token, which nothing reads;
`prepare_text_encoder` installs these and the vision tower's one-call windows
(imgedit.model.vision_attention), as every worker does.
"""

from __future__ import annotations

import inspect
import logging

import torch

from imgedit.model.vision_attention import install_one_call_windows

log = logging.getLogger(__name__)

TEXT, IMAGE, VIDEO = 0, 1, 2


def token_type_ids(input_ids: torch.Tensor, image_token_id: int, video_token_id: int) -> torch.Tensor:
    """What the processor returns as `mm_token_type_ids`, derived from the token ids."""
    types = torch.full_like(input_ids, TEXT, dtype=torch.int32)
    types[input_ids == image_token_id] = IMAGE
    types[input_ids == video_token_id] = VIDEO
    return types


def install_token_type_fix(text_encoder: torch.nn.Module):
    """Hook `text_encoder` so each call with images carries mm_token_type_ids. Returns the hook
    handle (None when this transformers version does not take the argument at all)."""
    if "mm_token_type_ids" not in inspect.signature(text_encoder.forward).parameters:
        log.info("text encoder takes no mm_token_type_ids: nothing to correct")
        return None
    config = text_encoder.config
    image_id, video_id = config.image_token_id, config.video_token_id

    def add_token_types(module, args, kwargs):
        if kwargs.get("mm_token_type_ids") is not None:
            return None  # the caller (a fixed diffusers) passed them: leave the call alone
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None or kwargs.get("image_grid_thw") is None:
            return None
        kwargs["mm_token_type_ids"] = token_type_ids(input_ids, image_id, video_id)
        return args, kwargs

    return text_encoder.register_forward_pre_hook(add_token_types, with_kwargs=True)


def install_no_logits(text_encoder: torch.nn.Module):
    """The pipelines' prompt encoding reads one hidden state, `outputs.hidden_states[-1]`, and nothing else of
    the encoder's output, yet by default the encoder also computes the logits of every token (vocabulary
    152,064: ~91 MB and ~0.3 TFLOP for a 300-token prompt on the 7B model), keeps a key/value cache of every
    layer and returns every layer's hidden states. At 2.1's ten 1024² references (~10,400 tokens) the cache is
    1.5 GiB and the layers' states 3.1 GiB, beside 5.3 GiB of resident weights on the 16 GB plan: the encode
    ran out of memory there. On calls that want hidden states and chose none of these, a pre-hook asks for the
    last token's logits alone (`logits_to_keep=1`, as transformers' generate() does), no cache
    (`use_cache=False`) and no per-layer states; a forward hook on the base model keeps its output and the
    encoder's output carries it as its one hidden state. transformers 5 ties `hidden_states[-1]` to that
    output (the base model's, after its final norm, which QwenImage21Pipeline's own hook makes the identity),
    so the pipelines read the same values (tests/test_encoding.py). Returns the pre-hook's handle (None when
    this transformers version does not take `logits_to_keep`)."""
    if "logits_to_keep" not in inspect.signature(text_encoder.forward).parameters:
        return None
    base = getattr(text_encoder, "model", None)
    kept: list = []

    def lean(module, args, kwargs):
        if not kwargs.get("output_hidden_states") or "logits_to_keep" in kwargs:
            return None
        changes = {"logits_to_keep": 1}
        if "use_cache" not in kwargs:
            changes["use_cache"] = False
        if base is not None:
            changes["output_hidden_states"] = False
            kept[:] = [None]  # this call's slot: the base model's output goes here
        return args, {**kwargs, **changes}

    def keep(module, args, output):
        if kept and kept[-1] is None:
            kept[-1] = output.last_hidden_state

    def give(module, args, kwargs, output):
        if kept and kwargs.get("output_hidden_states") is False and kept[-1] is not None:
            state = kept.pop()
            # where the caller gets the rest: an encoder on another GPU than the latents (the balanced
            # placement) has accelerate's hook inside its forward, which moved the logits back before this
            # hook runs; its last state stayed on the encoder's GPU and the pipeline's mask did not (2x H200,
            # 2026-11-29: every 2509 edit failed in _extract_masked_hidden)
            logits = getattr(output, "logits", None)
            output.hidden_states = (state.to(logits.device) if logits is not None else state,)
        return output

    handle = text_encoder.register_forward_pre_hook(lean, with_kwargs=True)
    if base is not None:
        base.register_forward_hook(keep)
        text_encoder.register_forward_hook(give, with_kwargs=True)
    return handle


def prepare_text_encoder(text_encoder: torch.nn.Module):
    """Everything a worker installs on its text encoder: the token-type fix, no logits for prompt encoding,
    the vision tower's windows in one call. Returns the token-type fix's hook handle (see
    install_token_type_fix)."""
    handle = install_token_type_fix(text_encoder)
    install_no_logits(text_encoder)
    install_one_call_windows(text_encoder)
    return handle
