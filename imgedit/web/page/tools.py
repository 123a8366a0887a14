"""The page's tools around one edit: upload checks (and a PNG's stored settings offered back), the
chosen result for use / add / download / compare, and "Copy as API call". Handlers run with
preprocess=False, so every value is raw event data: parsed here, problems raised as our own gr.Error.
"""

from __future__ import annotations

import html
import logging
import os
import secrets
from dataclasses import replace
from pathlib import Path

import gradio as gr
from gradio.processing_utils import hash_bytes
from gradio.utils import get_upload_folder
from PIL import Image, ImageOps

from imgedit.config.settings import Settings
from imgedit.engine.canvas import expanded, expanded_size, parse_expand
from imgedit.engine.images import decoded, open_image, peek_image
from imgedit.engine.outputs import png_bytes, read_settings
from imgedit.engine.prompt_tokens import MAX_PROMPT_TOKENS, PromptTokens
from imgedit.engine.validation import MAX_PROMPT_CHARS, check_params, model_defaults, output_size
from imgedit.errors import ImgEditError
from imgedit.planning.families import FAMILIES
from imgedit.protocol import EditRequest, request_kwargs
from imgedit.web.page.exports import download_copy, export_copy
from imgedit.web.page.mask_controls import painted_mask
from imgedit.web.page.snippets import (
    MASK_FILE,
    api_values,
    curl_snippet,
    gradio_snippet,
    input_files,
    openai_snippet,
)
from imgedit.web.page.speed import SERVER_CACHE, parse_cache_input, stored_cache_choice
from imgedit.web.page.uploads import gallery_paths, uploaded_paths

log = logging.getLogger(__name__)


def refusal(message: str, title: str | None = None) -> gr.Error:
    """A user's error for the page: one INFO line in the log, not the traceback Gradio prints for every
    gr.Error it catches (print_exception). The message is rendered as HTML, so pass it escaped."""
    log.info("page: refused (%s): %s", title or "error", message)
    # always titled: an untitled gr.Error of an unqueued event (History's buttons) reached its caller as the
    # generic "could not be processed" (imgedit.web.page.uploads lets only titled errors through as ours)
    return gr.Error(message, title=title or "Error", print_exception=False)


def user_error(exc: BaseException) -> gr.Error:
    """Only gr.Error text reaches users; it is rendered as HTML, so escape it."""
    if isinstance(exc, ImgEditError):
        return refusal(html.escape(exc.message), exc.kind.replace("_", " "))
    log.exception("unexpected error in the UI handler", exc_info=exc)  # ours: the traceback, once
    return gr.Error("internal error: see the server log", title="internal error", print_exception=False)


def _index(value) -> int:
    """The chosen result's index from a hidden Number's raw value (0 when it is not a whole number)."""
    try:
        return int(float(value or 0))
    except (TypeError, ValueError, OverflowError):
        return 0


class PageTools:
    def __init__(self, settings: Settings, family: str, tokens: PromptTokens | None = None,
                 cache_offered: bool = True):
        self.settings = settings
        self.cache_offered = cache_offered  # the workers can run a step cache (else the control is hidden)
        self.family = family
        self.tokens = tokens
        self.allowed = FAMILIES[family].max_images

    def prompt_count(self, text) -> str:
        """The line under the prompt box: its characters and tokens against the limits the edit checks (the
        checkpoint's own tokenizer), over a limit in bold with what to do."""
        if not isinstance(text, str) or not text:
            return ""
        chars = len(text)
        parts = [f"{chars:,} / {MAX_PROMPT_CHARS:,} characters"]
        tokens = self.tokens.count(text) if self.tokens is not None else None
        if tokens is not None:
            parts.append(f"{tokens:,} / {MAX_PROMPT_TOKENS:,} tokens")
        line = " · ".join(parts)
        if chars > MAX_PROMPT_CHARS or (tokens or 0) > MAX_PROMPT_TOKENS:
            return f"**{line}: too long for the model, shorten it**"
        return line

    def _paths(self, images) -> list[str]:
        try:
            return uploaded_paths(images)
        except Exception as exc:
            raise user_error(exc) from None

    def check_uploads(self, images):
        """At upload: unreadable files (or more than the model takes) are named and left out; a PNG
        this app made offers its settings back."""
        kept, problems = [], []
        for i, path in enumerate(self._paths(images)):
            try:
                open_image(path, self.settings.max_input_pixels, f"image {i + 1}")
                kept.append(path)
            except ImgEditError as exc:
                problems.append(exc.message)
        if len(kept) > self.allowed:
            names = ", ".join(Path(path).name for path in kept[self.allowed:])  # which ones (it did not say)
            problems.append(f"this model takes at most {self.allowed} input image(s): "
                            f"only the first {self.allowed} are kept, {names} left out")
            kept = kept[:self.allowed]
        for problem in problems:
            gr.Warning(html.escape(problem), title="left out")
        stored = next((found for path in kept if (found := self.restorable(read_settings(path)))), {})
        return kept, self._compare_first(kept), gr.update(visible=bool(stored)), stored

    def _compare_first(self, paths: list[str]):
        """Before/after before any result: the first input on both sides, as decoded (rotated, RGB), once."""
        first = open_image(paths[0], self.settings.max_input_pixels) if paths else None
        shown = cached_pngs([png_bytes(first)], "input")[0] if first else None
        return (shown, shown) if shown else None

    def first_input_compare(self, images):
        """An example's inputs in Before/after, as an upload's."""
        try:
            return self._compare_first(uploaded_paths(images))
        except Exception:  # noqa: BLE001 - the slider stays as it is; the edit names any problem
            return gr.update()

    def restorable(self, stored: dict) -> dict:
        """Only values a request could carry: each is checked as that request field (a seed over
        2**32, a NaN CFG, a size over MAX_OUTPUT_PIXELS, an over-long prompt are left out)."""
        kept = {}
        for key, value in stored.items():
            if key == "cache" and isinstance(value, str):
                # first-block:<threshold>: the server's
                value = stored_cache_choice(value, self.cache_offered)
                if value == SERVER_CACHE:
                    continue
            probe = {"prompt": "x", key: value}
            try:
                check_params(EditRequest(images=(), **request_kwargs(probe)), self.settings, self.family,
                             self.tokens)
            except Exception:  # noqa: BLE001 - ImgEditError, or a value of the wrong kind: not offered
                continue
            kept[key] = value
        return kept

    def restore_settings(self, stored, names: tuple[str, ...]):
        """The settings a result PNG carries, back into the form (seed fixed, so the edit repeats): a value
        for each of `names` (the declared parameters the form restores, protocol.PARAMETERS' `restore`), then
        Randomize seed and the Restore button."""
        if not isinstance(stored, dict) or not stored:
            raise refusal("this PNG carries no settings of this app", "nothing to restore")
        gr.Info("Restored the prompt, seed, steps, CFG, size and step cache saved in the PNG "
                "(this image's own seed: one image per prompt makes it again). The input images are not in "
                "the PNG: add the same ones.",
                title="settings restored")
        keep = gr.update()
        values = [stored.get(name, keep) for name in names]
        if "cache" in names:
            values[names.index("cache")] = stored_cache_choice(stored.get("cache"), self.cache_offered)
        return (*values, False if "seed" in stored else keep, gr.update(visible=False))

    def api_call(self, form: dict, canvas, request: gr.Request, used_seed: int | None = None):
        """Copy as API call: the form ({declared parameter: raw value}) as gradio_client, curl and OpenAI-SDK
        code, for this server's address. Each snippet repeats the page's edit: the painted mask (mask.png,
        offered with the inputs), the output size the server would make (one side given: both, from the
        last input's aspect) and, with Randomize seed ticked, `used_seed`: the chosen result's."""
        if form.get("randomize_seed") and used_seed is not None:
            form = {**form, "seed": used_seed, "randomize_seed": False}
        try:
            paths = uploaded_paths(form.get("images"))
        except Exception:  # noqa: BLE001
            # the snippets still show; the inputs are offered when they can be read
            paths = []
        # The snippets name their files input-1.png, ...: the same files under those names, to save beside
        # them.
        inputs = [export_copy([Path(path)], f"input-{k + 1}") for k, path in enumerate(paths)]
        mask = painted_mask(canvas) if canvas is not None else ""
        if mask:
            inputs.append(export_copy([Path(mask)], Path(MASK_FILE).stem))
        width, height = self._snippet_size(form.get("width"), form.get("height"), paths, form.get("expand"))
        form = {**form, "width": width, "height": height,
                "cache": self._snippet_cache(form.get("cache"), form.get("speed"))}
        # what the model does where the form leaves it to the model (the declaration's default: None)
        defaults = model_defaults(self.settings, self.family)
        generates = FAMILIES[self.family].generates
        values = api_values(form, input_files(len(paths), bool(mask), generates), defaults)
        host = request.headers.get("host", "localhost:7860")
        url = f"{request.headers.get('x-forwarded-proto', 'http')}://{host}/"
        return (gr.update(visible=True), gradio_snippet(url, values, self.settings.auth is not None),
                curl_snippet(url, values), openai_snippet(url, values), inputs or None)

    def _snippet_size(self, width, height, paths: list[str], expand=None):
        """The form's width and height as the server resolves them when one side is given (the other from the
        last input's aspect; an expanded edit's from its padded first input), so that REST's `size` (both
        sides or auto) makes what the page makes."""
        try:
            width, height = int(float(width or 0)), int(float(height or 0))
            if bool(width) == bool(height):
                return width, height
            # text to image: the model makes it square (validation.resolve); else as the form says
            if not paths:
                if FAMILIES[self.family].generates:
                    return output_size(width, height, (1, 1), self.settings, self.family)
                return width, height
            if (sides := parse_expand(expand)) is not None:  # validation.resolve: the padded first image
                first = peek_image(paths[0], self.settings.max_input_pixels).size
                return output_size(width, height, expanded_size(first, sides), self.settings, self.family)
            with Image.open(paths[-1]) as last:  # the header only
                return output_size(width, height, last.size, self.settings, self.family)
        except Exception:  # noqa: BLE001 - junk or an unreadable file: the snippet repeats the form as it is
            return width, height

    def page_cache(self, cache, speed) -> str | None:
        """The Step cache's value for the edit (None: the server's CACHE); unused where the control is
        hidden."""
        try:
            return parse_cache_input(cache, speed) if self.cache_offered else None
        except Exception as exc:
            raise user_error(exc) from None

    def _snippet_cache(self, cache, speed) -> str | None:
        """The form's Step cache for the snippets: only a choice the edit would use."""
        try:
            return self.page_cache(cache, speed)
        except gr.Error:  # junk: the snippet leaves it out, the edit itself refuses it
            return None

    def chosen_result(self, gallery, index) -> str:
        try:
            paths = gallery_paths(gallery)
        except Exception as exc:
            raise user_error(exc) from None
        if not paths:
            raise refusal("there is no result yet: run an edit first, then choose a result", "no result")
        index = _index(index)
        return paths[index if 0 <= index < len(paths) else 0]

    def preview_inputs(self, images) -> list[tuple[str, str]]:
        """The inputs as thumbnails in their own aspect, numbered as the model gets them."""
        try:
            paths = uploaded_paths(images)
        except Exception:  # noqa: BLE001
            # an unreadable value shows no thumbnails; the edit names the problem
            return []
        return [(path, f"image {i}") for i, path in enumerate(paths, 1)]

    @staticmethod
    def chosen_input(evt: gr.SelectData) -> int:
        return evt.index

    def make_first(self, images, index) -> list[str]:
        """The chosen input moves to the front (the model's first image: the one it edits)."""
        paths = self._paths(images)
        index = _index(index)
        if not 0 <= index < len(paths):
            raise refusal("choose an input image first (click its thumbnail)", "no input chosen")
        return [paths[index], *paths[:index], *paths[index + 1:]]

    @staticmethod
    def result_buttons(gallery) -> tuple:
        """"Use this result", "Add it as another input" and "Reuse its seed" act only with a result."""
        try:
            there = bool(gallery_paths(gallery))
        except Exception:  # noqa: BLE001 - an unreadable value: nothing to use
            there = False
        return gr.update(interactive=there), gr.update(interactive=there), gr.update(interactive=there)

    def result_seed(self, gallery, index) -> int | None:
        """The seed the chosen result was made from (its PNG's), None without one."""
        try:
            seed = read_settings(self.chosen_result(gallery, index)).get("seed")
        except gr.Error:
            return None
        return seed if isinstance(seed, int) else None

    def reuse_seed(self, gallery, index) -> tuple:
        """"Reuse its seed": the chosen result's seed into Seed, Randomize seed unticked."""
        seed = self.result_seed(gallery, index)
        if seed is None:
            raise refusal("there is no result yet: run an edit first", "no result")
        return seed, False

    def add_result(self, images, gallery, index) -> list[str]:
        path = self.chosen_result(gallery, index)
        paths = self._paths(images)
        if len(paths) >= self.allowed:
            raise refusal(f"this model takes at most {self.allowed} input image(s); remove one first",
                          "too many")
        return [*paths, path]

    def select_result(self, images, gallery, evt: gr.SelectData):
        """The chosen result becomes the 'after' of the comparison and the one the buttons use."""
        try:
            paths, inputs = gallery_paths(gallery), uploaded_paths(images)
            if not paths or not inputs:
                return evt.index, gr.update(), gr.update()
            after = open_image(paths[evt.index], self.settings.max_input_pixels)
            before = open_image(inputs[0], self.settings.max_input_pixels)
        except Exception as exc:
            raise user_error(exc) from None
        resized = png_bytes(before.resize(after.size, Image.Resampling.LANCZOS))
        compare = (cached_pngs([resized], "before")[0], paths[evt.index])  # "after": the gallery's own file
        return evt.index, compare, gr.update(value=download_copy(paths[evt.index]), interactive=True)

    def download_chosen(self, gallery, index):
        """The Download button serves the chosen result's PNG (its settings in its text chunks)."""
        try:
            paths = gallery_paths(gallery)
        except Exception as exc:
            raise user_error(exc) from None
        index = _index(index)
        chosen = paths[index if 0 <= index < len(paths) else 0] if paths else None
        return gr.update(value=download_copy(chosen) if chosen else None, interactive=chosen is not None)


MASK_TINT = (255, 45, 111)  # the page's mask brush colour


def compare_pair(first: Image.Image, image: Image.Image, mask: Image.Image | None = None
                 ) -> tuple[Image.Image, Image.Image]:
    """Before/after at the result's size (the slider needs two images of one size): the first input in its
    own aspect, bordered where it differs from the result's (it was squashed). After a masked edit (the
    result is then the first input's size) the "before" side shows the mask: the area that could change,
    tinted in the brush's colour."""
    before = ImageOps.pad(first.convert("RGB"), image.size, Image.Resampling.LANCZOS, color=(128, 128, 128))
    if mask is not None and mask.size == before.size:
        tint = Image.new("RGB", before.size, MASK_TINT)
        before = Image.composite(Image.blend(before, tint, 0.4), before, mask.convert("L").point(
            lambda v: 255 if v >= 128 else 0))
    return before, image


def cached_pngs(pngs: list[bytes], stem: str) -> list[str]:
    """PNG files written once into Gradio's cache, which components show as they are (a file already in the
    cache is neither copied nor hashed again). Handed a PIL image, each component writes a PNG of its own at
    zlib level 6: 0.15-0.28 s for a 1024x1024 result on the 2-core CPU machine, once for the result and again
    for the comparison (docs/BENCHMARKS.md). The folder is named by Gradio's own hash of the bytes; a file
    that is there already (the same bytes) is only touched, never rewritten while a browser may be reading
    it."""
    return [cached_png(png, f"{stem}-{i}.png") for i, png in enumerate(pngs)]


def cached_png(png: bytes, name: str) -> str:
    """One PNG written once into Gradio's cache under `name` (cached_pngs)."""
    path = Path(get_upload_folder()) / hash_bytes(png) / name
    if path.exists():
        os.utime(path)  # Gradio's cache sweep ages files by their time
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
        staging.write_bytes(png)
        os.replace(staging, path)
    return str(path.resolve())


def page_files(req: EditRequest, first: Image.Image,
               pngs: list[bytes]) -> tuple[list[str], tuple[str, str] | None]:
    """The result's files for the gallery, and the before/after pair for the slider: "after" is the gallery's
    first file (`first`, the first result, as `pngs[0]`), "before" one more PNG at zlib level 1; no pair for
    an image made from the prompt alone (nothing came before it)."""
    results = cached_pngs(pngs, "result")
    if not req.images:
        return results, None
    padded = expanded(replace(req, images=(decoded(req.images[0]),)))  # an expanded edit's canvas and mask
    before = compare_pair(padded.images[0], first, padded.mask)[0]
    return results, (cached_pngs([png_bytes(before)], "before")[0], results[0])
