"""Qwen-Image-2.1 (diffusers' QwenImage21Pipeline) on the tiny 2.1 checkpoint, through a real server: text to
image over OpenAI's `/v1/images/generations` and gradio's `/edit` without an image, edits with up to 10
references, transparency in and out, the family's defaults in /health, and the modes not built for this family
refused in the user's words (a request's 400 naming its parameter, a setting's start-up refusal)."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from conftest import make_manager, start_server
from PIL import Image

from imgedit.errors import PlacementError
from imgedit.model.demo_checkpoint import build_checkpoint

STEPS = {"num_inference_steps": "2", "seed": "3"}


@pytest.fixture(scope="module")
def manager21(ckpt21):
    return make_manager(ckpt21)


@pytest.fixture(scope="module")
def server21(manager21):
    with start_server(manager21) as server:
        yield server


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def noise(size: tuple[int, int], seed: int, mode: str = "RGB") -> Image.Image:
    channels = len(mode)
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (size[1], size[0], channels), np.uint8), mode)


def edit(server, images: list[bytes], **fields) -> httpx.Response:
    files = [("image", (f"in{k}.png", data, "image/png")) for k, data in enumerate(images)]
    return httpx.post(f"{server.url}/v1/images/edits", files=files, timeout=120,
                      data={"prompt": "blend them", **STEPS, **fields})


def result_of(response: httpx.Response) -> Image.Image:
    assert response.status_code == 200, response.text
    return Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"])))


def test_health_names_the_family_and_its_defaults(server21):
    health = httpx.get(f"{server21.url}/health", timeout=10).json()
    assert health["family"] == "21"
    assert health["defaults"] == {"num_inference_steps": 40, "true_cfg_scale": 1.0, "max_images": 10,
                                  "text_to_image": True, "output_resolution": 1024, "transparency": True}


def test_text_to_image_over_openais_generations_with_the_sdk(server21):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server21.url}/v1", api_key="unused")
    made = client.images.generate(model="qwen-image-2.1", prompt="a red fox in the snow", size="64x96",
                                  response_format="b64_json", extra_body={"seed": 7, "num_inference_steps": 2})
    image = Image.open(io.BytesIO(base64.b64decode(made.data[0].b64_json)))
    assert image.size == (64, 96) and image.mode == "RGBA"  # the VAE decodes RGBA: the PNG keeps the alpha
    assert image.info["prompt"] == "a red fox in the snow" and image.info["seed"] == "7"
    pixels = np.asarray(image, dtype=np.float64)
    assert np.isfinite(pixels).all() and pixels.std() > 0
    again = client.images.generate(model="x", prompt="a red fox in the snow", size="64x96", response_format="b64_json",
                                   extra_body={"seed": 7, "num_inference_steps": 2})
    assert again.data[0].b64_json == made.data[0].b64_json  # a seed makes it again


def test_a_generation_is_checked_like_an_edit_and_names_the_parameter(server21):
    url = f"{server21.url}/v1/images/generations"
    cases = [({"prompt": "x", "size": "64x64", "num_inference_steps": 1}, "num_inference_steps"),
             ({"prompt": "x", "n": 99}, "n"),
             ({"prompt": ""}, "prompt"),
             ({"prompt": "x", "image": "aGk="}, "image"),
             ({"prompt": "x", "speed": "fast"}, "speed"),
             ({"prompt": "x", "cache": "first-block"}, "cache")]
    for body, param in cases:
        response = httpx.post(url, json=body, timeout=30)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["param"] == param and "Traceback" not in error["message"], (body, error)
    assert "Lightning" in httpx.post(url, json={"prompt": "x", "speed": "fast"}).json()["error"]["message"]
    not_json = httpx.post(url, data={"prompt": "x"}, timeout=10)
    assert not_json.status_code == 400 and "JSON" in not_json.json()["error"]["message"]


def test_ten_references_edit_and_an_eleventh_is_refused_by_name(server21):
    images = [png(noise((40 + 8 * k, 48), k)) for k in range(11)]
    made = result_of(edit(server21, images[:10], size="64x64"))
    assert made.size == (64, 64)
    refused = edit(server21, images, size="64x64")
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "image" and "at most 10" in refused.json()["error"]["message"]
    none = httpx.post(f"{server21.url}/v1/images/edits", data={"prompt": "x"}, files={"x": ("a.txt", b"a")})
    assert none.status_code == 400 and "/v1/images/generations" in none.json()["error"]["message"]


def test_an_inputs_transparency_reaches_the_model(server21):
    """The same colours, fully transparent, edit differently from their flattening on white (what the server
    did to every input before): the alpha reached the VAE. Opaque RGBA edits exactly as the RGB picture."""
    colours = noise((64, 64), 5)
    transparent = colours.copy()
    transparent.putalpha(0)
    on_white = Image.new("RGB", (64, 64), (255, 255, 255))
    opaque = colours.copy()
    opaque.putalpha(255)
    made = {name: np.asarray(result_of(edit(server21, [png(image)], size="64x64")))
            for name, image in (("transparent", transparent), ("on_white", on_white), ("opaque", opaque),
                                ("rgb", colours))}
    assert np.abs(made["transparent"].astype(int) - made["on_white"]).mean() > 1
    assert np.array_equal(made["opaque"], made["rgb"])


def test_gradio_edit_without_an_image_makes_one_and_the_page_says_generate(server21):
    from gradio_client import Client

    client = Client(server21.url, verbose=False)
    gallery, seed = client.predict(images=[], prompt="a lighthouse", seed=2, randomize_seed=False,
                                   num_inference_steps=2, width=96, height=64, api_name="/edit")
    assert seed == 2 and len(gallery) == 1
    with Image.open(gallery[0]["image"]) as image:
        assert image.size == (96, 64) and image.mode == "RGBA"
    config = httpx.get(f"{server21.url}/config", timeout=10).json()
    shown = {c["props"].get("elem_id"): c["props"] for c in config["components"]}
    assert shown["edit-button"]["value"] == "Generate"
    assert "up to 10" in shown["input-files"]["label"]


def test_an_edit_only_model_refuses_generations(live_server):
    response = httpx.post(f"{live_server.url}/v1/images/generations", json={"prompt": "a fox"}, timeout=10)
    assert response.status_code == 400
    assert "POST /v1/images/edits" in response.json()["error"]["message"]


@pytest.mark.parametrize(("env", "said"), [
    ({"CACHE": "first-block"}, "CACHE=first-block cannot serve Qwen-Image-2.1"),
    ({"DEVICE_MAP": "cfg-parallel"}, "DEVICE_MAP=cfg-parallel cannot serve this model"),
])
def test_modes_not_built_for_the_family_are_refused_at_start_up(ckpt21, env, said):
    from imgedit.planning.plan import GpuSpec

    gpus = [GpuSpec(i, "H200", 140 * 2**30, 139 * 2**30) for i in range(2)]
    manager = make_manager(ckpt21, plan="planner", load=False, **env)
    manager._gpus = gpus
    with pytest.raises(PlacementError, match=said):
        manager.prepare()


def test_auto_gives_each_gpu_a_replica_as_the_family_has_no_pairs(ckpt21):
    from imgedit.planning.plan import GpuSpec

    manager = make_manager(ckpt21, plan="planner", load=False, DEVICE_MAP="auto")
    manager._gpus = [GpuSpec(i, "H200", 140 * 2**30, 139 * 2**30) for i in range(2)]
    manager.prepare()
    assert [(w.plan.parallel, w.plan.devices) for w in manager.workers] == [("none", ("cuda:0",)),
                                                                            ("none", ("cuda:1",))]
    assert "no CFG-parallel pairs for this model" in manager.plan.reason
    assert "DEVICE_MAP=ulysses splits each image over 2 GPUs instead" in manager.plan.reason


def test_a_lora_for_the_family_loads_and_changes_the_image(ckpt21, tmp_path):
    """A LoRA on Qwen-Image-2.1's attention (diffusers' names, checked against its transformer at start-up)
    loads through QwenImageLoraLoaderMixin: at strength 1 it changes the image, at 0 the image is the base's."""
    from imgedit.model.lora_random import random_lora
    from imgedit.model.loras import transformer_linears
    from imgedit.protocol import EditRequest

    random_lora(tmp_path / "loras" / "style21.safetensors", transformer_linears(ckpt21), rank=4, std=0.5,
                style="diffusers", dtype=__import__("torch").float32)
    manager = make_manager(ckpt21, LORA_DIR=str(tmp_path / "loras"))
    assert [lora["name"] for lora in manager.status().loras] == ["style21"]

    def made(**lora) -> np.ndarray:
        result = manager.edit(EditRequest(images=(noise((64, 64), 1),), prompt="paint it", num_inference_steps=2,
                                          width=64, height=64, seed=4, **lora))
        return np.asarray(result.images[0], dtype=np.int16)

    base = made()
    assert np.abs(made(lora="style21", lora_scale=1.0) - base).mean() > 1
    assert np.array_equal(made(lora="style21", lora_scale=0.0), base)


def test_the_real_size_checkpoint_is_the_published_model_and_a_16gb_card_gets_a_plan(tmp_path, monkeypatch):
    """`--size real --kind 21` writes the published configs (7.1 B transformer, Qwen3-VL-8B, the 16x VAE); on one
    80 GB GPU capped at 14.5 GiB (a 16 GB card) `auto` finds a lossless plan: the text encoder streamed per
    prompt, the transformer's blocks partly resident (the host's memory is the GPU machine's, 120 GiB free)."""
    import imgedit.engine.workers.startup as startup_module  # where start-up reads the host's memory
    from imgedit.model.inspect import layer_sizes
    from imgedit.planning.plan import GpuSpec

    real = build_checkpoint(tmp_path / "real21", kind="21", size="real")
    billions = {c["name"]: (sum(c["head"].values()) + sum(sum(b.values()) for b in c["blocks"])) / 1e9
                for c in layer_sizes(real)}
    assert round(billions["transformer"], 1) == 7.1 and round(billions["text_encoder"], 1) == 8.8
    monkeypatch.setattr(startup_module, "available_host_memory", lambda: 120 * 2**30)
    manager = make_manager(real, plan="planner", load=False, DEVICE_MAP="auto", MAX_MEMORY="14.5GiB")
    manager._gpus = [GpuSpec(0, "H100", 80 * 2**30, 79 * 2**30)]
    manager.prepare()
    memory = manager.plan.workers[0].memory
    assert memory.offload_text_encoder and memory.streams_blocks and memory.quantize == ()  # lossless first
    assert not memory.batch_cfg  # no CFG to batch on this family


def test_the_demo_can_serve_the_family(tmp_path):
    from imgedit.config.settings import load_settings
    from imgedit.engine.workers.inspection import ensure_demo_checkpoint
    from imgedit.planning.checkpoint import open_checkpoint

    settings = load_settings({"DEMO": "true", "DEMO_KIND": "21", "DEMO_DIR": str(tmp_path / "demo")})
    assert settings.model_source.endswith("demo-21")  # its own folder: the Plus demo's is never reused
    ensure_demo_checkpoint(settings.model_source, (), settings.demo_kind)
    assert open_checkpoint(settings.model_source).family == "21"


def test_copy_as_api_for_a_text_to_image_runs_as_copied(server21, manager21, tmp_path):
    """With no input image the page's "Copy as API call" offers text to image: gradio's /edit without images,
    curl and the openai SDK on /v1/images/generations; each runs as copied and makes the same image."""
    import os
    import subprocess
    import sys
    from types import SimpleNamespace

    from imgedit.web.page.tools import PageTools

    tools = PageTools(manager21.settings, "21", manager21.prompt_tokens)
    form = {"images": None, "prompt": "a small boat", "negative_prompt": "", "seed": 6, "randomize_seed": False,
            "num_inference_steps": 2, "true_cfg_scale": 1.0, "num_images": 1, "width": 64, "height": 96}
    shown = tools.api_call(form, None, request=SimpleNamespace(headers={"host": f"127.0.0.1:{server21.port}"}))
    gradio_code, curl_code, openai_code, inputs = shown[1:]
    assert inputs is None and "images=[]," in gradio_code
    assert "v1/images/generations" in curl_code and "client.images.generate(" in openai_code
    runs = {"gradio": [sys.executable, "-c", gradio_code], "curl": ["bash", "-c", curl_code],
            "openai": [sys.executable, "-c", openai_code]}
    made = {}
    for name, argv in runs.items():
        (tmp_path / "out.png").unlink(missing_ok=True)
        out = subprocess.run(argv, cwd=tmp_path, env={**os.environ, "IMGEDIT_API_KEY": "none"}, capture_output=True,
                             text=True, timeout=240)
        assert out.returncode == 0, (name, out.stdout[-1000:], out.stderr[-2000:])
        path = out.stdout.strip().splitlines()[-1].rsplit(" ", 1)[0] if name == "gradio" else tmp_path / "out.png"
        with Image.open(path) as image:
            assert image.size == (64, 96) and image.mode == "RGBA", (name, image.size, image.mode)
            made[name] = np.asarray(image)
    assert np.array_equal(made["gradio"], made["curl"]) and np.array_equal(made["curl"], made["openai"])


def test_compiling_is_on_for_the_family_on_whole_gpus_and_off_under_a_cap(ckpt21):
    """COMPILE=auto compiles 2.1's GPU workers (its steps after the first: runtime.compile21, no recompile per
    request), and COMPILE=on is taken; under MAX_MEMORY auto leaves them eager (not measured under a cap)."""
    from imgedit.planning.plan import GpuSpec

    manager = make_manager(ckpt21, plan="planner", load=False, DEVICE_MAP="auto")
    manager._gpus = [GpuSpec(0, "H100", 80 * 2**30, 79 * 2**30)]
    manager.prepare()
    assert manager.settings.compile == "auto" and manager.compile_enabled(manager.workers[0].plan)
    assert manager.status().compile_mode == "default"
    make_manager(ckpt21, plan="planner", load=False, COMPILE="on").prepare()  # not refused
    capped = make_manager(ckpt21, plan="planner", load=False, MAX_MEMORY="14.5GiB")
    capped._gpus = [GpuSpec(0, "H100", 80 * 2**30, 79 * 2**30)]
    capped.prepare()
    assert capped.settings.compile == "off" and not capped.compile_enabled(capped.workers[0].plan)


def test_a_job_of_reference_sets_runs_each_set_and_keeps_its_transparency(server21):
    """/v1/jobs takes sets of up to 10 references for this family (an 11th in a set is refused by name); each
    item's result is an RGBA PNG of the asked size."""
    import time
    import zipfile

    references = [png(noise((40 + 4 * k, 48), k, "RGBA")) for k in range(11)]
    fields = {"prompt": "combine them", "size": "64x64", **STEPS}
    files = [("set1", (f"r{k}.png", data, "image/png")) for k, data in enumerate(references[:10])]
    files.append(("set2", ("alone.png", references[10], "image/png")))
    created = httpx.post(f"{server21.url}/v1/jobs", files=files, data=fields, timeout=60)
    assert created.status_code == 202, created.text
    job = created.json()["id"]
    deadline = time.time() + 120
    while (view := httpx.get(f"{server21.url}/v1/jobs/{job}", timeout=30).json())["state"] in ("queued", "running"):
        assert time.time() < deadline, view
        time.sleep(0.2)
    assert view["state"] == "succeeded" and view["done"] == 2, view
    archive = zipfile.ZipFile(io.BytesIO(httpx.get(f"{server21.url}/v1/jobs/{job}/result", timeout=30).content))
    for name in archive.namelist():
        with Image.open(archive.open(name)) as image:
            assert image.size == (64, 64) and image.mode == "RGBA", (name, image.size, image.mode)
    eleven = [("set1", (f"r{k}.png", data, "image/png")) for k, data in enumerate(references)]
    refused = httpx.post(f"{server21.url}/v1/jobs", files=eleven, data=fields, timeout=60)
    assert refused.status_code == 400 and "at most 10" in refused.json()["error"]["message"], refused.text


def test_a_masked_edit_changes_only_the_masked_area_alpha_included(server21):
    """OpenAI's mask (transparent = edit) on 2.1: the latents outside it are the input's at every step and the
    result is laid over the input through it, so outside the mask every pixel, alpha included, is the input's;
    the result has the first image's size."""
    first = noise((96, 64), 8, "RGBA")
    mask = Image.new("RGBA", (96, 64), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (0, 0, 48, 64))  # the left half is to be edited
    files = [("image", ("in.png", png(first), "image/png")), ("mask", ("mask.png", png(mask), "image/png"))]
    response = httpx.post(f"{server21.url}/v1/images/edits", files=files, timeout=120,
                          data={"prompt": "paint the left half", **STEPS, "mask_feather": "0"})
    made = result_of(response)
    assert made.size == (96, 64) and made.mode == "RGBA"
    made, first = np.asarray(made), np.asarray(first)
    assert np.array_equal(made[:, 48:], first[:, 48:])  # outside the mask: the input, exactly
    assert np.abs(made[:, :48].astype(int) - first[:, :48]).mean() > 1  # inside: edited


def test_prompt_rewriting_with_qwen3_vl_for_an_edit_and_a_text_to_image(manager21, server21):
    """2.1's own text encoder (Qwen3-VL with its language-model head) rewrites: an edit's instruction with the
    (transparent) input in view, and a text to image's prompt with the generation instruction; its answer
    (scripted at the encoder's output, tests/faults.py) is used, over REST too."""
    from imgedit.protocol import EditRequest

    scripted = "a red barn at dusk, watercolour"
    edit = manager21.enhance(EditRequest(images=(noise((64, 64), 2, "RGBA"),), prompt=f"barn [rewrite:{scripted}]"))
    assert edit.prompt == scripted and edit.notice is None
    alone = manager21.enhance(EditRequest(images=(), prompt=f"barn [rewrite:{scripted}]"))
    assert alone.prompt == scripted
    made = httpx.post(f"{server21.url}/v1/images/generations", timeout=120,
                      json={"prompt": f"a barn [rewrite:{scripted}]", "size": "64x64", "enhance_prompt": True,
                            "num_inference_steps": 2, "seed": 1})
    assert made.status_code == 200, made.text
    assert made.json()["data"][0]["revised_prompt"] == scripted


def test_review_findings_one_side_history_cfg_snippet_size_cache_control_and_a_lone_mask(manager21, server21):
    """What a review found: a template checked before its images are decoded keeps the other side open (not a
    square: a 3072-wide item of a 3072x768 input is within MAX_OUTPUT_PIXELS); the Step cache is not offered;
    a text to image with one side given is copied as the square the page makes; a mask without an input image
    is refused by name."""
    from types import SimpleNamespace

    from imgedit.engine.validation import check_params
    from imgedit.protocol import EditRequest
    from imgedit.web.page.tools import PageTools

    check_params(EditRequest(images=(), prompt="x", width=3072), manager21.settings, "21")  # no error
    assert manager21.resolve(EditRequest(images=(), prompt="x", width=256)).height == 256  # text to image: square
    assert "caches the text and condition keys" in manager21.cache_refusal()
    tools = PageTools(manager21.settings, "21", manager21.prompt_tokens)
    form = {"images": None, "prompt": "a boat", "negative_prompt": "", "seed": 1, "randomize_seed": False,
            "num_inference_steps": 2, "true_cfg_scale": 1.0, "num_images": 1, "width": 256, "height": 0}
    _, _, curl, openai, _ = tools.api_call(form, None, request=SimpleNamespace(headers={"host": "h:1"}))
    assert '"size": "256x256"' in curl and "size='256x256'" in openai
    mask = Image.new("RGBA", (64, 64), (0, 0, 0, 0))
    refused = httpx.post(f"{server21.url}/v1/images/edits", data={"prompt": "x"}, timeout=30,
                         files=[("mask", ("m.png", png(mask), "image/png"))])
    assert refused.status_code == 400 and refused.json()["error"]["param"] in ("image", "mask"), refused.text


def test_a_mask_without_an_image_is_refused_by_name_over_gradio(server21, tmp_path):
    from gradio_client import Client, handle_file

    mask = tmp_path / "mask.png"
    Image.new("RGBA", (64, 64), (0, 0, 0, 0)).save(mask)
    with pytest.raises(Exception, match="a mask needs an input image"):
        Client(server21.url, verbose=False).predict(images=[], prompt="x", mask=handle_file(str(mask)),
                                                     num_inference_steps=2, api_name="/edit")


def test_history_fills_the_form_with_the_familys_cfg_for_an_entry_that_left_it_out(server21):
    """A text to image made without a CFG scale ran at the family's (1: off); the History tab's Re-run fills the
    form with that, not DEFAULT_TRUE_CFG's 4, and no input image."""
    from gradio_client import Client
    from raw_gradio import RawGradio

    from imgedit.web.identity import COOKIE
    from imgedit.web.page.requests import edit_fields

    browser = Client(server21.url, verbose=False)
    browser.predict(images=[], prompt="a quiet harbour", seed=3, randomize_seed=False, num_inference_steps=2,
                    true_cfg_scale=None, width=64, height=64, api_name="/edit")
    [listed] = [e for e in browser.predict(api_name="/history") if e["prompt"] == "a quiet harbour"]
    raw = RawGradio(server21.url, httpx.Client(timeout=60, cookies={COOKIE: browser.cookies[COOKIE]}))
    filled = raw.predict(raw.fn_index(trigger=("history-rerun", "click")), [listed["id"]])
    assert filled.status_code == 200, filled.text
    form = dict(zip(edit_fields(), filled.json()["data"], strict=True))
    assert form["true_cfg_scale"] == 1.0 and form["seed"] == 3 and not form["images"], form


def test_the_prefix_cache_goes_off_for_a_job_it_would_not_fit_under_a_cap(ckpt21):
    """Qwen-Image-2.1's pipeline keeps the prefix's keys and values on the GPU for a whole job (512 KiB a token
    at real size: 3 references at 1024² ~7.7 GiB), which a 16 GB card's cap cannot hold (every edit with a
    reference ran out of memory on the GPU machine's 16 GB plan). A worker under a cap turns the cache off for a
    job it would not fit: every step then runs the prefix again (the transformer is given no cache mode), and
    the image is the cached one's up to rounding. The real-size figures are checked against the config."""
    import threading

    from conftest import LocalPipeline

    from imgedit.config.settings import load_settings
    from imgedit.engine.validation import resolve
    from imgedit.model.demo_checkpoint import build_checkpoint as build
    from imgedit.protocol import EditRequest
    from imgedit.runtime.messages import Job
    from imgedit.runtime.prefix_cache import PrefixCache, cache_bytes, prefix_tokens
    from imgedit.runtime.runner import Runner

    pipe = LocalPipeline(ckpt21).pipe
    seen: list[str | None] = []  # each forward's kv_cache_mode
    pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["kv_cache_mode"]), with_kwargs=True)
    settings = load_settings({"QWEN_MODEL_DIR": str(ckpt21)})
    req = EditRequest(images=(noise((64, 64), 1), noise((64, 64), 2)), prompt="blend them", seed=5,
                      num_inference_steps=2, width=64, height=64)
    runner = Runner(pipe, "local", ("cpu",))

    def run(room) -> tuple[list, np.ndarray]:
        runner.parts = [PrefixCache(pipe.transformer, room)] if room is not None else []
        seen.clear()
        params = resolve(req, settings, "21", req.images[-1].size, len(req.images))
        result = runner.run(Job(req, params, "21"), threading.Event())
        return list(seen), np.asarray(result.images[0], dtype=np.int16)

    cached, cached_image = run(None)  # no cap: the pipeline's default
    assert cached == ["extract", "cached"], cached  # the second step runs the target alone
    assert run(lambda: 1 << 40)[0] == cached  # the cache fits: kept
    uncached, uncached_image = run(lambda: 0)
    assert uncached == [None, None], uncached  # every step runs the prefix again
    assert np.abs(uncached_image - cached_image).max() <= 2

    from diffusers import QwenImage21Transformer2DModel

    config = QwenImage21Transformer2DModel.load_config(build(ckpt21.parent / "q21-real", kind="21", size="real"),
                                                       subfolder="transformer")
    real = type("Config", (), config)
    assert cache_bytes(real, 1) == 512 * 1024
    assert 7.5 < cache_bytes(real, prefix_tokens(3, 1024)) / 1024**3 < 8


def test_a_prefix_cache_too_big_for_the_cap_lives_in_cpu_memory_and_gives_the_gpu_caches_image(ckpt21, caplog,
                                                                                              monkeypatch):
    """On the 16 GB plan a five-reference edit ran every later step through the prefix again (1.3 s a step) for
    want of room for its cache. Where the cap holds three blocks' worth and the CPU has room, the cache lives in
    CPU memory instead: the first step writes every block's keys and values there, a later step reads them back
    one block ahead (a hook hands the transformer this cache in place of the pipeline's). The steps stay cached
    and the image is the one the cache on the device gives, with true CFG's two caches too; with no CPU room,
    or on a worker that runs compiled, the job runs uncached, as before."""
    import threading

    from conftest import LocalPipeline

    from imgedit.config.settings import load_settings
    from imgedit.engine.validation import resolve
    from imgedit.protocol import EditRequest
    from imgedit.runtime import prefix_cache
    from imgedit.runtime.messages import Job
    from imgedit.runtime.prefix_cache import PrefixCache, cache_bytes, prefix_tokens
    from imgedit.runtime.runner import Runner

    # the tiny transformer has 2 blocks: room for one block's cache at a time (3 on a real one) is less than all
    monkeypatch.setattr(prefix_cache, "IN_FLIGHT", 1)
    pipe = LocalPipeline(ckpt21).pipe
    seen: list[tuple] = []  # each forward's kv_cache_mode at its first block, and the kind of block cache it got
    pipe.transformer.transformer_blocks[0].register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((kwargs["kv_cache_mode"], type(kwargs["layer_cache"]).__name__)),
        with_kwargs=True)
    settings = load_settings({"QWEN_MODEL_DIR": str(ckpt21)})
    runner = Runner(pipe, "local", ("cpu",))
    images = (noise((64, 64), 1), noise((64, 64), 2))

    def run(cache, **ask) -> np.ndarray:
        runner.parts = [cache] if cache is not None else []
        seen.clear()
        req = EditRequest(images=images, prompt="blend them", seed=5, num_inference_steps=3, width=64, height=64,
                          **ask)
        params = resolve(req, settings, "21", req.images[-1].size, len(req.images))
        return np.asarray(runner.run(Job(req, params, "21"), threading.Event()).images[0], dtype=np.int16)

    one = cache_bytes(pipe.transformer.config, prefix_tokens(2, 320))  # 64² inputs run at 2.1's least, 320²
    layers = pipe.transformer.config.num_layers
    for ask, copies in (({}, 1), ({"negative_prompt": "blurry", "true_cfg_scale": 4.0}, 2)):
        on_device = run(None, **ask)
        device_modes = list(seen)
        cap = copies * one // layers  # one block's worth of this job's cache, not the whole
        host = PrefixCache(pipe.transformer, lambda cap=cap: cap, [pipe.transformer], host_room=lambda: 1 << 40)
        assert host.place(2, 320, copies)[0] == "host"
        caplog.clear()
        with caplog.at_level("INFO"):
            on_host = run(host, **ask)
        assert "prefix KV cache in CPU memory for this job" in caplog.text
        assert [mode for mode, _ in seen] == [mode for mode, _ in device_modes]  # still cached after step 1
        assert {kind for mode, kind in seen} == {"_HostLayer"}, seen
        assert {kind for mode, kind in device_modes} == {"QwenImage21KVLayerCache"}, device_modes
        assert np.array_equal(on_host, on_device)  # the same keys and values, so the same image
        assert host.pool.wanted >= copies * one // 2  # every block's keys and values went to the CPU
        assert host.misses == 1  # only the first read waited: every other block's copy was started ahead
        host.host_room = lambda: None  # CPU memory unknown now: the buffer it holds is big enough already
        assert host.place(2, 320, copies)[0] == "host"

        no_room = PrefixCache(pipe.transformer, lambda cap=cap: cap, [pipe.transformer], host_room=lambda: 0)
        caplog.clear()
        with caplog.at_level("INFO"):
            run(no_room, **ask)
        assert {mode for mode, _ in seen} == {None}  # no room on the CPU either: every step runs the prefix
        assert "not in CPU memory: CPU memory available 0.0 GiB" in caplog.text  # the log says why
        compiled = PrefixCache(pipe.transformer, lambda cap=cap: cap, [pipe.transformer], lambda: True,
                               host_room=lambda: 1 << 40)
        caplog.clear()
        with caplog.at_level("INFO"):
            assert compiled.place(2, 320, copies)[0] == "off"
        assert "a compiled worker keeps no cache in CPU memory" in caplog.text


def test_the_prefix_caches_cpu_buffer_hands_out_aligned_slices_and_grows_to_the_largest_job():
    import torch

    from imgedit.runtime.prefix_cache import ALIGN, PinnedPool

    pool = PinnedPool()
    pool.reserve(4096)
    a, b = pool.take(torch.empty(3, 5, dtype=torch.bfloat16)), pool.take(torch.empty(100, dtype=torch.bfloat16))
    assert (a.shape, a.dtype, b.shape) == ((3, 5), torch.bfloat16, (100,))
    assert a.data_ptr() == pool.buffer.data_ptr() and b.data_ptr() == pool.buffer.data_ptr() + ALIGN  # aligned
    a.fill_(1)
    b.fill_(2)
    assert a.sum() == 15 and b.sum() == 200  # slices of their own
    big = pool.take(torch.empty(4096, dtype=torch.bfloat16))  # past the buffer: a tensor of its own
    assert big.numel() == 4096 and not (pool.buffer.data_ptr() <= big.data_ptr() < pool.buffer.data_ptr() + 4096)
    pool.reserve(100)  # the next job: the buffer grows to the largest need seen
    assert pool.size == 2 * ALIGN + 8192 and pool.used == 0


def test_a_decode_that_would_not_fit_under_a_cap_runs_in_tiles(ckpt21):
    """On the GPU machine's 16 GB plan for 2.1 most jobs ran out of memory in the VAE's decode (~5.8 GiB a
    megapixel at real size against ~7 GiB the cap left). A capped worker tiles a job's decode where it would not
    fit (diffusers' enable_tiling), decides again for the next job, and decodes whole where it fits. The real
    sizes' estimates are checked against benchmarks/probe_vae_decode.py's measurements (5.84 and 3.82 GiB)."""
    import inspect
    import threading

    from conftest import LocalPipeline
    from diffusers import AutoencoderKLQwenImage, AutoencoderKLQwenImage21

    from imgedit.config.settings import load_settings
    from imgedit.engine.validation import resolve
    from imgedit.protocol import EditRequest
    from imgedit.runtime.decode_room import DecodeRoom, decode_bytes
    from imgedit.runtime.messages import Job
    from imgedit.runtime.runner import Runner

    pipe = LocalPipeline(ckpt21).pipe
    decodes: list[bool] = []  # per decode: tiled?
    whole = pipe.vae._decode

    def spy(z, *args, **kwargs):
        decodes.append(pipe.vae.use_tiling)
        return whole(z, *args, **kwargs)

    pipe.vae._decode = spy
    settings = load_settings({"QWEN_MODEL_DIR": str(ckpt21)})
    req = EditRequest(images=(noise((96, 96), 1),), prompt="paint it", seed=5, num_inference_steps=2,
                      width=320, height=320)  # 20x20 latents: over the 16 of one 256-pixel tile
    runner = Runner(pipe, "local", ("cpu",))

    def run(room: int) -> np.ndarray:
        runner.parts = [DecodeRoom(pipe.vae, lambda: room)]
        params = resolve(req, settings, "21", req.images[-1].size, len(req.images))
        result = runner.run(Job(req, params, "21"), threading.Event())
        assert pipe.vae.use_tiling is False  # the next job decides again
        return np.asarray(result.images[0], dtype=np.int16)

    whole_image = run(1 << 40)
    tiled_image = run(0)
    again = run(1 << 40)
    assert decodes == [False, True, False], decodes
    assert (pipe.vae.tile_sample_min_width, pipe.vae.tile_sample_stride_width) == (256, 192)  # room 0: the least
    assert (again == whole_image).all() and not (tiled_image == whole_image).all()
    assert tiled_image.shape == whole_image.shape == (320, 320, 4)  # RGBA

    real = type("Config", (), AutoencoderKLQwenImage21.load_config(
        build_checkpoint(ckpt21.parent / "q21-real-vae", kind="21", size="real"), subfolder="vae"))
    assert 5.5 < decode_bytes(real, 1024, 1024, 1) / 2**30 < 6.2
    # the real-size Qwen-Image checkpoint's VAE is AutoencoderKLQwenImage's defaults (base dim 96)
    plus = {name: p.default for name, p in inspect.signature(AutoencoderKLQwenImage.__init__).parameters.items()}
    assert 3.6 < decode_bytes(type("Config", (), plus), 1024, 1024, 1) / 2**30 < 4.1
    assert decode_bytes(real, 1024, 1024, 2) == 2 * decode_bytes(real, 1024, 1024, 1)
    # the tiles: the largest that fits what is left; diffusers' 256 pixels where none does
    room = DecodeRoom(type("Vae", (), {"config": real})(), None)
    fits = [int(decode_bytes(real, side, side, 1) * 1.2) + 1 + (3 << 28) for side in (1024, 768, 384)]
    assert [room.tile_side(b, 1) for b in (*fits, 0)] == [1024, 768, 384, 256]
    assert room.tile_side(fits[1], 2) == 512  # two images decoded together: smaller tiles


def test_one_side_given_the_other_is_the_multiple_nearest_the_inputs_aspect():
    """#62: a 464x320 input at width 256 became 256x160 on Qwen-Image-2.1 (its sides: multiples of 32), though
    192 is nearer the aspect's 176.6; 2509 (multiples of 16) gives 176."""
    from imgedit.config.settings import load_settings
    from imgedit.engine.validation import output_size

    settings = load_settings({})
    assert output_size(256, None, (464, 320), settings, "21") == (256, 192)
    assert output_size(256, None, (464, 320), settings, "plus") == (256, 176)
    assert output_size(None, 256, (320, 464), settings, "21") == (192, 256)
    assert output_size(300, 200, (464, 320), settings, "21") == (288, 192)  # both given: each rounded down
