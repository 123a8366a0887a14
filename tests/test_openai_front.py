"""OpenAI-shaped front ends unchanged (#64): GET /v1/models, `response_format=url` (the owner's stored results,
for an hour; another key gets 404) and /docs, FastAPI's page of the REST routes, against the shared live server
(no keys set: each bearer token is its own owner; the 401s of a keyed server: test_adversarial), through the
official `openai` SDK. The tiny real checkpoint does every edit (64x64, 2 steps)."""

from __future__ import annotations

import io

import openai
import pytest
from conftest import http, picture
from PIL import Image

from imgedit.web.api import image_urls

KEYS = {"alice": "alice-token-0001", "bob": "bob-token-00002"}  # without keys set, each token is an owner
MADE: list[str] = []  # the request ids this module's edits made (the docs must name none)


def sdk(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def png(w: int = 80, h: int = 60) -> io.BytesIO:
    buffer = io.BytesIO()
    picture(w, h).save(buffer, format="PNG")
    buffer.seek(0)
    buffer.name = "photo.png"
    return buffer


def bearer(name: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def test_models_list_the_served_model(live_server, plus_ckpt):
    keyed = live_server
    alice = sdk(keyed.url, KEYS["alice"])
    models = alice.models.list().data
    assert [m.id for m in models] == [plus_ckpt.name]  # the folder's name: never a path of the server
    assert models[0].object == "model" and models[0].owned_by == "imgedit"
    assert alice.models.retrieve(plus_ckpt.name).id == plus_ckpt.name
    with pytest.raises(openai.NotFoundError):
        alice.models.retrieve("dall-e-3")
    assert http.post(f"{keyed.url}/v1/models", headers=bearer("alice"), timeout=30).status_code == 405


def test_url_replies_serve_the_owners_stored_images_for_an_hour(live_server, monkeypatch):
    keyed = live_server
    alice = sdk(keyed.url, KEYS["alice"])
    result = alice.images.edit(model="qwen-image-edit", image=png(), prompt="make it red", n=2, size="64x64",
                               response_format="url", extra_body={"seed": 5, "num_inference_steps": 2})
    assert [d.b64_json for d in result.data] == [None, None]
    first, second = (d.url for d in result.data)
    assert first.startswith(f"{keyed.url}/v1/images/results/req_") and second.endswith("/2")
    got = http.get(first, headers=bearer("alice"), timeout=30)
    assert got.status_code == 200 and got.headers["content-type"] == "image/png"
    image = Image.open(io.BytesIO(got.content))
    assert image.size == (64, 64) and image.info["seed"] == "5" and image.info["prompt"] == "make it red"
    assert Image.open(io.BytesIO(http.get(second, headers=bearer("alice"), timeout=30).content)).info["seed"] == "6"
    # another key: as for an id that never was; no key: the key check every /v1 route has
    assert http.get(first, headers=bearer("bob"), timeout=30).status_code == 404
    assert http.get(first, timeout=30).status_code == 404  # the anonymous owner (a keyed server: 401)
    MADE.append(first.split("/")[-2])
    assert http.get(first[:-1] + "3", headers=bearer("alice"), timeout=30).status_code == 404
    # OpenAI's output_format: the URL gives that encoding, made from the stored PNG
    jpeg = alice.images.edit(model="x", image=png(), prompt="make it red", size="64x64", response_format="url",
                             output_format="jpeg", extra_body={"seed": 5, "num_inference_steps": 2})
    got = http.get(jpeg.data[0].url, headers=bearer("alice"), timeout=30)
    assert got.headers["content-type"] == "image/jpeg" and got.content[:2] == b"\xff\xd8"
    monkeypatch.setattr(image_urls, "URL_LIFETIME_S", 0)  # an hour later
    expired = http.get(first, headers=bearer("alice"), timeout=30)
    assert expired.status_code == 410 and expired.json()["error"]["code"] == "expired"


def test_docs_page_lists_the_rest_routes_and_nothing_the_keys_protect(live_server, plus_ckpt):
    keyed = live_server
    page = http.get(f"{keyed.url}/docs", timeout=30)
    assert page.status_code == 200 and "swagger" in page.text.lower() and "/openapi.json" in page.text
    schema = http.get(f"{keyed.url}/openapi.json", timeout=30)
    assert schema.status_code == 200
    paths = schema.json()["paths"]
    assert {"/v1/images/edits", "/v1/images/generations", "/v1/models", "/v1/jobs", "/health"} <= set(paths)
    assert not any(p.startswith(("/gradio_api", "/v1/{")) or p == "/v1" for p in paths)
    form = paths["/v1/images/edits"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert {"image", "prompt", "n", "mask", "seed", "response_format"} <= set(form["properties"])
    assert form["properties"]["n"]["minimum"] == 1 and "prompt" in form["required"]
    assert "HTTPBearer" in schema.json()["components"]["securitySchemes"]
    # the schema is the routes' shapes alone: no key, no path of the server, no job
    assert MADE and not any(secret in schema.text for secret in (*KEYS.values(), str(plus_ckpt), *MADE))
