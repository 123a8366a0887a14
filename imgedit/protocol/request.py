"""One edit as the user asked for it: `EditRequest`, whose fields are the declaration of every parameter a
caller sends, `PARAMETERS` read from them, and the functions that read the declaration as it is now."""

from __future__ import annotations

import secrets
import typing
from dataclasses import field, fields
from typing import Annotated, ClassVar

from PIL import Image
from pydantic import ConfigDict, ValidationError, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from imgedit.errors import InvalidInput
from imgedit.protocol.params import BATCH, EDIT, JOBS, REST, SINGLE, Number, Param, declaration, declared


def new_request_id() -> str:
    """Unguessable: a REST edit's id fetches its result from /v1/jobs/<id> (for its owner)."""
    return "req_" + secrets.token_urlsafe(12)


@typing.runtime_checkable
class Picture(typing.Protocol):
    """An input image: a PIL image, or one known by its header alone before it is decoded (Gradio's validator
    checks sizes only: imgedit.engine.images.peek_image). Jobs carry decoded PIL images."""

    size: tuple[int, int]


# What a value of the wrong type is told, by pydantic's error type (the edges parse each field by its kind
# first; this is the manager's own API, where a caller may send anything).
_WRONG = {"int_from_float": "must be a whole number", "int_parsing": "must be a whole number",
          "int_type": "must be a whole number", "float_parsing": "must be a number",
          "float_type": "must be a number", "bool_parsing": "must be true or false",
          "bool_type": "must be true or false", "string_type": "must be text"}


@pydantic_dataclass(frozen=True, config=ConfigDict(arbitrary_types_allowed=True))
class EditRequest:
    """One edit as the user asked for it, and the declaration of every parameter a caller sends: each field's
    type, default and `declared(...)` (kind, help, bounds, unit, which entry points take it, PNG and restore,
    its REST name) are the one place it is written; `PARAMETERS` is read from here, in this order (it is
    `/edit`'s API's order). None means "the model's default". Pydantic checks each value's type when a
    request is made; the bounds, which may depend on the settings, are checked when it is resolved
    (imgedit.engine.validation)."""

    images: Annotated[tuple[Picture, ...], declared(
        "file", "the image(s) to edit: 1 for Qwen-Image-Edit, 1-3 for 2509/2511, 0-10 for Qwen-Image-2.1 "
        "(none: an image from the prompt alone)", rest="image", takes=SINGLE, required=True, openai=True)]
    prompt: Annotated[str, declared(
        "text", "what to change, in words (up to 4,000 characters and 1,024 tokens)", default="",
        required=True, png=True, restore=True, always=True, openai=True, status=True, history=True,
        kept_as_ran=True)]
    negative_prompt: Annotated[str, declared(
        "text", "what to avoid (true CFG)", png=True, restore=True, always=True, history=True,
        label="Negative prompt")] = ""
    seed: Annotated[int | None, declared(
        "whole", "the noise the edit starts from; absent: a random one, returned with the result", png=True,
        restore=True, low=0, high=2**32 - 1, always=True, unless="randomize_seed",
        history=True, kept_as_ran=True, label="Seed")] = None
    randomize_seed: ClassVar[Param] = Param(  # a caller's switch: the edges draw the seed where it is on
        "randomize_seed", "flag", "ignore `seed` and draw one", takes=frozenset((EDIT, BATCH)), default=False,
        field=None, always=True, label="Randomize seed", same_row=True)
    num_inference_steps: Annotated[int | None, declared(
        "whole", "denoising steps; absent: the model's", png=True, restore=True, low=2, high="max_steps",
        always=True, status=True, history=True, kept_as_ran=True, resolved="steps",
        label="Steps ({low}-{high})")] = None
    true_cfg_scale: Annotated[Number | None, declared(
        "number", "how strongly the prompt is followed (1 turns CFG off); absent: DEFAULT_TRUE_CFG "
        "(Qwen-Image-2.1: 1)", png=True, restore=True, low=1, high=20, why="1 turns CFG off",
        always=True, history=True, label="True CFG scale", slider=0.5)] = None
    num_images: Annotated[int, declared(
        "whole", "images per prompt", rest="n", low=1, high="max_images_per_prompt", always=True,
        openai=True, status=True, history=True, kept_as_ran=True, label="Images per prompt", slider=1)] = 1
    width: Annotated[int | None, declared(
        "whole", "output width; 0 or absent: from the last input's aspect, about 1 megapixel",
        takes=frozenset((EDIT, BATCH)), png=True, restore=True, api_default=0, always=True, low=0,
        history=True, label="Width (0 = auto)")] = None
    height: Annotated[int | None, declared(
        "whole", "output height; 0 or absent: as width", takes=frozenset((EDIT, BATCH)), png=True,
        restore=True, api_default=0, always=True, low=0, history=True, label="Height (0 = auto)",
        same_row=True)] = None
    size: ClassVar[Param] = Param(  # OpenAI's name for width and height: REST parses it into them
        "size", "size", "`auto` or WIDTHxHEIGHT (OpenAI's name for width and height)",
        takes=frozenset((REST, JOBS)), field=None, openai=True)
    speed: Annotated[str | None, declared(  # None = quality
        "text", "quality, fast (Lightning 8 steps) or fastest (4 steps), where offered", png=True,
        api_default="quality", status=True, history=True, group="speed")] = None
    lora: Annotated[str | None, declared(  # None or "none" = no LoRA
        "text", "a configured LoRA's name, or none", png=True, api_default="none", status=True,
        history=True, none_word="none", group="speed")] = None
    lora_scale: Annotated[Number | None, declared(  # None = 1
        "number", "that LoRA's strength; absent: 1", png=True, api_default=1.0, low=0, high=2,
        beside="lora", status=True, history=True, group="speed")] = None
    # Masked editing (imgedit.engine.masks): "L", the first image's size, 255 = may change; None = whole image
    mask: Annotated[Image.Image | None, declared(
        "file", "where to edit: white (or OpenAI's transparent) = edit; the first image's size (one mask for "
        "every item of a job)", takes=SINGLE, png=True, openai=True, status=True, group="mask")] = None
    mask_grow: Annotated[int | None, declared(
        "whole", "pixels the mask is grown by; absent: 0", takes=SINGLE, png=True, low=0, high=256,
        unit="pixels", beside="mask", group="mask")] = None
    mask_feather: Annotated[int | None, declared(  # None = masks.DEFAULT_FEATHER
        "whole", "pixels of soft edge inside the mask; absent: 8", takes=SINGLE, png=True, low=0, high=256,
        unit="pixels", beside="mask", group="mask")] = None
    strength: Annotated[Number | None, declared(
        "number", "how far the masked area may move from the input; absent: 1", takes=SINGLE, png=True, low=0,
        high=1, low_open=True, why="1 = repaint the masked area from scratch", beside="mask",
        group="mask")] = None
    # rewrite the prompt with the model's text encoder first (imgedit.runtime.enhance)
    enhance_prompt: Annotated[bool, declared(
        "flag", "rewrite the prompt with the model's own text encoder first", takes=SINGLE,
        status=True)] = False
    cache: Annotated[str | None, declared(  # None = CACHE
        "text", "step cache for quality edits: none, first-block or taylorseer, where offered", png=True,
        restore=True)] = None
    # outpainting (imgedit.engine.canvas): the request keeps the original image, the job gets it padded
    expand: Annotated[str | None, declared(
        "text", "pad the first image and let the model fill the new area (outpainting): pixels for every "
        "side (256) or sides by name (left=256,right=256; top, bottom, x, y); the original is kept exactly",
        png=True, restore=True, history=True)] = None
    # select what to edit by words (imgedit.runtime.grounding): the worker's text encoder boxes the phrase in
    # the first image and the boxes are the mask (last in /edit's order: gradio_client's positions stay)
    mask_prompt: Annotated[str | None, declared(
        "text", "what to edit, in words ('the sky', 'the red car'): the model's own vision-language encoder "
        "outlines it in the first image as the mask (boxes); a 400 when it finds nothing. Not with mask",
        takes=SINGLE, png=True, status=True, history=True, group="mask")] = None
    # not parameters: who and what the request is
    request_id: str = field(default_factory=new_request_id)
    source: str = "ui"  # ui | api | rest: for logs and metrics
    client: str | None = None  # who asked (imgedit.web.identity's owner): for each client's share of the line
    background: bool = False  # an item of a job (engine.jobs.batch): the line serves waiting edits first
    watch: bool = False  # someone watches: the worker sends a live preview every few steps (runtime.preview)
    # declared parameters (PARAMETERS) without an attribute of their own, by name: request_kwargs() puts them
    # here
    options: dict = field(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _in_our_words(cls, values, handler):
        """A value of the wrong type: InvalidInput naming the parameter, as every other check says it."""
        try:
            return handler(values)
        except ValidationError as exc:
            errors = exc.errors()
            # a union (a Number) lists one error per member: the last one says what was expected
            error = [e for e in errors if e["loc"][:1] == errors[0]["loc"][:1]][-1]
            name = str(error["loc"][0]) if error["loc"] else "a request value"
            wrong = _WRONG.get(error["type"], "is not valid")
            value = error.get("input")
            shown = repr(value) if isinstance(value, (int, float)) else repr(str(value)[:40])
            raise InvalidInput(f"{name} {wrong}, got {shown}", name if error["loc"] else None) from None

    def value(self, name: str, default=None):
        """A declared parameter's value as asked for: its attribute, or its entry in `options`."""
        if name in self.options:
            return self.options[name]
        return getattr(self, name, default)


# Every declared parameter, read from EditRequest once (tests/test_declared_once.py adds a test-only one).
PARAMETERS: tuple[Param, ...] = declaration(EditRequest)


def param(name: str) -> Param:
    """The declared parameter called `name` (the declaration as it is now)."""
    for p in PARAMETERS:
        if p.name == name:
            return p
    raise KeyError(name)


def parameters(entry: str | None = None) -> tuple[Param, ...]:
    """The parameters one entry point takes (all of them: None), in the declaration's order. Read at each
    call: nothing keeps a copy of the declaration from import time."""
    return tuple(p for p in PARAMETERS if entry is None or entry in p.takes)


def as_declared(source, params: typing.Iterable[Param] | None = None) -> dict:
    """{declared parameter: value} as `source` holds them (a Resolved, an EditResult, a History entry): each
    parameter's attribute by its own name, else by the name the worker side gives it (`resolved`); one
    `source` lacks is left out. `params`: these only (default: every declared one)."""
    found = {}
    for p in PARAMETERS if params is None else params:
        for attribute in dict.fromkeys((p.name, p.worker_name)):
            if hasattr(source, attribute):
                found[p.name] = getattr(source, attribute)
                break
    return found


def group(name: str) -> tuple[str, ...]:
    """The parameters of one of the page's control groups (Param.group), in the declaration's order."""
    return tuple(p.name for p in PARAMETERS if p.group == name)


def as_ran(values: typing.Mapping) -> dict:
    """as_declared's reverse: {the name the worker side gives a parameter: value} of a view keyed by declared
    names (/health's model defaults); what is not a declared parameter is left out."""
    declared_here = {p.name: p for p in PARAMETERS}
    return {declared_here[name].worker_name: value for name, value in values.items() if name in declared_here}


def request_kwargs(values: dict) -> dict:
    """{EditRequest field or declared parameter name: value} as EditRequest's keyword arguments: a name that
    is not one of its attributes goes into `options`."""
    attributes = {f.name for f in fields(EditRequest)}
    kwargs = {k: v for k, v in values.items() if k in attributes}
    if options := {k: v for k, v in values.items() if k not in attributes}:
        kwargs["options"] = {**kwargs.get("options", {}), **options}
    return kwargs
