"""Masked editing (#26): the edit changes only where the mask says, every other pixel is the input's,
exactly; OpenAI's transparent-means-edit mask and a black-and-white one; REST (the openai SDK),
the gradio API; the bad masks refused before anything runs.

The tiny checkpoint paints noise, so "the area inside changed" is easy to see, and "outside it did
not" is checked pixel for pixel.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
from conftest import http, picture, wait_job
from gradio_client import Client, handle_file
from PIL import Image

from imgedit.engine.masks import mask_digest, mask_from
from imgedit.errors import InvalidInput
from imgedit.protocol import EditRequest

W, H = 96, 64  # multiples of 16: the model runs at the image's own size (cheap on the CPU)


def photo() -> Image.Image:
    return picture(W, H, (40, 140, 90))


def white_left_half() -> Image.Image:
    """Black and white: white (edit) on the left 48 columns."""
    mask = Image.new("L", (W, H), 0)
    mask.paste(255, (0, 0, W // 2, H))
    return mask


def transparent_box() -> Image.Image:
    """OpenAI's way: opaque everywhere but a fully transparent box (edit) at 16..64 x 16..48."""
    mask = Image.new("RGBA", (W, H), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (16, 16, 64, 48))
    return mask


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def changed(result: Image.Image, area: np.ndarray) -> tuple[int, float]:
    """(pixels that differ from the input outside `area`, mean difference inside it)."""
    before = np.asarray(photo(), dtype=np.int16)
    after = np.asarray(result.convert("RGB"), dtype=np.int16)
    outside = np.abs(after - before)[~area]
    inside = np.abs(after - before)[area]
    return int((outside != 0).sum()), float(inside.mean())


def test_both_mask_conventions_become_one_edit_area():
    bw = np.asarray(mask_from(white_left_half(), (W, H))) == 255
    assert bw[:, : W // 2].all() and not bw[:, W // 2:].any()
    alpha = np.asarray(mask_from(transparent_box(), (W, H))) == 255
    assert alpha[16:48, 16:64].all() and alpha.sum() == 48 * 32
    # A palette PNG with a transparent index is OpenAI's kind too.
    palette = transparent_box().convert("P", palette=Image.Palette.ADAPTIVE)
    palette.info["transparency"] = palette.getpixel((20, 20))
    assert (np.asarray(mask_from(palette, (W, H))) == 255).sum() == 48 * 32


def test_only_the_masked_area_changes_and_the_png_says_which_mask(plus_manager):
    mask = mask_from(white_left_half(), (W, H))
    result = plus_manager.edit(EditRequest(images=(photo(),), prompt="make it red", mask=mask, mask_feather=4,
                                           num_inference_steps=2, width=W, height=H, seed=5))
    image = result.images[0]
    assert image.size == (W, H) == (result.width, result.height)
    outside, inside = changed(image, np.asarray(mask) == 255)
    assert outside == 0 and inside > 10, (outside, inside)
    assert image.info["mask"] == f"sha256:{mask_digest(mask)}" and image.info["mask_feather"] == "4"
    assert image.info["strength"] == "1" and image.info["mask_grow"] == "0"
    # Grown by 8 pixels: the edit reaches 8 columns further, and still not one pixel beyond.
    grown = plus_manager.edit(EditRequest(images=(photo(),), prompt="make it red", mask=mask, mask_grow=8,
                                          num_inference_steps=2, width=W, height=H, seed=5)).images[0]
    area = np.zeros((H, W), bool)
    area[:, : W // 2 + 8] = True
    outside, inside = changed(grown, area)
    assert outside == 0 and np.abs(np.asarray(grown, np.int16) - np.asarray(photo(), np.int16))[:, 50:56].mean() > 10


def test_a_masked_edit_restored_from_its_png_repeats_itself(plus_manager, tmp_path):
    """#46 item 7: the PNG of a masked edit recorded the output size (the first image's) as width and height, and
    restoring it ran the model at that size: another edit. It records the size the edit ran at."""
    from imgedit.engine.outputs import png_bytes, read_settings

    mask = mask_from(white_left_half(), (W, H))
    ask = dict(images=(photo(),), prompt="make it red", mask=mask, num_inference_steps=2, seed=5)
    first = plus_manager.edit(EditRequest(**ask, width=64, height=64)).images[0]
    assert first.size == (W, H)  # the first image's size
    (tmp_path / "result.png").write_bytes(png_bytes(first))
    stored = read_settings(tmp_path / "result.png")
    assert (stored["width"], stored["height"]) == (64, 64)  # what it ran at, as the form asks for it
    # #62: the chunks name the file's own size (they said the run's), and the run's as run_size
    chunks = Image.open(tmp_path / "result.png").text
    assert (chunks["width"], chunks["height"], chunks["run_size"]) == (str(W), str(H), "64x64"), chunks
    again = plus_manager.edit(EditRequest(**{**ask, "seed": stored["seed"]}, width=stored["width"],
                                          height=stored["height"])).images[0]
    assert np.array_equal(np.asarray(again), np.asarray(first))


def test_a_lower_strength_starts_from_the_input(plus_manager):
    mask = mask_from(white_left_half(), (W, H))
    ask = dict(images=(photo(),), prompt="make it red", mask=mask, num_inference_steps=4, width=W, height=H, seed=2)
    full = np.asarray(plus_manager.edit(EditRequest(**ask)).images[0], np.int16)
    half = np.asarray(plus_manager.edit(EditRequest(**ask, strength=0.5)).images[0], np.int16)
    before = np.asarray(photo(), np.int16)
    inside = np.asarray(mask) == 255
    assert (half[~inside] == before[~inside]).all()
    assert np.abs(half - full)[inside].mean() > 1  # a different start gives a different edit


def test_the_edit_model_masks_too_at_its_default_size(edit_manager):
    """Qwen-Image-Edit, no size asked: the model runs near 1 MP in the first image's aspect and the result
    comes back at the image's own size."""
    mask = mask_from(transparent_box(), (W, H))
    result = edit_manager.edit(EditRequest(images=(photo(),), prompt="make it red", mask=mask,
                                           num_inference_steps=2, seed=1, true_cfg_scale=1.0))
    outside, inside = changed(result.images[0], np.asarray(mask) == 255)
    assert result.images[0].size == (W, H) and outside == 0 and inside > 10


def test_openai_sdk_sends_a_mask(live_server):
    client = openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="x", max_retries=0, timeout=120)
    reply = client.images.edit(model="qwen-image-edit", image=("in.png", png_bytes(photo()), "image/png"),
                               mask=("mask.png", png_bytes(transparent_box()), "image/png"), prompt="make it red",
                               response_format="b64_json", extra_body={"num_inference_steps": 2, "seed": 3,
                                                                       "size": f"{W}x{H}"})
    image = Image.open(io.BytesIO(base64.b64decode(reply.data[0].b64_json)))
    area = np.asarray(mask_from(transparent_box(), (W, H))) == 255
    outside, inside = changed(image, area)
    assert image.size == (W, H) and outside == 0 and inside > 10
    assert image.text["mask"].startswith("sha256:") and image.text["mask_feather"] == "8"


def test_gradio_api_takes_a_mask(live_server, tmp_path):
    (tmp_path / "in.png").write_bytes(png_bytes(photo()))
    (tmp_path / "mask.png").write_bytes(png_bytes(white_left_half()))
    client = Client(live_server.url, verbose=False)
    images, seed = client.predict([handle_file(str(tmp_path / "in.png"))], "make it red", "", 4, False, 2, 4.0, 1,
                                  W, H, "quality", "none", 1.0, handle_file(str(tmp_path / "mask.png")), 0, 0, 1.0,
                                  api_name="/edit")
    image = Image.open(images[0]["image"])
    outside, inside = changed(image, np.asarray(white_left_half()) == 255)
    assert seed == 4 and outside == 0 and inside > 10


@pytest.mark.parametrize("mask, says", [
    (png_bytes(Image.new("L", (W + 16, H), 255)), "the mask is 112x64 but the first image is 96x64"),
    (b"no image at all", "the mask is not a readable image"),
    (png_bytes(Image.new("L", (W, H), 0)), "the mask marks nothing to edit"),
    (png_bytes(Image.new("RGBA", (W, H), (0, 0, 0, 255))), "has no fully transparent pixel"),
    (png_bytes(Image.new("L", (W, H), 255)), "the mask marks the whole image: leave the mask out"),
], ids=["other-size", "no-image", "marks-nothing", "opaque-png", "marks-everything"])
def test_a_bad_mask_is_a_400_that_costs_nothing(live_server, server_manager, mask, says):
    before = sum(w.jobs_done for w in server_manager.workers)
    r = http.post(f"{live_server.url}/v1/images/edits", timeout=60,
                   data={"prompt": "make it red", "size": f"{W}x{H}", "num_inference_steps": "2"},
                   files=[("image", ("in.png", png_bytes(photo()), "image/png")),
                          ("mask", ("m.png", mask, "image/png"))])
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "mask"
    assert sum(w.jobs_done for w in server_manager.workers) == before


def test_mask_fields_are_checked(live_server):
    for field, value, says in (("strength", "0", "strength 0.0 is out of range"),
                               ("mask_feather", "999", "mask_feather 999 is out of range"),
                               ("mask_grow", "-1", "mask_grow -1 is out of range")):
        r = http.post(f"{live_server.url}/v1/images/edits", timeout=60, data={"prompt": "x", field: value},
                       files=[("image", ("in.png", png_bytes(photo()), "image/png"))])
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
    r = http.post(f"{live_server.url}/v1/jobs", timeout=60, data={"prompt": "x", "strength": "1.5"},
                   files=[("image", ("in.png", png_bytes(photo()), "image/png")),
                          ("mask", ("m.png", png_bytes(white_left_half()), "image/png"))])
    assert r.status_code == 400 and "strength 1.5 is out of range" in r.json()["error"]["message"], r.text


def test_a_job_applies_one_mask_to_every_item_and_refuses_an_item_of_another_size(live_server, server_manager):
    """/v1/jobs takes `mask` too: the same area of each item's first image changes, the rest stays pixel for
    pixel; an item whose first image is not the mask's size is named in a 400 before anything runs."""
    mask = white_left_half()
    other = picture(W, H, (200, 60, 60))
    files = [("set1", ("a.png", png_bytes(photo()), "image/png")), ("set2", ("b.png", png_bytes(other), "image/png")),
             ("mask", ("m.png", png_bytes(mask), "image/png"))]
    fields = {"prompt": "make it red", "num_inference_steps": "2", "size": f"{W}x{H}", "mask_feather": "2"}
    r = http.post(f"{live_server.url}/v1/jobs", timeout=60, data=fields, files=files)
    assert r.status_code in (200, 201, 202), r.text
    job_id = r.json()["id"]
    view = wait_job(live_server.url, job_id)
    assert view["state"] == "succeeded" and view["mask"] == f"sha256:{mask_digest(mask_from(mask, (W, H)))}", view
    area = np.asarray(mask) == 255
    for item, source in ((1, photo()), (2, other)):
        png = http.get(f"{live_server.url}/v1/jobs/{job_id}/result?item={item}", timeout=30)
        result = Image.open(io.BytesIO(png.content))
        before = np.asarray(source, dtype=np.int16)
        after = np.asarray(result.convert("RGB"), dtype=np.int16)
        assert result.size == (W, H) and (after[~area] == before[~area]).all()
        assert np.abs(after - before)[area].mean() > 10 and result.text["mask"] == view["mask"]
    before = sum(w.jobs_done for w in server_manager.workers)
    odd = [("set1", ("a.png", png_bytes(photo()), "image/png")),
           ("set2", ("wide.png", png_bytes(picture(W + 16, H)), "image/png")),
           ("mask", ("m.png", png_bytes(mask), "image/png"))]
    r = http.post(f"{live_server.url}/v1/jobs", timeout=60, data=fields, files=odd)
    assert r.status_code == 400 and r.json()["error"]["param"] == "mask", r.text
    assert "wide.png is 112x64 but the mask is 96x64" in r.json()["error"]["message"], r.text
    assert sum(w.jobs_done for w in server_manager.workers) == before


def test_a_mask_for_another_size_is_refused_before_the_line():
    with pytest.raises(InvalidInput, match="must be the same size"):
        mask_from(white_left_half(), (W, H + 16))


def huge_png_header(width: int, height: int) -> bytes:
    """A PNG that says it is width x height: Pillow reads the header and refuses it before decoding anything."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def test_a_huge_mask_is_too_large_and_bad_numbers_name_their_parameter(live_server, server_manager):
    """#47 item 7: a 30000x30000 mask is too large (the pixel limit), not "not a readable image"; nan, inf and
    words for mask_grow, mask_feather and strength name the parameter."""
    before = sum(w.jobs_done for w in server_manager.workers)
    r = http.post(f"{live_server.url}/v1/images/edits", timeout=60, data={"prompt": "make it red"},
                  files=[("image", ("in.png", png_bytes(photo()), "image/png")),
                         ("mask", ("m.png", huge_png_header(30000, 30000), "image/png"))])
    error = r.json()["error"]
    assert r.status_code == 413 and "the mask is too large to decode safely" in error["message"], r.text
    assert error["param"] == "mask" and "MAX_INPUT_PIXELS" in error["message"]
    for field in ("mask_grow", "mask_feather", "strength"):
        for value in ("nan", "inf", "-inf", "lots"):
            r = http.post(f"{live_server.url}/v1/images/edits", timeout=60, data={"prompt": "x", field: value},
                          files=[("image", ("in.png", png_bytes(photo()), "image/png"))])
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, value, r.text)
    assert sum(w.jobs_done for w in server_manager.workers) == before
