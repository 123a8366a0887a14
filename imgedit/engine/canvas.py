"""Expanding the canvas (outpainting): `expand` pads the first image on any side and the model fills the
new area through the masked-edit path (imgedit.runtime.masking): the padded area is the mask, so every pixel
of the original is kept exactly where it was. Server side, no torch.

`expand` is one text field: a number of pixels for every side (`256`), or sides by name (`left=256,right=256`;
`top`, `bottom`, `left`, `right`, and `x`/`y` for both sides of an axis). The request keeps the original image
and `expand` (what the history stores and a re-run repeats); the job gets the padded image and its mask.
"""

from __future__ import annotations

from dataclasses import replace

from PIL import Image

from imgedit.errors import InvalidInput
from imgedit.protocol import EditRequest

MAX_SIDE = 4096  # pixels added on one side
# The new area as the model first sees it: flat mid-grey (ComfyUI's ImagePadForOutpaint fills with 0.5). The
# masked area starts from noise at strength 1, so the grey only tells the model where the picture ends.
FILL = 128
NAMES = {"left": ("left",), "right": ("right",), "top": ("top",), "bottom": ("bottom",),
         "x": ("left", "right"), "y": ("top", "bottom"), "all": ("left", "top", "right", "bottom")}
HOW = "pixels for every side (256) or sides by name (left=256,right=256; top, bottom, x, y)"


def expand_sides(req: EditRequest) -> tuple[int, int, int, int] | None:
    """The request's `expand` as (left, top, right, bottom) pixels, or None for no padding."""
    return parse_expand(req.expand)


def parse_expand(text) -> tuple[int, int, int, int] | None:
    if text is None or (isinstance(text, str) and not text.strip()):
        return None
    if not isinstance(text, str):
        text = str(text)
    sides = dict.fromkeys(("left", "top", "right", "bottom"), 0)
    for part in text.replace(" ", "").lower().split(","):
        name, sep, value = part.rpartition("=") if "=" in part else ("all", "=", part)
        if name not in NAMES or not value.isdecimal() or len(value) > 6:
            raise InvalidInput(f"expand must be {HOW}, got {text[:40]!r}", "expand")
        if int(value) > MAX_SIDE:
            raise InvalidInput(f"expand {name} {value} is out of range: 0 to {MAX_SIDE} pixels", "expand")
        for side in NAMES[name]:
            sides[side] = int(value)
    left, top, right, bottom = sides["left"], sides["top"], sides["right"], sides["bottom"]
    return None if not (left or top or right or bottom) else (left, top, right, bottom)


def expanded_size(size: tuple[int, int], sides: tuple[int, int, int, int]) -> tuple[int, int]:
    left, top, right, bottom = sides
    return size[0] + left + right, size[1] + top + bottom


def expanded(req: EditRequest) -> EditRequest:
    """The request as the worker runs it: its first image padded and the new area as its mask (255 = the
    model fills it). A request without `expand` is returned as it is."""
    sides = expand_sides(req)
    if sides is None or not req.images:
        return req
    first = req.images[0]
    left, top, _, _ = sides
    size = expanded_size(first.size, sides)
    fill = (FILL,) * len(first.getbands())
    if first.mode == "RGBA":
        fill = (FILL, FILL, FILL, 255)
    canvas = Image.new(first.mode, size, fill if len(fill) > 1 else fill[0])
    canvas.paste(first, (left, top))
    mask = Image.new("L", size, 255)
    mask.paste(0, (left, top, left + first.width, top + first.height))
    return replace(req, images=(canvas, *req.images[1:]), mask=mask)
