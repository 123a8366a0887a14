"""The page's mask: paint over the first input where the edit may change it (Gradio's ImageEditor with a
brush and an eraser), with the soft edge, grow and strength beside it; or select it by words first ("the
sky": the model's own text encoder outlines it, imgedit.runtime.grounding) and adjust the proposal with the
brush and the eraser.

The painted strokes become a black-and-white mask file in the upload cache (white = edit), the same
kind of file the gradio API and REST take, so the edit goes through the same checks
(imgedit.engine.masks). Nothing painted: an ordinary edit. Select's events: imgedit.web.page.select_controls.
"""

from __future__ import annotations

import hashlib
import os
import uuid

import gradio as gr
import numpy as np
from PIL import Image

from imgedit.engine.masks import DEFAULT_FEATHER
from imgedit.protocol import param
from imgedit.web.page.uploads import upload_folder, uploaded_paths

MASK_COLOUR = "#ff2d6f"


def build_mask_controls() -> tuple[gr.ImageEditor, dict[str, gr.components.Component], tuple]:
    """The canvas, the mask parameters' controls by their declared names (imgedit.protocol.PARAMETERS): `mask`
    holds the mask file of the last run, painted on the canvas; and Select's (words, button, note)."""
    with gr.Accordion("Mask: edit only where you paint", open=False, elem_id="mask-accordion"):
        with gr.Row(equal_height=True):
            words = gr.Textbox(label="Select by words", placeholder="e.g. the sky, the red car", scale=4,
                               max_length=200, elem_id="mask-words",
                               info="the model outlines it in the first input; adjust it with the brush")
            select = gr.Button("Select", size="sm", scale=1, elem_id="mask-select")
        note = gr.Markdown(elem_id="mask-select-note")
        canvas = gr.ImageEditor(
            label="Paint over the first input where it may change (the eraser takes paint away)", type="pil",
            image_mode="RGBA", sources=(), transforms=(), layers=False, elem_id="mask-canvas", height=360,
            brush=gr.Brush(colors=[MASK_COLOUR], color_mode="fixed", default_size=32),
            eraser=gr.Eraser(default_size=32))
        with gr.Row():
            # the declared bounds (imgedit.protocol.PARAMETERS)
            feather = gr.Slider(*param("mask_feather").bounds(), value=DEFAULT_FEATHER, step=1,
                                label="Soft edge (px)", elem_id="mask-feather")
            grow = gr.Slider(*param("mask_grow").bounds(), value=0, step=1, label="Grow (px)",
                             elem_id="mask-grow")
            # above the declared low bound (0 is refused): the slider's first stop
            strength = gr.Slider(0.05, param("strength").high, value=1.0, step=0.05,
                                 label="Strength (1 = repaint)", elem_id="mask-strength")
    painted = gr.Textbox(visible=False)  # a path in the upload cache, or ""
    # Select puts its mask on the canvas, to adjust: the Edit button never sends the words
    words_sent = gr.Textbox(visible=False)
    return canvas, {"mask": painted, "mask_grow": grow, "mask_feather": feather, "strength": strength,
                    "mask_prompt": words_sent}, (words, select, note)


def follow_first_input(files, canvas) -> None:
    """Every change of the inputs (upload, removal, an example, a result used as input) puts the first input
    on the canvas, when it is another image."""
    # The digest of the image the canvas shows. Not a gr.State: a State opens Gradio's heartbeat stream
    # for every page.
    shown = gr.Textbox(visible=False)
    files.change(canvas_for, [files, shown], [canvas, shown], preprocess=False, queue=False,
                 api_visibility="private")


def canvas_for(files, shown: str):
    """(canvas, shown): the canvas shows the first input, unpainted, when the first input changed.

    `shown` is the digest of the first input the canvas has. The inputs change twice for one upload (the
    upload, then its check returning the kept files); redrawing again would wipe strokes painted between.
    """
    try:
        paths = uploaded_paths(files)
    except Exception:  # noqa: BLE001 - the edit itself says what is wrong with the inputs
        paths = []
    if not paths:
        return (None, "") if shown else (gr.skip(), "")
    try:
        with open(paths[0], "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        with Image.open(paths[0]) as image:  # only a readable image goes on the canvas (the upload check
            image.verify()  # leaves the others out and says why)
    except Exception:  # noqa: BLE001 - gone from the upload cache, or not an image: an empty canvas
        return (None, "") if shown else (gr.skip(), "")
    if digest == shown:
        return gr.skip(), shown
    return {"background": paths[0], "layers": [], "composite": paths[0]}, digest


def _open(data) -> Image.Image | None:
    """One image of the editor's raw value (a file in the upload cache), or None."""
    try:
        [path] = uploaded_paths(data, "mask")
        with Image.open(path) as image:
            image.load()
            return image.copy()
    except Exception:  # noqa: BLE001 - no file, a file elsewhere, not an image: nothing painted there
        return None


def painted_mask(value) -> str:
    """The painted strokes as a mask file (white = edit) in the upload cache; "" when nothing is painted.
    Reads the editor's raw value (preprocess=False): a background that is no image means no mask."""
    if not isinstance(value, dict) or (background := _open(value.get("background"))) is None:
        return ""
    size = background.size
    painted = np.zeros((size[1], size[0]), bool)
    for layer in value.get("layers") or []:
        if (layer := _open(layer)) is not None and layer.mode in ("RGBA", "LA", "P"):
            alpha = np.asarray(layer.convert("RGBA").resize(size))[:, :, 3]
            painted |= alpha > 0
    if not painted.any():
        return ""
    folder = os.path.join(upload_folder(), "imgedit-masks")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{uuid.uuid4().hex}.png")
    Image.fromarray(np.where(painted, 255, 0).astype(np.uint8), mode="L").save(path)
    return path

