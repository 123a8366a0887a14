"""The page's output size presets: the output's shape chosen by name (an input's, or a common aspect) rather
than by typing Width and Height. Several inputs used to leave the size to the last one (a landscape, a ball
and a portrait came out portrait); "match image 1" keeps the edited image's shape.

Picking a preset writes Width and Height once (the edit then checks them as typed numbers:
imgedit.engine.validation); "auto" gives both back to the pipeline (the last input's aspect, about a
megapixel). The sides are about `area` pixels in all, multiples of 16, as the pipeline's own automatic size
is. A "match image k" preset reads that input when it is picked: changing the inputs afterwards leaves the
size as it is (pick it again), so that an upload costs no event more than the thumbnails' (the 2-core
machine's browser tests of the mask canvas are sensitive to each).
"""

from __future__ import annotations

import math

import gradio as gr
from PIL import Image, ImageOps

from imgedit.engine.validation import MIN_SIDE, SIDE_MULTIPLE
from imgedit.web.page.uploads import uploaded_paths

AUTO = "auto: as the last input"
ASPECTS = {"square 1:1": 1.0, "landscape 4:3": 4 / 3, "portrait 3:4": 3 / 4, "wide 16:9": 16 / 9,
           "tall 9:16": 9 / 16}


def choices(max_inputs: int) -> list[str]:
    return [AUTO, *(f"match image {k}" for k in range(1, max_inputs + 1)), *ASPECTS]


def sides(aspect: float, area: int) -> tuple[int, int]:
    """Width and height of about `area` pixels with this aspect (width / height), multiples of 16."""
    def side(value: float) -> int:
        return max(MIN_SIDE, round(value / SIDE_MULTIPLE) * SIDE_MULTIPLE)

    return side(math.sqrt(area * aspect)), side(math.sqrt(area / aspect))


def image_aspect(path: str) -> float:
    with Image.open(path) as image:
        width, height = ImageOps.exif_transpose(image).size  # as the edit will see it
    return width / height


def size_presets(max_inputs: int) -> gr.Dropdown:
    """The "Output size" control, where it is made (wired by `wire_size_presets` once Width and Height
    exist)."""
    return gr.Dropdown(choices(max_inputs), value=AUTO, label="Output size", elem_id="size-preset",
                       info="fills in Width and Height")


def wire_size_presets(preset: gr.Dropdown, files: gr.File, width: gr.Number, height: gr.Number, area: int,
                      auto_width: int = 0) -> None:
    """Picking a preset writes Width and Height. `auto_width`: the width "auto" leaves (the demo's small one;
    0 elsewhere)."""

    def apply(name: str, images):
        if name == AUTO:
            return auto_width, 0
        if name in ASPECTS:
            return sides(ASPECTS[name], area)
        k = int(str(name).rpartition(" ")[2])
        try:
            paths = uploaded_paths(images) if images else []
            aspect = image_aspect(paths[k - 1]) if k <= len(paths) else None
        except Exception:  # noqa: BLE001 - an unreadable input: the edit names it; the size stays as it is
            aspect = None
        if aspect is None:
            gr.Warning(f"there is no image {k} among the inputs yet: the size stays as it is")
            return gr.update(), gr.update()
        return sides(aspect, area)

    # queued (its own default group, never behind GPU jobs): only a queued event shows the warning
    preset.input(apply, [preset, files], [width, height], preprocess=False, api_visibility="private")
