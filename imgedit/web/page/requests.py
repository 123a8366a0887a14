"""One page or gradio API event's raw values as an EditRequest (events run with preprocess=False: any JSON can
arrive, and our own checks say what is wrong)."""

from __future__ import annotations

import inspect

import gradio as gr

from imgedit.config.settings import Settings
from imgedit.engine.images import encoded_image, image_label, peek_image
from imgedit.engine.masks import open_mask
from imgedit.engine.validation import check_counts
from imgedit.errors import InvalidInput
from imgedit.planning.families import FAMILIES
from imgedit.protocol import EDIT, EditRequest, param, parameters, request_kwargs
from imgedit.web.page.speed import parse_speed_inputs
from imgedit.web.page.uploads import uploaded_paths


def edit_fields() -> tuple[str, ...]:
    """The `/edit` API's parameters, in order: the declaration's (the page's edit event takes its inputs in
    this order too)."""
    return tuple(p.name for p in parameters(EDIT))


def event_fields(raw: dict) -> dict:
    """A form's raw values ({`/edit` parameter: value}, any JSON) as EditRequest fields: each declared
    parameter named in `raw` but the files, parsed by its kind, then what the form's controls mean: a
    ticked "randomize" draws the seed, 0 is an automatic side, the speed controls' "quality" and "none" are
    no preset and no LoRA."""
    fields = {p.name: p.parse(raw[p.name]) for p in parameters(EDIT)
              if p.request_field is not None and p.kind != "file" and p.name in raw}
    # a seed given is used unless "randomize" is ticked; none (the API's default) draws one
    randomize = param("randomize_seed").parse(raw.get("randomize_seed"))
    fields["seed"] = None if randomize else fields.get("seed")
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
    # kept compressed while the job waits; decoded once it has a worker (engine.images.Encoded)
    return tuple(encoded_image(p, settings.max_input_pixels, image_label(i + 1, p), alpha)
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
    parameters from the signature and passes those two where it finds them (after the inputs). Only a gradio
    API's handler is signed so (its parameters, names and defaults are the declaration's, which a written
    signature would list again); the page's handlers take the form by name (`inputs_kwargs`)."""
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [*params, inspect.Parameter("request", positional, default=None, annotation=gr.Request)]
    if progress:
        params.append(inspect.Parameter("progress", positional, default=gr.Progress()))

    def signed(function):
        function.__signature__ = inspect.Signature(params)
        function.__annotations__ = {"request": gr.Request}
        return function

    return signed


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


def build_enhance_request(settings: Settings, family: str, images, prompt, *, source: str) -> EditRequest:
    """A prompt rewrite's raw values (the images and the instruction) as an EditRequest."""
    decoded = decode_uploads(settings, family, images)
    return EditRequest(images=decoded, prompt=param("prompt").parse(prompt), source=source)
