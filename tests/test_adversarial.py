"""An adversarial mix against a live server on every run: junk over the Gradio API and REST, file
paths that were never uploaded, concurrent clients of every kind, cancel storms and API keys.

Every answer must be one of ours (our message, no framework text, no traceback), no junk may cost
GPU work, and afterwards the server must be idle and still edit.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import threading
import time
import uuid

import httpx
import openai
import pytest
from conftest import ROOT, ConcurrencyProbe, http, make_manager, picture, start_server, wait_for
from gradio_client import Client, handle_file
from gradio_client.utils import Status
from raw_gradio import RawGradio, file_data

FRAMEWORK_TEXT = ("Traceback", 'File "', "validation error", "Input should", "pydantic", "Cannot move",
                  "KeyError", "TypeError", "ValueError", "AttributeError", "NoneType", "object has no attribute",
                  "Field required", "not found in", "Exception", "internal error")
FIELDS = {"prompt": "make it red", "size": "64x64", "num_inference_steps": "2", "seed": "1"}
API_DOC = ROOT / "docs" / "api.md"


def png(w: int = 64, h: int = 48) -> bytes:
    buffer = io.BytesIO()
    picture(w, h).save(buffer, format="PNG")
    return buffer.getvalue()


def assert_ours(text: str) -> None:
    found = [marker for marker in FRAMEWORK_TEXT if marker in text]
    assert not found, f"framework text {found} reached the client: {text[:400]}"


def jobs_done(manager) -> int:
    return sum(w.jobs_done for w in manager.workers)


def wait_idle(manager, seconds: float = 60) -> None:
    deadline = time.time() + seconds
    while any(w.state == "busy" for w in manager.workers) or manager.waiting():
        assert time.time() < deadline, "the server did not go idle"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def raw(live_server):
    client = RawGradio(live_server.url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def uploaded(live_server, image_file) -> str:
    with open(image_file, "rb") as f:
        r = http.post(f"{live_server.url}/gradio_api/upload", files={"files": ("in.png", f, "image/png")}, timeout=30)
    return r.json()[0]


def good(path: str) -> list:
    return [[file_data(path)], "make it red", "", 1, False, 2, 4.0, 1, 64, 64]


def junk_edit_payloads(path: str) -> list:
    """Bad `data` for /edit: shapes, types, ranges, paths; each must be refused up front."""
    base = good(path)

    def with_(i, value):
        data = list(base)
        data[i] = value
        return data

    return [
        None, "x", 5, {}, [], [1] * 3, [None] * 10,
        with_(0, "just a string"), with_(0, 5), with_(0, {"path": 5}), with_(0, [{"path": None}]),
        with_(0, [{"path": "/etc/passwd", "meta": {"_type": "gradio.FileData"}}]),
        with_(0, [file_data("../../../../etc/hosts")]), with_(0, [file_data("x" * 5000)]),
        with_(0, [file_data("/proc/self/environ")]), with_(0, [[[[[[file_data("/etc/shadow")]]]]]]),
        with_(0, [file_data(path)] * 4), with_(0, []),
        with_(1, ""), with_(1, {"a": 1}), with_(1, ["x"]), with_(1, "x" * 100_000),
        with_(2, 7), with_(3, "abc"), with_(3, -1), with_(3, 2**70), with_(3, [1]),
        with_(5, 0), with_(5, 100_000), with_(5, "1e9"), with_(5, 2.5), with_(5, "nan"),
        with_(6, "x"), with_(6, 1e308), with_(6, -3), with_(7, 99), with_(7, 0),
        with_(8, -64), with_(8, 10**9), with_(9, "tall"), with_(8, 20000),
    ]


def test_junk_over_the_gradio_queue_is_refused_with_our_words(live_server, raw, server_manager, uploaded):
    edit = raw.fn_index(api_name="edit")
    before = jobs_done(server_manager)
    for data in junk_edit_payloads(uploaded):
        r = raw.join(edit, data)
        assert r.status_code in (400, 422), (data if len(str(data)) < 300 else str(data)[:300], r.status_code, r.text)
        assert_ours(r.text)
    assert jobs_done(server_manager) == before  # none of it reached a worker
    for body in (b"", b"not json", b"\xff\xfe", b"[]", json.dumps({"data": good(uploaded)}).encode(),
                 json.dumps({"data": good(uploaded), "fn_index": 999, "session_hash": "s"}).encode(),
                 json.dumps({"data": good(uploaded), "fn_index": "x", "session_hash": "s"}).encode()):
        r = http.post(f"{live_server.url}/gradio_api/queue/join", content=body,
                       headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code >= 400, (body[:80], r.text)
        assert_ours(r.text)
    assert jobs_done(server_manager) == before


def test_junk_to_the_private_events_is_refused_with_our_words(raw, uploaded):
    preview = raw.fn_index(trigger=("input-files", "upload"))
    again = raw.fn_index(trigger=("use-result", "click"))
    undo = raw.fn_index(trigger=("chain-undo", "click"))  # the edit chain's steps come back from the browser
    panel = raw.fn_index(api_name="panel")
    def used(gallery, index, chain=None) -> list:  # "Use this result as input": inputs, results, chosen, chain
        return [None, gallery, index, chain]

    cases = [(preview, [[file_data("/etc/hosts")]]), (preview, ["x"]), (preview, [5]), (preview, [[{"path": 1}]]),
             (preview, []), (preview, [None, None]), (again, used([], 0)), (again, used(None, 0)),
             (again, used(["x"], 0)), (again, used([{"image": file_data("/etc/hostname"), "caption": None}], 0)),
             (again, used([{"image": 5}], "x")), (again, used([], 0, {"steps": [["/etc/hosts"]], "at": 0})),
             (undo, [{"steps": [["/etc/hosts"], ["/etc/passwd"]], "at": 1}]), (undo, ["x"]), (undo, [None]),
             (panel, ["extra"]), (9999, [])]
    queued = {preview, again, undo}  # their warnings are toasts, so they run through the queue

    def send(fn, data) -> tuple[int, str]:
        if fn not in queued:
            r = raw.predict(fn, data)
            return r.status_code, r.text
        r = raw.join(fn, data)
        if r.status_code != 200:
            return r.status_code, r.text
        done = [m for m in raw.messages() if m.get("msg") == "process_completed"]
        return (200 if done and done[0]["success"] else 400), json.dumps(done)

    for fn, data in cases:
        status, text = send(fn, data)
        assert_ours(text)
        if status == 200:  # only harmless inputs may pass
            assert "/etc/" not in text
        else:
            assert status in (400, 404, 422, 500), text
    assert send(preview, [[file_data(uploaded)]])[0] == 200


def test_gradio_file_route_serves_no_server_file(live_server):
    for path in ("/etc/passwd", "../../../../etc/hosts", "/proc/self/environ", "README.md",
                 str(ROOT / "imgedit" / "web" / "app.py"), str(ROOT / "docs" / "screenshot.png")):
        if path.startswith(str(ROOT)):
            assert os.path.isfile(path), path  # a server file that exists: the probe must be able to fail
        r = http.get(f"{live_server.url}/gradio_api/file={path}", timeout=30)
        assert r.status_code in (403, 404), (path, r.status_code)
        assert b"root:" not in r.content and b"build_app" not in r.content and b"PNG" not in r.content


def test_junk_over_rest_is_an_openai_error(live_server, server_manager):
    url = f"{live_server.url}/v1/images/edits"
    before = jobs_done(server_manager)
    cases = [
        {"content": b"", "headers": {"content-type": "application/json"}},
        {"content": b'{"prompt": "x"}', "headers": {"content-type": "application/json"}},
        {"content": b"--zz\r\nbroken", "headers": {"content-type": "multipart/form-data; boundary=zz"}},
        {"data": {"prompt": "x"}},
        {"files": {"image": ("a.png", b"not a png", "image/png")}, "data": FIELDS},
        {"files": {"image": ("a.png", png(), "image/png")}, "data": {**FIELDS, "n": "1000"}},
        {"files": {"image": ("a.png", png(), "image/png")}, "data": {**FIELDS, "size": "-1x5"}},
        {"files": {"image": ("a.png", png(), "image/png")}, "data": {**FIELDS, "size": "64x"}},
        {"files": {"image": ("a.png", png(), "image/png")}, "data": {**FIELDS, "num_inference_steps": "1e9"}},
        {"files": {"image": ("a.png", png(), "image/png")}, "data": {**FIELDS, "seed": "-5"}},
        {"files": {"image": ("a.png", png(), "image/png")}, "data": {**FIELDS, "true_cfg_scale": "nan"}},
        {"files": {"image": ("a.png", png(), "image/png")}, "data": {**FIELDS, "response_format": "image_url"}},
        {"files": {"image": ("a.png", png(1, 900), "image/png")}, "data": FIELDS},
        {"files": [("image", ("a.png", png(), "image/png"))] * 4, "data": FIELDS},
        {"files": {"image": ("a.png", png(), "image/png")}, "data": {**FIELDS, "prompt": ""}},
        {"files": {"image": ("a.png", png(), "image/png")}, "data": {**FIELDS, "prompt": "x" * 5000}},
    ]
    for case in cases:
        r = http.post(url, timeout=60, **case)
        assert 400 <= r.status_code < 500, (str(case)[:200], r.status_code, r.text)
        assert set(r.json()) == {"error"} and r.json()["error"]["message"], r.text
        assert_ours(r.text)

    def chunked():
        yield b"--zz\r\n"

    r = http.post(url, content=chunked(), headers={"content-type": "multipart/form-data; boundary=zz"}, timeout=30)
    assert r.status_code == 400 and "Content-Length" in r.json()["error"]["message"]
    assert jobs_done(server_manager) == before


@pytest.fixture(scope="module")
def keyed(plus_ckpt):
    manager = make_manager(plus_ckpt, API_KEY="s3cret-key", API_KEYS="ci:ci-key-0001,alice:alice-key-01",
                           GRADIO_AUTH="ann:pw-1,bob:pw-2,alice:pw-3")
    with start_server(manager) as server:
        yield server, manager


def test_api_key_and_login_hold(keyed):
    server, manager = keyed
    url = f"{server.url}/v1/images/edits"
    files = {"image": ("a.png", png(), "image/png")}
    for header in (None, "", "Bearer", "Bearer ", "Bearer wrong", "Basic s3cret-key", "bearer s3cret-keyX",
                   "Bearer s3cret-ke", "s3cret-key", "Bearer s3cret-key\x00"):
        headers = {} if header is None else {"authorization": header}
        try:
            r = http.post(url, files=files, data=FIELDS, headers=headers, timeout=30)
        except httpx.LocalProtocolError:
            continue  # the client itself refuses to send such a header
        assert r.status_code == 401, (header, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert http.get(f"{server.url}/metrics", timeout=30).status_code == 401
    for route in ("/v1/models", "/v1/images/results/req_x/1"):  # OpenAI's model list, response_format=url's images
        assert http.get(f"{server.url}{route}", timeout=30).status_code == 401, route
    assert http.get(f"{server.url}/metrics", headers={"authorization": "Bearer s3cret-key"}, timeout=30).is_success
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="s3cret-key", max_retries=0, timeout=120)
    out = sdk.images.edit(model="m", image=[("a.png", png(), "image/png")], prompt="x", size="64x64",
                          response_format="b64_json", extra_body={"num_inference_steps": 2})
    assert len(out.data) == 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).images.edit(
            model="m", image=[("a.png", png(), "image/png")], prompt="x")
    # The page and its API need the login; the events cannot be reached without it.
    assert http.post(f"{server.url}/gradio_api/queue/join", json={"data": [], "fn_index": 1, "session_hash": "s"},
                      timeout=30).status_code in (401, 403)
    with pytest.raises(Exception, match="(?i)login|auth|credentials"):
        Client(server.url, verbose=False)
    # #62 item 9: docs/api.md shows the login call; run as the docs write it, with one GRADIO_AUTH pair
    shown = re.search(r'`(Client\("http://localhost:7860/", auth=\(user, password\)\))`', API_DOC.read_text())
    assert shown, "docs/api.md no longer shows gradio_client's login"
    c = eval(shown.group(1).replace('"http://localhost:7860/"', "url"),  # noqa: S307 (the docs' own line)
             {"Client": Client, "url": server.url, "user": "ann", "password": "pw-1"})
    assert c.predict(api_name="/gpu_status")["workers"]


def test_owned_keys_and_logins_each_see_their_own_and_open_views_show_no_ids(keyed, image_file):
    """#27 items 3, 4, 13: unguessable request ids; a named key (API_KEYS) reads only its own results;
    /health and /gpu_status show neither job ids, process ids, the checkpoint's path nor LoRA files
    (those are in /v1/status, for key holders); two logins have two Histories."""
    server, manager = keyed
    keys = {name: {"authorization": f"Bearer {key}"} for name, key in
            (("ci", "ci-key-0001"), ("alice", "alice-key-01"), ("shared", "s3cret-key"))}
    made = [http.post(f"{server.url}/v1/images/edits", files={"image": ("a.png", png(), "image/png")},
                       data=FIELDS, headers=keys["ci"], timeout=120).json()["request_id"] for _ in range(2)]
    assert all(re.fullmatch(r"req_[A-Za-z0-9_-]{16}", rid) for rid in made) and made[0] != made[1], made
    wait_for(lambda: http.get(f"{server.url}/v1/jobs/{made[0]}", headers=keys["ci"], timeout=30).status_code == 200,
             30)  # stored after the reply
    for other in ("alice", "shared"):
        r = http.get(f"{server.url}/v1/jobs/{made[0]}/result", headers=keys[other], timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (other, r.text)
    assert http.get(f"{server.url}/v1/jobs/{made[0]}/result", timeout=30).status_code == 401

    # While a job runs: the open views say "a job"; /v1/status names it to its owner alone, and shows the
    # worker processes' ids to the operator's API_KEY alone (#47 item 4).
    slow = threading.Thread(target=lambda: http.post(
        f"{server.url}/v1/images/edits", files={"image": ("a.png", png(), "image/png")},
        data={**FIELDS, "prompt": "[slow] make it red", "num_inference_steps": "8"}, headers=keys["alice"],
        timeout=120))
    slow.start()
    assert http.get(f"{server.url}/v1/status", timeout=30).status_code == 401

    def running() -> dict | None:
        details = http.get(f"{server.url}/v1/status", headers=keys["alice"], timeout=30).json()
        return next((w for w in details["workers"] if w["job_id"]), None)

    wait_for(lambda: running() is not None, 60)
    job_id = running()["job_id"]
    assert "pids" not in running()  # a named key is no operator
    others = [http.get(f"{server.url}/v1/status", headers=keys[k], timeout=30).json() for k in ("ci", "shared")]
    assert all([w["job_id"] for w in other["workers"]] == ["a job"] for other in others), others
    pids = others[1]["workers"][0]["pids"]  # API_KEY: the operator
    assert "pids" not in others[0]["workers"][0] and job_id not in json.dumps(others)
    health = http.get(f"{server.url}/health", timeout=30)
    gpu_status = Client(server.url, auth=("bob", "pw-2"), verbose=False).predict(api_name="/gpu_status")
    for open_view in (health.json(), gpu_status):
        assert [w["job_id"] for w in open_view["workers"]] == ["a job"], open_view
        assert all("pids" not in w for w in open_view["workers"])
        assert "/" not in open_view["model"] and all("file" not in lora for lora in open_view["loras"])
    assert job_id.startswith("req_") and job_id not in health.text and pids and str(pids[0]) not in health.text
    slow.join(120)

    # Two logins, two Histories: ann's edit is not in bob's.
    ann, bob = (Client(server.url, auth=login, verbose=False) for login in (("ann", "pw-1"), ("bob", "pw-2")))
    ann.predict([handle_file(str(image_file))], "x", "", 3, False, 2, 4.0, 1, 64, 64, api_name="/edit")
    assert len(ann.predict(api_name="/history")) == 1 and bob.predict(api_name="/history") == []
    # #62: alice's page History shows what her key made over REST beside her page edits (API_KEYS and GRADIO_AUTH
    # both name her); ci's key (no login of that name) stays apart.
    alice = Client(server.url, auth=("alice", "pw-3"), verbose=False)
    wait_for(lambda: any("[slow]" in e["prompt"] for e in alice.predict(api_name="/history")), 30)
    alice.predict([handle_file(str(image_file))], "y", "", 4, False, 2, 4.0, 1, 64, 64, api_name="/edit")
    listed = alice.predict(api_name="/history")
    assert sorted((e["prompt"], e["source"]) for e in listed) == [("[slow] make it red", "rest"), ("y", "api")], listed
    assert not any(e["prompt"] == "make it red" for who in (alice, ann, bob) for e in who.predict(api_name="/history"))


def test_concurrent_clients_of_every_kind_with_junk_between(live_server, server_manager, image_file, uploaded):
    probe = ConcurrencyProbe(server_manager)
    results, problems = [], []

    def guarded(fn):
        def run(*args):
            try:
                results.append(fn(*args))
            except Exception as exc:  # collected and reported below
                problems.append(f"{fn.__name__}{args}: {type(exc).__name__}: {exc}")
        return run

    @guarded
    def gradio_edit(seed):
        return ("gradio", Client(live_server.url, verbose=False).predict(
            [handle_file(str(image_file))], "x", "", seed, False, 2, 4.0, 1, 64, 64, api_name="/edit")[1])

    @guarded
    def rest_edit(seed):
        r = http.post(f"{live_server.url}/v1/images/edits", files={"image": ("a.png", png(), "image/png")},
                       data={**FIELDS, "seed": str(seed)}, timeout=120)
        assert r.status_code == 200, r.text
        return ("rest", r.json()["seed"])

    @guarded
    def sdk_edit(seed):
        sdk = openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="x", max_retries=0, timeout=120)
        out = sdk.images.edit(model="m", image=[("a.png", png(), "image/png")], prompt="x", size="64x64",
                              response_format="b64_json", extra_body={"num_inference_steps": 2, "seed": seed})
        return ("sdk", out.model_extra["seed"])

    @guarded
    def junk(i):
        raw = RawGradio(live_server.url)
        r = raw.join(raw.fn_index(api_name="edit"), [[file_data(f"/etc/passwd{i}")], "x"])
        assert r.status_code == 400
        assert_ours(r.text)
        r = http.post(f"{live_server.url}/v1/images/edits", content=b"x" * 100, timeout=30,
                       headers={"content-type": "multipart/form-data; boundary=q"})
        assert r.status_code == 400
        return ("junk", i)

    threads = [threading.Thread(target=f, args=(seed,)) for f, seed in
               [(gradio_edit, 201), (rest_edit, 202), (sdk_edit, 203), (gradio_edit, 204), (junk, 1),
                (rest_edit, 205), (junk, 2), (sdk_edit, 206)]]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
    finally:
        probe.close()
    assert problems == []
    assert sorted(seed for kind, seed in results if kind != "junk") == [201, 202, 203, 204, 205, 206]
    assert max(probe.max_active.values()) == 1
    wait_idle(server_manager)


def test_cancel_storm_then_everyone_else_is_served(live_server, server_manager, image_file):
    rng = random.Random(17)
    storm = Client(live_server.url, verbose=False)
    bystander = Client(live_server.url, verbose=False)
    args = lambda seed, steps: ([handle_file(str(image_file))], "x", "", seed, False, steps, 4.0, 1, 64, 64)  # noqa: E731
    wait_idle(server_manager)
    # Six jobs fill this server (two workers, QUEUE_MAX_SIZE=4): two to keep, four in the storm.
    keep = [bystander.submit(*args(300 + i, 3), api_name="/edit") for i in range(2)]
    # Gradio's queue counts an event until one of the two workers' slots takes it: the storm comes once both
    # kept jobs were taken (on a loaded machine a storm sent at once found them still queued: "Queue is full").
    started = (Status.PROCESSING, Status.ITERATING, Status.PROGRESS, Status.FINISHED)
    wait_for(lambda: all(job.done() or job.status().code in started for job in keep), 60, "the kept jobs never ran")
    doomed = [storm.submit(*args(400 + i, 10), api_name="/edit") for i in range(4)]
    survivors = []
    for job in doomed:
        time.sleep(rng.random() * 0.2)
        if rng.random() < 0.7:
            job.cancel()
            job.cancel()  # twice: a repeated cancel is harmless
        else:
            survivors.append(job)
    # Cancels naming events that do not exist, or another client's, change nothing.
    for body in ({"session_hash": "nobody", "fn_index": 1, "event_id": uuid.uuid4().hex},
                 {"session_hash": bystander.session_hash, "fn_index": 1, "event_id": "x"}):
        assert http.post(f"{live_server.url}/gradio_api/cancel", json=body, timeout=30).status_code == 200
    assert sorted(job.result(timeout=240)[1] for job in keep) == [300, 301]
    for job in survivors:
        assert 400 <= job.result(timeout=240)[1] < 404
    # REST clients that hang up mid-job.
    for _ in range(2):
        with pytest.raises(httpx.TimeoutException):
            http.post(f"{live_server.url}/v1/images/edits", files={"image": ("a.png", png(), "image/png")},
                       data={**FIELDS, "num_inference_steps": "30"}, timeout=0.5)
    wait_idle(server_manager)
    assert bystander.predict(*args(500, 2), api_name="/edit")[1] == 500
    storm.close()
    bystander.close()
