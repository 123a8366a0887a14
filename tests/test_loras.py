"""LoRAs and the Lightning speed presets: the registry, the start-up check, the per-job adapter and
scheduler in the runner, and the same fields through REST and the gradio API.

The LoRA files are written here (imgedit.model.lora_random): the published Lightning layout
(`lora_down`/`lora_up`/`alpha`) and diffusers' own (`transformer.*.lora_A/B`), for the tiny checkpoint.
"""

from __future__ import annotations

import base64
import io
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from conftest import ROOT, LocalPipeline, cfg_plan, http, make_manager, picture, start_server
from gradio_client import Client, handle_file
from gradio_client.exceptions import ValidationError
from PIL import Image
from safetensors.torch import load_file, save_file

from imgedit.config.loras import LoraError
from imgedit.config.settings import load_settings
from imgedit.engine.validation import resolve
from imgedit.errors import Cancelled, ImgEditError, InvalidInput, SettingsError
from imgedit.model.lora_random import random_lora
from imgedit.model.loras import transformer_linears
from imgedit.protocol import EditRequest
from imgedit.runtime.adapters import Adapters
from imgedit.runtime.masking import Masking
from imgedit.runtime.messages import Job
from imgedit.runtime.runner import Runner

STD = 0.4  # strong enough that the tiny model's pixels change visibly (mean > 1 level)


@pytest.fixture(scope="module")
def linears(plus_ckpt):
    return transformer_linears(plus_ckpt)


# What `python -m imgedit.model.lora_random` said when lora_dir ran it, by folder (checked by a test below;
# test_fast_weights and test_fusion import lora_dir too, so the fixture keeps its name and its value)
LORA_COMMAND: dict[Path, subprocess.CompletedProcess] = {}
COMMAND_DEFAULTS = dict(rank=4, std=0.2)  # the command's own (imgedit.model.lora_random.main)


@pytest.fixture(scope="module")
def lora_dir(request, tmp_path_factory, linears, plus_ckpt):
    folder = tmp_path_factory.mktemp("loras")
    random_lora(folder / "Tiny-Edit-Lightning-4steps-V1.0-bf16.safetensors", linears, rank=4, std=STD, seed=1)
    eight = folder / "Tiny-Edit-Lightning-8steps-V1.0-bf16.safetensors"
    if request.module.__name__ == "test_loras":
        # This one through the command line the README gives for the demo (its defaults: rank 4, std 0.2).
        command = subprocess.run([sys.executable, "-m", "imgedit.model.lora_random", str(plus_ckpt), str(eight),
                                  "--seed", "2"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert command.returncode == 0, command.stdout + command.stderr
        LORA_COMMAND[folder] = command
    else:  # test_fast_weights, test_fusion: the same file (checked below), without a process that imports torch
        random_lora(eight, linears, seed=2, **COMMAND_DEFAULTS)
    random_lora(folder / "style.safetensors", linears, rank=4, std=STD, seed=3, style="diffusers")
    return folder


@pytest.fixture(scope="module")
def bad_loras(tmp_path_factory, linears, lora_dir):
    folder = tmp_path_factory.mktemp("bad-loras")
    (folder / "garbage.safetensors").write_bytes(b"this is not a safetensors file" * 10)
    good = load_file(str(lora_dir / "style.safetensors"))
    # Keys of another architecture (Flux's single blocks), shapes as ours: diffusers would only warn.
    save_file({k.replace("transformer_blocks", "single_transformer_blocks"): v for k, v in good.items()},
              str(folder / "flux-like.safetensors"))
    # Our layer names, another model's width.
    save_file({k: torch.zeros(v.shape[0], v.shape[1] * 2) if "lora_A" in k else v for k, v in good.items()},
              str(folder / "wider-model.safetensors"))
    return folder


def env(lora_dir, **more) -> dict:
    return {"QWEN_MODEL_DIR": "/nonexistent", "DEVICE_MAP": "cpu", "LORA_DIR": str(lora_dir), **more}


FOUR, EIGHT = "Tiny-Edit-Lightning-4steps-V1.0-bf16", "Tiny-Edit-Lightning-8steps-V1.0-bf16"


# ---- settings and request fields (pure) ----

def test_registry_names_files_and_finds_the_lightning_loras(lora_dir, tmp_path):
    settings = load_settings(env(lora_dir, LORAS=f"extra={lora_dir / 'style.safetensors'}"))
    assert {e.name: e.steps for e in settings.lora_entries} == {FOUR: 4, EIGHT: 8, "style": None, "extra": None}
    chosen = load_settings(env(lora_dir, FAST_LORA_8STEP="style", LORAS=""))
    assert {e.name: e.steps for e in chosen.lora_entries} == {FOUR: 4, EIGHT: None, "style": 8}
    for variable, value, says in (("FAST_LORA_4STEP", "nope", "FAST_LORA_4STEP='nope' names no configured LoRA"),
                                  ("LORAS", "justapath.safetensors", "LORAS='justapath.safetensors' is not valid"),
                                  ("LORAS", f"style={tmp_path}/x.safetensors", "LORAS names 'style' twice"),
                                  ("LORA_DIR", str(tmp_path / "missing"), "is not a folder")):
        with pytest.raises(SettingsError) as caught:
            load_settings(env(lora_dir, **{variable: value}))
        assert says in caught.value.message


def test_speed_and_lora_fields_are_checked_in_one_place(lora_dir):
    settings = load_settings(env(lora_dir))

    def ask(**kw):
        return resolve(EditRequest(images=(picture(),), prompt="make it red", seed=1, **kw), settings, "plus",
                       None, 1)

    quality = ask(num_inference_steps=7, true_cfg_scale=3.0)
    assert (quality.steps, quality.true_cfg_scale, quality.adapters, quality.scheduler) == (7, 3.0, (), "default")
    fast = ask(speed="fast", num_inference_steps=30, true_cfg_scale=4.0)  # the preset wins
    assert (fast.steps, fast.true_cfg_scale, fast.adapters, fast.scheduler) == (8, 1.0, ((EIGHT, 1.0),), "lightning")
    fastest = ask(speed="fastest", lora="style", lora_scale=0.5)
    assert (fastest.steps, fastest.adapters) == (4, ((FOUR, 1.0), ("style", 0.5)))
    assert ask(lora="style").adapters == (("style", 1.0),) and ask(lora="none").adapters == ()
    for kw, field, says in (
            (dict(lora="nope"), "lora", f"unknown LoRA 'nope'; configured LoRAs: {FOUR}, {EIGHT}, style"),
            (dict(lora="style", lora_scale=2.5), "lora_scale", "lora_scale 2.5 is out of range: 0 to 2"),
            (dict(lora="style", lora_scale=math.nan), "lora_scale", "out of range"),
            (dict(speed="turbo"), "speed", "speed must be one of quality, fast, fastest")):
        with pytest.raises(InvalidInput) as caught:
            ask(**kw)
        assert caught.value.field == field and says in caught.value.message
    only_style = load_settings(env(lora_dir.parent, LORA_DIR="", LORAS=f"style={lora_dir / 'style.safetensors'}"))
    with pytest.raises(InvalidInput) as caught:
        resolve(EditRequest(images=(picture(),), prompt="x", speed="fast"), only_style, "plus", None, 1)
    assert "needs a Lightning 8-step LoRA" in caught.value.message and "FAST_LORA_8STEP" in caught.value.message


# ---- the start-up check ----

BAD = {"garbage.safetensors": "cannot be read as a LoRA file",
       "flux-like.safetensors": "single_transformer_blocks.0.attn.add_k_proj is not a layer of this model's",
       "wider-model.safetensors": "lora_A has shape"}


def test_bad_loras_stop_start_up_naming_every_file_at_once(plus_ckpt, bad_loras, lora_dir):
    """Three bad files and a good one: one start-up check names each bad file, its LoRA and why, in one message
    (a user fixing them learns of every one at once); no worker process is started. One bad file alone is
    named as before."""
    named = {f"bad{k}": bad_loras / file for k, file in enumerate(BAD)}
    loras = ",".join([f"{name}={path}" for name, path in named.items()] + [f"good={lora_dir / 'style.safetensors'}"])
    manager = make_manager(plus_ckpt, load=False, LORA_DIR="", LORAS=loras)
    with pytest.raises(LoraError) as caught:
        manager.prepare()
    message = caught.value.message
    assert message.startswith("3 LoRA files cannot be used: "), message
    for (name, path), says in zip(named.items(), BAD.values(), strict=True):
        part = next(p for p in message.split("; LoRA ") if f"{name}' ({path})" in p)
        assert says in part, (name, part)
    assert "'good'" not in message
    assert manager.workers == [] and manager.load_error == message  # no process was started
    alone = make_manager(plus_ckpt, load=False, LORA_DIR="", LORAS=f"bad={bad_loras / 'wider-model.safetensors'}")
    with pytest.raises(LoraError, match=r"^LoRA 'bad' \(.*wider-model.safetensors\) does not fit .*lora_A has shape"):
        alone.prepare()


def test_a_checked_lora_file_is_checked_again_only_when_it_changes(plus_ckpt, linears, tmp_path, monkeypatch):
    """A restart with the same file starts no inspection subprocess; the same path rewritten is checked
    again (and refused when it is no LoRA now)."""
    from imgedit.engine.workers import inspection

    monkeypatch.setattr(inspection, "CACHE_DIR", tmp_path / "cache")
    runs = []
    real_run = inspection._run
    monkeypatch.setattr(inspection, "_run", lambda request, **kw: runs.append(request) or real_run(request, **kw))
    path = tmp_path / "style.safetensors"
    random_lora(path, linears, rank=4, std=STD, seed=3, style="diffusers")
    first = make_manager(plus_ckpt, load=False, LORAS=f"style={path}").prepare()
    second = make_manager(plus_ckpt, load=False, LORAS=f"style={path}").prepare()
    assert len(runs) == 1 and [e[0] for e in runs[0]["loras"]] == ["style"]
    assert second.loras == first.loras and first.loras[0].layers > 0 and first.loras[0].rank == 4
    path.write_bytes(b"not a LoRA any more")
    with pytest.raises(LoraError, match="cannot be read as a LoRA file"):
        make_manager(plus_ckpt, load=False, LORAS=f"style={path}").prepare()
    assert len(runs) == 2


def test_the_inspection_forked_from_the_forkserver_answers_as_a_fresh_interpreter(plus_ckpt, lora_dir, tmp_path,
                                                                                  monkeypatch):
    """WORKER_START=forkserver: the sizes and the LoRA check come from a fork of the workers' forkserver
    (torch imported there once: ~0.1 s where a fresh interpreter took 5-8 s) with the fresh interpreter's
    answer; a bad file is refused in the same words, and an inspection that dies is a PlacementError."""
    from imgedit.config.loras import LoraEntry
    from imgedit.engine.workers import inspection
    from imgedit.errors import PlacementError
    from imgedit.planning.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(str(plus_ckpt))
    four = LoraEntry("four", str(lora_dir / "Tiny-Edit-Lightning-4steps-V1.0-bf16.safetensors"), 4)
    answers = {}
    for start in ("spawn", "forkserver"):
        monkeypatch.setattr(inspection, "CACHE_DIR", tmp_path / start)  # each measures: nothing cached
        answers[start] = inspection.inspect_checkpoint(checkpoint, ("img_mlp",), (four,), start=start)
    assert answers["forkserver"] == answers["spawn"]
    sizes, (lora,) = answers["forkserver"]
    assert len(sizes) == 3 and lora.rank == 4 and lora.layers > 0 and lora.steps == 4
    bad = tmp_path / "bad.safetensors"
    save_file({"transformer.nowhere.lora_A.weight": torch.zeros(4, 8)}, str(bad))
    refusals = []
    for start in ("spawn", "forkserver"):
        with pytest.raises(LoraError, match="does not fit this model's transformer") as caught:
            inspection.inspect_checkpoint(checkpoint, (), (LoraEntry("bad", str(bad), None),), sizes=False,
                                          start=start)
        refusals.append(caught.value.message)
    assert refusals[0] == refusals[1]
    with pytest.raises(PlacementError, match=r"could not read the checkpoint's component configs \(see"):
        inspection._run({"folder": str(tmp_path / "no-checkpoint"), "sizes": True}, start="forkserver")


def test_an_inspection_the_forkserver_cannot_start_is_a_placement_error_and_ray_never_forks(tmp_path, monkeypatch):
    """A forkserver that is gone (its preload failed, or it was killed) refuses the fork: start-up says it
    could not read the checkpoint, as for a failed subprocess (not a raw ConnectionRefusedError), and leaves
    no pipe open. Ray's workers come from no forkserver: their server inspects in a fresh interpreter."""
    import multiprocessing.forkserver

    from imgedit.engine.workers import inspection
    from imgedit.errors import PlacementError

    def pipes() -> set[str]:
        found = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}").startswith(("pipe:", "socket:")):
                    found.add(fd)
            except OSError:
                continue
        return found

    def gone(fds):
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(multiprocessing.forkserver, "connect_to_new_process", gone)
    before = pipes()
    with pytest.raises(PlacementError, match=r"could not read the checkpoint's component configs \(see"):
        inspection._run({"folder": str(tmp_path), "sizes": True}, start="forkserver")
    assert pipes() <= before
    ray = load_settings({"QWEN_MODEL_DIR": str(tmp_path), "WORKERS": "ray", "WORKER_START": "forkserver"})
    local = load_settings({"QWEN_MODEL_DIR": str(tmp_path), "WORKER_START": "forkserver"})
    assert (inspection.inspection_start(ray), inspection.inspection_start(local)) == ("spawn", "forkserver")


def test_a_missing_hub_file_stops_start_up_offline(plus_ckpt, monkeypatch):
    """Checked in a fresh interpreter even with WORKER_START=forkserver (the tests' workers): the forkserver's
    hub client read HF_HUB_OFFLINE when it was imported, and a fork went online for 23 s before failing."""
    from imgedit.engine.workers import inspection

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the LoRA check runs in a subprocess (imgedit.model.inspect)
    starts = []
    real_run = inspection._run
    monkeypatch.setattr(inspection, "_run", lambda request, **kw: starts.append(kw) or real_run(request, **kw))
    manager = make_manager(plus_ckpt, load=False, LORAS="hub=someone/some-loras/not-cached.safetensors")
    assert manager.settings.worker_start == "forkserver"
    with pytest.raises(LoraError) as caught:
        manager.prepare()
    assert "LoRA 'hub': could not fetch someone/some-loras/not-cached.safetensors" in caught.value.message
    assert starts == [{"start": "spawn"}]


# ---- the runner, in this process, on a pipeline of its own ----

class Local:
    """A fresh tiny pipeline: a baseline image before any LoRA exists, then the LoRAs loaded."""

    def __init__(self, ckpt, lora_dir, fuse: str = "off", fast: str = "none"):
        from imgedit.model.loras import check_all

        self.pipe = LocalPipeline(ckpt).pipe
        self.settings = load_settings(env(lora_dir, QWEN_MODEL_DIR=str(ckpt)))
        self.baseline = self.run(Runner(self.pipe, "local", ("cpu",)), EditRequest(**self.ask()))
        self.adapters = Adapters(self.pipe, check_all(self.settings.lora_entries, ckpt), fuse=fuse, fast=fast)
        self.runner = Runner(self.pipe, "local", ("cpu",), parts=(self.adapters, Masking(self.pipe)))

    @staticmethod
    def ask(**kw) -> dict:
        return {**dict(images=(picture(),), prompt="make it red", seed=3, num_inference_steps=2, width=64, height=64),
                **kw}

    def run(self, runner, req, cancel=None, on_step=None) -> np.ndarray:
        params = resolve(req, self.settings, "plus", req.images[-1].size, len(req.images))
        result = runner.run(Job(req, params, "plus"), cancel or threading.Event(), on_step)
        return np.asarray(result.images[0], dtype=np.int16)

    def edit(self, **kw) -> np.ndarray:
        return self.run(self.runner, EditRequest(**self.ask(**kw)))

    def any_adapter_active(self) -> bool:
        from peft.tuners.tuners_utils import BaseTunerLayer

        return any(isinstance(m, BaseTunerLayer) and not m.disable_adapters for m in self.pipe.transformer.modules())


@pytest.fixture(scope="module")
def local(plus_ckpt, lora_dir):
    return Local(plus_ckpt, lora_dir)


def test_no_lora_gives_todays_pixels_a_lora_changes_them_and_nothing_leaks(local):
    assert np.array_equal(local.edit(), local.baseline)  # LoRAs loaded, none asked for
    styled = local.edit(lora="style")
    assert np.abs(styled - local.baseline).mean() > 1.0
    assert np.abs(local.edit(lora="style", lora_scale=0.3) - styled).mean() > 0.1  # strength matters
    fast = local.edit(speed="fastest")
    assert np.abs(fast - local.baseline).mean() > 1.0
    assert local.pipe.scheduler is local.adapters.default_scheduler
    assert local.any_adapter_active()  # a finished LoRA job leaves peft's layers on for the next one (no walk)
    assert np.array_equal(local.edit(), local.baseline)  # a job without LoRA turns them off
    assert not local.any_adapter_active()


def test_lightning_preset_runs_its_steps_with_cfg_off_and_its_scheduler(local):
    seen = []

    def record(module, args, kwargs):
        scheduler = local.pipe.scheduler
        seen.append((scheduler.config.base_shift, scheduler.config.max_shift, scheduler.config.shift,
                     scheduler.config.shift_terminal, scheduler.config.time_shift_type, len(scheduler.timesteps)))

    hook = local.pipe.transformer.register_forward_pre_hook(record, with_kwargs=True)
    try:
        steps = []
        local.edit(speed="fastest", num_inference_steps=40, true_cfg_scale=4.0,
                   negative_prompt="blurry")  # the preset overrides steps and CFG
        local.run(local.runner, EditRequest(**local.ask(speed="fast")), on_step=lambda s, t: steps.append((s, t)))
        quality = len(seen)
        local.edit(num_inference_steps=2, true_cfg_scale=4.0)
    finally:
        hook.remove()
    # 4 then 8 steps, one forward each (CFG off), on log-3 exponential shift without shift_terminal
    assert seen[:quality] == [(math.log(3), math.log(3), 1.0, None, "exponential", 4)] * 4 + \
        [(math.log(3), math.log(3), 1.0, None, "exponential", 8)] * 8
    assert steps == [(i, 8) for i in range(1, 9)]
    default = local.adapters.default_scheduler.config
    assert seen[quality:] == [(default.base_shift, default.max_shift, default.shift, default.shift_terminal,
                               default.time_shift_type, 2)] * 4  # quality: 2 steps x 2 forwards (CFG)
    assert default.shift_terminal == 0.02 or default.base_shift != math.log(3)  # the recipe really differs


def test_masks_work_with_a_lora_and_with_the_lightning_presets(local):
    """#26 with LoRAs and fast mode: outside the mask every pixel is the input's; inside, the LoRA or the
    preset decides (the blend follows the Lightning scheduler's own sigmas)."""
    mask = Image.new("L", (80, 60), 0)
    mask.paste(255, (8, 8, 56, 48))
    outside, inside = np.asarray(mask) == 0, np.asarray(mask) == 255
    original = np.asarray(picture(), dtype=np.int16)
    masked = dict(mask=mask, width=80, height=64)
    plain = local.edit(**masked)
    for asked in (dict(lora="style"), dict(speed="fastest"), dict(speed="fast", lora="style", lora_scale=0.5)):
        image = local.edit(**masked, **asked)
        assert image.shape == original.shape and (image[outside] == original[outside]).all(), asked
        # the LoRA / preset changes the area (the tiny model's random LoRAs move it by about a level)
        assert (image[inside] != plain[inside]).mean() > 0.3 and np.abs(image[inside] - plain[inside]).mean() > 0.3, \
            asked
    assert local.pipe.scheduler is local.adapters.default_scheduler
    assert np.array_equal(local.edit(**masked), plain) and not local.any_adapter_active()


def test_a_failed_or_cancelled_lora_job_leaves_no_adapter_behind(local):
    def fail(module, args):
        if local.any_adapter_active():
            raise KeyError("fault injected inside a LoRA job")

    hook = local.pipe.transformer.register_forward_pre_hook(fail)
    try:
        with pytest.raises(ImgEditError) as caught:
            local.edit(lora="style")
        assert "internal error" in caught.value.message
    finally:
        hook.remove()
    assert not local.any_adapter_active() and local.pipe.scheduler is local.adapters.default_scheduler
    cancel = threading.Event()
    with pytest.raises(Cancelled):
        local.run(local.runner, EditRequest(**local.ask(speed="fast")), cancel=cancel,
                  on_step=lambda step, total: cancel.set())
    assert not local.any_adapter_active() and local.pipe.scheduler is local.adapters.default_scheduler
    assert np.array_equal(local.edit(), local.baseline)


# ---- worker processes, REST and the gradio API ----

@pytest.fixture(scope="module")
def lora_server(plus_ckpt, lora_dir):
    manager = make_manager(plus_ckpt, LORA_DIR=str(lora_dir))
    with start_server(manager) as server:
        yield manager, server


def png_bytes() -> bytes:
    buffer = io.BytesIO()
    picture().save(buffer, format="PNG")
    return buffer.getvalue()


def rest_edit(url: str, **fields) -> httpx.Response:
    data = {"prompt": "make it red", "size": "64x64", "num_inference_steps": "2", "seed": "4", **fields}
    return http.post(f"{url}/v1/images/edits", files={"image": ("in.png", png_bytes(), "image/png")}, data=data,
                      timeout=120)


def rest_pixels(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    raw = base64.b64decode(response.json()["data"][0]["b64_json"])
    return np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"), dtype=np.int16)


def test_jobs_with_different_loras_share_a_worker_without_leaking(lora_server):
    manager, server = lora_server
    plain = rest_edit(server.url)
    styled = rest_edit(server.url, lora="style", lora_scale="0.8")
    fastest = rest_edit(server.url, speed="fastest")
    again = rest_edit(server.url)
    assert np.array_equal(rest_pixels(again), rest_pixels(plain))
    assert np.abs(rest_pixels(styled) - rest_pixels(plain)).mean() > 1.0
    assert np.abs(rest_pixels(fastest) - rest_pixels(plain)).mean() > 1.0
    # The PNG says what the job ran with (a LoRA without lora_scale: strength 1; a preset: its LoRA).
    default_scale = rest_edit(server.url, lora="style")
    assert np.array_equal(rest_pixels(default_scale), rest_pixels(rest_edit(server.url, lora="style", lora_scale="1")))

    def chunks(response):
        return Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"]))).text

    assert (chunks(default_scale)["lora"], chunks(default_scale)["lora_scale"]) == ("style", "1")
    fast = chunks(fastest)
    assert (fast["lora"], fast["speed"], fast["num_inference_steps"]) == (FOUR, "fastest", "4")
    assert chunks(plain)["lora"] == "none" and "lora_scale" not in chunks(plain)
    with open_sdk(server.url) as client:  # the openai SDK sends the extensions through extra_body
        sdk = client.images.edit(model="qwen-image-edit", image=[("in.png", png_bytes(), "image/png")],
                                 prompt="make it red", size="64x64", response_format="b64_json",
                                 extra_body={"num_inference_steps": 2, "seed": 4, "lora": "style", "lora_scale": 0.8})
    sdk_pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(sdk.data[0].b64_json))).convert("RGB"), np.int16)
    assert np.array_equal(sdk_pixels, rest_pixels(styled))  # the same LoRA job again: the same image
    health = http.get(f"{server.url}/health").json()
    assert {lora["name"]: lora["lightning_steps"] for lora in health["loras"]} == {FOUR: 4, EIGHT: 8, "style": None}
    assert all(lora["rank"] == 4 for lora in health["loras"])
    assert [w["jobs_done"] for w in health["workers"]] == [7]  # one worker ran them all, one after another
    from imgedit.engine.workers.gpus import GpuMonitor, snapshot
    from imgedit.web.page.panel import panel_html

    assert f"LoRAs loaded: {FOUR} (Lightning 4-step), {EIGHT} (Lightning 8-step), style" in \
        panel_html(snapshot(GpuMonitor(), manager.status()))


def open_sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)


def test_bad_lora_fields_get_specific_errors_and_cost_nothing(lora_server, tmp_path):
    manager, server = lora_server
    done = sum(w.jobs_done for w in manager.status().workers)
    for fields, says in (({"lora": "nope"}, "unknown LoRA 'nope'; configured LoRAs:"),
                         ({"lora": "style", "lora_scale": "9"}, "lora_scale 9.0 is out of range"),
                         ({"speed": "warp"}, "speed must be one of quality, fast, fastest")):
        response = rest_edit(server.url, **fields)
        assert response.status_code == 400 and says in response.json()["error"]["message"]
    image = tmp_path / "in.png"
    image.write_bytes(png_bytes())
    client = Client(server.url, verbose=False)
    args = ([handle_file(str(image))], "make it red", "", 4, False, 2, 4.0, 1, 64, 64)
    with pytest.raises(ValidationError) as caught:
        client.predict(*args, "quality", "nope", 1.0, api_name="/edit")
    assert "unknown LoRA" in str(caught.value)
    assert sum(w.jobs_done for w in manager.status().workers) == done  # nothing ran
    gallery, seed = client.predict(*args, "fastest", "style", 0.8, api_name="/edit")
    fastest_styled = np.asarray(Image.open(gallery[0]["image"]).convert("RGB"), np.int16)
    rest = rest_pixels(rest_edit(server.url, speed="fastest", lora="style", lora_scale="0.8"))
    assert seed == 4 and np.array_equal(fastest_styled, rest)
    gallery, _ = client.predict(*args, api_name="/edit")  # old clients: no speed fields, quality, no LoRA
    plain = np.asarray(Image.open(gallery[0]["image"]).convert("RGB"), np.int16)
    assert np.array_equal(plain, rest_pixels(rest_edit(server.url)))


def test_page_shows_speed_and_lora_controls_only_when_configured(lora_dir):
    from imgedit.web.page.speed import lora_choices, speed_choices

    configured, bare = load_settings(env(lora_dir)), load_settings(env(lora_dir, LORA_DIR=""))
    assert [value for _, value in speed_choices(configured)] == ["quality", "fast", "fastest"]
    assert lora_choices(configured) == ["none", FOUR, EIGHT, "style"]
    only_four = load_settings(env(lora_dir, FAST_LORA_8STEP="", LORA_DIR="",
                                  LORAS=f"four={lora_dir / (FOUR + '.safetensors')}"))
    assert [value for _, value in speed_choices(only_four)] == ["quality", "fastest"]
    assert [value for _, value in speed_choices(bare)] == ["quality"] and lora_choices(bare) == ["none"]


def test_lightning_job_on_a_cfg_pair_runs_on_rank_zero_only(plus_ckpt, lora_dir):
    import os

    from conftest import PROBE_FILE

    pair = make_manager(plus_ckpt, plan=cfg_plan(), LORA_DIR=str(lora_dir))
    start = PROBE_FILE.stat().st_size if PROBE_FILE.exists() else 0
    result = pair.edit(EditRequest(**Local.ask(speed="fastest", negative_prompt="blurry")))
    with PROBE_FILE.open() as f:
        f.seek(start)
        forwards = [line.split()[0] for line in f if line.split()[1:] == ["enter", "transformer"]]
    pids = pair.status().workers[0].pids
    assert os.environ.get("IMGEDIT_TEST_PROBE") and result.steps == 4
    assert forwards.count(str(pids[0])) == 4 and forwards.count(str(pids[1])) == 0
    pair.close()


def test_the_random_lora_command_prints_its_own_line_only(lora_dir, linears, tmp_path):
    """#46 item 12: the README's `python -m imgedit.model.lora_random ...` printed torchao's "Failed to load ..." and
    diffusers' "Unable to import `torchao` Tensor objects": library notes at import, no news to the user. (The run
    is lora_dir's own, which wrote the 8-step LoRA: the command imports torch, a start of seconds.) Its file is
    random_lora's with the command's defaults, which test_fast_weights' and test_fusion's lora_dir write instead."""
    out = LORA_COMMAND[lora_dir]
    said = out.stdout + out.stderr
    assert out.returncode == 0 and (lora_dir / f"{EIGHT}.safetensors").is_file(), said
    assert "wrote " in said and "Failed to load" not in said and "Unable to import" not in said, said
    assert "_pytree" not in said and "no triton" not in said, said
    by_hand = load_file(str(random_lora(tmp_path / "eight.safetensors", linears, seed=2, **COMMAND_DEFAULTS)))
    written = load_file(str(lora_dir / f"{EIGHT}.safetensors"))
    assert by_hand.keys() == written.keys() and all(torch.equal(by_hand[k], written[k]) for k in written)


def test_the_random_lora_command_without_a_checkpoint_says_how_to_make_one(tmp_path, capsys):
    """#62: before the demo checkpoint existed it ended in a raw FileNotFoundError."""
    from imgedit.model.lora_random import main

    assert main([str(tmp_path / "demo"), str(tmp_path / "style.safetensors")]) == 2
    said = capsys.readouterr().err
    assert "holds no checkpoint" in said and "python app.py --demo" in said and "demo_checkpoint" in said, said
    assert not (tmp_path / "style.safetensors").exists()
