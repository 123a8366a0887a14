"""The page's History tab and the `/history` gradio API: this browser's (or user's) stored edits.

Lists thumbnails with prompt, seed and time; a chosen entry can be re-opened (its result and a
download), loaded into the editor, or re-run with the same settings. Every lookup names the caller's
owner (`imgedit.web.identity`), so another browser's entries are never found.
"""

from __future__ import annotations

import html
import time

import gradio as gr
from PIL import Image

from imgedit.config.settings import Settings
from imgedit.engine.history import HistoryEntry, HistoryStore
from imgedit.engine.images import read_settings
from imgedit.engine.validation import lora_adapters, speed_preset
from imgedit.errors import ImgEditError
from imgedit.protocol import EditRequest
from imgedit.web.exports import download_name, export_copy
from imgedit.web.identity import page_owner
from imgedit.web.speed import NO_LORA, stored_cache_choice
from imgedit.web.tools import refusal, user_error

NO_OWNER = "History needs cookies (or sign-in): this browser sent none, so nothing is kept for it."


def _when(created: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(created))


def _describe(entry: HistoryEntry) -> dict:
    return {"id": entry.id, "created": entry.created, "prompt": entry.prompt, "negative_prompt": entry.negative_prompt,
            "seed": entry.seed, "num_inference_steps": entry.steps, "true_cfg_scale": entry.true_cfg_scale,
            "num_images": entry.num_images, "width": entry.out_width, "height": entry.out_height,
            "source": entry.source, "name": entry.name, "speed": entry.speed or "quality", "lora": entry.lora,
            "lora_scale": entry.lora_scale, "original_prompt": entry.original_prompt}


def check_still_offered(entry: HistoryEntry, settings) -> None:
    """Raise the usual InvalidInput ("unknown LoRA ...", "speed fast needs a Lightning ...") when the
    speed preset or LoRA this entry was made with is no longer configured."""
    req = EditRequest(images=(), prompt=entry.prompt, speed=entry.speed, lora=entry.lora, lora_scale=entry.lora_scale)
    lora_adapters(req, settings, speed_preset(req, settings))


def speed_values(entry: HistoryEntry) -> tuple[str, str, float]:
    """The Speed / LoRA / strength controls' values that repeat this entry."""
    return (entry.speed or "quality", entry.lora or NO_LORA, 1.0 if entry.lora_scale is None else entry.lora_scale)


# Fixed-size cells (one or two entries once stretched into full-width cropped banners), whole pictures,
# and each thumbnail's caption (prompt, seed, time) shown in full width under the picture's edge.
HISTORY_CSS = """<style>
#history-gallery .grid-container{grid-template-columns:repeat(auto-fill,180px)!important;
  grid-template-rows:none!important;grid-auto-rows:180px!important}
#history-result .grid-container{grid-template-columns:repeat(auto-fill,320px)!important;
  grid-template-rows:none!important;grid-auto-rows:320px!important}
#history-gallery img,#history-result img{object-fit:contain!important}
#history-gallery .caption-label{max-width:100%!important;left:0;right:0;bottom:0;white-space:normal!important;
  opacity:.9;font-size:11px}
</style>"""


def build_history_tab(settings: Settings, history: HistoryStore, edit_inputs: list, edit_outputs: list, edit,
                      gpu_group: str, cache_offered: bool = True):
    """Inside a `gr.Tabs`: the History tab. `edit_inputs`, `edit_outputs` and `edit` are the Edit tab's
    button's (the advanced settings, then Speed, LoRA, strength and Step cache), so a re-run is an ordinary
    edit (same line, same checks and messages, stored again). The step cache an entry was made with comes
    from its first result's PNG (the store keeps no column for it); `cache_offered`: the workers can run one.
    Returns the `/history` API function, to be registered outside the tabs."""
    auth = settings.auth is not None

    def owner(request: gr.Request | None) -> str | None:
        return page_owner(request, auth)

    with gr.Tab("History", id="history") as tab:
        gr.HTML(HISTORY_CSS, padding=False)
        gr.Markdown("Your past edits in this browser (per user when the page asks for a sign-in), newest first. "
                    "Old results are deleted after a while (OUTPUT_RETENTION_HOURS, OUTPUT_MAX_GB).")
        refresh = gr.Button("Refresh", elem_id="history-refresh")
        listing = gr.Gallery(label="Past edits", columns=6, height=280, allow_preview=False, interactive=False,
                             elem_id="history-gallery")
        # Plain hidden components, not gr.State: a State makes the page hold a heartbeat connection
        # open. Ids are no secret: every lookup checks the caller's owner again.
        ids = gr.JSON([], visible=False)
        chosen = gr.Textbox(visible=False)
        details = gr.Markdown(elem_id="history-details")
        outputs = gr.Gallery(label="Result", format="png", columns=2, interactive=False, elem_id="history-result")
        download = gr.File(label="Download", interactive=False, elem_id="history-download")
        with gr.Row():
            reopen = gr.Button("Open in the editor", elem_id="history-open")
            rerun = gr.Button("Re-run with the same settings", elem_id="history-rerun")

    def load(request: gr.Request):
        who = owner(request)
        if who is None:
            return [], [], NO_OWNER
        entries = history.list(who)
        shown = [(Image.open(e.thumb_path), f"{e.prompt[:60]} · seed {e.seed} · {_when(e.created)}")
                 for e in entries if e.thumb_path.exists()]
        ids = [e.id for e in entries if e.thumb_path.exists()]
        return shown, ids, "" if entries else "Nothing here yet: finished edits appear here."

    def pick(ids: list[str], request: gr.Request, evt: gr.SelectData):
        who = owner(request)
        entry = history.get(who, ids[evt.index]) if who and 0 <= evt.index < len(ids) else None
        if entry is None:
            raise refusal("that entry is gone (deleted by the retention rules)")
        speed, lora, scale = speed_values(entry)
        made_with = (f" · {speed}" if speed != "quality" else "") + \
            (f" · LoRA {html.escape(lora)} ({scale:g})" if lora != NO_LORA else "") + \
            (f" · {html.escape(entry.weights)} weights" if entry.weights else "")
        words = f"  \n*rewritten from:* {html.escape(entry.original_prompt)}" if entry.original_prompt else ""
        text = (f"**{html.escape(entry.prompt)}**{words}  \nseed {entry.seed} · {entry.steps} steps{made_with} · "
                f"{entry.out_width}x{entry.out_height} · {entry.outputs} image(s) · {_when(entry.created)}")
        images = [Image.open(p) for p in entry.output_paths]
        # named as the page's Download PNG names a result: its prompt's first words and its seed
        return entry.id, text, images, export_copy(entry.output_paths, download_name(entry.prompt, entry.seed))

    def values(entry: HistoryEntry, speed: tuple) -> tuple:
        inputs = [export_copy([p], f"input-{k + 1}") for k, p in enumerate(entry.input_paths)]
        cfg = settings.default_true_cfg if entry.true_cfg_scale is None else entry.true_cfg_scale
        made_with = read_settings(entry.output_paths[0]).get("cache") if entry.output_paths else None
        return (inputs, entry.prompt, entry.negative_prompt, entry.seed, False, entry.steps, cfg, entry.num_images,
                entry.width or 0, entry.height or 0, *speed, stored_cache_choice(made_with, cache_offered))

    def chosen_entry(entry_id: str | None, request: gr.Request) -> HistoryEntry:
        entry = history.get(owner(request), entry_id) if entry_id and owner(request) else None
        if entry is None:
            raise refusal("choose an entry in the history first")
        return entry

    def fill(entry_id: str | None, request: gr.Request):
        """Open in the editor: a speed or LoRA no longer offered falls back to quality / none, with a notice."""
        entry = chosen_entry(entry_id, request)
        speed = speed_values(entry)
        try:
            check_still_offered(entry, settings)
        except ImgEditError as exc:
            gr.Warning(f"{html.escape(exc.message)}; the editor uses quality and no LoRA instead")
            speed = ("quality", NO_LORA, 1.0)
        return values(entry, speed)

    def fill_for_rerun(entry_id: str | None, request: gr.Request):
        """Re-run: exactly the stored settings, or the usual error when the LoRA or speed is gone (the
        edit then does not start)."""
        entry = chosen_entry(entry_id, request)
        try:
            check_still_offered(entry, settings)
        except ImgEditError as exc:
            raise user_error(exc) from None
        return values(entry, speed_values(entry))

    def history_api(request: gr.Request) -> list[dict]:
        """This caller's stored edits, newest first: id, created, prompt, seed, steps, size, ..."""
        who = owner(request)
        return [_describe(e) for e in history.list(who)] if who else []

    shown = [listing, ids, details]
    refresh.click(load, None, shown, queue=False, api_visibility="private")
    tab.select(load, None, shown, queue=False, api_visibility="private")
    listing.select(pick, ids, [chosen, details, outputs, download], queue=False, api_visibility="private")
    # Queued (its own default group, never behind GPU jobs): only queued events can show fill's notice.
    reopen.click(fill, chosen, edit_inputs, api_visibility="private")
    rerun.click(fill_for_rerun, chosen, edit_inputs, queue=False, api_visibility="private").success(
        edit, edit_inputs, edit_outputs, concurrency_id=gpu_group, concurrency_limit=None, preprocess=False,
        show_progress_on=edit_outputs[:1], api_visibility="private")
    return history_api
