"""Prompt enhancement: the pipeline's own text encoder (Qwen2.5-VL, or Qwen-Image-2.1's Qwen3-VL, with its
language-model head) rewrites the user's instruction into a clearer edit instruction, with the input images in
view; without an input image (Qwen-Image-2.1's text to image) it rewrites a prompt for a picture.

Runs in the worker, on the weights already loaded: no second model, no cloud call, the images never
leave the machine. Greedy decoding (the same instruction and images give the same rewrite), a token
limit, stop at the end of the answer. Nothing of a call outlives it: the KV cache is the generate call's own,
dropped with it, or, for an encoder resident on one GPU, the one static cache its captured decoding steps hold
(decode_graphs), zeroed after each call; no adapter is active (the runner resets them after every job).

A rewrite that comes back empty, or is cut at the token limit, is not used: the original instruction
stays, with a notice saying why.
"""

from __future__ import annotations

import math
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate.hooks import AlignDevicesHook, add_hook_to_module, remove_hook_from_module
from PIL import Image
from transformers import StoppingCriteriaList

from imgedit.errors import Cancelled
from imgedit.model import internals
from imgedit.runtime import decode_graphs

INSTRUCTION = (Path(__file__).with_name("enhance_instruction.txt")).read_text(encoding="utf-8").strip()
GENERATION = (Path(__file__).with_name("enhance_generation.txt")).read_text(encoding="utf-8").strip()
# The pipelines' own prompt layout (diffusers' QwenImageEditPlusPipeline): pictures, then the text.
_PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
_CHAT = "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
VIEW_AREA = 384 * 384  # what the model sees of each input (the Plus pipelines' condition-image size)
# prompt, pictures and answer of any rewrite the settings allow (~235 MB on the 7B)
STATIC_CACHE_TOKENS = 4096
# the devices whose rewrites decode with the static cache (the tests add the CPU, to run that path there)
STATIC_DEVICES = ("cuda",)


@dataclass(frozen=True)
class Rewrite:
    prompt: str  # the one to use: the rewrite, or the original after a fallback
    original: str
    notice: str | None  # why the original was kept (None: the rewrite is used)
    new_tokens: int
    seconds: float
    answer: str = ""  # what the model wrote (cleaned), used or not: for logs and tests
    token_ids: tuple[int, ...] = ()  # the new tokens, as generated


class _Stop:
    """A generate() stopping criterion that ends the call when the job is cancelled."""

    def __init__(self, cancel: threading.Event):
        self.cancel = cancel

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.cancel.is_set(),
                          dtype=torch.bool, device=input_ids.device)


def view(image: Image.Image, cell: int = 28, area: int = VIEW_AREA) -> Image.Image:
    """The image at about `area` pixels, sides a multiple of `cell` (the vision encoder's merged patch: 28
    for Qwen2.5-VL, 32 for Qwen3-VL), a transparent one over white (as the 2.1 pipeline shows its text
    encoder)."""
    scale = math.sqrt(area / (image.width * image.height))
    width = max(cell, round(image.width * scale / cell) * cell)
    height = max(cell, round(image.height * scale / cell) * cell)
    if image.mode == "RGBA":
        white = Image.new("RGB", image.size, (255, 255, 255))
        white.paste(image, mask=image.getchannel("A"))
        image = white
    return image.convert("RGB").resize((width, height), Image.Resampling.BICUBIC)


def merged_cell(processor) -> int:
    """The pixels one merged vision token covers: patch size x merge size of the processor's image half."""
    images = processor.image_processor
    return int(getattr(images, "patch_size", 14) or 14) * int(getattr(images, "merge_size", 2) or 2)


@contextmanager
def on_its_own_gpu(encoder):
    """The encoder without the hook that moves its inputs to its GPU and its outputs back, while a rewrite
    runs there directly (yields that device; None, and nothing changed, for any other encoder). The balanced
    placement puts the text encoder whole on another GPU than the latents: the hook only moves a few tensors,
    but a CUDA graph cannot capture its CPU-side moves, and the captured decoding steps are what make a
    rewrite fast."""
    hook = internals.device_hook(encoder)
    devices = {p.device for p in encoder.parameters()}
    if not (type(hook) is AlignDevicesHook and not hook.offload and len(devices) == 1):
        yield None
        return
    remove_hook_from_module(encoder)
    try:
        yield next(iter(devices))
    finally:
        add_hook_to_module(encoder, hook)


def static_cache(encoder, needed: int):
    """The static KV cache of a text encoder resident on one GPU, reset, or None (then generate() keeps its
    dynamic one).

    With it generate()'s decoding steps run through decode_graphs: each step's kernels captured once as a CUDA
    graph and replayed. Eager, a step is launch-bound (an H200: 29.6-34.6 ms a token for ~960 kernels and 6 ms
    of GPU work); compiled by transformers (inductor, reduce-overhead) 10-12 ms, after a 50-60 s compile in
    every first start. The length is fixed (STATIC_CACHE_TOKENS, or the next 1024 above `needed`) so that
    every prompt and picture count reuses the one captured step. Not for a streamed or split encoder (24 GB
    mode, blocks over GPUs): their hooks move weights and inputs on the CPU's side, which a graph cannot hold
    (on_its_own_gpu takes a whole encoder's off)."""
    if not decodes_with_graphs(encoder):
        return None
    graphs = decode_graphs.installed(encoder) or decode_graphs.install(encoder)
    return graphs.cache(max(STATIC_CACHE_TOKENS, -(-needed // 1024) * 1024))


def decodes_with_graphs(encoder) -> bool:
    """Whether this encoder's rewrites decode with the static cache (captured steps): resident on one GPU, no
    hooks of its own (on_its_own_gpu takes a whole encoder's off), and not turned eager by no_static_cache."""
    hooked = (internals.has_device_hook(encoder)
              or any(internals.has_diffusers_hooks(m) for m in encoder.modules()))
    eager = getattr(encoder, "_imgedit_eager_decoding", False)
    return not (hooked or eager or encoder.device.type not in STATIC_DEVICES)


def no_static_cache(encoder) -> None:
    """This encoder's rewrites decode with generate()'s dynamic cache from now on, its graphs and kept cache
    let go: the worker is not compiled (COMPILE=off), or its captured decoding failed (the worker falls back
    and says so)."""
    encoder._imgedit_eager_decoding = True
    decode_graphs.uninstall(encoder)


def rewrite(pipe, images, prompt: str, max_new_tokens: int, cancel: threading.Event) -> Rewrite:
    """Rewrite `prompt` for `images` with `pipe.text_encoder`. Raises Cancelled."""
    started = time.perf_counter()
    pictures = "".join(_PICTURE.format(i + 1) for i in range(len(images)))
    if images:
        text = _CHAT.format(system=INSTRUCTION, user=f"{pictures}Instruction: {prompt}")
    else:  # text to image: a prompt for a picture, not an edit
        text = _CHAT.format(system=GENERATION, user=f"Prompt: {prompt}")
    cell = merged_cell(pipe.processor)
    said = generate(pipe, text, [view(i, cell) for i in images], max_new_tokens, cancel, "rewrite")
    new, answer = said.token_ids, _clean(said.text)
    seconds = time.perf_counter() - started
    if not said.finished:
        notice = f"the rewrite was cut at the {max_new_tokens}-token limit: the original instruction was kept"
        return Rewrite(prompt, prompt, notice, len(new), seconds, answer, new)
    if not answer:
        return Rewrite(prompt, prompt, "the rewrite came back empty: the original instruction was kept",
                       len(new), seconds, answer, new)
    return Rewrite(answer, prompt, None, len(new), seconds, answer, new)


@dataclass(frozen=True)
class Said:
    """What the text encoder wrote: its new tokens, whether it ended its answer, the answer as text, and the
    size (width, height) its processor gave each picture (the pixels its vision tower saw)."""

    token_ids: tuple[int, ...]
    finished: bool
    text: str
    seen: tuple[tuple[int, int], ...]


def generate(pipe, text: str, pictures: list[Image.Image], max_new_tokens: int, cancel: threading.Event,
             what: str, stop=None) -> Said:
    """`pipe.text_encoder` answers `text` (its chat format, a picture placeholder for each of `pictures`),
    greedily, up to `max_new_tokens` (or until `stop`, a further stopping criterion, says so); the prompt
    rewrite's and the outline's one generate call. Raises Cancelled (`what` names the work in its message)."""
    encoder = pipe.text_encoder
    tokenizer = pipe.processor.tokenizer
    ends = (tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id)
    end = [t for t in ends if t is not None]
    with on_its_own_gpu(encoder) as device, torch.inference_mode():
        inputs = pipe.processor(text=[text], images=pictures or None, padding=True,
                                return_tensors="pt").to(device or internals.execution_device(pipe))
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(encoder.dtype)
            patch = int(getattr(pipe.processor.image_processor, "patch_size", 14) or 14)
            seen = tuple((int(w) * patch, int(h) * patch) for _, h, w in inputs["image_grid_thw"].tolist())
        else:  # text to image: the decoding steps get the arguments they get with pictures (a None: the
            inputs["image_grid_thw"] = None  # prefill reads it to make positions, a decoding step does not)
            seen = ()
        cache = static_cache(encoder, inputs["input_ids"].shape[1] + max_new_tokens)
        try:
            output = encoder.generate(
                **inputs, max_new_tokens=max_new_tokens, do_sample=False,
                temperature=None, top_p=None, top_k=None,
                eos_token_id=end, pad_token_id=tokenizer.pad_token_id or end[0],
                stopping_criteria=StoppingCriteriaList([_Stop(cancel), *([stop] if stop else [])]),
                **({"past_key_values": cache} if cache is not None else {}))
        finally:
            if cache is not None:  # the kept static cache zeroed: nothing of this prompt stays on the GPU
                cache.reset()
    new = output[0, inputs["input_ids"].shape[1]:].tolist()
    del output, inputs  # with them a dynamic KV cache: nothing is kept for later
    if cancel.is_set():
        raise Cancelled(f"cancelled after {len(new)} token(s) of the {what}")
    finished = bool(new) and new[-1] in end
    answer = tokenizer.decode([t for t in new if t not in end], skip_special_tokens=True)
    return Said(tuple(new), finished, answer, seen)


def _clean(text: str) -> str:
    """One line of plain text: whitespace folded, a pair of quotes around the whole answer taken off."""
    text = " ".join(text.split())
    for opening, closing in (('"', '"'), ("'", "'"), ("“", "”")):
        wrapped = len(text) > 1 and text.startswith(opening) and text.endswith(closing)
        if wrapped and text.count(opening) == 1 + (opening == closing):
            text = text[1:-1].strip()
    return text
