"""Select by words on the page and in the gradio API: the model's own text encoder outlines a phrase ("the
sky", "the red car") in the first input (imgedit.runtime.grounding, a job in the same line as edits) and the
proposal becomes the mask canvas's brush layer, for the user to adjust before Edit.

- Page: "Select" (or Enter) beside the words: the canvas shows the proposal as brush strokes; nothing found
  (the demo's random weights never find anything), or any refusal: the note says why, the canvas stays.
- `/select_mask` (images, mask_prompt) -> the proposed mask file (white = edit), `/edit`'s `mask` as it is.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from dataclasses import replace

import gradio as gr
from PIL import Image

from imgedit.config.settings import Settings
from imgedit.engine.interface import Engine
from imgedit.engine.outputs import png_bytes
from imgedit.protocol import EditRequest, param
from imgedit.web.identity import page_owner
from imgedit.web.page.controls import hidden_api_route
from imgedit.web.page.mask_controls import MASK_COLOUR
from imgedit.web.page.requests import decode_uploads
from imgedit.web.page.tools import cached_png, user_error
from imgedit.web.page.uploads import upload_folder, uploaded_paths


def wire_select(settings: Settings, manager: Engine, files, canvas, controls: tuple,
                concurrency_id: str) -> None:
    """Select: the words' outline (a job in the same line as edits) as the canvas's brush layer, for the user
    to adjust; nothing found (or any refusal): the note says why and the canvas stays as it was. And the
    gradio API's `/select_mask`."""
    words, select, note = controls

    async def outline(images, phrase, request: gr.Request | None):
        source = "ui" if request is not None and request.headers.get("referer") else "api"
        try:
            decoded = await asyncio.to_thread(decode_uploads, settings, manager.family, images)
            phrase = param("mask_prompt").parse(phrase)
            req = EditRequest(images=decoded, prompt="", mask_prompt=phrase, source=source)
        except Exception as exc:
            raise user_error(exc) from None
        owner = page_owner(request, settings.auth is not None)
        # the line's share: per login or browser, else per Gradio connection (as a rewrite's)
        connection = f"session:{request.session_hash}" if request is not None else None
        try:
            return await manager.run_outline(replace(req, client=owner or connection))
        except Exception as exc:  # asyncio.CancelledError is not an Exception: it goes on
            raise user_error(exc) from None

    async def select_page(images, phrase, request: gr.Request = None):
        try:
            result = await outline(images, phrase, request)
        except gr.Error as exc:
            return gr.skip(), f"**Nothing selected:** {exc.message}"
        background = uploaded_paths(images)[0]
        layer = await asyncio.to_thread(_brush_layer, result.mask)
        said = (f"Selected {len(result.boxes)} area(s) in {result.seconds:.1f} s: adjust them with the brush "
                "and the eraser, then Edit.")
        return {"background": background, "layers": [layer], "composite": background}, said

    async def select_mask(images, mask_prompt, request: gr.Request = None) -> str:
        """Outline `mask_prompt` in the first of `images` with the model's own text encoder: the proposed mask
        (a PNG the first image's size, white = edit), to adjust and send as `/edit`'s mask."""
        result = await outline(images, mask_prompt, request)
        return await asyncio.to_thread(cached_png, png_bytes(result.mask), "mask.png")

    gr.on([select.click, words.submit], select_page, [files, words], [canvas, note], preprocess=False,
          concurrency_id=concurrency_id, concurrency_limit=None, show_progress_on=[canvas],
          api_visibility="private")
    hidden_api_route(select_mask, lambda: gr.File(label="mask"), "select_mask", concurrency_id)


def _brush_layer(mask: Image.Image) -> str:
    """A proposed mask as the canvas's brush layer: the brush's colour where the mask marks, clear elsewhere
    (a file in the upload cache, as the strokes the canvas sends)."""
    layer = Image.new("RGBA", mask.size, MASK_COLOUR)
    layer.putalpha(mask.point(lambda v: 255 if v >= 128 else 0))
    folder = os.path.join(upload_folder(), "imgedit-masks")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{uuid.uuid4().hex}-layer.png")
    layer.save(path)
    return path
