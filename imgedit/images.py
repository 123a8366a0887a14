"""Turn uploaded files into clean RGB images, checking limits before decoding in full.

Handles what users really upload: EXIF-rotated phone photos, transparent PNGs (composited on white,
not turned black), 16-bit PNG/TIFF (scaled, not clamped), CMYK JPEGs and palette images.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from imgedit.errors import InputTooLarge, InvalidInput

FORMATS = ("PNG", "JPEG", "WEBP", "BMP", "GIF", "TIFF")


def open_image(source: str | Path | bytes | Image.Image, max_pixels: int, label: str = "image") -> Image.Image:
    """Decode one input to an RGB image, or raise InvalidInput / InputTooLarge naming `label`."""
    try:
        if isinstance(source, Image.Image):
            image = source
            _check_pixels(image.size, max_pixels, label)
        else:
            fp = io.BytesIO(source) if isinstance(source, bytes) else source
            image = Image.open(fp, formats=FORMATS)
            _check_pixels(image.size, max_pixels, label)  # header only: nothing decoded yet
            image.load()
        return to_rgb(image)
    except (InvalidInput, InputTooLarge):
        raise
    except Image.DecompressionBombError:
        raise InputTooLarge(f"{label} is too large to decode safely (limit {max_pixels:,} pixels)") from None
    except FileNotFoundError:
        raise InvalidInput(f"{label} could not be read") from None
    except Exception:  # truncated, corrupt or exotic files: Pillow raises many kinds
        raise InvalidInput(f"{label} is not a readable image (allowed: {', '.join(FORMATS)})") from None


def _check_pixels(size: tuple[int, int], max_pixels: int, label: str) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise InvalidInput(f"{label} is empty ({width}x{height})")
    if width * height > max_pixels:
        raise InputTooLarge(
            f"{label} is {width}x{height} = {width * height:,} pixels; the limit is {max_pixels:,} pixels")


def _grey_to_8bit(image: Image.Image) -> Image.Image:
    """16-bit, 32-bit and float greyscale to 8-bit by scaling (convert("L") would clamp at 255)."""
    values = np.asarray(image, dtype=np.float64)
    if image.mode == "F":
        top = 1.0 if np.nanmax(values, initial=0.0) <= 1.0 else 255.0
    else:
        top = 65535.0 if image.mode.startswith("I;16") or values.max(initial=0) > 255 else 255.0
    scaled = np.clip(np.nan_to_num(values) / top * 255.0, 0, 255).round().astype(np.uint8)
    return Image.fromarray(scaled, mode="L")


def to_rgb(image: Image.Image) -> Image.Image:
    """EXIF rotation, then 8-bit RGB: alpha on white, 16-bit scaled, CMYK and palette converted."""
    image = ImageOps.exif_transpose(image)
    if image.mode.startswith("I") or image.mode == "F":
        image = _grey_to_8bit(image)
    if image.mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    if image.mode in ("LA", "La", "PA"):
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "RGBa"):
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, image.convert("RGBA"))
    return image.convert("RGB") if image.mode != "RGB" else image
