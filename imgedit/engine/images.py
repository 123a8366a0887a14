"""Turn uploaded files into clean RGB images, checking limits before decoding in full.

Handles what users really upload: EXIF-rotated phone photos (HEIC and AVIF too; a 24-50 MP photo is
downscaled to MAX_INPUT_PIXELS for the model, which works near 1 MP anyway), transparent PNGs (composited on
white, not turned black), 16-bit PNG/TIFF (scaled, not clamped), CMYK JPEGs and palette images.
"""

from __future__ import annotations

import io
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import ExifTags, Image, ImageOps, features

from imgedit.errors import InputTooLarge, InvalidInput

FORMATS = ("PNG", "JPEG", "WEBP", "BMP", "GIF", "TIFF")
try:  # iPhones' HEIC (pillow-heif, requirements.txt); AVIF where Pillow was built with it (its wheels are)
    from pillow_heif import register_heif_opener

    register_heif_opener()
    FORMATS += ("HEIF",)
except ImportError:
    pass
if features.check("avif"):
    FORMATS += ("AVIF",)
# An input over MAX_INPUT_PIXELS is downscaled to it; one over READ_FACTOR times that (67 MP by default: a
# 50 MP phone photo is read) is refused from its header, as is anything over Pillow's own bomb limit.
READ_FACTOR = 4


# The first bytes of each format in FORMATS, and of a zip (the Batch tab takes a zip of images).
_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"BM", b"GIF87a", b"GIF89a", b"II*\x00", b"MM\x00*",
          b"PK\x03\x04")
# HEIC and AVIF: an ISO media file ("ftyp" at byte 4) of one of these brands
_HEIF_BRANDS = (b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis", b"mif1", b"msf1", b"avif", b"avis")


def image_or_zip(head: bytes) -> bool:
    """Whether a file's first 12 bytes start an image this app reads (FORMATS) or a zip."""
    return (head.startswith(_MAGIC) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP")
            or (head[4:8] == b"ftyp" and head[8:12] in _HEIF_BRANDS))


def working_size(size: tuple[int, int], max_pixels: int) -> tuple[int, int]:
    """The size an input of `size` is edited at: its own, or scaled down (aspect kept) to at most
    `max_pixels` (MAX_INPUT_PIXELS)."""
    width, height = size
    if width * height <= max_pixels:
        return width, height
    scale = (max_pixels / (width * height)) ** 0.5
    return max(1, int(width * scale)), max(1, int(height * scale))


def _downscaled(image: Image.Image, max_pixels: int) -> Image.Image:
    """`image` at its working_size; one that was larger notes its own size in info["downscaled_from"]."""
    size = working_size(image.size, max_pixels)
    if size == image.size:
        return image
    original = image.size
    image = image.resize(size, Image.Resampling.LANCZOS, reducing_gap=3.0)
    image.info["downscaled_from"] = original
    return image


@contextmanager
def _reading(label: str, max_pixels: int):
    """Pillow's many failures as our messages, naming the input (`label`)."""
    try:
        yield
    except (InvalidInput, InputTooLarge):
        raise
    except Image.DecompressionBombError:
        limit = _read_limit(max_pixels)
        raise InputTooLarge(f"{label} is too large to decode safely (limit {limit:,} pixels: "
                            f"{READ_FACTOR} x MAX_INPUT_PIXELS)") from None
    except FileNotFoundError:
        raise InvalidInput(f"{label} could not be read") from None
    except Exception:  # truncated, corrupt or exotic files: Pillow raises many kinds
        raise InvalidInput(f"{label} is not a readable image (allowed: {', '.join(FORMATS)})") from None


def open_image(source: str | Path | bytes | Image.Image, max_pixels: int, label: str = "image",
               alpha: bool = False) -> Image.Image:
    """Decode one input to an RGB image (RGBA if it has transparency and `alpha`: a model that takes it,
    planning.families), or raise InvalidInput / InputTooLarge naming `label`."""
    with _reading(label, max_pixels):
        if isinstance(source, Image.Image):
            image = source
            _check_pixels(image.size, max_pixels, label)
        else:
            fp = io.BytesIO(source) if isinstance(source, bytes) else source
            image = Image.open(fp, formats=FORMATS)
            _check_pixels(image.size, max_pixels, label)  # header only: nothing decoded yet
            if image.format == "JPEG":  # a large photo decoded at 1/2, 1/4 or 1/8 of its size where enough
                image.draft(image.mode, working_size(image.size, max_pixels))
            image.load()
        frames = getattr(image, "n_frames", 1)
        image = _downscaled(to_rgb(image, alpha), max_pixels)
        if frames > 1:  # an animated GIF/WebP/PNG or a multi-page TIFF: its first frame is what gets edited
            image.info["frames"] = frames
        return image


@dataclass(frozen=True)
class Peeked:
    """An input known by its header alone (`peek_image`): its size as the edit will see it."""

    size: tuple[int, int]
    frames: int = 1


def peek_image(path: str | Path | bytes, max_pixels: int, label: str = "image") -> Peeked:
    """An input's size from its header, checked as open_image checks it (a format we read, within
    `max_pixels`) but not decoded: for checks before a job queues (gradio's validator), which need sizes
    only. A truncated or corrupt body is found when the job decodes it (open_image), with the same message."""
    source = io.BytesIO(path) if isinstance(path, bytes) else path
    with _reading(label, max_pixels), Image.open(source, formats=FORMATS) as image:
        _check_pixels(image.size, max_pixels, label)
        width, height = image.size
        if _orientation(image) in (5, 6, 7, 8):  # exif_transpose turns these a quarter
            width, height = height, width
        return Peeked(working_size((width, height), max_pixels), _frames(image))


def _frames(image: Image.Image) -> int:
    try:
        return int(getattr(image, "n_frames", 1))
    except Exception:  # a broken later frame: the decode keeps the first one
        return 1


class Encoded:
    """An input as its compressed bytes, its header checked (`peek_image`): what a request carries while it
    waits in line. Ten 4096x4096 PNGs of 75 KB are 750 KB here and 480 MB decoded; sixteen such requests
    waiting held 6.6 GB before (issue 63). The manager decodes them (`decoded`) once the job has a worker,
    just before it is sent, and the pixels go when the job ends."""

    __slots__ = ("data", "size", "info", "label", "max_pixels", "alpha")

    def __init__(self, data: bytes, max_pixels: int, label: str = "image", alpha: bool = False):
        peeked = peek_image(data, max_pixels, label)
        self.data, self.size, self.label = data, peeked.size, label
        self.max_pixels, self.alpha = max_pixels, alpha
        self.info = {"frames": peeked.frames} if peeked.frames > 1 else {}  # as open_image's `info` says

    def decode(self) -> Image.Image:
        return open_image(self.data, self.max_pixels, self.label, self.alpha)


def encoded_image(source: str | Path | bytes, max_pixels: int, label: str = "image",
                  alpha: bool = False) -> Encoded:
    """`open_image`'s checks on the header, the pixels left compressed until the job runs (`Encoded`)."""
    with _reading(label, max_pixels):
        data = source if isinstance(source, bytes) else Path(source).read_bytes()
    return Encoded(data, max_pixels, label, alpha)


def decoded(picture) -> Image.Image:
    """A request's input as pixels: an `Encoded` one decoded now, a PIL image as it is."""
    return picture.decode() if isinstance(picture, Encoded) else picture


# Where a PNG keeps an orientation getexif() reads (EXIF, ImageMagick's raw profile, XMP)
PNG_ORIENTATION_KEYS = ("exif", "Raw profile type exif", "xmp", "XML:com.adobe.xmp")


def _orientation(image: Image.Image) -> int:
    """The orientation exif_transpose will apply, read as it reads it (getexif(): EXIF and XMP) from the
    header; a broken EXIF block counts as none, as the decode skips it. A PNG is asked only when it carries
    one of PNG_ORIENTATION_KEYS: getexif() decodes a PNG to look for an eXIf chunk after its pixels."""
    if image.format == "TIFF":
        return 1  # Pillow's TIFF reader gives the turned size already (tests/test_images.py checks it)
    if image.format == "PNG" and not any(key in image.info for key in PNG_ORIENTATION_KEYS):
        return 1
    try:
        return int(image.getexif().get(ExifTags.Base.Orientation, 1))
    except Exception:  # a broken EXIF block: the decode's exif_transpose leaves the image as it is
        return 1


def image_label(number: int, name: str | None = None) -> str:
    """How a message names an input: the file's own name as the user sent it, and its place among the inputs
    ("notanimage.png (image 2)"); the place alone when no name came with it."""
    name = " ".join(os.path.basename(str(name or "")).split())[:80]
    return f"{name} (image {number})" if name else f"image {number}"


def frame_notices(images) -> list[str]:
    """What the user should know about the inputs as read: several frames (open_image keeps their first), or
    downscaled to MAX_INPUT_PIXELS."""
    notices = []
    for i, image in enumerate(images, 1):
        info = getattr(image, "info", {})
        if info.get("frames", 1) > 1:
            notices.append(f"image {i} has {info['frames']} frames (animated or multi-page): "
                           "only its first frame was edited")
        if original := info.get("downscaled_from"):
            notices.append(f"image {i} ({original[0]}x{original[1]}) was downscaled to "
                           f"{image.size[0]}x{image.size[1]} for the model (MAX_INPUT_PIXELS)")
    return notices


def _read_limit(max_pixels: int) -> int:
    """The most pixels an input may have to be read at all (it is then downscaled to `max_pixels`)."""
    return min(READ_FACTOR * max_pixels, 2 * (Image.MAX_IMAGE_PIXELS or 89_478_485))


def _check_pixels(size: tuple[int, int], max_pixels: int, label: str) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise InvalidInput(f"{label} is empty ({width}x{height})")
    if width * height > _read_limit(max_pixels):
        raise InputTooLarge(
            f"{label} is {width}x{height} = {width * height:,} pixels; the largest this server reads is "
            f"{_read_limit(max_pixels):,} ({READ_FACTOR} x MAX_INPUT_PIXELS; larger inputs up to that are "
            f"downscaled to MAX_INPUT_PIXELS, {max_pixels:,} pixels)")


def _grey_to_8bit(image: Image.Image) -> Image.Image:
    """16-bit, 32-bit and float greyscale to 8-bit by scaling (convert("L") would clamp at 255)."""
    values = np.asarray(image, dtype=np.float64)
    if image.mode == "F":
        top = 1.0 if np.nanmax(values, initial=0.0) <= 1.0 else 255.0
    else:
        top = 65535.0 if image.mode.startswith("I;16") or values.max(initial=0) > 255 else 255.0
    scaled = np.clip(np.nan_to_num(values) / top * 255.0, 0, 255).round().astype(np.uint8)
    return Image.fromarray(scaled, mode="L")


def to_rgb(image: Image.Image, alpha: bool = False) -> Image.Image:
    """EXIF rotation, then 8-bit RGB: alpha on white (kept as RGBA with `alpha`), 16-bit scaled, CMYK and
    palette converted."""
    image = ImageOps.exif_transpose(image)
    if image.mode.startswith("I") or image.mode == "F":
        image = _grey_to_8bit(image)
    if image.mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    if image.mode in ("LA", "La", "PA"):
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "RGBa") and alpha:
        return image.convert("RGBA")
    if image.mode in ("RGBA", "RGBa"):
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, image.convert("RGBA"))
    return image.convert("RGB") if image.mode != "RGB" else image
