"""Edit masks as users send them, turned into one form: an 8-bit greyscale image the size of the first
input, 255 where the edit may change pixels and 0 where the input's pixels are kept.

Two conventions are read (docs/features.md says which is which):
- OpenAI's (`images.edit(mask=...)`): a PNG with an alpha channel; fully transparent pixels mark the
  area to edit, everything else is kept.
- A plain black-and-white image (no transparency): white marks the area to edit, black keeps.
The page's brush layer is sent in the second form. Server side, no torch.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageOps

# mask_digest: re-exported
from imgedit.engine.images import FORMATS, _check_pixels  # noqa: F401
from imgedit.engine.outputs import mask_digest  # noqa: F401
from imgedit.errors import InputTooLarge, InvalidInput

DEFAULT_FEATHER = 8  # mask_feather's (its bounds and mask_grow's: imgedit.protocol.PARAMETERS)


def mask_from(source: Image.Image, image_size: tuple[int, int]) -> Image.Image:
    """The edit mask ("L", 255 = edit) from an uploaded mask image; refuses a mask of another size
    than the first input image, one that marks nothing, and one that marks everything."""
    source = ImageOps.exif_transpose(source)
    if _downscaled_to(source.size, image_size):  # drawn on a photo that was downscaled for the model
        source = source.resize(image_size, Image.Resampling.NEAREST)
    check_mask_size(source.size, image_size)
    if _has_alpha(source):
        alpha = np.asarray(source.convert("RGBA"))[:, :, 3]
        edit = alpha == 0  # OpenAI: fully transparent = edit here
        if not edit.any():
            raise InvalidInput("the mask has no fully transparent pixel: with a transparent PNG "
                               "(OpenAI's way) the transparent area is edited; or send black and white, "
                               "white = edit", "mask")
    else:
        edit = np.asarray(source.convert("L")) >= 128  # white = edit
        if not edit.any():
            raise InvalidInput("the mask marks nothing to edit: white (or, in a transparent PNG, fully "
                               "transparent) pixels mark the area to change", "mask")
    if edit.all():
        raise InvalidInput("the mask marks the whole image: leave the mask out for an ordinary edit", "mask")
    return Image.fromarray(np.where(edit, 255, 0).astype(np.uint8), mode="L")


def _downscaled_to(mask_size: tuple[int, int], image_size: tuple[int, int]) -> bool:
    """Whether a mask of `mask_size` fits an input that was that size before images.working_size scaled it
    down to `image_size` (the same aspect, each side rounded down)."""
    (mw, mh), (iw, ih) = mask_size, image_size
    if mw <= iw or mh <= ih:
        return False
    scale = (iw * ih / (mw * mh)) ** 0.5
    return abs(mw * scale - iw) <= 1.5 and abs(mh * scale - ih) <= 1.5


def check_mask_size(mask_size: tuple[int, int], image_size: tuple[int, int]) -> None:
    if tuple(mask_size) != tuple(image_size):
        raise InvalidInput(f"the mask is {mask_size[0]}x{mask_size[1]} but the first image is "
                           f"{image_size[0]}x{image_size[1]}: the mask must be the same size", "mask")


def _has_alpha(image: Image.Image) -> bool:
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        return True
    return image.mode == "P" and "transparency" in image.info


def open_mask(raw: bytes, image_size: tuple[int, int], max_pixels: int) -> Image.Image:
    """Decode an uploaded mask file (any format open_image reads) and turn it into the edit mask."""
    try:
        image = Image.open(io.BytesIO(raw), formats=FORMATS)
        _check_pixels(image.size, max_pixels, "mask")  # header only: nothing decoded yet
        image.load()
    except (InvalidInput, InputTooLarge) as exc:
        raise type(exc)(exc.message, "mask") from None
    except Image.DecompressionBombError:  # Pillow refuses past ~179 MP before our own header check can
        raise InputTooLarge(f"the mask is too large to decode safely (limit {max_pixels:,} pixels, "
                            "MAX_INPUT_PIXELS)", "mask") from None
    except Exception:
        raise InvalidInput("the mask is not a readable image: send a PNG the size of the first image",
                           "mask") from None
    return mask_from(image, image_size)
