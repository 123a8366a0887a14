"""The page's live preview: while an edit of this page runs, the model's current guess at the finished image
(imgedit.runtime.preview: a small JPEG the worker makes every few steps of a watched job) shows under the
result, refreshed as the steps go, and gives way to the result (or to nothing, on a refusal or Cancel).

Only the page's own edits are watched (`EditRequest.watch`): a gradio_client or REST call pays nothing for it.
The picture travels inline, as a data URL of about 3 KB, so no file is written for it.
"""

from __future__ import annotations

import base64

import gradio as gr

HIDDEN = {"value": "", "visible": False}


def build_live_preview() -> gr.HTML:
    """The place of the preview, hidden until an edit's first preview arrives."""
    return gr.HTML(visible=False, elem_id="live-preview", padding=False)


def hidden():
    return gr.update(**HIDDEN)


def preview_html(jpeg: bytes, step: int, total: int) -> str:
    """The preview as an image with its step: the JPEG is the worker's own, a 128 px sketch, shown larger."""
    data = base64.b64encode(jpeg).decode()
    said = f"step {step} of {total}" if total else "denoising"
    return (f'<figure style="margin:0;display:flex;gap:12px;align-items:center">'
            f'<img src="data:image/jpeg;base64,{data}" alt="live preview" '
            f'style="max-width:256px;max-height:256px;width:auto;height:auto;border-radius:4px">'
            f'<figcaption>Live preview, {said}: the model\'s current guess at the result '
            f'(a rough sketch; the result replaces it).</figcaption></figure>')


class Watch:
    """One page edit's preview: the manager's newest for the job (once the job is known), handed out once per
    new picture."""

    def __init__(self, manager):
        self.manager = manager
        self.request_id: str | None = None
        self.track = None  # the edit's EditProgress: the step the preview came with
        self._shown: bytes | None = None

    def follow(self, request_id: str, track) -> None:
        self.request_id, self.track = request_id, track

    def fresh(self):
        """An update showing the newest preview, or None when there is none new since the last one."""
        if self.request_id is None:
            return None
        jpeg = self.manager.preview(self.request_id)
        if jpeg is None or jpeg == self._shown:
            return None
        self._shown = jpeg
        step, total = (self.track.step, self.track.total) if self.track is not None else (0, 0)
        return gr.update(value=preview_html(jpeg, step, total), visible=True)
