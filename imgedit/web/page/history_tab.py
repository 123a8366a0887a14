"""The page's History tab and the `/history` gradio API: this browser's (or user's) stored edits.

Lists thumbnails with prompt, seed and time; a chosen entry can be re-opened (its result and a
download), loaded into the editor, re-run with the same settings (the new result is shown here, where the
user clicked, as well as in the editor) or deleted with its files. Every lookup names the caller's owner
(`imgedit.web.identity`), so another browser's entries are never found or deleted.
"""

from __future__ import annotations

import html
import time

import gradio as gr
from PIL import Image

from imgedit.config.settings import Settings
from imgedit.engine.jobs.history import HistoryEntry, HistoryStore
from imgedit.engine.outputs import read_settings
from imgedit.engine.validation import lora_adapters, speed_preset
from imgedit.errors import ImgEditError
from imgedit.planning.families import FAMILIES
from imgedit.protocol import EditRequest, param, request_kwargs
from imgedit.web.identity import page_owner
from imgedit.web.page.exports import download_name, export_copy
from imgedit.web.page.speed import NO_LORA, SPEED_FIELDS, stored_cache_choice
from imgedit.web.page.tools import refusal, user_error

NO_OWNER = "History needs cookies (or sign-in): this browser sent none, so nothing is kept for it."


def _when(created: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(created))


def _describe(entry: HistoryEntry) -> dict:
    """`/history`'s view of an entry: the declared parameters it keeps, by their names; its output size."""
    return {"id": entry.id, "created": entry.created, **entry.kept(),
            "width": entry.out_width, "height": entry.out_height, "source": entry.source, "name": entry.name,
            "speed": entry.speed or "quality", "original_prompt": entry.original_prompt}


def check_still_offered(entry: HistoryEntry, settings) -> None:
    """Raise the usual InvalidInput ("unknown LoRA ...", "speed fast needs a Lightning ...") when the
    speed preset or LoRA this entry was made with is no longer configured."""
    req = EditRequest(images=(), **request_kwargs(entry.kept()))
    lora_adapters(req, settings, speed_preset(req, settings))


def form_value(name: str, value):
    """A kept value as the page's control for that parameter shows it: one the edit left out (None) as the
    parameter's `/edit` default where it has one (0 = an automatic side, quality, no LoRA, strength 1), an
    empty box for other text."""
    if value is not None:
        return value
    declared = param(name)
    return "" if declared.edit_default is None and declared.kind == "text" else declared.edit_default


def speed_values(entry: HistoryEntry) -> tuple[str, str, float]:
    """The Speed / LoRA / strength controls' values that repeat this entry."""
    return tuple(form_value(name, getattr(entry, name)) for name in SPEED_FIELDS)


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


def build_history_tab(settings: Settings, history: HistoryStore, controls: dict, edit_outputs: list, edit,
                      gpu_group: str, cache_offered: bool = True, family: str = "plus"):
    """Inside a `gr.Tabs`: the History tab. `controls` ({declared parameter: the page's control}, in
    `/edit`'s order; `edit` takes them by name), `edit_outputs` and `edit` are the Edit tab's button's, so a
    re-run is an ordinary edit (same line, same checks and messages, stored again); the mask's settings (not
    stored) stay as the form has them.
    The step cache an entry was made with comes from its first result's PNG (the store keeps no column for
    it); `cache_offered`: the workers can run one.
    Returns the `/history` API function, to be registered outside the tabs."""
    auth = settings.auth is not None
    edit_inputs = list(controls.values())

    def owner(request: gr.Request | None) -> str | None:
        return page_owner(request, auth)

    with gr.Tab("History", id="history") as tab:
        gr.HTML(HISTORY_CSS, padding=False)
        gr.Markdown("Your past edits in this browser (per user when the page asks for a sign-in, with what "
                    "that user's API key made), newest first. Old results are deleted after a while "
                    "(OUTPUT_RETENTION_HOURS, OUTPUT_MAX_GB).")
        refresh = gr.Button("Refresh", elem_id="history-refresh")
        listing = gr.Gallery(label="Past edits", columns=6, height=280, allow_preview=False,
                             interactive=False, elem_id="history-gallery")
        # Plain hidden components, not gr.State: a State makes the page hold a heartbeat connection
        # open. Ids are no secret: every lookup checks the caller's owner again.
        ids = gr.JSON([], visible=False)
        chosen = gr.Textbox(visible=False)
        details = gr.Markdown(elem_id="history-details")
        outputs = gr.Gallery(label="Result", format="png", columns=2, interactive=False,
                             elem_id="history-result")
        download = gr.File(label="Download", interactive=False, elem_id="history-download")
        with gr.Row():
            reopen = gr.Button("Open in the editor", elem_id="history-open")
            rerun = gr.Button("Re-run with the same settings", elem_id="history-rerun")
            reuse = gr.Button("Reuse its seed in the editor", elem_id="history-reuse-seed")
            delete = gr.Button("Delete", variant="stop", elem_id="history-delete")
        # Delete asks first (it once removed the entry and its files at the first click)
        with gr.Row(visible=False, elem_id="history-confirm") as confirm_row:
            gr.Markdown("Delete this entry and its files? This cannot be undone.")
            confirm = gr.Button("Yes, delete it", variant="stop", size="sm", elem_id="history-delete-confirm")
            keep = gr.Button("Keep it", size="sm", elem_id="history-delete-keep")

    def relist(request: gr.Request):
        who = owner(request)
        entries = history.list(who) if who is not None else []
        shown = [(Image.open(e.thumb_path), f"{e.prompt[:60]} · seed {e.seed} · {_when(e.created)}")
                 for e in entries if e.thumb_path.exists()]
        return shown, [e.id for e in entries if e.thumb_path.exists()]

    def load(request: gr.Request):
        if owner(request) is None:
            return [], [], NO_OWNER
        shown, ids = relist(request)
        return shown, ids, "" if ids else "Nothing here yet: finished edits appear here."

    def opened(entry: HistoryEntry, heading: str = "") -> tuple:
        """(chosen id, details, result pictures, download) for one entry."""
        speed, lora, scale = speed_values(entry)
        made_with = (f" · {speed}" if speed != "quality" else "") + \
            (f" · LoRA {html.escape(lora)} ({scale:g})" if lora != NO_LORA else "") + \
            (f" · {html.escape(entry.weights)} weights" if entry.weights else "")
        words = f"  \n*rewritten from:* {html.escape(entry.original_prompt)}" if entry.original_prompt else ""
        text = (f"{heading}**{html.escape(entry.prompt)}**{words}  \nseed {entry.seed} · {entry.steps} steps"
                f"{made_with} · {entry.out_width}x{entry.out_height} · {entry.outputs} image(s) · "
                f"{_when(entry.created)}")
        images = [Image.open(p) for p in entry.output_paths]
        # named as the page's Download PNG names a result: its prompt's first words and its seed
        named = export_copy(entry.output_paths, download_name(entry.prompt, entry.seed))
        return entry.id, text, images, named

    def pick(ids: list[str], request: gr.Request, evt: gr.SelectData):
        who = owner(request)
        entry = history.get(who, ids[evt.index]) if who and 0 <= evt.index < len(ids) else None
        if entry is None:
            raise refusal("that entry is gone (deleted, or removed by the retention rules)")
        return opened(entry)

    def rerun_done(request: gr.Request):
        """The re-run's result where the user clicked: the newest entry the page stored is the one the re-run
        just stored (a script of the same owner, over REST with a key named as the login, may store one
        meanwhile: web.identity)."""
        who = owner(request)
        newest = [e for e in history.list(who, limit=50) if e.source == "ui"][:1] if who else []
        if not newest:
            raise refusal("the re-run finished, but its result was not stored (see the editor above)")
        return opened(newest[0], "Re-run done (also in the editor above):  \n")

    def rerun_notice(entry_id: str | None, request: gr.Request) -> str:
        """What the History tab says while a re-run runs (or why it does not: the editor's error says it
        too)."""
        entry = history.get(owner(request), entry_id) if entry_id and owner(request) else None
        if entry is None:
            return "Choose an entry first."
        try:
            check_still_offered(entry, settings)
        except ImgEditError as exc:
            return f"Not re-run: {html.escape(exc.message)}."
        return "Re-running with the same settings… the result appears here and in the editor."

    def delete_entry(entry_id: str | None, request: gr.Request):
        """Delete the chosen entry and its files (the caller's own only)."""
        entry = chosen_entry(entry_id, request)
        history.delete(owner(request), entry.id)
        return "", f"Deleted: *{html.escape(entry.prompt[:80])}* (seed {entry.seed}).", [], None

    def values(entry: HistoryEntry, speed: tuple) -> tuple:
        """The form's controls that repeat this entry (`speed`: the speed controls' values): every declared
        parameter it keeps, by name, as its control shows it (form_value: words or padding left in the form
        do not re-run); the form's own values for those it does not keep."""
        inputs = [export_copy([p], f"input-{k + 1}") for k, p in enumerate(entry.input_paths)]
        # a request that left CFG out ran at the model's own (Qwen-Image-2.1: off)
        cfg = entry.true_cfg_scale
        if cfg is None:
            cfg = FAMILIES[family].cfg(settings.default_true_cfg)
        made_with = read_settings(entry.output_paths[0]).get("cache") if entry.output_paths else None
        stored = dict(entry.kept(), **dict(zip(SPEED_FIELDS, speed, strict=True)), images=inputs,
                      randomize_seed=False, true_cfg_scale=cfg,
                      # the store keeps no step cache column: the one the result's PNG records
                      cache=stored_cache_choice(made_with, cache_offered),
                      # the store keeps no mask: the edit was unmasked or is not; the prompt kept is the one
                      # the edit used (a rewrite's), rewritten again by nothing
                      mask=None, enhance_prompt=False)
        return tuple(form_value(name, stored[name]) if name in stored else gr.update() for name in controls)

    def chosen_entry(entry_id: str | None, request: gr.Request) -> HistoryEntry:
        entry = history.get(owner(request), entry_id) if entry_id and owner(request) else None
        if entry is None:
            raise refusal("choose an entry in the history first")
        return entry

    def fill(entry_id: str | None, request: gr.Request):
        """Open in the editor: a speed or LoRA no longer offered falls back to quality / none, with a
        notice."""
        entry = chosen_entry(entry_id, request)
        speed = speed_values(entry)
        try:
            check_still_offered(entry, settings)
        except ImgEditError as exc:
            gr.Warning(f"{html.escape(exc.message)}; the editor uses quality and no LoRA instead")
            speed = tuple(form_value(name, None) for name in SPEED_FIELDS)  # quality, no LoRA, strength 1
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
    entry_view = [chosen, details, outputs, download]
    refresh.click(load, None, shown, queue=False, api_visibility="private")
    tab.select(load, None, shown, queue=False, api_visibility="private")
    listing.select(pick, ids, entry_view, queue=False, api_visibility="private")
    # Queued (its own default group, never behind GPU jobs): only queued events can show fill's notice.
    reopen.click(fill, chosen, edit_inputs, api_visibility="private")
    # A re-run is an ordinary edit of the editor's; its progress and its result show here too.
    rerun.click(fill_for_rerun, chosen, edit_inputs, queue=False, api_visibility="private").success(
        edit, None, edit_outputs, inputs_kwargs=controls, concurrency_id=gpu_group, concurrency_limit=None,
        preprocess=False, show_progress_on=[edit_outputs[0], outputs], api_visibility="private"
    ).success(rerun_done, None, entry_view, queue=False, api_visibility="private").then(
        relist, None, [listing, ids], queue=False, api_visibility="private")
    rerun.click(rerun_notice, chosen, details, queue=False, api_visibility="private")
    def ask(entry_id: str | None, request: gr.Request):
        chosen_entry(entry_id, request)  # "choose an entry first" rather than a question about nothing
        return gr.update(visible=True)

    def reuse_seed(entry_id: str | None, request: gr.Request):
        entry = chosen_entry(entry_id, request)
        return entry.seed, False

    delete.click(ask, chosen, confirm_row, queue=False, api_visibility="private")
    keep.click(lambda: gr.update(visible=False), None, confirm_row, queue=False, api_visibility="private")
    def confirmed(entry_id: str | None, request: gr.Request):
        return (*delete_entry(entry_id, request), gr.update(visible=False))

    deleted = confirm.click(confirmed, chosen, [*entry_view, confirm_row], queue=False,
                            api_visibility="private")
    deleted.success(relist, None, [listing, ids], queue=False, api_visibility="private")
    listing.select(lambda: gr.update(visible=False), None, confirm_row, queue=False, api_visibility="private")
    reuse.click(reuse_seed, chosen, [controls["seed"], controls["randomize_seed"]], queue=False,
                api_visibility="private")
    return history_api
