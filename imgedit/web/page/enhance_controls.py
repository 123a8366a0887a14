"""Prompt enhancement on the page and in the gradio API: the model's own text encoder (Qwen2.5-VL, on the
workers' GPUs) rewrites the instruction with the input images in view (imgedit.runtime.enhance).

- Page: "Enhance" beside the prompt puts the rewrite into the box, for the user to keep or change, and
  "Back to my words" puts the original back (one click).
- `/enhance_prompt` (images, prompt) -> prompt: the rewrite, or the prompt unchanged when the rewrite was
  not usable (empty, or cut at ENHANCE_MAX_TOKENS).
A rewrite is a short job in the same line as edits (it waits its turn, the workers' locks hold).
"""

from __future__ import annotations

import asyncio
import functools
import html
from dataclasses import replace

import gradio as gr

from imgedit.config.settings import Settings
from imgedit.engine.interface import Engine
from imgedit.web.identity import page_owner
from imgedit.web.page.controls import hidden_api_route
from imgedit.web.page.requests import build_enhance_request
from imgedit.web.page.tools import user_error


def build_enhance_buttons():
    """(enhance, undo, note, original, rewritten): to be built right under the prompt box."""
    with gr.Row():
        # no emoji: without an emoji font it rendered as a box
        enhance = gr.Button("Enhance the instruction", size="sm", elem_id="enhance-button")
        undo = gr.Button("Back to my words", size="sm", visible=False, elem_id="enhance-undo")
    note = gr.Markdown(elem_id="enhance-note")
    # The user's words before Enhance, and the last rewrite (hidden Textboxes, not gr.State: no heartbeat).
    original, rewritten = gr.Textbox(visible=False), gr.Textbox(visible=False)
    return enhance, undo, note, original, rewritten


def wire_enhance(settings: Settings, manager: Engine, files, prompt, controls, concurrency_id: str) -> None:
    enhance, undo, note, original, rewritten = controls

    async def rewrite(images, text, request: gr.Request | None):
        source = "ui" if request is not None and request.headers.get("referer") else "api"
        try:
            parse = functools.partial(build_enhance_request, settings, manager.family, images, text,
                                      source=source)
            req = await asyncio.to_thread(parse)
        except Exception as exc:
            raise user_error(exc) from None
        owner = page_owner(request, settings.auth is not None)
        session = f"session:{request.session_hash}" if request is not None else None
        req = replace(req, client=owner or session)
        try:
            return req, await manager.run_enhance(req)
        except Exception as exc:
            # asyncio.CancelledError is not an Exception: it goes on (manager.run cancels)
            raise user_error(exc) from None

    async def enhance_page(images, text, before, last, request: gr.Request = None):
        keep = gr.update()
        try:
            req, result = await rewrite(images, text, request)
        except gr.Error as exc:
            return keep, keep, f"**{exc.title or 'Not rewritten'}:** {exc.message}", keep, keep
        if result.prompt is None:
            unchanged = f"Your instruction is unchanged: {html.escape(result.notice or '')}."
            return keep, keep, unchanged, keep, keep
        said = (f"Rewritten by the model in {result.seconds:.1f} s: edit it as you like, "
                "or go back to your words.")
        # Enhance pressed again on the model's own words: "Back to my words" still means the user's.
        mine = before if before and text == last else req.prompt
        return result.prompt, gr.update(visible=True), said, mine, result.prompt

    async def enhance_prompt(images, prompt, request: gr.Request = None) -> str:
        """Rewrite `prompt` into a clearer edit instruction for `images` with the model's own text encoder;
        returns the rewrite, or `prompt` unchanged when no usable rewrite came back."""
        _, result = await rewrite(images, prompt, request)
        return result.prompt or prompt

    enhance.click(enhance_page, [files, prompt, original, rewritten],
                  [prompt, undo, note, original, rewritten],
                  preprocess=False,
                  concurrency_id=concurrency_id, concurrency_limit=None, show_progress_on=[prompt],
                  api_visibility="private")
    undo.click(lambda words: (words, gr.update(visible=False), "", ""), original,
               [prompt, undo, note, rewritten], queue=False, api_visibility="private")
    hidden_api_route(enhance_prompt, lambda: gr.Textbox(label="prompt"), "enhance_prompt", concurrency_id)
