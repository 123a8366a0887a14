"""Turn uploaded files into clean RGB images, checking limits before decoding in full.

Handles what users really upload: EXIF-rotated phone photos, transparent PNGs (composited on white,
not turned black), 16-bit PNG/TIFF (scaled, not clamped), CMYK JPEGs and palette images.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path

from PIL import Image, ImageOps, UnidentifiedImageError

from imgedit.errors import InputTooLarge, InvalidInput

FORMATS = ("PNG", "JPEG", "WEBP", "BMP", "GIF", "TIFF")


def open_image(source: str | Path | bytes | Image.Image, max_pixels: int, label: str = "image") -> Image.Image:
    """Decode one input to an RGB image, or raise InvalidInput / InputTooLarge naming `label`."""
    if isinstance(source, Image.Image):
        image = source
        _check_pixels(image.size, max_pixels, label)
    else:
        fp = io.BytesIO(source) if isinstance(source, bytes) else source
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                image = Image.open(fp, formats=FORMATS)
                _check_pixels(image.size, max_pixels, label)  # header only: nothing decoded yet
                image.load()
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise InputTooLarge(f"{label} is too large to decode safely (limit {max_pixels:,} pixels)") from None
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
            if isinstance(exc, FileNotFoundError):
                raise InvalidInput(f"{label} could not be read") from None
            raise InvalidInput(f"{label} is not a readable image (allowed: {', '.join(FORMATS)})") from None
    return to_rgb(image)


def _check_pixels(size: tuple[int, int], max_pixels: int, label: str) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise InvalidInput(f"{label} is empty ({width}x{height})")
    if width * height > max_pixels:
        raise InputTooLarge(
            f"{label} is {width}x{height} = {width * height:,} pixels; the limit is {max_pixels:,} pixels")


def to_rgb(image: Image.Image) -> Image.Image:
    """EXIF rotation, then 8-bit RGB: alpha on white, 16-bit scaled, CMYK and palette converted."""
    image = ImageOps.exif_transpose(image)
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        # 16-bit greyscale: scale 0..65535 to 0..255 (convert("L") would clamp at 255).
        image = image.point(lambda v: v / 257).convert("L")
    elif image.mode == "F":
        image = image.point(lambda v: v * 255 if v <= 1.0 else v).convert("L")
    if image.mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    if image.mode in ("LA", "La", "PA"):
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "RGBa"):
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, image.convert("RGBA"))
    return image.convert("RGB") if image.mode != "RGB" else image
