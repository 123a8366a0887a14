"""The Edit tab's layout: the inputs, the prompt and its buttons, the speed, mask and Advanced controls (made
from the declaration: imgedit.web.page.controls), the result and what acts on it. Its events are wired in
imgedit.web.page.edit_events."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from types import SimpleNamespace

import gradio as gr

from imgedit.config.settings import Settings
from imgedit.engine.validation import default_steps, model_defaults
from imgedit.planning.families import FAMILIES
from imgedit.protocol import EDIT, as_declared, parameters
from imgedit.web.page.chain import build_chain_controls
from imgedit.web.page.controls import build_advanced, page_control
from imgedit.web.page.enhance_controls import build_enhance_buttons
from imgedit.web.page.examples import example_rows
from imgedit.web.page.expand import ExpandControls, build_expand_controls
from imgedit.web.page.live_preview import build_live_preview
from imgedit.web.page.mask_controls import build_mask_controls
from imgedit.web.page.sizes import size_presets, wire_size_presets
from imgedit.web.page.speed import build_cache_control, build_speed_controls
from imgedit.web.page.uploads import upload_folder

DEMO_SIZE, DEMO_STEPS = 256, 4  # a first-time visitor of the demo sees a result in seconds
SNIPPET_KINDS = (("gradio", "python", "gradio_client"), ("curl", "shell", "curl (REST)"),
                 ("openai", "python", "OpenAI SDK (REST)"))


@dataclass
class Editor:
    """The Edit tab's components. `controls`: {declared parameter: its control}, in `/edit`'s order."""

    controls: dict
    files: gr.File
    prompt: gr.Textbox
    preview: gr.Gallery
    chosen_input: gr.Number
    first: gr.Button
    counter: gr.Markdown
    enhance_controls: tuple
    restore: gr.Button
    stored: gr.JSON
    run: gr.Button
    stop: gr.Button
    message: gr.Markdown
    canvas: gr.components.Component
    result: gr.Gallery
    live: gr.HTML
    status: gr.Markdown
    again: gr.Button
    add: gr.Button
    download: gr.DownloadButton
    reuse: gr.Button
    chain_controls: tuple
    compare: gr.ImageSlider
    chosen: gr.Number
    copy_api: gr.Button
    snippets: gr.Group
    snippet_code: list
    snippet_inputs: gr.File
    examples: gr.Examples
    expand: ExpandControls
    select_controls: tuple = ()  # Select by words: (words, button, note) (web.page.mask_controls)

    @property
    def outputs(self) -> list:
        """What an edit shows: the gallery, the status line, the comparison, the chosen result, the
        message, and the live preview while it runs."""
        return [self.result, self.status, self.compare, self.chosen, self.message, self.live]


def starting_values(settings: Settings, family: str, demo: bool) -> dict:
    """The form's first values where the model sets them (its steps and CFG); the demo's few steps and small
    width (named as the pipeline gets them, mapped by the declaration)."""
    values = model_defaults(settings, family)
    if demo:
        fast = SimpleNamespace(steps=min(DEMO_STEPS, default_steps(settings, family)), width=DEMO_SIZE)
        values.update(as_declared(fast))
    return values


def build_editor(settings: Settings, family_key: str, demo: bool, cache_refused: str | None) -> Editor:
    """Inside the page's Blocks: the editor's two columns."""
    family = FAMILIES[family_key]
    max_inputs = family.max_images
    laid_out: dict = {}  # the declared parameters' controls, by name, as each is made
    with gr.Row(elem_id="editor"):
        with gr.Column(elem_id="editor-left"):
            files = laid_out["images"] = gr.File(label=family.inputs_label, file_count="multiple",
                                                 file_types=["image"], elem_id="input-files")
            # The inputs as pictures (remove one with its x in the list above; click one to choose it).
            preview = gr.Gallery(label="Inputs, in the order the model gets them", columns=max_inputs,
                                 object_fit="contain", height=170, interactive=False,
                                 elem_id="input-preview", buttons=[], allow_preview=False)
            chosen_input = gr.Number(value=-1, visible=False)
            first = gr.Button("Make the chosen input image 1", size="sm", elem_id="make-first")
            prompt = laid_out["prompt"] = gr.Textbox(
                label="What to change", lines=2, elem_id="prompt",
                placeholder="e.g. make the sky a sunset, keep the people unchanged",
                info="Ctrl+Enter (⌘+Enter on a Mac) runs the edit")
            counter = gr.Markdown(elem_id="prompt-count")  # characters and tokens, as the edit counts them
            enhance_controls = build_enhance_buttons()  # the model rewrites the instruction
            restore = gr.Button("Restore the settings saved in this PNG", visible=False, size="sm",
                                elem_id="restore-settings")
            # The settings found in the last uploaded PNG. Not a gr.State: State makes every page hold a
            # heartbeat connection open for the session's lifetime.
            stored = gr.JSON({}, visible=False)
            with gr.Row():
                # a model that generates: "Generate" while there is no input image (web.page.tools)
                run = gr.Button("Generate" if family.generates else "Edit", variant="primary",
                                elem_id="edit-button")
                # Active only while an edit of this page runs (it looked ready to click when idle).
                stop = gr.Button("Cancel", variant="stop", elem_id="cancel-button", interactive=False)
            message = gr.Markdown(elem_id="edit-message")  # why the last edit was refused, until the next run
            # What comes after the Edit button on a phone, below the result (INPUT_PREVIEW_CSS)
            with gr.Column(elem_id="editor-more"):
                # a folder of this server's own: Gradio deletes the files it served when its server stops,
                # and a shared folder left another running server's examples blank (403)
                examples_folder = tempfile.mkdtemp(prefix="imgedit-examples-", dir=upload_folder())
                rows, labels = example_rows(examples_folder, max_inputs)
                examples = gr.Examples(rows, [files, prompt], example_labels=labels,
                                       label="Examples (click one to fill the form)", elem_id="examples")
                laid_out.update(build_speed_controls(settings))  # Speed, LoRA, strength
                # painted mask, grow, feather, strength; Select by words
                canvas, masking, select_controls = build_mask_controls()
                laid_out.update(masking)
                expand = build_expand_controls()  # pad the canvas: presets, pixels per side, a picture
                laid_out["expand"] = expand.text
                size_preset = size_presets(max_inputs)  # the output's shape by name
                with gr.Accordion("Advanced", open=False, elem_id="advanced"):
                    # the declaration's labelled parameters (the bounds the checks hold to)
                    laid_out.update(build_advanced(settings, starting_values(settings, family_key, demo)))
                    laid_out["cache"] = build_cache_control(settings, cache_refused)  # hidden where refused
                    # a rewrite has its own button (web.page.enhance_controls): never on Edit
                    laid_out["enhance_prompt"] = gr.Checkbox(False, visible=False)
                    # a declared parameter the page does not lay out: a control of its own
                    laid_out.update({p.name: page_control(p, settings, p.default) for p in parameters(EDIT)
                                     if p.name not in laid_out})
                area, auto_width = (DEMO_SIZE**2, DEMO_SIZE) if demo else (1024**2, 0)
                wire_size_presets(size_preset, files, laid_out["width"], laid_out["height"], area=area,
                                  auto_width=auto_width)
        with gr.Column(elem_id="editor-right"):
            result = gr.Gallery(label="Result", format="png", columns=2, elem_id="result", interactive=False,
                                object_fit="contain", height="auto", buttons=["download", "fullscreen"])
            live = build_live_preview()  # while an edit runs: its intermediate image (web.page.live_preview)
            status = gr.Markdown("Results appear here.", elem_id="edit-status")
            with gr.Row():
                # Enabled once there is a result (they only said "there is no result yet" before).
                again = gr.Button("Use this result as input", elem_id="use-result", interactive=False)
                add = gr.Button("Add it as another input", elem_id="add-result", interactive=False)
                download = gr.DownloadButton("Download PNG", elem_id="download-result", interactive=False)
                reuse = gr.Button("Reuse its seed", elem_id="reuse-seed", interactive=False)
            # "Use this result as input" builds a chain of steps with Undo and Redo (web.page.chain)
            chain_controls = build_chain_controls()
            compare = gr.ImageSlider(label="Before / after (drag the handle)", format="png", type="pil",
                                     interactive=False, elem_id="compare", max_height=420)
            chosen = gr.Number(value=0, visible=False)  # the result the buttons and the comparison use
            copy_api = gr.Button("Copy as API call", size="sm", elem_id="copy-api")
            with gr.Group(visible=False, elem_id="api-call") as snippets:
                snippet_code = [gr.Code(language=language, label=label, interactive=False,
                                        elem_id=f"api-{key}") for key, language, label in SNIPPET_KINDS]
                snippet_inputs = gr.File(label="The inputs as the snippets name them (save them beside it)",
                                         file_count="multiple", interactive=False, elem_id="api-inputs")
    controls = {p.name: laid_out[p.name] for p in parameters(EDIT)}  # KeyError: a parameter with no control
    return Editor(controls, files, prompt, preview, chosen_input, first, counter, enhance_controls, restore,
                  stored, run, stop, message, canvas, result, live, status, again, add, download, reuse,
                  chain_controls, compare, chosen, copy_api, snippets, snippet_code, snippet_inputs, examples,
                  expand, select_controls)
