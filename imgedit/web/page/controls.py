"""The page's controls made from the declaration (imgedit.protocol.PARAMETERS): the Advanced settings, a
control for a declared parameter laid out nowhere else, and `/edit`'s hidden API inputs."""

from __future__ import annotations

import contextlib

import gradio as gr

from imgedit.config.settings import Settings
from imgedit.protocol import EDIT, Param, parameters


def api_component(param: Param):
    """The hidden input of `/edit` for one declared parameter: no ranges, so that every value reaches our
    checks (and our messages), and the declared default for gradio_client."""
    if param.kind == "file":
        return gr.File(file_count="multiple" if param.name == "images" else "single")
    if param.required:  # no value: gradio_client then asks for it
        return gr.Textbox() if param.kind == "text" else gr.Number()
    if param.kind == "flag":
        return gr.Checkbox(param.edit_default)
    if param.kind in ("whole", "number"):
        return gr.Number(param.edit_default)
    return gr.Textbox(param.edit_default)


def page_control(param: Param, settings: Settings, value=None):
    """The page's control for a declared parameter: with its declared `label` (and `slider`), or, for one
    declared without, named by its name and explained by its help and range (`elem_id` param-<name>). A
    number box keeps the declared bounds, unless its label shows them: a value outside then reaches our checks
    and gets our message (Steps: "one step makes a blank image"), not the box's."""
    low, high = param.bounds(settings)
    box = (None, None) if "{low}" in param.label or "{high}" in param.label else (low, high)
    if param.label:
        label, info, elem_id = param.label.format(low=low, high=high), None, None
    else:
        label, info, elem_id = param.name.replace("_", " ").capitalize(), param.help, f"param-{param.name}"
        if param.kind in ("whole", "number") and (range_text := param.range_text(settings)):
            info = f"{info} ({range_text})"
    if param.kind == "flag":
        return gr.Checkbox(bool(value), label=label, info=info, elem_id=elem_id)
    if param.kind in ("whole", "number"):
        if param.slider is not None:
            return gr.Slider(low, high, value=value, step=param.slider, label=label, info=info,
                             elem_id=elem_id)
        precision = 0 if param.kind == "whole" else None
        return gr.Number(value, label=label, info=info, precision=precision, minimum=box[0], maximum=box[1],
                         elem_id=elem_id)
    if param.kind == "file":
        return gr.File(label=label, elem_id=elem_id)
    return gr.Textbox(value or "", label=label, info=info, elem_id=elem_id)


def build_advanced(settings: Settings, values: dict) -> dict:
    """The declared parameters with a page label, in the declaration's order (one row for those declared
    `same_row` with the one before), each starting at `values`' (by name) or its `/edit` default.
    {declared parameter: its control}."""
    rows: list[list[Param]] = []
    for p in parameters(EDIT):
        if p.label and p.same_row and rows:
            rows[-1].append(p)
        elif p.label:
            rows.append([p])
    made = {}
    for row in rows:
        with gr.Row() if len(row) > 1 else contextlib.nullcontext():
            for p in row:
                made[p.name] = page_control(p, settings, values.get(p.name, p.edit_default))
    return made


def hidden_api_route(fn, output, api_name: str, concurrency_id: str) -> None:
    """A gradio API route with no control on the page: `fn(images, text)` -> `output()`'s component. Its
    inputs are hidden and have no ranges, so every value reaches our checks (and our messages)."""
    with gr.Row(visible=False):
        inputs = [gr.File(file_count="multiple"), gr.Textbox()]
        answer = output()
        button = gr.Button()
    button.click(fn, inputs, answer, api_name=api_name, preprocess=False, concurrency_id=concurrency_id,
                 concurrency_limit=None)
