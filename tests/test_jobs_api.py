"""The async jobs API against a real server and the tiny real checkpoint (64x64, 2 steps)."""

from __future__ import annotations

import base64
import io
import threading
import time
import zipfile

import httpx
import numpy as np
import pytest
from conftest import http, make_manager, picture, start_server
from PIL import Image

FIELDS = {"prompt": "make it red", "size": "64x64", "num_inference_steps": "2", "seed": "3"}
A = {"Authorization": "Bearer token-a"}
B = {"Authorization": "Bearer token-b"}


def png(color=(30, 120, 200)) -> bytes:
    buffer = io.BytesIO()
    picture(80, 60, color).save(buffer, format="PNG")
    return buffer.getvalue()


def zipped(names: list[str]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name in names:
            archive.writestr(name, png())
        archive.writestr("__MACOSX/._x.png", b"junk")
        archive.writestr("readme.txt", b"not an image: skipped")
    return buffer.getvalue()


def wait_finished(url: str, job_id: str, headers=A, timeout: float = 300) -> dict:
    deadline = time.time() + timeout
    while True:
        view = http.get(f"{url}/v1/jobs/{job_id}", headers=headers, timeout=30).json()
        if view["state"] not in ("queued", "running", "cancelling"):
            return view
        assert time.time() < deadline, view
        time.sleep(0.2)


FOUR = "Tiny-Edit-Lightning-4steps-V1.0-bf16"


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory, plus_ckpt):
    from imgedit.model.lora_random import random_lora
    from imgedit.model.loras import transformer_linears

    folder = tmp_path_factory.mktemp("loras")
    linears = transformer_linears(plus_ckpt)
    random_lora(folder / f"{FOUR}.safetensors", linears, rank=4, std=0.2, seed=1)
    random_lora(folder / "style.safetensors", linears, rank=4, std=0.2, seed=3, style="diffusers")
    return folder


@pytest.fixture(scope="module")
def server(plus_ckpt, lora_dir):
    manager = make_manager(plus_ckpt, LORA_DIR=str(lora_dir))  # LoRAs loaded; jobs without one run as before
    with start_server(manager) as live:
        live.manager = manager
        yield live


def test_batch_of_five_from_files_and_a_zip(server):
    files = [("batch", (f"photo{i}.png", png(), "image/png")) for i in range(3)]
    files.append(("batch", ("more.zip", zipped(["b/second.png", "a/first.jpg.png"]), "application/zip")))
    r = http.post(f"{server.url}/v1/jobs", files=files, data=FIELDS, headers=A, timeout=60)
    assert r.status_code == 202, r.text
    job = r.json()
    assert r.headers["location"] == f"/v1/jobs/{job['id']}"
    assert job["state"] == "queued" and isinstance(job["position"], int)
    assert [i["name"] for i in job["items"]] == ["photo0.png", "photo1.png", "photo2.png", "first.jpg.png",
                                                 "second.png"]
    view = wait_finished(server.url, job["id"])
    assert view["state"] == "succeeded" and view["done"] == 5, view
    assert {i["seed"] for i in view["items"]} == {3}
    # one numbering (#46 item 4): the items count from 1, as ?item=N and the zip's names do
    assert [i["item"] for i in view["items"]] == [1, 2, 3, 4, 5] and all("index" not in i for i in view["items"])
    r = http.get(f"{server.url}/v1/jobs/{job['id']}/result", headers=A, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"] == "application/zip"
    archive = zipfile.ZipFile(io.BytesIO(r.content))
    assert archive.namelist() == ["001-photo0.png", "002-photo1.png", "003-photo2.png", "004-first.jpg.png",
                                  "005-second.png"]
    assert all(Image.open(archive.open(n)).size == (64, 64) for n in archive.namelist())
    one = http.get(f"{server.url}/v1/jobs/{job['id']}/result?item=2", headers=A, timeout=30)
    assert one.status_code == 200 and one.headers["content-type"] == "image/png"
    assert one.content == archive.read("002-photo1.png")
    check_other_formats(server.url, job["id"], archive)


def check_other_formats(url: str, job_id: str, pngs: zipfile.ZipFile) -> None:
    """The stored PNGs fetched as JPEG or WebP (OpenAI's output_format / output_compression, in the query):
    near the PNG's pixels, the settings in the EXIF UserComment; a format it does not offer is a 400."""
    import json

    from PIL import ExifTags

    webp = http.get(f"{url}/v1/jobs/{job_id}/result", params={"output_format": "webp", "output_compression": "80"},
                    headers=A, timeout=30)
    assert webp.status_code == 200 and webp.headers["content-type"] == "application/zip", webp.text
    members = zipfile.ZipFile(io.BytesIO(webp.content))
    assert members.namelist() == [n.removesuffix(".png") + ".webp" for n in pngs.namelist()]
    jpeg = http.get(f"{url}/v1/jobs/{job_id}/result", params={"item": "2", "output_format": "jpg"}, headers=A,
                    timeout=30)
    assert jpeg.status_code == 200 and jpeg.headers["content-type"] == "image/jpeg", jpeg.text
    for data, kind in ((members.read("002-photo1.webp"), "WEBP"), (jpeg.content, "JPEG")):
        image = Image.open(io.BytesIO(data))
        assert image.format == kind and image.size == (64, 64)
        png = np.asarray(Image.open(pngs.open("002-photo1.png")).convert("RGB"), float)
        assert np.abs(np.asarray(image.convert("RGB"), float) - png).mean() < 12  # lossy, the same picture
        comment = image.getexif().get_ifd(ExifTags.IFD.Exif)[ExifTags.Base.UserComment]
        stamped = json.loads(comment.removeprefix(b"ASCII\0\0\0"))
        assert stamped["prompt"] == FIELDS["prompt"] and str(stamped["seed"]) == "3", stamped
    bad = http.get(f"{url}/v1/jobs/{job_id}/result", params={"output_format": "gif"}, headers=A, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "output_format", bad.text
    bad = http.get(f"{url}/v1/jobs/{job_id}/result", params={"output_format": "jpeg", "output_compression": "101"},
                   headers=A, timeout=30)
    assert bad.status_code == 400 and "output_compression must be 0 to 100" in bad.text, bad.text


def test_single_set_gives_a_png(server):
    files = [("image", ("a.png", png(), "image/png")), ("image", ("b.png", png((200, 0, 0)), "image/png"))]
    r = http.post(f"{server.url}/v1/jobs", files=files, data=FIELDS, headers=A, timeout=60)
    assert r.status_code == 202, r.text
    assert len(r.json()["items"]) == 1
    assert wait_finished(server.url, r.json()["id"])["state"] == "succeeded"
    result = http.get(f"{server.url}/v1/jobs/{r.json()['id']}/result", headers=A, timeout=30)
    assert result.headers["content-type"] == "image/png"
    assert Image.open(io.BytesIO(result.content)).size == (64, 64)
    # #62: DELETE of a finished job removes it and its results (it answered with the job, still there);
    # another token's DELETE finds nothing
    job_id = r.json()["id"]
    other = {"Authorization": "Bearer token-zz"}
    assert http.delete(f"{server.url}/v1/jobs/{job_id}", headers=other, timeout=30).status_code == 404
    deleted = http.delete(f"{server.url}/v1/jobs/{job_id}", headers=A, timeout=30)
    assert deleted.json() == {"id": job_id, "deleted": True, "results_deleted": 1}, deleted.text
    assert http.get(f"{server.url}/v1/jobs/{job_id}", headers=A, timeout=30).status_code == 404
    assert http.get(f"{server.url}/v1/jobs/{job_id}/result", headers=A, timeout=30).status_code == 404
    assert http.delete(f"{server.url}/v1/jobs/{job_id}", headers=A, timeout=30).status_code == 404


def test_a_job_recorded_with_total_steps_reads_back_with_the_request_fields_name(tmp_path):
    """Items recorded before the step count took the request field's name (`total_steps`) read back as
    `num_inference_steps`, in a job's status and in the list."""
    from imgedit.engine.jobs.records import JobRecords

    records = JobRecords(tmp_path)
    old = {"index": 0, "name": "a.png", "state": "succeeded", "seed": 3, "step": 2, "total_steps": 2, "error": None}
    records.write("job_old", "token:a", "rest", time.time(), {"prompt": "p"}, [old], finished=time.time())
    [read] = records.read("token:a", "job_old")["items"]
    [listed] = records.newest("token:a", 10)[0][0]["items"]
    assert read == listed == {**{k: v for k, v in old.items() if k != "total_steps"}, "num_inference_steps": 2}
    records.close()


def test_another_tokens_job_id_gives_404(server):
    r = http.post(f"{server.url}/v1/jobs", files=[("image", ("a.png", png(), "image/png"))], data=FIELDS,
                   headers=A, timeout=60)
    job_id = r.json()["id"]
    for method, path in (("GET", ""), ("GET", "/result"), ("DELETE", "")):
        other = http.request(method, f"{server.url}/v1/jobs/{job_id}{path}", headers=B, timeout=30)
        assert other.status_code == 404, (method, path, other.text)
        assert other.json()["error"]["code"] == "not_found"
        # the answer any made-up id gets: nothing tells B that A's job exists
        made_up = http.request(method, f"{server.url}/v1/jobs/req_{'x' * (len(job_id) - 4)}{path}", headers=B,
                               timeout=30)
        assert made_up.status_code == 404
        assert other.json()["error"] == {**made_up.json()["error"], "message": made_up.json()["error"]["message"]
                                         .replace("req_" + "x" * (len(job_id) - 4), job_id)}
    assert wait_finished(server.url, job_id)["state"] == "succeeded"  # B's DELETE did not cancel it
    assert http.get(f"{server.url}/v1/jobs/{job_id}/result", headers=B, timeout=30).status_code == 404


def test_result_before_the_end_is_409_and_delete_cancels(server):
    files = [("batch", (f"p{i}.png", png(), "image/png")) for i in range(3)]
    r = http.post(f"{server.url}/v1/jobs", files=files, data={**FIELDS, "num_inference_steps": "40"},
                   headers=A, timeout=60)
    job_id = r.json()["id"]
    deadline = time.time() + 120
    while not (busy := [w for w in http.get(f"{server.url}/health").json()["workers"] if w["step"] >= 1]):
        assert time.time() < deadline
        time.sleep(0.1)
    # /health names the running job's step count as the request does (it was `total_steps`)
    assert busy[0]["num_inference_steps"] == 40 and "total_steps" not in busy[0], busy
    while (running := http.get(f"{server.url}/v1/jobs/{job_id}", headers=A).json())["items"][0]["step"] < 1:
        assert time.time() < deadline
        time.sleep(0.1)
    assert running["items"][0]["num_inference_steps"] == 40 and "total_steps" not in running["items"][0]
    early = http.get(f"{server.url}/v1/jobs/{job_id}/result", headers=A, timeout=30)
    assert early.status_code == 409 and early.json()["error"]["code"] == "not_finished"
    assert early.json()["error"]["type"] == "invalid_request_error"  # the caller's to wait for, as every 4xx
    deleted = http.delete(f"{server.url}/v1/jobs/{job_id}", headers=A, timeout=30)
    assert deleted.status_code == 200 and deleted.json()["state"] == "cancelling"  # it said "running"
    view = wait_finished(server.url, job_id, timeout=60)
    assert view["state"] == "cancelled" and view["done"] == 0, view
    assert all(i["state"] == "cancelled" for i in view["items"])
    assert view["items"][0]["step"] < 40  # the running item really stopped
    gone = http.get(f"{server.url}/v1/jobs/{job_id}/result", headers=A, timeout=30)
    assert gone.status_code == 409 and gone.json()["error"]["code"] == "no_result"
    history = server.server.config.app.state.history
    assert history.job(owner_of("token-a"), job_id) == []  # nothing is stored for a cancelled job


def test_a_result_deleted_after_the_job_is_410_in_the_shape_of_every_other_4xx(server):
    """One error builder for every route: 409 and 410 are the request's (invalid_request_error), not the
    server's."""
    job_id = http.post(f"{server.url}/v1/jobs", files={"image": ("d.png", png(), "image/png")}, data=FIELDS,
                       headers=A, timeout=60).json()["id"]
    assert wait_finished(server.url, job_id)["state"] == "succeeded"
    history = server.server.config.app.state.history
    for entry in history.job(owner_of("token-a"), job_id):
        for path in entry.output_paths:
            path.unlink()
    gone = http.get(f"{server.url}/v1/jobs/{job_id}/result", headers=A, timeout=30)
    assert gone.status_code == 410, gone.text
    assert gone.json()["error"] == {"message": "the stored result was deleted (OUTPUT_RETENTION_HOURS / "
                                    "OUTPUT_MAX_GB)", "type": "invalid_request_error", "param": None,
                                    "code": "gone"}


def test_finished_items_are_served_at_once_a_cancelled_job_keeps_them_and_jobs_are_listed(server):
    """?item=N answered 409 while item N was done; a job cancelled after an item finished said `partial`;
    GET /v1/jobs was a 404."""
    files = [("batch", (f"q{i}.png", png(), "image/png")) for i in range(3)]
    job_id = http.post(f"{server.url}/v1/jobs", files=files, data={**FIELDS, "num_inference_steps": "6"},
                        headers=A, timeout=60).json()["id"]
    deadline = time.time() + 120
    while (view := http.get(f"{server.url}/v1/jobs/{job_id}", headers=A).json())["items"][0]["state"] != "succeeded":
        assert time.time() < deadline and view["state"] not in ("failed", "partial", "cancelled"), view
        time.sleep(0.1)
    first = http.get(f"{server.url}/v1/jobs/{job_id}/result?item=1", headers=A, timeout=30)
    assert first.status_code == 200 and first.content[:8] == b"\x89PNG\r\n\x1a\n"
    later = http.get(f"{server.url}/v1/jobs/{job_id}/result?item=3", headers=A, timeout=30)
    assert later.status_code == 409 and "item 3 is " in later.json()["error"]["message"]
    assert http.delete(f"{server.url}/v1/jobs/{job_id}", headers=A, timeout=30).status_code == 200
    view = wait_finished(server.url, job_id, timeout=60)
    assert view["state"] == "cancelled" and view["done"] >= 1 and view["items"][2]["state"] == "cancelled", view
    kept = http.get(f"{server.url}/v1/jobs/{job_id}/result", headers=A, timeout=30)
    assert kept.status_code == 200  # the finished items (a PNG or a zip of them)
    # The caller's jobs, newest first, a page at a time; another token sees none of them.
    newest = http.get(f"{server.url}/v1/jobs?limit=1", headers=A, timeout=30).json()
    assert newest["object"] == "list" and [j["id"] for j in newest["data"]] == [job_id] and newest["has_more"]
    assert newest["data"][0]["state"] == "cancelled"
    following = http.get(f"{server.url}/v1/jobs?limit=100&after={job_id}", headers=A, timeout=30).json()
    assert following["data"] and job_id not in [j["id"] for j in following["data"]] and not following["has_more"]
    created = [j["created"] for j in following["data"]]
    assert created == sorted(created, reverse=True)
    other = http.get(f"{server.url}/v1/jobs", headers={"Authorization": "Bearer token-zz"}, timeout=30).json()
    assert job_id not in [j["id"] for j in other["data"]]
    assert http.get(f"{server.url}/v1/jobs?limit=0", headers=A, timeout=30).status_code == 400


def owner_of(token: str) -> str:
    from imgedit.web.identity import rest_owner

    return rest_owner(httpx.Request("GET", "http://x", headers={"Authorization": f"Bearer {token}"}))


def test_a_batch_does_not_hold_up_a_single_edit(server):
    """One worker: a 4-item batch is running when a single edit arrives; the single edit runs next,
    before the batch's second item (the batch keeps one item per worker in the line)."""
    files = [("batch", (f"p{i}.png", png(), "image/png")) for i in range(4)]
    r = http.post(f"{server.url}/v1/jobs", files=files, data={**FIELDS, "num_inference_steps": "6"}, headers=A,
                   timeout=60)
    job_id = r.json()["id"]
    deadline = time.time() + 120
    while http.get(f"{server.url}/v1/jobs/{job_id}", headers=A).json()["items"][0]["step"] < 1:
        assert time.time() < deadline
        time.sleep(0.05)
    single = http.post(f"{server.url}/v1/images/edits", files=[("image", ("s.png", png(), "image/png"))],
                        data=FIELDS, headers=B, timeout=300)
    assert single.status_code == 200, single.text
    view = http.get(f"{server.url}/v1/jobs/{job_id}", headers=A, timeout=30).json()
    assert view["done"] <= 1, view  # only the item that was already running finished before it
    assert wait_finished(server.url, job_id)["state"] == "succeeded"


@pytest.mark.parametrize("case, status, code, text", [
    ("not_an_image", 400, "invalid_input", "notes.png is not a readable image"),  # the job's only file
    ("bad_zip", 400, "invalid_input", "broken.zip is not a readable zip file"),
    ("too_many", 400, "invalid_input", "BATCH_MAX_ITEMS"),
    ("no_image", 400, "invalid_input", "no input image"),
    ("four_in_a_set", 400, "invalid_input", "takes at most 3"),
    ("empty_prompt", 400, "invalid_input", "prompt is empty"),
    ("wrong_key", 401, "invalid_api_key", "API key"),
])
def test_bad_requests_are_refused_up_front(plus_ckpt, case, status, code, text, request):
    server = request.getfixturevalue("keyed_server")
    headers = {"Authorization": "Bearer secret"}
    data = FIELDS
    files = [("batch", ("p.png", png(), "image/png"))]
    if case == "not_an_image":  # nothing could run (one readable file among bad ones runs: see below)
        files = [("batch", ("notes.png", b"hello", "image/png"))]
    elif case == "bad_zip":
        files.append(("batch", ("broken.zip", b"PK\x03\x04 truncated", "application/zip")))
    elif case == "too_many":
        files = [("batch", (f"p{i}.png", png(), "image/png")) for i in range(4)]
    elif case == "no_image":
        files = [("other", ("p.png", png(), "image/png"))]
    elif case == "four_in_a_set":
        files = [("set1", (f"p{i}.png", png(), "image/png")) for i in range(4)]
    elif case == "empty_prompt":
        data = {**FIELDS, "prompt": " "}
    elif case == "wrong_key":
        headers = {"Authorization": "Bearer wrong"}
    r = http.post(f"{server.url}/v1/jobs", files=files, data=data, headers=headers, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and text in error["message"], error
    assert "Traceback" not in r.text
    assert server.manager.workers[0].jobs_done == 0


@pytest.fixture(scope="module")
def keyed_server(plus_ckpt):
    manager = make_manager(plus_ckpt, API_KEY="secret", API_KEYS="other:other-key-1", BATCH_MAX_ITEMS="3",
                           JOBS_MAX_PENDING="4")
    with start_server(manager) as live:
        live.manager = manager
        yield live


def test_pending_limit_gives_429(keyed_server):
    headers = {"Authorization": "Bearer secret"}
    files = [("batch", (f"p{i}.png", png(), "image/png")) for i in range(3)]
    data = {**FIELDS, "num_inference_steps": "30", "prompt": "[slow] make it red"}  # >= 9 s an item: all stay pending
    first = http.post(f"{keyed_server.url}/v1/jobs", files=files, data=data, headers=headers, timeout=60)
    assert first.status_code == 202, first.text
    second = http.post(f"{keyed_server.url}/v1/jobs", files=files[:2], data=data, headers=headers, timeout=60)
    assert second.status_code == 429 and second.json()["error"]["code"] == "busy", second.text
    # The fourth place is not for this client (it once took every place), but for another one.
    one = files[:1]
    mine = http.post(f"{keyed_server.url}/v1/jobs", files=one, data=data, headers=headers, timeout=60)
    assert mine.status_code == 429 and "one client would hold more than 3 of the 4 places" in mine.text, mine.text
    theirs = http.post(f"{keyed_server.url}/v1/jobs", files=one, data={**data, "num_inference_steps": "2"},
                        headers={"Authorization": "Bearer other-key-1"}, timeout=60)
    assert theirs.status_code == 202, theirs.text
    assert http.delete(f"{keyed_server.url}/v1/jobs/{first.json()['id']}", headers=headers).status_code == 200
    assert wait_finished(keyed_server.url, theirs.json()["id"], headers={"Authorization": "Bearer other-key-1"},
                         timeout=120)["state"] == "succeeded"
    wait_finished(keyed_server.url, first.json()["id"], headers=headers, timeout=60)


def test_many_clients_at_once(server):
    """Jobs from threads at once: every one finishes, each with its own results."""
    ids, errors = [], []

    def one(i):
        try:
            r = http.post(f"{server.url}/v1/jobs", files=[("batch", (f"t{i}.png", png(), "image/png"))] * 2,
                           data={**FIELDS, "seed": str(i)}, headers=A, timeout=60)
            ids.append((i, r.json()["id"]))
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    for seed, job_id in ids:
        view = wait_finished(server.url, job_id)
        assert view["state"] == "succeeded" and {i["seed"] for i in view["items"]} == {seed}


def test_speed_and_lora_reach_every_item_of_a_job(server):
    """Two items with speed=fastest (and a LoRA): each runs the Lightning preset's 4 steps, and its PNG
    says so; the same settings through /v1/images/edits give the same pixels."""
    files = [("batch", (f"p{i}.png", png(), "image/png")) for i in range(2)]
    fields = {**FIELDS, "num_inference_steps": "6", "speed": "fastest", "lora": "style", "lora_scale": "0.5"}
    r = http.post(f"{server.url}/v1/jobs", files=files, data=fields, headers=A, timeout=60)
    assert r.status_code == 202, r.text
    assert (r.json()["speed"], r.json()["lora"], r.json()["lora_scale"]) == ("fastest", "style", 0.5)
    view = wait_finished(server.url, r.json()["id"])
    assert view["state"] == "succeeded" and [i["num_inference_steps"] for i in view["items"]] == [4, 4], view
    archive = zipfile.ZipFile(io.BytesIO(http.get(f"{server.url}/v1/jobs/{view['id']}/result", headers=A,
                                                   timeout=30).content))
    chunks = [Image.open(archive.open(name)).text for name in archive.namelist()]
    assert [(c["speed"], c["lora"], c["lora_scale"], c["num_inference_steps"]) for c in chunks] == \
        [("fastest", f"{FOUR},style", "1,0.5", "4")] * 2
    single = http.post(f"{server.url}/v1/images/edits", files=[("image", ("s.png", png(), "image/png"))],
                        data=fields, headers=B, timeout=120)
    assert single.status_code == 200, single.text
    same = Image.open(io.BytesIO(base64.b64decode(single.json()["data"][0]["b64_json"])))
    assert np.array_equal(np.asarray(same), np.asarray(Image.open(archive.open(archive.namelist()[0]))))
    assert np.asarray(same).std() > 5  # a real picture, not a black (NaN) one
    lora_only = http.post(f"{server.url}/v1/jobs", files=files[:1], data={**FIELDS, "lora": "style"}, headers=A,
                           timeout=60)
    view = wait_finished(server.url, lora_only.json()["id"])
    assert view["state"] == "succeeded" and view["items"][0]["num_inference_steps"] == 2  # quality: the asked-for steps
    png_text = Image.open(io.BytesIO(http.get(f"{server.url}/v1/jobs/{view['id']}/result", headers=A,
                                               timeout=30).content)).text
    assert (png_text["lora"], png_text["lora_scale"], "speed" in png_text) == ("style", "1", False)


@pytest.mark.parametrize("fields, param, says", [
    ({"lora": "nope"}, "lora", "unknown LoRA 'nope'; configured LoRAs: " + FOUR + ", style"),
    ({"speed": "fast"}, "speed", "speed fast needs a Lightning 8-step LoRA"),
    ({"speed": "warp"}, "speed", "speed must be one of quality, fast, fastest"),
    ({"lora": "style", "lora_scale": "many"}, "lora_scale", "lora_scale must be a number"),  # named since #47
])
def test_bad_speed_or_lora_is_a_400_before_anything_runs(server, fields, param, says):
    done = server.manager.status().workers[0].jobs_done
    r = http.post(f"{server.url}/v1/jobs", files=[("batch", ("p.png", png(), "image/png"))] * 2,
                   data={**FIELDS, **fields}, headers=A, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_input", param)
    assert says in error["message"] and "Traceback" not in r.text
    assert server.manager.status().workers[0].jobs_done == done  # nothing ran


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "1e400"])
@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/images/edits"])
def test_a_non_finite_lora_scale_is_a_400_everywhere_even_without_a_lora(server, path, raw):
    """Before: /v1/jobs answered 500 in plain text and still ran the job; /v1/images/edits gave 200."""
    done = server.manager.status().workers[0].jobs_done
    field = "batch" if path == "/v1/jobs" else "image"
    r = http.post(f"{server.url}{path}", files=[(field, ("p.png", png(), "image/png"))],
                   data={**FIELDS, "lora_scale": raw}, headers=A, timeout=60)
    assert r.status_code == 400, r.text
    assert "lora_scale must be a finite number" in r.json()["error"]["message"]
    assert server.manager.status().workers[0].jobs_done == done  # nothing ran


def test_a_lora_scale_out_of_range_is_refused_without_a_lora_too(server):
    r = http.post(f"{server.url}/v1/jobs", files=[("batch", ("p.png", png(), "image/png"))],
                   data={**FIELDS, "lora_scale": "7"}, headers=A, timeout=60)
    assert r.status_code == 400 and "lora_scale 7.0 is out of range: 0 to 2" in r.json()["error"]["message"]


def test_v1_jobs_refuses_the_elongated_image_v1_images_edits_refuses(server):
    """A 1000x1 image: both entry points answer 400 up front, naming the image (before: /v1/jobs took
    it and the item failed later)."""
    buffer = io.BytesIO()
    Image.new("RGB", (1000, 1)).save(buffer, format="PNG")
    for path, field in (("/v1/images/edits", "image"), ("/v1/jobs", "batch")):
        r = http.post(f"{server.url}{path}", files=[(field, ("thin.png", buffer.getvalue(), "image/png"))],
                       data=FIELDS, headers=A, timeout=60)
        assert r.status_code == 400, (path, r.text)
        assert "aspect" in r.json()["error"]["message"], (path, r.text)


def test_a_result_item_that_is_not_a_number_is_an_openai_shaped_400(server):
    job = http.post(f"{server.url}/v1/jobs", files=[("image", ("p.png", png(), "image/png"))], data=FIELDS,
                     headers=A, timeout=60).json()
    wait_finished(server.url, job["id"])
    for raw in ("abc", "-1", "1.5", "9" * 30):
        r = http.get(f"{server.url}/v1/jobs/{job['id']}/result", params={"item": raw}, headers=A, timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_input", "item")
        assert "item must be a whole number" in error["message"] and "Input should be" not in r.text
    assert http.get(f"{server.url}/v1/jobs/{job['id']}/result", params={"item": "1"}, headers=A,
                     timeout=30).status_code == 200


def test_too_many_files_or_fields_name_the_limit(live_server):
    """#47 item 5: 200 batch files were "malformed multipart body (HTTPException)"; 5,000 form fields too."""
    files = [("batch", (f"in{i}.png", b"x", "image/png")) for i in range(200)]
    r = http.post(f"{live_server.url}/v1/jobs", data={"prompt": "x"}, files=files, timeout=60)
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "too many files" in message and "BATCH_MAX_ITEMS" in message, r.text
    fields = {f"field{i}": "1" for i in range(5000)}
    for route in ("/v1/jobs", "/v1/images/edits", "/v1/prompts/enhance"):  # the siblings share read_form
        r = http.post(f"{live_server.url}{route}", data={"prompt": "x", **fields},
                      files=[("image", ("in.png", b"x", "image/png"))], timeout=60)
        assert r.status_code == 400 and "too many form fields: at most 64" in r.json()["error"]["message"], r.text


def test_one_unreadable_file_fails_alone_and_the_rest_run(server):
    """#46 item 5: a zip with one broken member was refused whole (400) where the page's Batch tab runs the rest:
    now the job runs what can run and reports each failure by its name ("partial: 3 of 4")."""
    files = [("batch", ("photo.png", png(), "image/png")), ("batch", ("notes.png", b"hello", "image/png")),
             ("batch", ("more.zip", zipped(["a.png", "b.png"]), "application/zip"))]
    broken = io.BytesIO()
    with zipfile.ZipFile(broken, "w") as archive:
        archive.writestr("good.png", png())
        archive.writestr("broken.png", b"\x89PNG\r\n\x1a\n not really")
    files.append(("batch", ("mixed.zip", broken.getvalue(), "application/zip")))
    r = http.post(f"{server.url}/v1/jobs", files=files, data=FIELDS, headers=A, timeout=60)
    assert r.status_code == 202, r.text
    view = wait_finished(server.url, r.json()["id"])
    states = {i["name"]: (i["state"], i["error"]) for i in view["items"]}
    assert view["state"] == "partial" and view["done"] == 4 and view["failed"] == 2, view
    assert states["notes.png"][0] == "failed" and "notes.png is not a readable image" in states["notes.png"][1]
    assert states["broken.png"][0] == "failed" and "broken.png is not a readable image" in states["broken.png"][1]
    assert all(states[n][0] == "succeeded" for n in ("photo.png", "a.png", "b.png", "good.png")), states
