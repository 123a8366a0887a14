"""One page or gradio API event's raw values as an EditRequest (events run with preprocess=False: any JSON can
arrive, and our own checks say what is wrong)."""

from __future__ import annotations

import inspect

import gradio as gr

from imgedit.config.settings import Settings
from imgedit.engine.images import image_label, open_image, peek_image
from imgedit.engine.masks import open_mask
from imgedit.engine.validation import check_counts
from imgedit.errors import InvalidInput
from imgedit.planning.families import FAMILIES
from imgedit.protocol import EDIT, EditRequest, parameters, request_kwargs
from imgedit.web.page.speed import parse_speed_inputs
from imgedit.web.page.uploads import uploaded_paths


def edit_fields() -> tuple[str, ...]:
    """The `/edit` API's parameters, in order: the declaration's (the page's edit event takes its inputs in
    this order too)."""
    return tuple(p.name for p in parameters(EDIT))


def api_component(param):
    """The hidden input of `/edit` for one declared parameter: no ranges, so that every value reaches our
    checks (and our messages), and the declared default for gradio_client."""
    if param.kind == "file":
        return gr.File(file_count="multiple" if param.name == "images" else "single")
    if param.required:  # no value: gradio_client then asks for it
        return gr.Textbox() if param.kind == "text" else gr.Number()
    if param.kind == "flag":
        return gr.Checkbox(param.edit_default)
    if param.kind in ("whole", "number"):
        return gr.Number(param.edit_default)
    return gr.Textbox(param.edit_default)


def page_control(param, settings: Settings):
    """The page's control for a declared parameter it does not lay out itself (in Advanced): named and
    explained by the declaration."""
    label, info = param.name.replace("_", " ").capitalize(), param.help
    if param.kind == "flag":
        return gr.Checkbox(param.default or False, label=label, info=info, elem_id=f"param-{param.name}")
    if param.kind in ("whole", "number"):
        low, high = param.bounds(settings)
        if range_text := param.range_text(settings):
            info = f"{info} ({range_text})"
        precision = 0 if param.kind == "whole" else None
        return gr.Number(param.default, label=label, info=info, precision=precision,
                         minimum=low, maximum=high, elem_id=f"param-{param.name}")
    if param.kind == "file":
        return gr.File(label=label, elem_id=f"param-{param.name}")
    return gr.Textbox(param.default or "", label=label, info=info, elem_id=f"param-{param.name}")


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


def event_fields(raw: dict) -> dict:
    """A form's raw values ({`/edit` parameter: value}, any JSON) as EditRequest fields: each declared
    parameter named in `raw` but the files, parsed by its kind, then what the form's controls mean: a
    ticked "randomize" draws the seed, 0 is an automatic side, the speed controls' "quality" and "none" are
    no preset and no LoRA."""
    fields: dict = {}
    for param in parameters(EDIT):
        value = raw.get(param.name)
        if param.request_field is None or param.kind == "file" or param.name not in raw:
            continue
        if param.kind == "text":
            fields[param.name] = _text(value, param.name) or param.default
        elif param.kind in ("whole", "number"):
            fields[param.name] = _number(value, param.name, param.default)
        elif param.kind == "flag":
            fields[param.name] = _flag(value, param.name)
    # a seed given is used unless "randomize" is ticked; none (the API's default) draws one
    fields["seed"] = None if _flag(raw.get("randomize_seed"), "randomize_seed") else fields.get("seed")
    fields["width"], fields["height"] = fields.get("width") or None, fields.get("height") or None
    fields["speed"], fields["lora"], fields["lora_scale"] = parse_speed_inputs(
        raw.get("speed"), raw.get("lora"), raw.get("lora_scale"))
    return fields


def decode_uploads(settings: Settings, family: str, images, decode: bool = True) -> tuple:
    """The event's uploaded images (in Gradio's upload cache), counted for the family and decoded, each named
    by its file (transparency kept for a model that takes it). `decode` False: read by their headers only
    (imgedit.engine.images.peek_image), for a check before the job queues."""
    paths = uploaded_paths(images)
    check_counts(len(paths), family)
    if not decode:
        return tuple(peek_image(p, settings.max_input_pixels, image_label(i + 1, p))
                     for i, p in enumerate(paths))
    alpha = FAMILIES[family].rgba
    return tuple(open_image(p, settings.max_input_pixels, image_label(i + 1, p), alpha)
                 for i, p in enumerate(paths))


def build_request(settings: Settings, family: str, *values, source: str,
                  decode: bool = True) -> EditRequest:
    """Parse one event's raw values, `/edit`'s parameters in the declaration's order (protocol.PARAMETERS;
    absent trailing ones take their defaults), each by its kind. Every file must lie in Gradio's upload
    cache (imgedit.web.page.uploads). `decode` False: the images by their headers (sizes) only, for gradio's
    validator."""
    names = edit_fields()
    raw = dict(zip(names, values, strict=False))
    decoded = decode_uploads(settings, family, raw.get("images"), decode)
    fields = event_fields({name: raw.get(name) for name in names})  # an absent trailing one: its default
    if mask_paths := uploaded_paths(raw.get("mask"), "mask"):
        if len(mask_paths) > 1:
            raise InvalidInput("send one mask (for the first image)", "mask")
        if not decoded:  # a model that generates takes no image; a mask belongs to one
            raise InvalidInput("a mask needs an input image to edit (the mask is the first image's size)",
                               "mask")
        with open(mask_paths[0], "rb") as f:
            data = f.read(settings.max_file_size + 1)
        fields["mask"] = open_mask(data, decoded[0].size, settings.max_input_pixels)
    return EditRequest(images=decoded, **request_kwargs(fields), source=source)


def _signed(params: list[inspect.Parameter], progress: bool):
    """A decorator giving a function `params`, then gr.Request (and gr.Progress): Gradio reads an event's
    parameters from the signature and passes those two where it finds them (after the inputs)."""
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [*params, inspect.Parameter("request", positional, default=None, annotation=gr.Request)]
    if progress:
        params.append(inspect.Parameter("progress", positional, default=gr.Progress()))

    def signed(function):
        function.__signature__ = inspect.Signature(params)
        function.__annotations__ = {"request": gr.Request}
        return function

    return signed


def form_signature(names, *, progress: bool = False):
    """A decorator: `function(*values, request[, progress])` for a page event's inputs, one per name."""
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return _signed([inspect.Parameter(name, positional, default=None) for name in names], progress)


def api_signature(entry: str = EDIT, leading: tuple[str, ...] = (), progress: bool = True):
    """A decorator: `function(*values, request[, progress])` with a gradio API's signature made from the
    declaration (`/edit`'s, or `/batch`'s after its `leading` required inputs): Gradio names the API's
    parameters and their defaults after it."""
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter(name, positional) for name in leading]
    params += [inspect.Parameter(p.name, positional,
                                 default=inspect.Parameter.empty if p.required else p.edit_default)
               for p in parameters(entry)]
    return _signed(params, progress)


def edit_signature(function):
    """`function(*values, request, progress)` with the gradio `/edit` API's signature (api_signature)."""
    return api_signature(EDIT)(function)


def _flag(value, name: str) -> bool:
    if value is None or value == "":
        return False
    if not isinstance(value, bool):
        raise InvalidInput(f"{name} must be true or false, got {str(value)[:40]!r}", name)
    return value


def build_enhance_request(settings: Settings, family: str, images, prompt, *, source: str) -> EditRequest:
    """A prompt rewrite's raw values (the images and the instruction) as an EditRequest."""
    decoded = decode_uploads(settings, family, images)
    return EditRequest(images=decoded, prompt=_text(prompt, "prompt"), source=source)
