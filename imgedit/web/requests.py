"""One page or gradio API event's raw values as an EditRequest (events run with preprocess=False: any JSON can
arrive, and our own checks say what is wrong)."""

from __future__ import annotations

from imgedit.config.settings import Settings
from imgedit.engine.images import image_label, open_image
from imgedit.engine.masks import open_mask
from imgedit.engine.validation import check_counts
from imgedit.errors import InvalidInput
from imgedit.protocol import EDIT, EditRequest, parameters
from imgedit.web.speed import parse_speed_inputs
from imgedit.web.uploads import uploaded_paths

# The `/edit` API's parameters, in order: the declaration's (the page lays its inputs out in this order).
FIELDS = tuple(p.name for p in parameters(EDIT))


def _number(value, name: str, default=None):
    """A number from the raw event data (events run with preprocess=False: any JSON can arrive)."""
    if value is None or value == "":
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise InvalidInput(f"{name} must be a number, got {str(value)[:40]!r}", name)
    try:
        number = float(value)
    except ValueError:
        raise InvalidInput(f"{name} must be a number, got {str(value)[:40]!r}", name) from None
    return int(number) if number.is_integer() else number


def _text(value, name: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidInput(f"{name} must be text", name)
    return value


def build_request(settings: Settings, family: str, images, prompt, negative_prompt, seed, randomize_seed,
                  num_inference_steps, true_cfg_scale, num_images, width, height, speed=None, lora=None,
                  lora_scale=None, mask=None, mask_grow=None, mask_feather=None, strength=None,
                  enhance_prompt=None, cache=None, *, source: str) -> EditRequest:
    """Parse one event's raw values. Every file must lie in Gradio's upload cache (imgedit.web.uploads)."""
    paths = uploaded_paths(images)
    check_counts(len(paths), family)
    decoded = tuple(open_image(p, settings.max_input_pixels, image_label(i + 1, p)) for i, p in enumerate(paths))
    speed, lora, lora_scale = parse_speed_inputs(speed, lora, lora_scale)
    masking = {}
    if mask_paths := uploaded_paths(mask, "mask"):
        if len(mask_paths) > 1:
            raise InvalidInput("send one mask (for the first image)", "mask")
        with open(mask_paths[0], "rb") as f:
            raw = f.read(settings.max_file_size + 1)
        masking["mask"] = open_mask(raw, decoded[0].size, settings.max_input_pixels)
    if any(v not in (None, "") for v in (mask_grow, mask_feather, strength)):
        masking.update(mask_grow=_number(mask_grow, "mask_grow"), mask_feather=_number(mask_feather, "mask_feather"),
                       strength=_number(strength, "strength"))
    return EditRequest(**masking,
        images=decoded, prompt=_text(prompt, "prompt"), negative_prompt=_text(negative_prompt, "negative_prompt"),
        seed=None if randomize_seed else _number(seed, "seed", 0),
        num_inference_steps=_number(num_inference_steps, "num_inference_steps"),
        true_cfg_scale=_number(true_cfg_scale, "true_cfg_scale"), num_images=_number(num_images, "num_images", 1),
        width=_number(width, "width", 0) or None, height=_number(height, "height", 0) or None, speed=speed,
        lora=lora, lora_scale=lora_scale, enhance_prompt=_flag(enhance_prompt, "enhance_prompt"),
        cache=_text(cache, "cache") or None, source=source)


def _flag(value, name: str) -> bool:
    if value is None or value == "":
        return False
    if not isinstance(value, bool):
        raise InvalidInput(f"{name} must be true or false, got {str(value)[:40]!r}", name)
    return value


def build_enhance_request(settings: Settings, family: str, images, prompt, *, source: str) -> EditRequest:
    """A prompt rewrite's raw values (the images and the instruction) as an EditRequest."""
    paths = uploaded_paths(images)
    check_counts(len(paths), family)
    decoded = tuple(open_image(p, settings.max_input_pixels, image_label(i + 1, p)) for i, p in enumerate(paths))
    return EditRequest(images=decoded, prompt=_text(prompt, "prompt"), source=source)
