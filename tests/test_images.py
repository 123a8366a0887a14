"""Input normalisation: what users really upload, and limits checked before full decoding."""

from __future__ import annotations

import io
import json
import math
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import picture
from PIL import ExifTags, Image

from imgedit.engine.images import open_image, peek_image
from imgedit.engine.outputs import encoded
from imgedit.errors import InputTooLarge, InvalidInput

LIMIT = 4096 * 4096


def encode(image: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kw)
    return buffer.getvalue()


def test_exif_rotation_is_applied():
    image = Image.new("RGB", (40, 20), (255, 0, 0))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 CW to display
    out = open_image(encode(image, "JPEG", exif=exif), LIMIT)
    assert out.size == (20, 40)


def test_a_peek_reads_the_size_the_decode_will_have_and_refuses_what_it_would(tmp_path):
    """gradio's validator reads inputs by their headers (peek_image): the size open_image gives (EXIF turns
    applied), the same refusals named the same way; a body cut short is left to the decode."""
    image = Image.new("RGB", (40, 20), (255, 0, 0))
    exif = Image.Exif()
    exif[0x0112] = 6
    for fmt in ("JPEG", "WEBP", "TIFF", "PNG"):
        turned = tmp_path / f"phone.{fmt.lower()}"
        turned.write_bytes(encode(image, fmt, exif=exif))
        assert peek_image(turned, LIMIT, "phone").size == open_image(turned, LIMIT).size == (20, 40), fmt
    # an orientation in XMP only (exif_transpose reads it through getexif()), and a broken EXIF block the
    # decode skips: the peek agrees with the decode and refuses neither
    xmp = (b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
           b'<rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="6"/></rdf:RDF></x:xmpmeta>')
    for name, data in (("xmp.jpg", encode(image, "JPEG", xmp=xmp)), ("xmp.webp", encode(image, "WEBP", xmp=xmp)),
                       ("broken.jpg", encode(image, "JPEG", exif=b"Exif\x00\x00not a TIFF header"))):
        (tmp_path / name).write_bytes(data)
        expected = (40, 20) if name == "broken.jpg" else (20, 40)
        assert peek_image(tmp_path / name, LIMIT, name).size == open_image(tmp_path / name, LIMIT).size == expected
    text = tmp_path / "notes.png"
    text.write_text("not a picture")
    with pytest.raises(InvalidInput, match=r"notes.png \(image 2\) is not a readable image"):
        peek_image(text, LIMIT, "notes.png (image 2)")
    big = tmp_path / "big.png"
    big.write_bytes(encode(Image.new("L", (300, 300))))
    with pytest.raises(InputTooLarge, match="big.png is 300x300 = 90,000 pixels"):
        peek_image(big, 140 * 140, "big.png")  # over 4x the limit (below it: downscaled)
    cut = tmp_path / "cut.png"
    cut.write_bytes(encode(Image.effect_noise((64, 64), 50))[:300])
    assert peek_image(cut, LIMIT, "cut.png").size == (64, 64)
    with pytest.raises(InvalidInput, match="cut.png is not a readable image"):
        open_image(cut, LIMIT, "cut.png")


def test_transparent_pixels_become_white_not_black():
    image = Image.new("RGBA", (8, 8), (0, 0, 0, 0))
    image.putpixel((0, 0), (255, 0, 0, 255))
    out = open_image(encode(image), LIMIT)
    assert out.mode == "RGB"
    assert out.getpixel((5, 5)) == (255, 255, 255) and out.getpixel((0, 0)) == (255, 0, 0)


def test_palette_with_transparency_and_la():
    pal = Image.new("P", (4, 4), 0)
    pal.putpalette([0, 0, 0, 10, 200, 10] + [0] * 762)
    pal.info["transparency"] = 0
    assert open_image(encode(pal), LIMIT).getpixel((0, 0)) == (255, 255, 255)
    la = Image.new("LA", (4, 4), (0, 0))
    assert open_image(encode(la), LIMIT).getpixel((1, 1)) == (255, 255, 255)


def test_sixteen_bit_is_scaled_not_clamped():
    ramp = (np.arange(256, dtype=np.uint32).reshape(16, 16) * 257).astype(np.uint16)
    image = Image.fromarray(ramp)
    out = np.asarray(open_image(encode(image), LIMIT))
    assert out.shape == (16, 16, 3)
    assert out.max() >= 250 and out.min() == 0
    assert len(np.unique(out[..., 0])) > 200  # a real ramp, not a clamp to 255


def test_cmyk_jpeg_converts():
    image = Image.new("CMYK", (8, 8), (0, 255, 255, 0))  # red in CMYK
    r, g, b = open_image(encode(image, "JPEG"), LIMIT).getpixel((4, 4))
    assert r > 200 and g < 60 and b < 60


def test_not_an_image_and_unsupported_formats():
    with pytest.raises(InvalidInput, match="image 2 is not a readable image"):
        open_image(b"%PDF-1.4 definitely not a picture", LIMIT, "image 2")
    with pytest.raises(InvalidInput, match="not a readable image"):
        open_image(encode(Image.new("RGB", (4, 4)), "PNG")[:40], LIMIT)  # truncated


def test_a_phone_photo_over_the_limit_is_downscaled_heic_and_avif_are_read_and_past_4x_it_is_refused(tmp_path):
    """#62: a 20 MP PNG was a 400 at MAX_INPUT_PIXELS (16.7 MP), and HEIC was not read: here at a limit of
    50,000 pixels, a 60,000-pixel input is edited at 50,000 or fewer (the aspect kept, the notice names the
    setting), a JPEG is decoded at a reduced scale, and one over 4x the limit is refused from its header."""
    from imgedit.engine.images import frame_notices, image_or_zip, peek_image
    from imgedit.engine.masks import open_mask

    for fmt in ("PNG", "JPEG", "HEIF", "AVIF"):
        data = encode(picture(600, 400), fmt)  # 240,000 pixels
        assert image_or_zip(data[:12]), fmt
        image = open_image(data, 100_000)
        assert image.size == (387, 258) and image.info["downscaled_from"] == (600, 400), (fmt, image.size)
        assert 0.6 < np.asarray(image)[..., 2].mean() / np.asarray(picture(387, 258))[..., 2].mean() < 1.4
        assert frame_notices([image]) == ["image 1 (600x400) was downscaled to 387x258 for the model "
                                          "(MAX_INPUT_PIXELS)"]
        (tmp_path / f"photo.{fmt}").write_bytes(data)
        assert peek_image(tmp_path / f"photo.{fmt}", 100_000).size == (387, 258)
    assert open_image(encode(picture(300, 200), "PNG"), 100_000).size == (300, 200)  # under it: as it is
    mask = Image.new("L", (600, 400), 0)
    mask.paste(255, (0, 0, 300, 400))  # painted on the photo as uploaded: fits the downscaled input
    assert open_mask(encode(mask), (387, 258), 100_000).size == (387, 258)
    with pytest.raises(InputTooLarge, match=r"900x600 = 540,000 pixels; the largest this server reads is 400,000 "
                                            r"\(4 x MAX_INPUT_PIXELS"):
        open_image(encode(Image.new("RGB", (900, 600))), 100_000)


def test_decompression_bomb_is_refused_without_decoding():
    data = bytearray(encode(Image.new("RGB", (1, 1))))
    ihdr = bytearray(data[12:29])
    ihdr[4:12] = struct.pack(">II", 40000, 40000)
    data[12:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)) & 0xFFFFFFFF)
    with pytest.raises(InputTooLarge, match="too large|the limit is"):
        open_image(bytes(data), LIMIT)


def test_empty_file_path_gives_a_clear_error(tmp_path):
    with pytest.raises(InvalidInput, match="could not be read"):
        open_image(str(tmp_path / "missing.png"), LIMIT)


def test_big_endian_16_bit_and_float_tiffs_are_scaled():
    ramp = (np.arange(256, dtype=np.uint32).reshape(16, 16) * 257).astype(">u2")
    ramp16 = Image.frombytes("I;16B", (16, 16), ramp.tobytes())
    data = encode(ramp16, "TIFF")
    assert Image.open(io.BytesIO(data)).mode == "I;16B"
    out = np.asarray(open_image(data, LIMIT))
    assert out.min() == 0 and out.max() == 255
    floats = Image.fromarray(np.linspace(0, 1, 256, dtype=np.float32).reshape(16, 16), mode="F")
    out = np.asarray(open_image(encode(floats, "TIFF"), LIMIT))
    assert out.min() == 0 and out.max() == 255


def test_settings_chunks_round_trip_and_junk_is_left_out(tmp_path):
    """PNG text chunks: what stamp/save_png write, read_settings gives back typed; junk is dropped."""
    from imgedit.engine.outputs import read_settings, save_png, stamp

    image = Image.new("RGB", (8, 8))
    stamp([image], {"prompt": "说 hello", "seed": "12", "num_inference_steps": "many", "true_cfg_scale": "4.5",
                    "width": "8", "height": "8", "software": "imgedit 0.1.0", "lora": "none"})
    save_png(image, tmp_path / "ours.png")
    assert read_settings(tmp_path / "ours.png") == {"prompt": "说 hello", "seed": 12, "true_cfg_scale": 4.5,
                                                    "width": 8, "height": 8}
    other = Image.new("RGB", (8, 8))
    stamp([other], {"prompt": "x", "software": "another app"})
    save_png(other, tmp_path / "theirs.png")
    (tmp_path / "text.png").write_text("not an image")
    assert read_settings(tmp_path / "theirs.png") == {} and read_settings(tmp_path / "text.png") == {}


def test_restore_offers_only_what_a_request_could_carry_and_skips_bulky_chunks(tmp_path):
    """#27 item 12: a seed over 2**64 (it once broke the upload event), a NaN CFG, an out-of-range size
    are not offered; 2,000 text chunks, a 3 MB zTXt or an over-long chunk make the PNG not ours."""
    from PIL import PngImagePlugin

    from imgedit.config.settings import load_settings
    from imgedit.engine.outputs import read_settings, save_png, stamp
    from imgedit.web.page.tools import PageTools

    ours = {"software": "imgedit 0.1.0", "prompt": "<b>make it red</b>", "seed": str(2**64 + 5),
            "true_cfg_scale": "nan", "num_inference_steps": "8", "width": "99999", "height": "512"}
    image = Image.new("RGB", (8, 8))
    stamp([image], ours)
    save_png(image, tmp_path / "odd.png")
    stored = read_settings(tmp_path / "odd.png")
    assert stored["seed"] == 2**64 + 5 and math.isnan(stored["true_cfg_scale"])  # parsed, not yet trusted
    tools = PageTools(load_settings({}), "plus")
    assert tools.restorable(stored) == {"prompt": "<b>make it red</b>", "num_inference_steps": 8, "height": 512}

    def png_with(add) -> Path:
        info = PngImagePlugin.PngInfo()
        info.add_text("software", "imgedit 0.1.0")
        info.add_text("prompt", "x")
        add(info)
        path = tmp_path / f"bulky-{len(list(tmp_path.iterdir()))}.png"
        Image.new("RGB", (8, 8)).save(path, pnginfo=info)
        return path

    assert read_settings(png_with(lambda info: None)) == {"prompt": "x"}
    many = png_with(lambda info: [info.add_text(f"k{n}", "v") for n in range(2000)])
    zipped = png_with(lambda info: info.add_text("junk", "a" * 3_000_000, zip=True))
    long = png_with(lambda info: info.add_text("negative_prompt", "b" * 20_000))
    squeezed = png_with(lambda info: info.add_itxt("note", "c" * 1000, zip=True))
    assert [read_settings(p) for p in (many, zipped, long, squeezed)] == [{}, {}, {}, {}]



def test_an_input_with_several_frames_is_noted_and_its_first_frame_kept():
    from imgedit.engine.images import frame_notices

    frames = [Image.new("RGB", (40, 30), color) for color in ((255, 0, 0), (0, 0, 255))]
    gif, png = io.BytesIO(), io.BytesIO()
    frames[0].save(gif, format="GIF", save_all=True, append_images=frames[1:], duration=100)
    frames[1].save(png, format="PNG")
    first, still = open_image(gif.getvalue(), 10_000), open_image(png.getvalue(), 10_000)
    assert first.getpixel((5, 5))[0] > 200 and first.info["frames"] == 2
    assert frame_notices([still, first]) == [
        "image 2 has 2 frames (animated or multi-page): only its first frame was edited"]


@pytest.mark.parametrize("output_format", ["png", "jpeg", "webp"])
@pytest.mark.parametrize("mode", ["RGB", "RGBA", "P", "L"])
def test_a_reply_in_each_format_reads_back_with_its_settings(output_format, mode):
    """REST's output_format: the file is the format asked for, the picture survives (lossy within a few levels
    at quality 95), and the settings come back exactly, a non-Latin prompt included."""
    y, x = np.mgrid[0:64, 0:64]
    source = Image.fromarray(np.stack([x * 4, y * 4, 255 - (x + y) * 2], -1).astype(np.uint8))
    image = source.convert(mode, palette=Image.Palette.ADAPTIVE) if mode == "P" else source.convert(mode)
    image.info.update(prompt="mach den Himmel 赤", seed="42")
    data = encoded(image, output_format, 95)
    back = Image.open(io.BytesIO(data))
    assert back.format == output_format.upper() and back.size == (64, 64)
    want = np.asarray(image.convert("RGB"), dtype=np.float64)
    tolerance = {"png": 0.01, "jpeg": 5, "webp": 5}[output_format]  # PNG exact, the others lossy
    assert np.abs(np.asarray(back.convert("RGB"), dtype=np.float64) - want).mean() < tolerance
    if output_format == "png":
        settings = dict(back.text)
    else:
        comment = back.getexif().get_ifd(ExifTags.IFD.Exif)[ExifTags.Base.UserComment]
        settings = json.loads(comment.removeprefix(b"ASCII\0\0\0"))
    assert settings == {"prompt": "mach den Himmel 赤", "seed": "42"}
