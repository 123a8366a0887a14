"""Expanding the canvas (#64 item 2, imgedit.engine.canvas): `expand` pads the first image and the model fills
the new area through the masked-edit path; the original's pixels come back exactly where they were. Over REST on
the shared live server (the tiny real checkpoint, 2 steps), and the parsing and refusals."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from conftest import http, picture

from imgedit.engine.canvas import expanded, parse_expand
from imgedit.errors import InvalidInput
from imgedit.protocol import EditRequest

FIELDS = {"prompt": "continue the scene", "num_inference_steps": "2", "seed": "3"}


def png(w: int = 80, h: int = 60) -> bytes:
    buffer = io.BytesIO()
    picture(w, h).save(buffer, format="PNG")
    return buffer.getvalue()


def test_expand_is_parsed_and_bounded():
    assert parse_expand("256") == (256, 256, 256, 256)
    assert parse_expand("left=32, top=16") == (32, 16, 0, 0)
    assert parse_expand("x=8,bottom=4") == (8, 0, 8, 4)
    assert parse_expand("") is None and parse_expand("0") is None and parse_expand(None) is None
    for bad in ("middle=4", "left=-4", "left=4px", "9999"):
        with pytest.raises(InvalidInput) as refused:
            parse_expand(bad)
        assert refused.value.field == "expand"
    req = expanded(EditRequest(images=(picture(80, 60),), prompt="x", expand="left=32,top=16"))
    assert req.images[0].size == req.mask.size == (112, 76)
    mask = np.asarray(req.mask)
    assert (mask[16:, 32:] == 0).all() and (mask[:16] == 255).all() and (mask[:, :32] == 255).all()


def test_an_expanded_edit_keeps_the_original_pixels_where_they_were(live_server):
    from PIL import Image

    r = http.post(f"{live_server.url}/v1/images/edits", files={"image": ("a.png", png(), "image/png")},
                  data={**FIELDS, "expand": "left=32,top=16"}, timeout=120)
    assert r.status_code == 200, r.text
    image = Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"])))
    assert image.size == (112, 76) and image.info["expand"] == "left=32,top=16"
    out = np.asarray(image.convert("RGB")).astype(int)
    assert (out[16:, 32:] == np.asarray(picture(80, 60))).all()  # the original, exactly
    assert np.abs(out[:16] - 128).mean() > 1  # the new area is the model's, not the grey it was given

    refusals = {"mask": ("64", png(), {"mask": ("m.png", png(), "image/png")}, "its own mask"),
                "bad text": ("wide", png(), {}, "expand must be"),
                "too large": ("4096", png(), {}, "MAX_INPUT_PIXELS"),
                "too elongated": ("x=4096", png(80, 4), {}, "aspect")}
    for case, (expand, image, files, said) in refusals.items():
        r = http.post(f"{live_server.url}/v1/images/edits", files={"image": ("a.png", image, "image/png"), **files},
                      data={**FIELDS, "expand": expand}, timeout=60)
        assert r.status_code == 400 and said in r.json()["error"]["message"], (case, r.text)
