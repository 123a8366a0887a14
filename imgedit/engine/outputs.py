"""A result's files: the settings that made each image, carried in the PNGs we return (tEXt chunks) and in a
JPEG's or WebP's EXIF; the reply's encodings; and the settings read back from a PNG a user uploads (the page's
"Restore", History's re-run). The inputs' side (decoding uploads) is imgedit.engine.images.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

from PIL import ExifTags, Image, PngImagePlugin

from imgedit import __version__
from imgedit.engine.images import to_rgb
from imgedit.protocol import as_declared, parameters

# ---- settings carried in the PNGs we return (tEXt chunks) ----
# Key names are the API's parameter names, so a stored PNG reads like the call that made it.
KIND_TYPES = {"text": str, "whole": int, "number": float}


def restorable() -> dict[str, type]:
    """The declared parameters a PNG's settings give back to the form (protocol.PARAMETERS' `restore`), each
    with its type."""
    return {p.name: KIND_TYPES[p.kind] for p in parameters() if p.restore and p.kind in KIND_TYPES}


MAX_CHUNK = 4000  # validation.MAX_PROMPT_CHARS: a longer value is not one of ours


def settings_text(req, params, model: str, size: tuple[int, int], rewritten: str | None = None,
                  weights: str | None = None) -> dict[str, str]:
    """What produced an image, as text: each parameter declared `png` (`declared_text`), the output size (a
    masked edit's: the size it ran at), the model, the LoRAs and step cache the job ran with. `rewritten`: the
    enhanced prompt the edit used; then `prompt` is that one and `original_prompt` the user's. `weights`: the
    lossy copy of the transformer a fast job ran on (FAST_QUANTIZE), recorded as `weights`."""

    text = {**declared_text(req, params), "width": str(size[0]), "height": str(size[1]), "model": model,
            "software": f"imgedit {__version__}"}
    # As the job ran, where that is not what the request says: the LoRAs (a speed preset's Lightning LoRA
    # included; "none" for none) and the step cache (a Lightning or Turbo job runs none, whatever it asked
    # for: the asked one is dropped; lossy, so the PNG says which one made it).
    adapters = getattr(params, "adapters", ())
    text.pop("lora_scale", None)
    text["lora"] = ",".join(name for name, _ in adapters) or "none"
    if adapters:
        text["lora_scale"] = ",".join(f"{scale:g}" for _, scale in adapters)
    text.pop("cache", None)
    if getattr(params, "cache", "none") != "none":
        text["cache"] = params.cache
        if params.cache == "first-block":
            text["cache"] = f"first-block:{params.cache_threshold:g}"
    if rewritten is not None:
        text.update(prompt=rewritten, original_prompt=req.prompt)
    if weights:  # lossy: a server without FAST_QUANTIZE makes a slightly different image from these settings
        text["weights"] = weights
    # A masked edit comes back the first image's size but runs at the resolved size: width and height are the
    # file's own, `run_size` the size to ask for again (read_settings restores it into the form: the edit
    # repeats). Older PNGs wrote the run's size as width and height.
    masked = req.mask is not None and getattr(params, "width", None)
    if masked and (params.width, params.height) != tuple(size):
        text["run_size"] = f"{params.width}x{params.height}"
    if req.mask is not None:  # which mask (its hash; how it was applied: its settings, declared beside it)
        text["mask"] = f"sha256:{mask_digest(req.mask)}"
    return text


def declared_text(req, params) -> dict[str, str]:
    """The parameters declared `png` but files, by their names: a number as the pipeline got it (`params`, a
    `Resolved`, by its declared or `resolved` name), anything else as asked for (`req`, an EditRequest:
    its attribute or its `options`); written where set (not None, not empty; one declared `always`
    whatever it is), one declared `beside` another (a mask's settings) only with it."""
    shown = [p for p in parameters() if p.png and p.kind != "file"
             and (p.beside is None or req.value(p.beside) is not None)]
    ran = as_declared(params, [p for p in shown if p.kind in ("whole", "number")])
    text = {}
    for p in shown:
        value = ran[p.name] if p.name in ran else req.value(p.name)
        if p.always or value not in (None, ""):
            text[p.name] = "" if value is None else _as_text(value)
    return text


def _as_text(value) -> str:
    """A setting as its PNG text: 4 not 4.0, 2.5 as it is."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def mask_digest(mask: Image.Image) -> str:
    """A short hash of an edit mask (imgedit.engine.masks), for the PNG's settings: the same mask, the
    same text."""
    return hashlib.sha256(mask.tobytes()).hexdigest()[:16]


def stamp_result(result, req, params, model: str) -> None:
    """Each image of an edit's result carries its settings, and its own seed (Resolved.image_seeds)."""
    text = settings_text(req, params, model, (result.width, result.height), result.prompt, result.weights)
    for image, seed in zip(result.images, params.image_seeds, strict=True):
        stamp([image], {**text, "seed": str(seed)})


def stamp(images: list[Image.Image], text: dict[str, str]) -> None:
    """Attach the settings to each image's `info`: `png_bytes` writes every text entry as a tEXt/iTXt chunk,
    `encoded` as JSON in a JPEG's or WebP's EXIF (Gradio's own PNG encoder copies them too)."""
    for image in images:
        image.info.update(text)


def stamped_text(image: Image.Image) -> dict[str, str]:
    """The settings `stamp` attached (the text entries of the image's `info`)."""
    return {key: value for key, value in image.info.items()
            if isinstance(key, str) and isinstance(value, str)}


def png_info(image: Image.Image) -> PngImagePlugin.PngInfo:
    info = PngImagePlugin.PngInfo()
    for key, value in stamped_text(image).items():
        info.add_text(key, value)  # Pillow writes iTXt for non-Latin-1 text (prompts in any language)
    return info


def save_png(image: Image.Image, target, compress_level: int = 1) -> None:
    """Save as PNG with the settings attached by `stamp` (a path or a binary file object)."""
    image.save(target, format="PNG", compress_level=compress_level, pnginfo=png_info(image))


def png_bytes(image: Image.Image, compress_level: int = 1) -> bytes:
    buffer = io.BytesIO()
    save_png(image, buffer, compress_level)
    return buffer.getvalue()


# OpenAI's output_format values, as file names end
SUFFIXES = {"png": ".png", "jpeg": ".jpg", "webp": ".webp"}
REPLY_FORMATS = tuple(SUFFIXES)


def encoded(image: Image.Image, output_format: str = "png", quality: int = 100) -> bytes:
    """The image as PNG (lossless, zlib level 1), JPEG or WebP (lossy, `quality` 0-100), with the settings
    `stamp` attached: PNG text chunks, or for JPEG and WebP one JSON object in the EXIF UserComment.

    A 1024x1024 result on the 2-core CPU machine: PNG 0.14-0.17 s for a noisy image (docs/BENCHMARKS.md),
    JPEG 5-19 ms. JPEG keeps full-resolution colour (4:4:4) from quality 90 up and halves it below, as
    photo tools do; WebP uses libwebp's fastest method (0): 1.6-4.8x faster than its default 4, as small at
    quality 90."""
    if output_format == "png":
        return png_bytes(image)
    options: dict = {"quality": quality, "exif": settings_exif(image)}
    if output_format == "jpeg":
        options["subsampling"] = "4:4:4" if quality >= 90 else "4:2:0"
    elif output_format == "webp":
        options["method"] = 0
    else:
        raise ValueError(f"unknown output format {output_format!r}")
    if output_format == "jpeg" and image.mode not in ("RGB", "L"):  # no alpha or palette in JPEG
        image = to_rgb(image)  # a transparent result (Qwen-Image-2.1) on white
    buffer = io.BytesIO()
    image.save(buffer, format=output_format.upper(), **options)
    return buffer.getvalue()


def reencoded(path, output_format: str, quality: int = 100) -> bytes:
    """A stored PNG result in `output_format` (`encoded`), its settings text carried over."""
    with Image.open(path) as image:
        image.load()
        return encoded(image, output_format, quality)


# bytes; today's prompt limits (4,000 characters, 1,024 tokens) stay near 51 KB at worst
MAX_EXIF_COMMENT = 60_000


def settings_exif(image: Image.Image) -> bytes:
    """EXIF carrying the image's settings (its `info` text) as JSON in the UserComment, in the EXIF "ASCII"
    character code: non-ASCII prompts are JSON escapes, so every EXIF reader shows the text and every JSON
    reader gets the prompt back exactly."""
    exif = Image.Exif()
    text = stamped_text(image)
    comment = json.dumps(text, ensure_ascii=True, separators=(",", ":")).encode("ascii")
    # a JPEG's EXIF must fit one 64 KiB segment: the prompts give way first
    if len(comment) > MAX_EXIF_COMMENT:
        prompts = ("prompt", "negative_prompt", "original_prompt")
        text = {key: value for key, value in text.items() if key not in prompts}
        text["prompt_left_out"] = "too long for EXIF"
        comment = json.dumps(text, ensure_ascii=True, separators=(",", ":")).encode("ascii")
    if text:
        exif.get_ifd(ExifTags.IFD.Exif)[ExifTags.Base.UserComment] = b"ASCII\0\0\0" + comment
    return exif.tobytes()


MAX_TEXT_CHUNKS = 32  # ours carry about a dozen
MAX_TEXT_CHUNK_BYTES = 4 * MAX_CHUNK + 256  # a prompt of MAX_CHUNK characters, as UTF-8, plus its keyword


def _plain_text_chunks(path: str | Path) -> bool:
    """Whether the PNG's text chunks look like ours before Pillow decodes any: at most MAX_TEXT_CHUNKS,
    none over MAX_TEXT_CHUNK_BYTES, none compressed (we never write zTXt or compressed iTXt; a 3 MB
    zTXt or 2,000 chunks are somebody else's, and Pillow would inflate them all)."""
    count = 0
    try:
        with open(path, "rb") as f:
            if f.read(8) != b"\x89PNG\r\n\x1a\n":
                return False
            while header := f.read(8):
                if len(header) < 8:
                    return False
                length, kind = int.from_bytes(header[:4], "big"), header[4:]
                if kind in (b"IDAT", b"IEND"):
                    return True
                if kind in (b"tEXt", b"zTXt", b"iTXt"):
                    count += 1
                    if kind == b"zTXt" or count > MAX_TEXT_CHUNKS or length > MAX_TEXT_CHUNK_BYTES:
                        return False
                    if kind == b"iTXt":
                        data = f.read(length)
                        keyword_end = data.find(b"\0")
                        if keyword_end < 0 or data[keyword_end + 1:keyword_end + 2] != b"\0":
                            return False  # compressed
                        f.seek(4, 1)  # CRC
                        continue
                f.seek(length + 4, 1)
    except OSError:
        return False
    return False


def read_settings(path: str | Path) -> dict[str, str | int | float]:
    """The restorable settings stored in a PNG we made ({} for any other file). Reads the header
    chunks only, and only when they look like ours; values that do not parse are left out, never
    trusted as given (the page also checks each as a request field: imgedit.web.page.tools)."""
    if not _plain_text_chunks(path):
        return {}
    try:
        with Image.open(path, formats=["PNG"]) as image:
            chunks = dict(image.text) if hasattr(image, "text") else {}
    except Exception:  # not a PNG, or not readable: there is nothing to restore
        return {}
    if not str(chunks.get("software", "")).startswith("imgedit"):
        return {}
    restored: dict[str, str | int | float] = {}
    for key, kind in restorable().items():
        value = chunks.get(key)
        if not isinstance(value, str) or len(value) > MAX_CHUNK:
            continue
        try:
            restored[key] = kind(value)
        except ValueError:
            continue
    run = str(chunks.get("run_size", "")).split("x")  # a masked edit's: the size it ran at repeats it
    if len(run) == 2 and all(side.isdecimal() and len(side) <= 6 for side in run) and "width" in restored:
        restored["width"], restored["height"] = int(run[0]), int(run[1])
    return restored
