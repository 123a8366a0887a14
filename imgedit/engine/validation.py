"""Up-front checks of an edit request and the defaults each model family wants. Pure: no torch.

The edges resolve a request once (`PipelineManager.resolve`, before the job enters the line, so bad input
costs nothing) and the `Resolved` parameters travel to the worker. Gradio's `/edit` validator checks first
(`check_params`: the images by their headers, not decoded), to put the message on the input at fault.
"""

from __future__ import annotations

import functools
import math
import numbers
import random
import re
from types import SimpleNamespace

from imgedit.config.loras import SPEEDS, lightning_for
from imgedit.config.settings import Settings
from imgedit.engine.canvas import expand_sides, expanded_size
from imgedit.engine.masks import DEFAULT_FEATHER, check_mask_size
from imgedit.engine.prompt_tokens import MAX_PROMPT_TOKENS, PromptTokens
from imgedit.errors import InvalidInput
from imgedit.planning.families import FAMILIES, not_built
from imgedit.planning.turbo import SETTING as TURBO_SETTING
from imgedit.planning.turbo import TurboCheckpoint, open_turbo
from imgedit.protocol import (
    EditRequest,
    Resolved,  # noqa: F401  (re-exported for the edges)
    as_declared,
    param,
)

SIDE_MULTIPLE = 16  # the edit families' VAE downsamples 8x and latents are packed in 2x2 patches (2.1: 32)
MIN_SIDE = 64
MAX_PROMPT_CHARS = 4000
# How the pipelines resize each input (diffusers `calculate_dimensions`: the input's aspect at a target
# area, sides rounded to multiples of 32). The text encoder sees the image at the family's `vl_area`, the
# VAE at VAE_AREA (Qwen-Image-2.1: both at output_resolution²); a very elongated input rounds its short side
# to 0 ("height and width must be > 0"), and before that the Qwen-VL image processor refuses an aspect above
# 200 (transformers `smart_resize`).
VAE_AREA = 1024 * 1024
# One step of the checkpoints' FlowMatch scheduler (shift_terminal 0.02) stretches its single sigma to 0/0:
# a NaN latent, a black image (diffusers 0.42.1, checked on the CPU). Two steps are the fewest that work: the
# step count's declared low bound (imgedit.protocol.EditRequest).
ONE_STEP = "one step makes a blank image: the model's scheduler needs two"
VL_MAX_ASPECT = 200
CONTROL_TOKEN = re.compile(r"<\|(?:im_start|im_end|endoftext|vision_start|vision_end|vision_pad|image_pad|"
                           r"video_pad|object_ref_start|object_ref_end|box_start|box_end|quad_start|"
                           r"quad_end)\|>")


# mask_prompt (imgedit.runtime.grounding): a phrase, and the most new tokens its outline may write (a box is
# ~20 tokens of JSON: a dozen boxes fit; the demo's random weights write nonsense up to this limit)
MAX_MASK_PROMPT_CHARS = 200
OUTLINE_MAX_TOKENS = 256
BOTH_MASKS = ("mask and mask_prompt both choose where to edit: send one (mask_prompt outlines the mask for "
              "you; or draw it and send it as mask)")


def check_counts(n_images: int, family: str) -> None:
    """A family that generates takes no image too (text to image)."""
    fam = FAMILIES[family]
    if n_images < fam.min_images:
        raise InvalidInput("no input image: upload the image to edit", "images")
    if n_images > fam.max_images:
        raise InvalidInput(f"{n_images} input images given; {fam.model} takes at most {fam.max_images}",
                           "images")


def _pipeline_size(area: int, ratio: float) -> tuple[int, int]:
    """diffusers' `calculate_dimensions` (pipeline_qwenimage_edit*.py), to the rounding."""
    width = math.sqrt(area * ratio)
    height = width / ratio
    return round(width / 32) * 32, round(height / 32) * 32


def pipeline_accepts(size: tuple[int, int], family: str) -> bool:
    """Whether the pipeline can resize an input of this size without a side of 0 or an aspect the
    text encoder's image processor refuses."""
    ratio = size[0] / size[1]
    fam = FAMILIES[family]
    vae_area = (fam.output_resolution or 1024) ** 2
    vl_w, vl_h = _pipeline_size(fam.vl_area or vae_area, ratio)
    vae_w, vae_h = _pipeline_size(vae_area, ratio)
    return min(vl_w, vl_h, vae_w, vae_h) > 0 and max(vl_w, vl_h) / min(vl_w, vl_h) <= VL_MAX_ASPECT


@functools.cache
def max_aspect(family: str) -> int:
    """The most elongated aspect (long/short side, rounded down) the family accepts: 279 for Plus,
    163 for Qwen-Image-Edit. Acceptance falls off once, so a bisection finds the edge."""
    low, high = 1.0, 100_000.0
    while high - low > 0.01:
        middle = (low + high) / 2
        low, high = (middle, high) if pipeline_accepts((middle, 1.0), family) else (low, middle)
    return int(low)


def check_aspect(size: tuple[int, int], family: str, label: str) -> None:
    width, height = size
    if not (pipeline_accepts((width, height), family) and pipeline_accepts((height, width), family)):
        ratio = max(width, height) / min(width, height)
        raise InvalidInput(f"{label} is {width}x{height} (aspect 1:{ratio:.0f}); this model takes images up "
                           f"to about 1:{max_aspect(family)}: crop or pad it", "images")


def output_size(width: int | None, height: int | None, last_image_size: tuple[int, int] | None,
                settings: Settings, family: str = "plus") -> tuple[int | None, int | None]:
    """The output size the pipeline gets: None/None = from the input's aspect (about 1 MP). With one
    side given the other follows the last input's aspect; sides are rounded down to the family's
    multiple (16; 32 for Qwen-Image-2.1)."""
    multiple = FAMILIES[family].side_multiple
    width = width or None
    height = height or None
    for name, value in (("width", width), ("height", height)):
        if value is not None and not MIN_SIDE <= value <= 16384:
            raise InvalidInput(f"{name} {value} is out of range: {MIN_SIDE} to 16384 (0 = automatic)", name)
    if width is None and height is None:
        return None, None
    asked = width is not None and height is not None
    if width is None or height is None:
        if last_image_size is None:
            return width, height  # checked again once the images are decoded
        # the side given rounded down, the other the multiple nearest the input's aspect (rounded down, a
        # 464x320 input at width 256 was 256x160 on Qwen-Image-2.1: 192 is nearer its 176.6)
        aspect = last_image_size[0] / last_image_size[1]
        if width is None:
            height = max(MIN_SIDE, height // multiple * multiple)
            width = max(MIN_SIDE, round(height * aspect / multiple) * multiple)
        else:
            width = max(MIN_SIDE, width // multiple * multiple)
            height = max(MIN_SIDE, round(width / aspect / multiple) * multiple)
    rounded = max(MIN_SIDE, width // multiple * multiple), max(MIN_SIDE, height // multiple * multiple)
    # a size asked is checked as asked: 2064x2048 (over the limit) rounded down to 2048x2048 passed
    width, height = (width, height) if asked else rounded
    if width * height > settings.max_output_pixels:
        raise InvalidInput(
            f"output {width}x{height} is {width * height:,} pixels; the limit is "
            f"{settings.max_output_pixels:,} (MAX_OUTPUT_PIXELS)", "width")
    return rounded


def check_params(req: EditRequest, settings: Settings, family: str,
                 tokens: PromptTokens | None = None) -> Resolved:
    """Everything that can be checked without decoding images (the prompts' token counts too, when
    the edge has the checkpoint's tokenizer); what these workers can run is the manager's (`check`)."""
    return resolve(req, settings, family, last_image_size=None, n_images=None, tokens=tokens)


def check_tokens(req: EditRequest, tokens: PromptTokens) -> None:
    for field, text in (("prompt", req.prompt), ("negative_prompt", req.negative_prompt or "")):
        count = tokens.count(text)
        if count > MAX_PROMPT_TOKENS:
            raise InvalidInput(
                f"the {field.replace('_', ' ')} is {count:,} tokens; the model takes at most "
                f"{MAX_PROMPT_TOKENS:,} (emoji and characters outside common scripts take several tokens "
                "each): shorten it", field)


def resolve(req: EditRequest, settings: Settings, family: str,
            last_image_size: tuple[int, int] | None, n_images: int | None,
            tokens: PromptTokens | None = None) -> Resolved:
    _check_inputs(req, family, n_images, tokens)
    if n_images == 0 and FAMILIES[family].generates:
        # text to image (decoded: no image came): one side given, the image is square. A template checked
        # before its images are decoded (n_images None: /v1/jobs, the Batch tab, a PNG's restore) keeps the
        # other side open, as for the edit models.
        last_image_size = (1, 1)
    preset = speed_preset(req, settings, family)  # a Lightning or Turbo preset sets its steps, turns CFG off
    steps = req.num_inference_steps if preset is None else preset.steps
    if steps is None:
        steps = default_steps(settings, family)
    check_range("num_inference_steps", steps, settings, why=ONE_STEP if steps == 1 else "")
    cfg = req.true_cfg_scale
    if cfg is None:
        cfg = FAMILIES[family].cfg(settings.default_true_cfg)
    if preset is not None:
        cfg = 1.0
    check_range("true_cfg_scale", cfg, settings)
    check_range("num_images", req.num_images, settings)
    seed = req.seed if req.seed is not None else random.randint(0, 2**31 - 1)
    check_range("seed", seed, settings)
    grow, feather, strength = mask_fields(req)
    outlined = mask_phrase(req, n_images) is not None
    first = _expanded_first(req, settings, family, n_images) if expand_sides(req) is not None else None
    if (req.mask is not None or outlined) and req.images:
        first = req.images[0].size
        if req.mask is not None:
            check_mask_size(req.mask.size, first)
    if first is not None:
        # A masked edit (an expanded canvas is one) follows the first image (the one it changes), not the last
        # as the pipelines do.
        width, height = output_size(req.width, req.height, first, settings, family)
        if width is None:
            width, height = _masked_size(first, settings, FAMILIES[family].side_multiple)
    else:
        width, height = output_size(req.width, req.height, last_image_size, settings, family)
    # True CFG runs only when a negative prompt is passed: always pass one (" " when empty).
    negative = req.negative_prompt if (req.negative_prompt or "").strip() else " "
    adapters = lora_adapters(req, settings, preset)
    return Resolved(
        steps=int(steps), true_cfg_scale=float(cfg), negative_prompt=negative, seed=int(seed),
        num_images=int(req.num_images), width=width, height=height, adapters=adapters,
        scheduler=preset_scheduler(preset), mask_grow=grow, mask_feather=feather,
        strength=strength, enhance_tokens=settings.enhance_max_tokens if req.enhance_prompt else 0,
        outline_tokens=OUTLINE_MAX_TOKENS if outlined else 0, cache=step_cache(req, settings, preset, family),
        cache_threshold=settings.cache_threshold)


def _expanded_first(req: EditRequest, settings: Settings, family: str,
                    n_images: int | None) -> tuple[int, int] | None:
    """The first image's size once `expand` has padded it (imgedit.engine.canvas), checked as an input's; None
    before the images are known (a job's template)."""
    if req.mask is not None:
        raise InvalidInput("expand makes its own mask (the new area): leave the mask out", "expand")
    if n_images == 0:
        raise InvalidInput("expand pads an input image: send the image to expand", "expand")
    if not req.images:  # a job's template: its images come later
        return None
    size = expanded_size(req.images[0].size, expand_sides(req))
    check_expanded_size(size, settings, family)
    return size


def check_expanded_size(size: tuple[int, int], settings: Settings, family: str) -> None:
    """A padded first image's size checked as an input's: MAX_INPUT_PIXELS and the family's aspect (the page's
    Expand box says it before the edit)."""
    if size[0] * size[1] > settings.max_input_pixels:
        raise InvalidInput(f"the expanded image would be {size[0]}x{size[1]}, over "
                           f"{settings.max_input_pixels:,} pixels (MAX_INPUT_PIXELS): expand less", "expand")
    check_aspect(size, family, "the expanded image")


CACHES = ("none", "first-block", "taylorseer")


def step_cache(req: EditRequest, settings: Settings, preset, family: str = "plus") -> str:
    """The request's `cache`, else CACHE; for quality edits only (a Lightning preset's 4 or 8 steps leave
    nothing to skip: asked for explicitly, that is refused; CACHE alone does not apply to them)."""
    if req.cache is not None and req.cache not in CACHES:
        raise InvalidInput(f"cache must be one of {', '.join(CACHES)}, got {str(req.cache)[:40]!r}", "cache")
    if preset is not None:
        if req.cache not in (None, "none"):
            raise InvalidInput(f"cache {req.cache} is for quality edits; speed {req.speed} runs a few "
                               f"{'Turbo' if isinstance(preset, TurboCheckpoint) else 'Lightning'} steps "
                               "with nothing to skip: leave cache out", "cache")
        return "none"
    if req.cache not in (None, "none") and (refused := not_built(family, "cache")) is not None:
        raise InvalidInput(f"cache {req.cache} is not available for this model: {refused}", "cache")
    return req.cache or settings.cache


def resolve_enhance(req: EditRequest, settings: Settings, family: str, n_images: int | None,
                    tokens: PromptTokens | None = None) -> Resolved:
    """A prompt rewrite alone: the images and prompt are checked as an edit's; nothing else applies."""
    _check_inputs(req, family, n_images, tokens)
    return Resolved(steps=0, true_cfg_scale=1.0, negative_prompt="", seed=0, num_images=1, width=None,
                    height=None, task="enhance", enhance_tokens=settings.enhance_max_tokens)


def resolve_outline(req: EditRequest, family: str, n_images: int | None) -> Resolved:
    """mask_prompt's outline alone (the mask it proposes, no edit): the images and the phrase."""
    if n_images is not None:
        check_counts(n_images, family)
    for i, image in enumerate(req.images):
        check_aspect(image.size, family, f"image {i + 1}")
    if mask_phrase(req, n_images) is None:
        raise InvalidInput("mask_prompt is required: say what to select, e.g. 'the sky'", "mask_prompt")
    return Resolved(steps=0, true_cfg_scale=1.0, negative_prompt="", seed=0, num_images=1, width=None,
                    height=None, task="outline", outline_tokens=OUTLINE_MAX_TOKENS)


def mask_phrase(req: EditRequest, n_images: int | None) -> str | None:
    """mask_prompt as the worker asks for it (whitespace folded), None when absent or blank; refused with a
    mask (both choose the area), with expand (it makes its own mask), without an input image, too long, or
    with the text encoder's control tokens."""
    phrase = " ".join((req.mask_prompt or "").split())
    if not phrase:
        return None
    if req.mask is not None:
        raise InvalidInput(BOTH_MASKS, "mask_prompt")
    if expand_sides(req) is not None:
        raise InvalidInput("expand makes its own mask (the new area): leave mask_prompt out", "mask_prompt")
    if n_images == 0:
        raise InvalidInput("mask_prompt outlines something in the first image: send the image to edit",
                           "mask_prompt")
    if len(phrase) > MAX_MASK_PROMPT_CHARS:
        raise InvalidInput(f"mask_prompt is {len(phrase)} characters; at most {MAX_MASK_PROMPT_CHARS}: name "
                           "the thing to select in a few words", "mask_prompt")
    if found := CONTROL_TOKEN.search(phrase):
        raise InvalidInput(f"mask_prompt contains {found.group(0)}, a control token of the model's text "
                           "encoder: leave it out", "mask_prompt")
    return phrase


def _check_inputs(req: EditRequest, family: str, n_images: int | None, tokens: PromptTokens | None) -> None:
    """What an edit and a rewrite share: the number of images, each one's aspect, the prompts."""
    if n_images is not None:
        check_counts(n_images, family)
    for i, image in enumerate(req.images):
        check_aspect(image.size, family, f"image {i + 1}")
    _check_prompt(req, tokens)


def _check_prompt(req: EditRequest, tokens: PromptTokens | None) -> None:
    if not req.prompt.strip():
        raise InvalidInput("the prompt is empty: say what to change", "prompt")
    for field, text in (("prompt", req.prompt), ("negative_prompt", req.negative_prompt or "")):
        # The text encoder's control tokens (<|image_pad|>, <|im_end|>, ...) in a prompt broke the
        # pipeline's own layout of images and text (an internal error; on a CFG pair, a restart).
        if isinstance(text, str) and (found := CONTROL_TOKEN.search(text)):
            raise InvalidInput(f"the {field.replace('_', ' ')} contains {found.group(0)}, a control token of "
                               "the model's text encoder: leave it out", field)
    for field, text in (("prompt", req.prompt), ("negative_prompt", req.negative_prompt or "")):
        if len(text) > MAX_PROMPT_CHARS:  # each named as itself (a long negative prompt was "the prompt")
            raise InvalidInput(f"the {field.replace('_', ' ')} is longer than {MAX_PROMPT_CHARS} characters",
                               field)
    if tokens is not None:
        check_tokens(req, tokens)


def _masked_size(first: tuple[int, int], settings: Settings,
                 multiple: int = SIDE_MULTIPLE) -> tuple[int, int]:
    """The size a masked edit runs at when none is asked: the first image's aspect at about 1 MP (as the
    pipelines size an edit), sides multiples of the family's (16; 32 for 2.1) and within MAX_OUTPUT_PIXELS."""
    ratio = first[0] / first[1]
    area = min(VAE_AREA, settings.max_output_pixels)
    width = max(MIN_SIDE, int(math.sqrt(area * ratio)) // multiple * multiple)
    height = max(MIN_SIDE, int(width / ratio) // multiple * multiple)
    return width, height


def default_steps(settings: Settings, family: str) -> int:
    return min(settings.default_steps or FAMILIES[family].default_steps, settings.max_steps)


def model_defaults(settings: Settings, family: str) -> dict:
    """What the model gives the parameters a request leaves to it ("absent: the model's"), by their declared
    names (the page's snippets, /health's defaults): named as the pipeline gets them, mapped by the
    declaration."""
    model = SimpleNamespace(steps=default_steps(settings, family),
                            true_cfg_scale=FAMILIES[family].cfg(settings.default_true_cfg))
    return as_declared(model)


def mask_fields(req: EditRequest) -> tuple[int, int, float]:
    """mask_grow, mask_feather (pixels) and strength (0 to 1], with their defaults."""
    grow = 0 if req.mask_grow is None else req.mask_grow
    feather = DEFAULT_FEATHER if req.mask_feather is None else req.mask_feather
    strength = 1.0 if req.strength is None else req.strength
    for name, value in (("mask_grow", grow), ("mask_feather", feather), ("strength", strength)):
        check_range(name, value)  # the types are the request's own (protocol.EditRequest)
    return grow, feather, float(strength)


def check_range(name: str, value, settings: Settings | None = None, why: str = "") -> None:
    """Refuse a number outside its declared bounds (imgedit.protocol.PARAMETERS), naming the parameter, the
    range and, where the declaration or the caller gives one, the reason for a bound."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidInput(f"{name} must be a number, got {str(value)[:40]!r}", name)
    declared = param(name)
    low, high = declared.bounds(settings)
    above_low = low < value if declared.low_open else low <= value
    if not (above_low and value <= high):  # NaN is inside no range
        why = why or declared.why
        raise InvalidInput(f"{name} {value} is out of range: {declared.range_text(settings)}"
                           + (f" ({why})" if why else ""), name)


def speed_preset(req: EditRequest, settings: Settings, family: str = "plus"):
    """What a fast/fastest request runs with: TURBO_MODEL_DIR's checkpoint (Qwen-Image-2.1: both speeds run
    its own schedule, imgedit.planning.turbo), else the Lightning LoRA entry; None for quality."""
    speed = "quality" if req.speed in (None, "") else req.speed
    if not isinstance(speed, str) or speed.lower() not in SPEEDS:
        raise InvalidInput(f"speed must be one of {', '.join(SPEEDS)}, got {str(speed)[:40]!r}", "speed")
    steps = SPEEDS[speed.lower()]
    if steps is None:
        return None
    if settings.turbo_model_dir:  # start-up takes it for a Qwen-Image-2.1 server only
        return open_turbo(settings.turbo_model_dir)
    if (refused := not_built(family, "lightning")) is not None:
        turbo = f": set {TURBO_SETTING} to a local Qwen-Image-2.1-Turbo folder" if family == "21" else ""
        raise InvalidInput(f"speed {speed.lower()} is not available for this model: {refused}{turbo}",
                           "speed")
    entry = lightning_for(settings.lora_entries, steps)
    if entry is None:
        raise InvalidInput(f"speed {speed.lower()} needs a Lightning {steps}-step LoRA and none is "
                           f"configured: set FAST_LORA_{steps}STEP (or add a ...Lightning-{steps}steps... "
                           "file to LORA_DIR/LORAS)", "speed")
    return entry


def preset_scheduler(preset) -> str:
    """The scheduler a job runs with (Resolved.scheduler): the model's, Lightning's or the Turbo's."""
    if preset is None:
        return "default"
    return "turbo" if isinstance(preset, TurboCheckpoint) else "lightning"


def lora_adapters(req: EditRequest, settings: Settings, preset) -> tuple[tuple[str, float], ...]:
    """(name, strength) of every adapter the job runs with: the speed preset's Lightning LoRA at 1,
    then the picked LoRA at its strength. A Turbo preset runs no adapter, and takes none (the LoRAs are
    loaded on the model's transformer, not on the Turbo's)."""
    turbo = isinstance(preset, TurboCheckpoint)
    adapters = [(preset.name, 1.0)] if preset is not None and not turbo else []
    scale = 1.0 if req.lora_scale is None else req.lora_scale
    # checked with or without a LoRA: a value no LoRA could run with is refused, never stored
    check_range("lora_scale", scale, settings)
    name = req.lora
    if name in (None, "", "none"):
        return tuple(adapters)
    if turbo:
        raise InvalidInput(f"speed {req.speed} runs Qwen-Image-2.1-Turbo's own transformer, and LoRAs are "
                           "loaded on the model's: leave lora out, or use speed quality with it", "lora")
    known = [e.name for e in settings.lora_entries]
    if not isinstance(name, str) or name not in known:
        offered = ", ".join(known) if known else "none (set LORA_DIR or LORAS)"
        raise InvalidInput(f"unknown LoRA {str(name)[:64]!r}; configured LoRAs: {offered}", "lora")
    # the preset's LoRA picked again: one adapter, the picked strength
    if adapters and adapters[0][0] == name:
        return ((name, float(scale)),)
    return (*adapters, (name, float(scale)))
