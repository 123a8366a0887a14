"""REST edge against a real server: the official OpenAI SDK, API keys, /metrics, readiness, concurrency
with the Gradio API, and bad input. The tiny real checkpoint does every edit (64x64, 2 steps)."""

from __future__ import annotations

import base64
import io
import json
import socket
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from conftest import ConcurrencyProbe, http, make_manager, picture, start_server, wait_for
from PIL import ExifTags, Image
from prometheus_client.parser import text_string_to_metric_families

from imgedit.config.settings import load_settings
from imgedit.engine.manager import PipelineManager
from imgedit.protocol import WorkerState

EXTRA = {"num_inference_steps": 2}
GOOD_FIELDS = {"prompt": "make it red", "size": "64x64", "num_inference_steps": "2", "seed": "1"}


def sdk(url: str, key: str = "x", **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120, **kwargs)


def sdk_edit(client: openai.OpenAI, png, seed: int = 1, n: int = 1):
    with open(png, "rb") as f:
        return client.images.edit(model="qwen-image-edit", image=[f], prompt="make the sky red", n=n,
                                  size="64x64", response_format="b64_json",
                                  extra_body={**EXTRA, "seed": seed})


def decode(b64: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert image.format == "PNG"
    image.load()
    return image


def post_edit(url: str, files=None, data=None, headers=None, **kwargs) -> httpx.Response:
    return http.post(f"{url}/v1/images/edits", files=files, data=data, headers=headers, timeout=120, **kwargs)


def png_bytes(w: int = 80, h: int = 60) -> bytes:
    buffer = io.BytesIO()
    picture(w, h).save(buffer, format="PNG")
    return buffer.getvalue()


def bomb_png(width: int = 30000, height: int = 30000) -> bytes:
    """A tiny valid 1x1 PNG whose IHDR (with a fixed CRC) claims width x height."""
    buffer = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buffer, format="PNG")
    raw = bytearray(buffer.getvalue())
    assert raw[12:16] == b"IHDR"
    raw[16:24] = struct.pack(">II", width, height)
    raw[29:33] = struct.pack(">I", zlib.crc32(bytes(raw[12:29])) & 0xFFFFFFFF)
    return bytes(raw)


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    text = response.text
    assert "Traceback" not in text and 'File "' not in text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert {"param", "code"} <= error.keys()
    if code is not None:
        assert error["code"] == code, error
    return error


def metric_samples(text: str) -> dict[str, list]:
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def sample_value(samples, name: str, **labels) -> float:
    return sum(s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items()))


# ---- 1. the official SDK ----

def test_openai_sdk_edits(live_server, image_file):
    sent = []
    hooks = {"request": [lambda request: sent.append(request.read())]}
    with httpx.Client(event_hooks=hooks, timeout=120) as recording:
        client = sdk(live_server.url, http_client=recording)
        first = sdk_edit(client, image_file, seed=7)
        again = sdk_edit(client, image_file, seed=7)
        other = sdk_edit(client, image_file, seed=8, n=2)
    # The SDK sends a list of images as `image[]`, and extra_body as plain form fields.
    assert b'name="image[]"' in sent[0] and b'name="num_inference_steps"' in sent[0]
    assert len(first.data) == 1 and len(again.data) == 1 and len(other.data) == 2
    images = [decode(d.b64_json) for d in (*first.data, *other.data)]
    assert all(image.size == (64, 64) for image in images)
    assert base64.b64decode(first.data[0].b64_json) == base64.b64decode(again.data[0].b64_json)
    assert images[0].tobytes() != images[1].tobytes()
    # Each image says its own seed (image i: seed + i), in the reply and in its PNG.
    assert [d.model_extra["seed"] for d in other.data] == [8, 9]
    assert [decode(d.b64_json).info["seed"] for d in other.data] == ["8", "9"]



def test_output_format_jpeg_and_webp_carry_the_same_image_and_its_settings(live_server, image_file):
    """OpenAI's output_format / output_compression through the SDK: the same seed's image as the PNG reply,
    lossy within a JPEG/WebP's error, with the settings as JSON in the EXIF UserComment."""
    client = sdk(live_server.url)
    replies = {}
    for output_format, quality in (("png", None), ("jpeg", 95), ("webp", 95)):
        with open(image_file, "rb") as f:
            options = {"output_format": output_format} | ({"output_compression": quality} if quality else {})
            replies[output_format] = client.images.edit(
                model="qwen-image-edit", image=[f], prompt="make the sky 赤", size="64x64",
                response_format="b64_json", extra_body={**EXTRA, "seed": 11}, **options)
    png = np.asarray(decode(replies["png"].data[0].b64_json), dtype=np.float64)
    for output_format in ("jpeg", "webp"):
        reply = replies[output_format]
        assert reply.output_format == output_format
        image = Image.open(io.BytesIO(base64.b64decode(reply.data[0].b64_json)))
        assert image.format == output_format.upper() and image.size == (64, 64)
        pixels = np.asarray(image.convert("RGB"), dtype=np.float64)
        assert np.abs(pixels - png).mean() < 8, output_format  # the same image, lossy
        comment = image.getexif().get_ifd(ExifTags.IFD.Exif)[ExifTags.Base.UserComment]
        assert comment.startswith(b"ASCII\0\0\0")
        settings = json.loads(comment[8:])
        assert (settings["prompt"], settings["seed"]) == ("make the sky 赤", "11")
    assert replies["png"].output_format == "png"


# ---- 2. API_KEY ----

@pytest.fixture(scope="module")
def keyed_server(plus_ckpt):
    with start_server(make_manager(plus_ckpt, API_KEY="sekret")) as server:
        yield server


def test_api_key_guards_edits_and_metrics_not_health(keyed_server, image_file):
    url = keyed_server.url
    with pytest.raises(openai.AuthenticationError) as caught:
        sdk_edit(sdk(url, key="wrong"), image_file)
    assert caught.value.status_code == 401
    assert_openai_error(post_edit(url, files={"image": png_bytes()}, data=GOOD_FIELDS), 401, "invalid_api_key")
    assert_openai_error(http.get(f"{url}/metrics"), 401, "invalid_api_key")
    assert http.get(f"{url}/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    scraped = http.get(f"{url}/metrics", headers={"Authorization": "Bearer sekret"})
    assert scraped.status_code == 200 and "imgedit_workers_healthy" in scraped.text
    health = http.get(f"{url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    result = sdk_edit(sdk(url, key="sekret"), image_file)
    assert decode(result.data[0].b64_json).size == (64, 64)


# ---- 3. /metrics ----

def test_metrics_count_rest_edits(live_server, image_file):
    url = live_server.url
    before = metric_samples(http.get(f"{url}/metrics").text)
    response = post_edit(url, files={"image": ("in.png", png_bytes(), "image/png")}, data=GOOD_FIELDS)
    assert response.status_code == 200, response.text
    assert_openai_error(post_edit(url, files={"image": png_bytes()}, data={**GOOD_FIELDS, "n": "0"}), 400)
    scraped = http.get(f"{url}/metrics")
    assert scraped.status_code == 200
    assert scraped.headers["content-type"].startswith("text/plain")
    after = metric_samples(scraped.text)
    ok = dict(source="rest", outcome="ok")
    assert sample_value(after, "imgedit_requests_total", **ok) >= 1
    assert sample_value(after, "imgedit_requests_total", **ok) == sample_value(
        before, "imgedit_requests_total", **ok) + 1
    bad = dict(source="rest", outcome="invalid_input")
    assert sample_value(after, "imgedit_requests_total", **bad) == sample_value(
        before, "imgedit_requests_total", **bad) + 1
    assert sample_value(after, "imgedit_job_seconds_count") == sample_value(before, "imgedit_job_seconds_count") + 1
    assert sample_value(after, "imgedit_job_seconds_sum") > 0
    assert after["imgedit_queue_length"][0].value == 0  # nothing waits once the edits have answered
    assert after["imgedit_workers_healthy"][0].value == 2
    assert after["imgedit_workers"][0].value == 2
    assert after["imgedit_steps_per_second"][0].value > 0
    # the time budget (imgedit.runtime.budget): each phase of the one edit summed once, and the worker's
    # phases inside the job's seconds
    phases = ("upload", "queue", "prepare", "first_step", "later_steps", "finish", "reply")
    for phase in phases:
        counted = sample_value(after, "imgedit_request_phase_seconds_count", phase=phase) - sample_value(
            before, "imgedit_request_phase_seconds_count", phase=phase)
        assert counted == 1, (phase, counted)
    spent = {phase: sample_value(after, "imgedit_request_phase_seconds_sum", phase=phase) - sample_value(
        before, "imgedit_request_phase_seconds_sum", phase=phase) for phase in phases}
    assert spent["first_step"] > 0 and spent["later_steps"] > 0 and spent["prepare"] > 0, spent
    job = sample_value(after, "imgedit_job_seconds_sum") - sample_value(before, "imgedit_job_seconds_sum")
    assert sum(spent[p] for p in ("queue", "prepare", "first_step", "later_steps", "finish")) <= job, (spent, job)


# ---- 4. readiness ----

def test_health_flips_with_loading_and_failed_workers(plus_ckpt, image_file):
    settings = load_settings({"QWEN_MODEL_DIR": str(plus_ckpt), "DEVICE_MAP": "cpu"})
    manager = PipelineManager(settings)
    with start_server(manager) as server:
        url = server.url
        health = http.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        assert_openai_error(post_edit(url, files={"image": png_bytes()}, data=GOOD_FIELDS), 503, "not_ready")
        manager.load()
        health = http.get(f"{url}/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        for worker in manager.workers:
            worker.state = WorkerState.FAILED  # planted: every worker failed
        health = http.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        error = assert_openai_error(post_edit(url, files={"image": png_bytes()}, data=GOOD_FIELDS), 503)
        assert error["type"] == "server_error"


# ---- 5. concurrency: REST and the Gradio API share the workers ----

def test_rest_and_gradio_jobs_share_workers_one_job_each(live_server, server_manager, image_file):
    from gradio_client import Client, handle_file

    client = Client(live_server.url, verbose=False)
    probe = ConcurrencyProbe(server_manager)
    done_before = sum(w.jobs_done for w in server_manager.workers)
    try:
        def rest(seed):
            return post_edit(live_server.url, files={"image": ("in.png", png_bytes(), "image/png")},
                             data={**GOOD_FIELDS, "seed": str(seed)})

        def ui(seed):
            job = client.submit([handle_file(str(image_file))], "make it red", "", seed, False, 2, 4.0, 1, 64, 64,
                                api_name="/edit")
            return job.result(timeout=240)

        with ThreadPoolExecutor(5) as pool:
            rests = [pool.submit(rest, s) for s in (1, 2, 3)]
            uis = [pool.submit(ui, s) for s in (4, 5)]
            rest_results = [f.result(timeout=300) for f in rests]
            ui_results = [f.result(timeout=300) for f in uis]
    finally:
        probe.close()
        client.close()
    for response in rest_results:
        assert response.status_code == 200, response.text
        assert decode(response.json()["data"][0]["b64_json"]).size == (64, 64)
    for (gallery, seed), asked in zip(ui_results, (4, 5), strict=True):
        assert len(gallery) == 1 and seed == asked
        assert Image.open(gallery[0]["image"]).size == (64, 64)
    assert sum(w.jobs_done for w in server_manager.workers) == done_before + 5
    # Both workers ran jobs, never two at once on the same worker.
    assert probe.max_active == {w.name: 1 for w in server_manager.workers}


# ---- 6. bad input ----

def _multipart(url: str, body: bytes, content_type: str) -> httpx.Response:
    return http.post(f"{url}/v1/images/edits", content=body, headers={"content-type": content_type}, timeout=60)


def _form(url: str, **fields) -> httpx.Response:
    """multipart/form-data with text fields only (httpx sends urlencoded when there are no files)."""
    return post_edit(url, files={k: (None, v) for k, v in fields.items()})


# case -> (request, a piece of the expected message)
BAD_INPUT = {
    "malformed_multipart": (lambda url: _multipart(
        url, b"--xyz\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a.png\"\r\n\r\n\x89PNG",
        "multipart/form-data; boundary=xyz"), "no input image"),
    "multipart_without_boundary": (lambda url: _multipart(url, b"garbage", "multipart/form-data"),
                                   "malformed multipart"),
    "json_body": (lambda url: http.post(f"{url}/v1/images/edits", json={"prompt": "x", "image": "aGk="}),
                  "send multipart/form-data"),
    "missing_prompt": (lambda url: post_edit(url, files={"image": png_bytes()}, data={"size": "64x64"}),
                       "prompt is required"),
    "blank_prompt": (lambda url: post_edit(url, files={"image": png_bytes()}, data={**GOOD_FIELDS, "prompt": " "}),
                     "prompt is empty"),
    "missing_image": (lambda url: _form(url, **GOOD_FIELDS), "no input image"),
    "four_images": (lambda url: post_edit(url, files=[("image[]", png_bytes())] * 4, data=GOOD_FIELDS),
                    "at most 3"),
    "image_as_text": (lambda url: _form(url, **GOOD_FIELDS, image="aGVsbG8="), "not a text field"),
    "not_an_image": (lambda url: post_edit(url, files={"image": ("a.png", b"hello, not a picture")},
                                           data=GOOD_FIELDS), "not a readable image"),
    "n_not_a_number": (lambda url: post_edit(url, files={"image": png_bytes()}, data={**GOOD_FIELDS, "n": "abc"}),
                       "n must be a whole number"),
    "n_zero": (lambda url: post_edit(url, files={"image": png_bytes()}, data={**GOOD_FIELDS, "n": "0"}),
               "n 0 is out of range"),
    "size_garbage": (lambda url: post_edit(url, files={"image": png_bytes()}, data={**GOOD_FIELDS, "size": "abc"}),
                     "size must be"),
    "too_many_steps": (lambda url: post_edit(url, files={"image": png_bytes()},
                                             data={**GOOD_FIELDS, "num_inference_steps": "10000"}),
                       "num_inference_steps 10000 is out of range"),
    "url_format": (lambda url: post_edit(url, files={"image": png_bytes()},
                                         data={**GOOD_FIELDS, "response_format": "uri"}),
                   "response_format must be b64_json or url"),
    "gif_output": (lambda url: post_edit(url, files={"image": png_bytes()},
                                         data={**GOOD_FIELDS, "output_format": "gif"}),
                   "output_format must be one of png, jpeg, webp"),
    "quality_over_100": (lambda url: post_edit(url, files={"image": png_bytes()},
                                               data={**GOOD_FIELDS, "output_format": "jpeg",
                                                     "output_compression": "101"}),
                         "output_compression must be 0 to 100"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_is_a_400_in_openai_shape(live_server, case):
    send, expected = BAD_INPUT[case]
    error = assert_openai_error(send(live_server.url), 400, "invalid_input")
    assert error["type"] == "invalid_request_error"
    assert expected in error["message"], error["message"]


def test_decompression_bomb_is_413_then_server_still_edits(live_server):
    url = live_server.url
    error = assert_openai_error(post_edit(url, files={"image": ("bomb.png", bomb_png())}, data=GOOD_FIELDS),
                                413, "too_large")
    assert "30000x30000" in error["message"] or "too large" in error["message"]
    assert_openai_error(BAD_INPUT["malformed_multipart"][0](url), 400)
    response = post_edit(url, files={"image": ("in.png", png_bytes(), "image/png")}, data=GOOD_FIELDS)
    assert response.status_code == 200, response.text
    assert decode(response.json()["data"][0]["b64_json"]).size == (64, 64)


@pytest.fixture(scope="module")
def small_limit_server(plus_ckpt):
    with start_server(make_manager(plus_ckpt, MAX_FILE_SIZE="200KB")) as server:
        yield server


def test_upload_over_max_file_size_is_413(small_limit_server):
    url = small_limit_server.url
    megabyte = b"\x89PNG\r\n\x1a\n" + bytes(1_000_000)
    error = assert_openai_error(post_edit(url, files={"image": ("big.png", megabyte)}, data=GOOD_FIELDS), 413,
                                "too_large")
    assert "larger than 200 KB (MAX_FILE_SIZE)" in error["message"], error  # as the setting was written
    # A body whose Content-Length is over the limit is refused before it is read.
    with socket.create_connection(("127.0.0.1", small_limit_server.port), timeout=30) as conn:
        conn.sendall(b"POST /v1/images/edits HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: multipart/form-data; boundary=xyz\r\nContent-Length: 50000000\r\n\r\n--xyz\r\n")
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = conn.recv(65536)
            if not chunk:
                break
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), reply[:300]
    assert b'"code":"too_large"' in body and b"Traceback" not in body
    assert http.get(f"{url}/health").status_code == 200


def test_full_queue_is_429_busy(plus_ckpt):
    manager = make_manager(plus_ckpt, workers=1, QUEUE_MAX_SIZE="1")
    with start_server(manager) as server:
        fields = {**GOOD_FIELDS, "num_inference_steps": "4"}
        barrier = threading.Barrier(4)

        def fire(_):
            barrier.wait()
            return post_edit(server.url, files={"image": ("in.png", png_bytes(), "image/png")}, data=fields)

        with ThreadPoolExecutor(4) as pool:
            responses = list(pool.map(fire, range(4)))
        statuses = sorted(r.status_code for r in responses)
        assert set(statuses) <= {200, 429}, [r.text for r in responses]
        assert statuses.count(200) >= 1 and statuses.count(429) >= 1, statuses
        for response in responses:
            if response.status_code == 429:
                error = assert_openai_error(response, 429, "busy")
                assert error["type"] == "rate_limit_error"


def test_a_client_that_goes_away_stops_its_gpu_work(plus_ckpt, image_file):
    """Servers do not cancel a handler when the client disconnects; imgedit watches and cancels."""
    manager = make_manager(plus_ckpt)
    with start_server(manager) as server:
        files = {"image": ("in.png", image_file.read_bytes(), "image/png")}
        form = {"prompt": "slow one", "num_inference_steps": "60", "size": "64x64"}
        with pytest.raises(httpx.ReadTimeout):
            http.post(f"{server.url}/v1/images/edits", data=form, files=files, timeout=4)
        deadline = time.time() + 30
        while manager.workers[0].state == "busy":
            assert time.time() < deadline, "the abandoned job kept running"
            time.sleep(0.1)
        assert manager.workers[0].jobs_done == 0 and manager.workers[0].progress.step < 60


def test_the_reply_and_the_stored_result_are_the_same_png(live_server, server_manager, image_file):
    """The PNG is encoded once for both; the reply does not wait for the store, which follows it."""
    response = post_edit(live_server.url, files={"image": ("in.png", image_file.read_bytes(), "image/png")},
                         data={"prompt": "keep me", "size": "64x64", "num_inference_steps": "2", "seed": "4242"},
                         headers={"Authorization": "Bearer history-probe"})
    assert response.status_code == 200, response.text
    png = base64.b64decode(response.json()["data"][0]["b64_json"])
    chunks = Image.open(io.BytesIO(png)).text
    assert (chunks["prompt"], chunks["seed"]) == ("keep me", "4242")  # the settings travel with it
    root = Path(server_manager.settings.output_dir).expanduser()
    wait_for(lambda: any(p.read_bytes() == png for p in root.glob("*/*/out-0.png")), 30)


def test_an_animated_gif_is_edited_by_its_first_frame_and_the_reply_says_so(live_server):
    """An animated input was used silently (its first frame)."""
    frames = [picture(color=(255, 0, 0)), picture(color=(0, 0, 255)), picture(color=(0, 255, 0))]
    gif = io.BytesIO()
    frames[0].save(gif, format="GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    response = post_edit(live_server.url, files={"image": ("anim.gif", gif.getvalue(), "image/gif")},
                         data={"prompt": "make it red", "size": "64x64", "num_inference_steps": "2", "seed": "1"})
    assert response.status_code == 200, response.text
    assert response.json()["notices"] == [
        "image 1 has 3 frames (animated or multi-page): only its first frame was edited"]
    still = post_edit(live_server.url, files={"image": ("in.png", png_bytes(), "image/png")},
                      data={"prompt": "make it red", "size": "64x64", "num_inference_steps": "2", "seed": "1"})
    assert "notices" not in still.json()
    # #62: OpenAI's fields this server does not use, and a size the model rounds, are said (both were silent)
    changed = post_edit(live_server.url, files={"image": ("in.png", png_bytes(), "image/png")},
                        data={"prompt": "make it red", "size": "72x70", "num_inference_steps": "2", "seed": "1",
                              "quality": "high", "background": "transparent"})
    assert changed.status_code == 200, changed.text
    assert changed.json()["notices"] == [
        "quality='high' was ignored: this server does not use OpenAI's quality",
        "background='transparent' was ignored: this server does not use OpenAI's background",
        "size 72x70 became 64x64: the model's sides are multiples of 16 (Qwen-Image-2.1: 32)"], changed.json()


def test_errors_speak_the_callers_words(live_server, image_file):
    """#46 item 9: a bad file is named by its file name, and REST's `n` is `n` (not the gradio API's num_images)."""
    r = http.post(f"{live_server.url}/v1/images/edits", data=GOOD_FIELDS, timeout=60,
                  files=[("image", ("good.png", image_file.read_bytes(), "image/png")),
                         ("image", ("notanimage.png", b"just text", "image/png"))])
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("notanimage.png (image 2) is not a readable image"), r.text
    for route in ("/v1/images/edits", "/v1/jobs"):
        r = http.post(f"{live_server.url}{route}", data={**GOOD_FIELDS, "n": "99"}, timeout=60,
                      files=[("image", ("in.png", image_file.read_bytes(), "image/png"))])
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "n" and error["message"].startswith("n 99 is out of range")
        assert "num_images" not in error["message"], error
