"""Example inputs for the page, drawn with PIL on first use (small, made here: nothing is downloaded)."""

from __future__ import annotations

import os
from pathlib import Path

from PIL import Image, ImageDraw

SIZE = (320, 240)


def _landscape() -> Image.Image:
    image = Image.new("RGB", SIZE, (120, 180, 235))
    draw = ImageDraw.Draw(image)
    draw.ellipse((230, 30, 280, 80), fill=(255, 220, 90))
    draw.polygon([(0, 170), (90, 100), (170, 160), (250, 110), (320, 150), (320, 240), (0, 240)],
                 fill=(70, 140, 70))
    draw.rectangle((0, 200, 320, 240), fill=(90, 160, 80))
    return image


def _house() -> Image.Image:
    image = Image.new("RGB", SIZE, (200, 225, 245))
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 200, 320, 240), fill=(110, 170, 90))
    draw.rectangle((90, 110, 230, 200), fill=(235, 225, 200))
    draw.polygon([(75, 112), (160, 50), (245, 112)], fill=(150, 60, 50))
    draw.rectangle((145, 145, 175, 200), fill=(120, 80, 50))  # the door
    draw.rectangle((105, 130, 135, 160), fill=(160, 200, 230))
    draw.rectangle((185, 130, 215, 160), fill=(160, 200, 230))
    return image


def _room() -> Image.Image:
    image = Image.new("RGB", SIZE, (235, 230, 215))
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 170, 320, 240), fill=(170, 130, 90))  # the floor
    draw.rectangle((100, 120, 220, 135), fill=(120, 80, 50))  # a table
    draw.rectangle((110, 135, 120, 190), fill=(120, 80, 50))
    draw.rectangle((200, 135, 210, 190), fill=(120, 80, 50))
    return image


def _ball() -> Image.Image:
    image = Image.new("RGB", (160, 160), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    draw.ellipse((30, 30, 130, 130), fill=(220, 50, 50))
    draw.arc((30, 30, 130, 130), 200, 340, fill=(255, 255, 255), width=6)
    return image


DRAWINGS = {"landscape.png": _landscape, "house.png": _house, "room.png": _room, "ball.png": _ball}
# (label, input file names, prompt): the multi-image one only for models that take more than one input.
EXAMPLES = (
    ("Landscape: sunset sky", ("landscape.png",), "make the sky a warm sunset, keep the hills unchanged"),
    ("House: red door, flowers", ("house.png",),
     "paint the door bright red and add flowers under the windows"),
    ("Room + ball: combine two images", ("room.png", "ball.png"),
     "put the red ball from image 2 on the table in image 1"),
)


def example_rows(folder: str | Path, max_inputs: int) -> tuple[list[list], list[str]]:
    """[files, prompt] rows for gr.Examples and their labels; draws the images into `folder` the first
    time."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, draw in DRAWINGS.items():
        target = folder / name
        if not target.exists():
            partial = folder / f".{name}.{os.getpid()}"
            draw().save(partial, format="PNG")
            partial.replace(target)  # atomic: two servers starting at once never see half a file
    chosen = [(label, names, prompt) for label, names, prompt in EXAMPLES if len(names) <= max_inputs]
    return [[[str(folder / n) for n in names], prompt] for _, names, prompt in chosen], [c[0] for c in chosen]
