"""The Gradio app through the real gradio_client against the real server (tiny model, CPU workers)."""

from __future__ import annotations

import struct
import threading
import time
import zlib
from pathlib import Path

import pytest
from conftest import ConcurrencyProbe, group_plan, http, make_manager, picture, start_server
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError, ValidationError
from gradio_client.utils import QueueError
from PIL import Image

from imgedit.protocol import EDIT, parameters


def edit_args(files, steps=2, seed=1, randomize=False, width=64, height=64, prompt="make it red", n=1):
    return ([handle_file(str(f)) for f in files], prompt, "", seed, randomize, steps, 4.0, n, width, height)


@pytest.fixture(scope="module")
def client(live_server):
    return Client(live_server.url, verbose=False)


def test_edit_round_trip_returns_png_and_seed(client, image_file):
    gallery, seed = client.predict(*edit_args([image_file], seed=5), api_name="/edit")
    assert seed == 5 and len(gallery) == 1
    path = Path(gallery[0]["image"])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert Image.open(path).size == (64, 64)
    _, random_seed = client.predict(*edit_args([image_file], randomize=True), api_name="/edit")
    assert isinstance(random_seed, int) and 0 <= random_seed < 2**31
    # #62: a seed given by keyword is the seed used (randomize_seed's API default is False); none: a random one
    small = dict(images=[handle_file(str(image_file))], prompt="x", num_inference_steps=2, width=64, height=64)
    assert client.predict(**small, seed=42, api_name="/edit")[1] == 42
    drawn = {client.predict(**small, api_name="/edit")[1] for _ in range(2)}
    assert len(drawn) == 2, drawn


def test_the_gradio_api_contract_optional_parameters_named_results_same_names(client, image_file):
    """view_api once marked negative_prompt, num_inference_steps and true_cfg_scale required (so a call with
    images and prompt alone failed), left the results unnamed and named /batch's steps and CFG otherwise."""
    info = client.view_api(return_format="dict", print_info=False)
    assert set(info["named_endpoints"]) == {"/edit", "/gpu_status", "/batch", "/history", "/enhance_prompt",
                                            "/select_mask"}
    assert not info["unnamed_endpoints"]
    edit = info["named_endpoints"]["/edit"]
    names = [p["parameter_name"] for p in edit["parameters"]]
    assert names[:2] == ["images", "prompt"] and not any(p["parameter_has_default"] for p in edit["parameters"][:2])
    assert all(p["parameter_has_default"] for p in edit["parameters"][2:]), edit["parameters"]
    assert [r["label"] for r in edit["returns"]] == ["images", "seed"]
    # /batch takes /edit's parameters but the mask ones (a mask belongs to one image) and enhance_prompt
    assert names[13:] == ["mask", "mask_grow", "mask_feather", "strength", "enhance_prompt", "cache", "expand",
                          "mask_prompt"]
    enhance = info["named_endpoints"]["/enhance_prompt"]
    assert [p["parameter_name"] for p in enhance["parameters"]] == ["images", "prompt"]
    assert [r["label"] for r in enhance["returns"]] == ["prompt"]
    # (the step cache is /batch's too: the page's Step cache applies to both tabs)
    batch = [p["parameter_name"] for p in info["named_endpoints"]["/batch"]["parameters"]]
    assert batch[1:] == names[1:13] + ["cache", "expand"]
    gallery, seed = client.predict(images=[handle_file(str(image_file))], prompt="make it red", seed=4,
                                   randomize_seed=False, num_inference_steps=2, width=64, height=64, api_name="/edit")
    assert len(gallery) == 1 and seed == 4


def test_gpu_status_api_without_gpus(client, live_server):
    data = client.predict(api_name="/gpu_status")
    assert data["gpus"] == [] and "no GPU is visible" in data["message"]
    assert [w["name"] for w in data["workers"]] == ["worker-0", "worker-1"]
    assert data["workers"][0]["placement"] == {"transformer": "cpu", "text_encoder": "cpu", "vae": "cpu"}
    assert data["workers"][0]["encode_cache"] == 8  # ENCODE_CACHE's default, as the worker installed it
    # The README's `GET /gpu_status` over plain HTTP (it was a 404): the same data, open like /health.
    plain = http.get(f"{live_server.url}/gpu_status", timeout=30)
    assert plain.status_code == 200 and plain.headers["content-type"] == "application/json"
    assert plain.json().keys() == data.keys() and plain.json()["workers"][0]["placement"] == data["workers"][0][
        "placement"] and plain.json()["message"] == data["message"]


def test_concurrent_submits_complete_without_overlap_also_after_a_cancel(client, server_manager, image_file):
    probe = ConcurrencyProbe(server_manager)
    try:
        long_job = client.submit(*edit_args([image_file], steps=40), api_name="/edit")
        deadline = time.time() + 60
        while not any(w.state == "busy" and w.progress.step >= 1 for w in server_manager.workers):
            assert time.time() < deadline, "the long job never started"
            time.sleep(0.05)
        long_job.cancel()
        # The GPU work really stops: the worker is free again well before 40 steps could finish.
        deadline = time.time() + 20
        while any(w.state == "busy" for w in server_manager.workers):
            assert time.time() < deadline, "cancel did not stop the pipeline"
            time.sleep(0.05)
        assert all(w.progress.step < 40 for w in server_manager.workers)
        jobs = [client.submit(*edit_args([image_file], seed=i), api_name="/edit") for i in range(4)]
        seeds = sorted(job.result(timeout=300)[1] for job in jobs)
    finally:
        probe.close()
    assert seeds == [0, 1, 2, 3]
    assert probe.max_active == {"worker-0": 1, "worker-1": 1}


def bomb_png(path: Path, width: int = 30000, height: int = 30000) -> Path:
    """A tiny PNG whose header claims a huge size: decoding it would need gigabytes."""
    Image.new("RGB", (1, 1)).save(path)
    data = bytearray(path.read_bytes())
    ihdr = data[12:29]
    ihdr[4:12] = struct.pack(">II", width, height)
    data[12:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)) & 0xFFFFFFFF)
    path.write_bytes(bytes(data))
    return path


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bad")
    text = folder / "notes.png"
    text.write_text("this is not an image")
    return {"text": text, "bomb": bomb_png(folder / "bomb.png")}


@pytest.mark.parametrize("case, message", [
    ("no_image", "no input image"),
    ("four_images", "takes at most 3"),
    ("not_an_image", "notes.png (image 1) is not a readable image"),  # the file by its name (#46 item 9)
    ("bomb", "67,108,864 pixels: 4 x MAX_INPUT_PIXELS"),
    ("zero_steps", "num_inference_steps 0 is out of range"),
    ("many_steps", "num_inference_steps 10000 is out of range"),
    ("huge_size", "MAX_OUTPUT_PIXELS"),
    ("empty_prompt", "prompt is empty"),
])
def test_bad_inputs_get_their_own_message_and_cost_nothing(client, server_manager, image_file, bad_files,
                                                           case, message, capfd):
    files, kw = [image_file], {}
    if case == "no_image":
        files = []
    elif case == "four_images":
        files = [image_file] * 4
    elif case == "not_an_image":
        files = [bad_files["text"]]
    elif case == "bomb":
        files = [bad_files["bomb"]]
    elif case == "zero_steps":
        kw = {"steps": 0}
    elif case == "many_steps":
        kw = {"steps": 10000}
    elif case == "huge_size":
        kw = {"width": 9000, "height": 9000}
    elif case == "empty_prompt":
        kw = {"prompt": "  "}
    done_before = sum(w.jobs_done for w in server_manager.workers)
    with pytest.raises((ValidationError, AppError)) as info:
        client.predict(*edit_args(files, **kw), api_name="/edit")
    text = str(info.value)
    assert message in text, text
    assert "Traceback" not in text
    assert "Traceback" not in capfd.readouterr().err  # nor in the server's log (the validator refused it)
    assert sum(w.jobs_done for w in server_manager.workers) == done_before  # no GPU work was spent
    _, seed = client.predict(*edit_args([image_file], seed=9), api_name="/edit")  # still serving
    assert seed == 9


def test_queue_full_gives_the_busy_error(plus_ckpt, image_file):
    manager = make_manager(plus_ckpt, QUEUE_MAX_SIZE="1")
    with start_server(manager) as server:
        c = Client(server.url, verbose=False)
        running = c.submit(*edit_args([image_file], steps=12), api_name="/edit")
        deadline = time.time() + 60
        while manager.workers[0].state != "busy":
            assert time.time() < deadline
            time.sleep(0.05)
        waiting = c.submit(*edit_args([image_file], steps=2), api_name="/edit")
        time.sleep(1.0)
        with pytest.raises((AppError, QueueError), match="busy"):
            Client(server.url, verbose=False).predict(*edit_args([image_file]), api_name="/edit")
        assert running.result(timeout=300)[1] == 1 and waiting.result(timeout=300)[1] == 1


def test_raw_http_cannot_skip_the_queue(live_server):

    r = http.post(f"{live_server.url}/gradio_api/api/edit", json={"data": []}, timeout=30)
    assert r.status_code in (403, 404, 405), r.text


def test_one_line_for_threads_of_many_clients(live_server, server_manager, image_file):
    """Several clients at once: all served, a worker never runs two jobs."""
    probe = ConcurrencyProbe(server_manager)
    seeds, errors = [], []

    def one(i):
        try:
            seeds.append(Client(live_server.url, verbose=False).predict(*edit_args([image_file], seed=20 + i),
                                                                        api_name="/edit")[1])
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    finally:
        probe.close()
    assert errors == [] and sorted(seeds) == [20, 21, 22]
    assert max(probe.max_active.values()) == 1


def test_demo_banner_and_page(plus_ckpt):

    manager = make_manager(plus_ckpt)
    from imgedit.web.app import build_app

    app = build_app(manager.settings, manager, demo=True)
    from conftest import LiveServer, free_port

    with LiveServer(app, free_port()) as server:
        config = http.get(f"{server.url}/config", timeout=30).json()
        assert "outputs are noise" in str(config)
        # A small width and the height from the input's aspect (it was 256x256 whatever the input's shape).
        sizes = {c["props"]["label"]: c["props"]["value"] for c in config["components"]
                 if c.get("props", {}).get("label", "").startswith(("Width", "Height"))}
        assert sizes == {"Width (0 = auto)": 256, "Height (0 = auto)": 0}, sizes


def test_the_before_after_view_keeps_the_inputs_aspect():
    """The comparison once squashed an input of another aspect into the result's shape."""
    from imgedit.web.page.tools import compare_pair

    tall = Image.new("RGB", (60, 120), (200, 0, 0))
    before, after = compare_pair(tall, Image.new("RGB", (64, 64)))
    assert before.size == after.size == (64, 64)
    pixels = before.load()
    assert pixels[32, 32][0] > 150 and pixels[2, 32] == (128, 128, 128)  # the input in the middle, bordered
    assert sum(pixels[x, 32][0] > 150 for x in range(64)) in range(30, 35)  # 60:120 at a height of 64: ~32 wide


def test_after_a_masked_edit_the_before_side_shows_where_the_mask_let_it_change():
    """#26: the before/after slider's "before" is the input with the mask's area tinted (the brush's
    colour), every other pixel the input's."""
    import numpy as np

    from imgedit.web.page.tools import MASK_TINT, compare_pair

    first = Image.new("RGB", (96, 64), (20, 120, 60))
    mask = Image.new("L", (96, 64), 0)
    mask.paste(255, (10, 10, 40, 30))
    before, after = compare_pair(first, first.copy(), mask)
    shown, plain = np.asarray(before, dtype=np.int16), np.asarray(first, dtype=np.int16)
    inside = np.asarray(mask) == 255
    assert (shown[~inside] == plain[~inside]).all()
    expected = (0.6 * plain[inside] + 0.4 * np.array(MASK_TINT)).round()
    assert np.abs(shown[inside] - expected).max() <= 1 and after.size == before.size


def test_step_progress_and_place_in_line_reach_the_client(client, server_manager, image_file):
    """gr.Progress is fed from the manager's threads: the client must see step units move."""
    job = client.submit(*edit_args([image_file], steps=12), api_name="/edit")
    seen = set()
    deadline = time.time() + 120
    while not job.done() and time.time() < deadline:
        status = job.status()
        for unit in status.progress_data or []:
            if unit.unit == "steps" and unit.index:
                seen.add(unit.index)
        time.sleep(0.05)
    assert job.result(timeout=60)[1] == 1
    assert len(seen) >= 2 and max(seen) <= 12, seen


def test_metrics_after_ui_edits(live_server, client, image_file):
    from prometheus_client.parser import text_string_to_metric_families

    client.predict(*edit_args([image_file]), api_name="/edit")
    r = http.get(f"{live_server.url}/metrics", timeout=30)
    assert r.status_code == 200, r.text[:300]
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    assert families["imgedit_queue_length"].samples[0].value == 0
    ok = [s for s in families["imgedit_requests"].samples
          if s.name == "imgedit_requests_total" and s.labels == {"source": "api", "outcome": "ok"}]
    assert ok and ok[0].value >= 1


def test_edit_api_takes_the_documented_keyword_names_and_explains_out_of_range_values(client, server_manager,
                                                                                      image_file):
    """Issue #14 defect 5: the README's names work as keywords; out-of-range values get our reason."""
    params = client.view_api(print_info=False, return_format="dict")["named_endpoints"]["/edit"]["parameters"]
    # the page's inputs, as Gradio publishes them, follow the declaration (imgedit.protocol.PARAMETERS)
    assert [p["parameter_name"] for p in params] == [p.name for p in parameters(EDIT)] == [
        "images", "prompt", "negative_prompt", "seed", "randomize_seed", "num_inference_steps", "true_cfg_scale",
        "num_images", "width", "height", "speed", "lora", "lora_scale", "mask", "mask_grow", "mask_feather",
        "strength", "enhance_prompt", "cache", "expand", "mask_prompt"]
    call = dict(images=[handle_file(str(image_file))], prompt="make it red", negative_prompt="", seed=3,
                randomize_seed=False, num_inference_steps=2, true_cfg_scale=4.0, num_images=1, width=64, height=64)
    gallery, seed = client.predict(**call, api_name="/edit")
    assert seed == 3 and len(gallery) == 1
    done_before = sum(w.jobs_done for w in server_manager.workers)
    for change, message in (({"true_cfg_scale": -5}, "true_cfg_scale -5 is out of range: 1 to 20"),
                            ({"num_images": 1000}, "num_images 1000 is out of range: 1 to"),
                            # one step of the checkpoint's scheduler made a NaN (black) image; now refused
                            ({"num_inference_steps": 1}, "out of range: 2 to 100 (one step makes a blank image")):
        with pytest.raises((ValidationError, AppError)) as info:
            client.predict(**{**call, **change}, api_name="/edit")
        assert message in str(info.value) and "Bad Request" not in str(info.value), str(info.value)
    assert sum(w.jobs_done for w in server_manager.workers) == done_before


def test_every_returned_png_carries_its_settings(live_server, client, image_file):
    """gradio API and REST PNGs carry prompt, seed, steps, CFG, size, model, LoRA and version in text chunks."""
    import base64
    import io

    from imgedit import __version__
    from imgedit.engine.outputs import read_settings

    gallery, _ = client.predict(*edit_args([image_file], seed=11, steps=3, prompt="make it ünicode red"),
                                api_name="/edit")
    text = Image.open(gallery[0]["image"]).text
    assert text["prompt"] == "make it ünicode red" and text["seed"] == "11" and text["num_inference_steps"] == "3"
    assert text["true_cfg_scale"] == "4" and (text["width"], text["height"]) == ("64", "64")
    assert text["lora"] == "none" and text["software"] == f"imgedit {__version__}"
    assert text["model"] == "plus"  # the checkpoint folder's name (QWEN_MODEL_DIR=/tmp/.../plus), never its path
    assert read_settings(gallery[0]["image"]) == {
        "prompt": "make it ünicode red", "negative_prompt": "", "seed": 11, "num_inference_steps": 3,
        "true_cfg_scale": 4.0, "width": 64, "height": 64}
    with open(image_file, "rb") as f:
        r = http.post(f"{live_server.url}/v1/images/edits", files={"image": ("in.png", f, "image/png")},
                       data={"prompt": "rest edit", "size": "64x64", "num_inference_steps": "2", "seed": "4"},
                       timeout=120)
    assert r.status_code == 200, r.text[:300]
    rest = Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))).text
    assert rest["prompt"] == "rest edit" and rest["seed"] == "4" and rest["width"] == "64"
    assert read_settings(image_file) == {}  # a PNG we did not make offers nothing


def test_api_call_snippets_are_valid_code_for_the_form():
    """"Copy as API call": the gradio_client and OpenAI snippets compile; quotes in a prompt stay quoted."""
    import shlex

    from imgedit.web.page.snippets import api_values, curl_snippet, gradio_snippet, input_files, openai_snippet

    form = {"prompt": "it's \"red\"", "negative_prompt": "", "seed": "7", "randomize_seed": False,
            "num_inference_steps": None, "true_cfg_scale": "4.5", "num_images": 2, "width": 64, "height": 0}
    values = api_values(form, input_files(2), {"num_inference_steps": 40, "true_cfg_scale": 4.0})
    assert values["seed"] == 7 and values["num_inference_steps"] == 40 and values["true_cfg_scale"] == 4.5
    code = gradio_snippet("http://host:7860/", values, auth=False)
    compile(code, "gradio_snippet", "exec")
    assert "images=[handle_file('input-1.png'), handle_file('input-2.png')]" in code and "seed=7," in code
    compile(openai_snippet("http://host:7860/", values), "openai_snippet", "exec")
    curl = curl_snippet("http://host:7860/", values)
    command = "\n".join(line for line in curl.splitlines() if not line.startswith("#"))  # the notes above it
    words = shlex.split(command.split("| python3")[0].replace("\\\n", " "))
    assert "prompt=it's \"red\"" in words and "size=auto" in words and "seed=7" in words, words
    assert "seed" not in curl_snippet("http://h/", {**values, "randomize_seed": True})


def test_the_api_snippets_run_as_copied_with_a_login_and_a_key(server_manager, image_file, tmp_path):
    """"Copy as API call" once printed code that did not run as copied: files input-N.png nobody had,
    `auth=(USER, PASSWORD)` (a NameError), a placeholder API key (401) and a curl pipe that swallowed the
    server's errors. Each snippet, exactly as shown for a server with a login and an API key, now runs
    with the inputs offered beside it and the credentials in clearly named environment variables."""
    import dataclasses
    import os
    import shutil
    import subprocess
    import sys
    from types import SimpleNamespace

    from conftest import LiveServer, free_port

    from imgedit.web.app import build_app
    from imgedit.web.page.tools import PageTools
    from imgedit.web.page.uploads import upload_folder

    settings = dataclasses.replace(server_manager.settings, gradio_auth=(("ann", "pw-1"),), api_key="key-1")
    upload = Path(upload_folder()) / "snippet-test" / "photo.png"  # as the page's upload would be
    upload.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(image_file, upload)
    port = free_port()
    with LiveServer(build_app(settings, server_manager), port):
        tools = PageTools(settings, server_manager.family, server_manager.prompt_tokens)
        # #46 items 2 and 3: one side given (128, height 0: the server makes 128x96 of the 80x60 input) and a
        # painted mask (its left half): every snippet repeats exactly that edit
        layer = upload.parent / "strokes.png"
        strokes = Image.new("RGBA", (80, 60), (0, 0, 0, 0))
        strokes.paste((255, 255, 255, 255), (0, 0, 40, 60))
        strokes.save(layer)
        canvas = {"background": {"path": str(upload)}, "layers": [{"path": str(layer)}], "composite": None}
        form = {"images": [{"path": str(upload)}], "prompt": "make it red", "negative_prompt": "", "seed": 5,
                "randomize_seed": False, "num_inference_steps": 2, "true_cfg_scale": 4.0, "num_images": 1,
                "width": 128, "height": 0, "mask_grow": 2, "mask_feather": 3, "strength": 0.8}
        shown = tools.api_call(form, canvas, request=SimpleNamespace(headers={"host": f"127.0.0.1:{port}"}))
        gradio_code, curl_code, openai_code, inputs = shown[1:]
        assert [Path(p).name for p in inputs] == ["input-1.png", "mask.png"]  # offered beside the snippets
        # the size each one asks for is the one the page's edit ran at (REST has no "one side": both)
        assert "width=128," in gradio_code and "height=96," in gradio_code
        assert "size=128x96" in curl_code and "size='128x96'" in openai_code
        for offered in inputs:
            shutil.copyfile(offered, tmp_path / Path(offered).name)
        env = {**os.environ, "IMGEDIT_USER": "ann", "IMGEDIT_PASSWORD": "pw-1", "IMGEDIT_API_KEY": "key-1"}
        runs = {"gradio": [sys.executable, "-c", gradio_code], "curl": ["bash", "-c", curl_code],
                "openai": [sys.executable, "-c", openai_code]}
        settings_of = {}
        for name, argv in runs.items():
            (tmp_path / "out.png").unlink(missing_ok=True)
            out = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
            assert out.returncode == 0, (name, out.stdout[-1000:], out.stderr[-2000:])
            if name == "gradio":
                assert out.stdout.strip().endswith(" 5"), out.stdout  # the result's file and the seed
                made = Image.open(out.stdout.strip().splitlines()[-1].rsplit(" ", 1)[0])
            else:
                assert "wrote out.png" in out.stdout
                made = Image.open(tmp_path / "out.png")
            # a masked edit comes back the first input's size; the model ran at the size asked for
            assert made.size == (80, 60), (name, made.size)
            settings_of[name] = {k: made.text.get(k) for k in ("width", "height", "mask", "mask_grow",
                                                                "mask_feather", "strength")}
        assert settings_of["gradio"] == settings_of["curl"] == settings_of["openai"], settings_of
        assert settings_of["gradio"]["mask"].startswith("sha256:") and settings_of["gradio"]["mask_grow"] == "2"
        # A wrong key: curl's pipe says what the server said (it once failed with KeyError: 'data').
        wrong = subprocess.run(runs["curl"], cwd=tmp_path, env={**env, "IMGEDIT_API_KEY": "nope"},
                               capture_output=True, text=True, timeout=120)
        assert wrong.returncode == 1 and "the server answered" in wrong.stderr, wrong.stderr
        assert "KeyError" not in wrong.stderr and "Traceback" not in wrong.stderr


def test_the_step_cache_in_the_page_and_batch_and_where_it_is_hidden(client, image_file, plus_ckpt):
    """The Step cache choice (Advanced) reaches /batch as /edit's `cache`, and the PNG records it; a Lightning
    speed drops it; on workers that cannot run a cache (a Ulysses group) the control is not shown at all."""
    from imgedit.web.page.blocks import build_blocks
    from imgedit.web.page.speed import SERVER_CACHE, parse_cache_input

    gallery, report, _ = client.predict(*edit_args([image_file]), "quality", "none", 1.0, "first-block",
                                        api_name="/batch")
    assert "1 done" in report and Image.open(gallery[0]["image"]).text["cache"].startswith("first-block:"), report
    assert parse_cache_input(SERVER_CACHE, "quality") is None and parse_cache_input("taylorseer", "fastest") is None
    assert parse_cache_input("taylorseer", "quality") == "taylorseer"

    def cache_control(manager):
        blocks = build_blocks(manager.settings, manager)
        return next(b for b in blocks.blocks.values() if getattr(b, "elem_id", None) == "cache")

    ulysses = make_manager(plus_ckpt, plan=group_plan("ulysses", 2, 2), load=False).prepare()  # no worker started
    assert ulysses.cache_refusal() is not None and cache_control(ulysses).visible is False
    plain = make_manager(plus_ckpt, load=False).prepare()
    control = cache_control(plain)
    assert control.visible is True and control.value == SERVER_CACHE
    assert [value for _, value in control.choices] == [SERVER_CACHE, "none", "first-block", "taylorseer"]


def test_a_pngs_step_cache_is_restored_only_where_the_workers_can_run_one(plus_ckpt):
    """Restore and History's Open/Re-run set the Step cache from a PNG's `cache` ("first-block:0.08" -> first-block;
    none when the PNG has our settings but no cache). Where the control is hidden (a server refusing caches) it
    stays at the server's default: a restored taylorseer there would have every later edit refused."""
    from imgedit.web.page.speed import SERVER_CACHE, stored_cache_choice
    from imgedit.web.page.tools import PageTools

    settings = make_manager(plus_ckpt, load=False).prepare().settings
    stored = {"prompt": "make it red", "seed": 3, "cache": "first-block:0.08"}
    for offered, expected in ((True, "first-block"), (False, SERVER_CACHE)):
        tools = PageTools(settings, "plus", cache_offered=offered)
        kept = tools.restorable(stored)
        assert kept.get("cache") == (expected if offered else None) and kept["seed"] == 3
        names = ("prompt", "seed", "cache")
        assert tools.restore_settings(kept, names)[2] == expected
        assert tools.page_cache("taylorseer", "quality") == ("taylorseer" if offered else None)
    assert stored_cache_choice(None, True) == "none" and stored_cache_choice("teacache", True) == SERVER_CACHE
    assert stored_cache_choice("taylorseer", False) == SERVER_CACHE


def test_a_reloaded_edit_chain_drops_the_steps_whose_files_are_gone():
    """The edit chain is kept in the browser (imgedit.web.page.chain): on a reload a step whose file the upload cache's
    sweep removed, or that names a file outside the cache, is dropped and the rest shows as it was."""
    import shutil
    import uuid

    from gradio.utils import get_upload_folder

    from imgedit.web.page.chain import reload

    folder = Path(get_upload_folder()) / f"chain-{uuid.uuid4().hex}"
    folder.mkdir(parents=True)
    steps = []
    for i in range(3):
        path = folder / f"step-{i}.png"
        picture().save(path)
        steps.append([str(path)])
    try:
        files, prompt, value, group, strip, undo, redo = reload({"steps": steps, "at": 1, "prompts": [None, "a", 3]})
        assert value == {"steps": steps, "at": 1, "prompts": [None, "a", None]} and group["visible"] and len(strip) == 3
        assert undo["interactive"] and redo["interactive"]
        # #62: the step marked "(now)" is in the editor again, with the prompt it was edited with
        assert files == steps[1] and prompt == "a"
        Path(steps[1][0]).unlink()  # swept
        files, _, value, _, strip, undo, redo = reload({"steps": [*steps, ["/etc/hosts"]], "at": 1})
        assert value == {"steps": [steps[0], steps[2]], "at": 1, "prompts": [None, None]}
        assert [s[1] for s in strip] == ["start", "edit 1 (now)"] and files == steps[2]
        assert undo["interactive"] and not redo["interactive"]
        assert reload("junk")[2] == {"steps": [], "at": -1, "prompts": []} and not reload(None)[3]["visible"]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_browser_leaving_mid_upload_is_one_info_line(live_server, caplog):
    """#62: a browser closed mid-upload logged ERROR and an 80-line ClientDisconnect traceback."""
    import logging
    import socket

    caplog.set_level(logging.INFO)
    boundary = "imgedit-boundary"
    head = ("POST /gradio_api/upload HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: 200000\r\n\r\n")
    part = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"files\"; filename=\"a.png\"\r\n"
            "Content-Type: image/png\r\n\r\n").encode() + b"\x89PNG\r\n\x1a\n" + bytes(4000)
    with socket.create_connection(("127.0.0.1", live_server.port), timeout=10) as s:
        s.sendall(head.encode() + part)
        time.sleep(0.5)  # the server is reading the body when the browser goes
    deadline = time.monotonic() + 15
    while not any("client left" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, [(r.levelname, r.getMessage()[:200]) for r in caplog.records]
        time.sleep(0.1)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text[-3000:]
