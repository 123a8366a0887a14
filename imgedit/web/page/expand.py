"""The page's Expand box (outpainting, imgedit.engine.canvas): pad the first input on any side, by presets (a
side by a quarter, the canvas to a common aspect) or by pixels per side, with a picture of the padded canvas
before the edit (the new area hatched) and its size checked as the edit will check it.

Every control writes one value, the declared `expand` text as REST takes it (`left=64,right=64`): the edit,
Copy as API call, the Batch tab, Restore and History read that one. Sizes are the first input's as the edit
sees it (turned by its EXIF orientation, scaled to MAX_INPUT_PIXELS: imgedit.engine.images.peek_image).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import gradio as gr
import numpy as np
from PIL import Image, ImageOps

from imgedit.config.settings import Settings
from imgedit.engine.canvas import FILL, expanded_size, parse_expand
from imgedit.engine.images import peek_image
from imgedit.engine.validation import check_expanded_size
from imgedit.errors import ImgEditError
from imgedit.web.page.mask_controls import MASK_COLOUR
from imgedit.web.page.uploads import uploaded_paths

SIDES = ("left", "top", "right", "bottom")
QUARTER = 0.25
GROW = {"Left +25 %": "left", "Right +25 %": "right", "Top +25 %": "top", "Bottom +25 %": "bottom"}
ASPECTS = {"To 16:9": 16 / 9, "To 4:3": 4 / 3, "To square": 1.0, "To 3:4": 3 / 4, "To 9:16": 9 / 16}
RESET = "No padding"
PICTURE_SIDE = 384  # the canvas picture's longer side at most, pixels
STRIPE = 6  # the hatching's stripe width in the picture, pixels
NO_INPUT = "Add an input image: the canvas is padded around the first one."


@dataclass
class ExpandControls:
    text: gr.Textbox  # the declared `expand` control
    grow: dict  # {button: side}
    aspects: dict  # {button: width / height}
    reset: gr.Button
    numbers: list  # left, top, right, bottom
    picture: gr.Image
    note: gr.Markdown


def build_expand_controls() -> ExpandControls:
    """The Expand box, where it is made (wired by `wire_expand` once the inputs exist)."""
    with gr.Accordion("Expand the canvas (outpainting)", open=False, elem_id="expand-accordion"):
        gr.Markdown("Pad the first input and the model fills the new area; its own pixels stay exactly where "
                    "they are. Say in the prompt what belongs there.")
        with gr.Row():
            grow = {gr.Button(name, size="sm", elem_id=f"expand-{side}"): side for name, side in GROW.items()}
        with gr.Row():
            aspects = {gr.Button(name, size="sm", elem_id=f"expand-to-{name[3:].replace(':', '-')}"): aspect
                       for name, aspect in ASPECTS.items()}
            reset = gr.Button(RESET, size="sm", elem_id="expand-reset")
        with gr.Row():
            # no bounds of the box's own: a value out of range gets our message (below, and from the edit)
            numbers = [gr.Number(0, label=f"{side.capitalize()} (px)", precision=0, min_width=80,
                                 elem_id=f"expand-px-{side}") for side in SIDES]
        text = gr.Textbox("", label="expand (as the API takes it)", elem_id="param-expand",
                          info="pixels for every side (256) or sides by name (left=256,right=256; top, "
                               "bottom, x, y)")
        picture = gr.Image(None, type="pil", format="png", interactive=False, label="The padded canvas",
                           elem_id="expand-canvas", height=260, buttons=[], visible=False)
        note = gr.Markdown(elem_id="expand-note")
    return ExpandControls(text, grow, aspects, reset, numbers, picture, note)


def expand_text(sides) -> str:
    """(left, top, right, bottom) as `expand` writes them: the sides by name, those padded only."""
    return ",".join(f"{name}={int(value)}" for name, value in zip(SIDES, sides, strict=True) if value)


def grown(sides, size: tuple[int, int], side: str) -> tuple[int, ...]:
    """`sides` with `side` padded by a quarter more of the input's width (left, right) or height."""
    extra = round((size[0] if side in ("left", "right") else size[1]) * QUARTER)
    return tuple(v + (extra if name == side else 0) for name, v in zip(SIDES, sides, strict=True))


def to_aspect(size: tuple[int, int], aspect: float) -> tuple[int, int, int, int]:
    """The padding, split evenly, that makes the input `aspect` (width / height) wide by growing one axis."""
    width, height = size
    if width / height < aspect:
        extra = max(0, round(height * aspect) - width)
        return extra // 2, 0, extra - extra // 2, 0
    extra = max(0, round(width / aspect) - height)
    return 0, extra // 2, 0, extra - extra // 2


def canvas_picture(path: str, size: tuple[int, int], sides) -> Image.Image:
    """The padded canvas, small: the input where it will be, the new area hatched in the mask's colour over
    the grey the model is given."""
    left, top, _, _ = sides
    canvas = expanded_size(size, sides)
    scale = min(1.0, PICTURE_SIDE / max(canvas))
    with Image.open(path) as image:
        image.thumbnail((PICTURE_SIDE, PICTURE_SIDE))  # a JPEG decodes at a fraction of its size
        image = ImageOps.exif_transpose(image).convert("RGB")
    shown = image.resize((max(1, round(size[0] * scale)), max(1, round(size[1] * scale))))
    width, height = max(1, round(canvas[0] * scale)), max(1, round(canvas[1] * scale))
    y, x = np.mgrid[0:height, 0:width]
    hatched = ((x + y) // STRIPE) % 2 == 0
    colour = np.array([int(MASK_COLOUR[i:i + 2], 16) for i in (1, 3, 5)])
    pixels = np.where(hatched[..., None], (colour + FILL) // 2, FILL).astype(np.uint8)
    picture = Image.fromarray(pixels, "RGB")
    picture.paste(shown, (round(left * scale), round(top * scale)))
    return picture


class ExpandEvents:
    """The Expand box's handlers (raw values: preprocess=False)."""

    def __init__(self, settings: Settings, family: str):
        self.settings, self.family = settings, family

    def first_size(self, files) -> tuple[str, tuple[int, int]] | None:
        """The first input's path and its size as the edit sees it, or None."""
        try:
            paths = uploaded_paths(files)
            return (paths[0], peek_image(paths[0], self.settings.max_input_pixels).size) if paths else None
        except Exception:  # noqa: BLE001 - the edit itself says what is wrong with the inputs
            return None

    def preset(self, files, text, *, side: str | None = None, aspect: float | None = None):
        """A preset's new `expand` text and the note (where there is no input to measure)."""
        first = self.first_size(files)
        if first is None:
            return gr.skip(), NO_INPUT
        try:
            sides = parse_expand(text) or (0, 0, 0, 0)
        except ImgEditError:
            sides = (0, 0, 0, 0)  # junk typed: a preset starts afresh
        sides = grown(sides, first[1], side) if side else to_aspect(first[1], aspect)
        return expand_text(sides), gr.skip()

    def numbers(self, *values) -> str:
        """The per-side boxes as the `expand` text (a box left empty is 0)."""
        sides = []
        for value in values:
            try:
                sides.append(max(0, int(float(value or 0))))
            except (TypeError, ValueError, OverflowError):
                sides.append(0)
        return expand_text(sides)

    def show(self, text, files):
        """The boxes, the canvas picture and the note for the `expand` text and the first input."""
        try:
            sides = parse_expand(text)
        except ImgEditError as exc:
            return (*[gr.skip()] * 4, gr.update(visible=False), f"**Not valid:** {exc.message}")
        boxes = [int(v) for v in (sides or (0, 0, 0, 0))]
        if sides is None:
            return (*boxes, gr.update(value=None, visible=False), "")
        first = self.first_size(files)
        if first is None:
            return (*boxes, gr.update(value=None, visible=False), NO_INPUT)
        path, size = first
        canvas = expanded_size(size, sides)
        padded = ", ".join(f"{name} {value}" for name, value in zip(SIDES, sides, strict=True) if value)
        said = (f"Canvas **{canvas[0]}x{canvas[1]}** (the first input {size[0]}x{size[1]}, padded {padded} "
                "px): the model fills the hatched area.")
        try:
            check_expanded_size(canvas, self.settings, self.family)
        except ImgEditError as exc:
            said = f"**Too much:** {exc.message}."
        try:
            picture = canvas_picture(path, size, sides)
        except Exception:  # noqa: BLE001 - gone from the upload cache, or unreadable: the edit says so
            return (*boxes, gr.update(value=None, visible=False), said)
        return (*boxes, gr.update(value=picture, visible=True), said)


def wire_expand(controls: ExpandControls, files, settings: Settings, family: str) -> None:
    """The presets and boxes write the `expand` text; the text (whoever wrote it: a preset, a box, Restore,
    History) and the inputs redraw the boxes, the picture and the note. All private, unqueued."""
    events, c = ExpandEvents(settings, family), controls
    private = {"api_visibility": "private", "queue": False, "preprocess": False}
    for button, side in c.grow.items():
        button.click(functools.partial(events.preset, side=side), [files, c.text], [c.text, c.note],
                     **private)
    for button, aspect in c.aspects.items():
        button.click(functools.partial(events.preset, aspect=aspect), [files, c.text], [c.text, c.note],
                     **private)
    c.reset.click(lambda: "", None, c.text, **private)
    for box in c.numbers:  # typed by the user (.input): the boxes set by `show` do not write back
        box.input(events.numbers, c.numbers, c.text, trigger_mode="always_last", **private)
    shown = [*c.numbers, c.picture, c.note]
    c.text.change(events.show, [c.text, files], shown, trigger_mode="always_last", **private)
    files.change(events.show, [c.text, files], shown, **private)
