"""Qwen-Image-2.1-Turbo (TURBO_MODEL_DIR) on the tiny 2.1 checkpoint and its Turbo kind, through real worker
processes: speed=fast/fastest run the Turbo's 8 steps on its own transformer (the probe counts the forwards of
each transformer; the image is the Turbo pipeline's own, bit for bit, on the CPU), a quality job after it runs on
the model's transformer again, a failed or cancelled Turbo job leaves the model's in place; the settings and
requests it cannot serve are refused in the user's words."""

from __future__ import annotations

import base64
import io
import json
import shutil
import threading
import time

import httpx
import numpy as np
import pytest
from conftest import ConcurrencyProbe, make_manager, start_server
from PIL import Image

from imgedit.errors import Cancelled, ImgEditError, InvalidInput, PlacementError
from imgedit.model.demo_checkpoint import TURBO_SIGMAS, build_checkpoint
from imgedit.protocol import EditRequest

SIZE = 64


@pytest.fixture(scope="module")
def turbo_dir(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "q21-turbo", kind="21turbo", seed=0)


@pytest.fixture(scope="module")
def manager(ckpt21, turbo_dir):
    return make_manager(ckpt21, TURBO_MODEL_DIR=str(turbo_dir))


@pytest.fixture(scope="module")
def server(manager):
    with start_server(manager) as live:
        yield live


def noise(seed: int) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (SIZE, SIZE, 3), np.uint8))


def request(speed: str | None = None, prompt: str = "a red boat", images: int = 1, **extra) -> EditRequest:
    steps = {} if speed else {"num_inference_steps": 2}
    return EditRequest(images=tuple(noise(k) for k in range(images)), prompt=prompt, seed=5, width=SIZE,
                       height=SIZE, speed=speed, **steps, **extra)


def pixels(result) -> np.ndarray:
    return np.asarray(result.images[0])


def forwards(manager, req: EditRequest):
    """The job's result and how many forwards each transformer ran (tests/faults.py's probe)."""
    probe = ConcurrencyProbe(manager)
    result = manager.edit(req)
    probe.close()
    return result, {name: probe.forwards.get(name, 0) for name in ("transformer", "turbo_transformer")}


def test_fastest_runs_the_turbo_transformer_for_its_eight_steps_then_quality_runs_the_model_again(manager):
    quality, ran = forwards(manager, request())
    assert ran == {"transformer": 2, "turbo_transformer": 0}
    for speed in ("fastest", "fast"):  # both speeds run the Turbo's own schedule
        fast, ran = forwards(manager, request(speed))
        assert ran == {"transformer": 0, "turbo_transformer": 8}, speed
        assert fast.steps == 8
    again, ran = forwards(manager, request())
    assert ran == {"transformer": 2, "turbo_transformer": 0}
    assert np.array_equal(pixels(again), pixels(quality))  # the model's transformer and scheduler, as before
    assert not np.array_equal(pixels(fast), pixels(quality))


def test_a_turbo_image_is_the_turbo_pipelines_own_bit_for_bit(manager, turbo_dir):
    """The same request made directly with diffusers' QwenImage21Pipeline loaded from the Turbo folder (its
    sample_sigmas, its scheduler, its transformer; the CPU, float32, the seed's CPU generator)."""
    import torch
    from diffusers import QwenImage21Pipeline

    from imgedit.model.processor import load_processor, processor_class

    served = manager.edit(request("fastest", images=0))
    processor = load_processor(turbo_dir / "processor", processor_class(turbo_dir))  # no video processor saved
    pipe = QwenImage21Pipeline.from_pretrained(turbo_dir, processor=processor, torch_dtype=torch.float32)
    assert list(pipe.config.sample_sigmas) == TURBO_SIGMAS
    direct = pipe(image=None, prompt="a red boat", negative_prompt=None, true_cfg_scale=1.0, width=SIZE,
                  height=SIZE, output_resolution=320, num_images_per_prompt=1,
                  generator=[torch.Generator("cpu").manual_seed(5)]).images[0]
    assert np.array_equal(np.asarray(served.images[0]), np.asarray(direct))
    quality = manager.edit(EditRequest(images=(), prompt="a red boat", seed=5, width=SIZE, height=SIZE,
                                       num_inference_steps=8))
    assert not np.array_equal(np.asarray(quality.images[0]), np.asarray(direct))  # the model's: another image


def test_a_failed_or_cancelled_turbo_job_leaves_the_models_transformer_in_place(manager):
    quality = pixels(manager.edit(request()))
    turbo = pixels(manager.edit(request("fastest")))
    with pytest.raises(ImgEditError, match="internal error"):
        manager.edit(request("fastest", prompt="a red boat [bug]"))
    cancel = threading.Event()
    threading.Timer(1.0, cancel.set).start()
    with pytest.raises(Cancelled):
        manager.edit(request("fast", prompt="a red boat [slow]"), cancel=cancel)
    again, ran = forwards(manager, request())
    assert ran == {"transformer": 2, "turbo_transformer": 0} and np.array_equal(pixels(again), quality)
    assert np.array_equal(pixels(manager.edit(request("fastest"))), turbo)


def test_rest_speed_fastest_records_the_speed_and_health_names_the_turbo(server, manager):
    response = httpx.post(f"{server.url}/v1/images/generations", timeout=120,
                          json={"prompt": "a fox", "size": f"{SIZE}x{SIZE}", "seed": 3, "speed": "fastest"})
    assert response.status_code == 200, response.text
    image = Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"])))
    assert image.info["speed"] == "fastest" and image.info["num_inference_steps"] == "8"
    assert image.info["true_cfg_scale"] == "1" and image.info["lora"] == "none"
    assert image.info["model"] == manager.settings.model_name
    health = httpx.get(f"{server.url}/health", timeout=10).json()
    assert [w["turbo"] for w in health["workers"]] == ["Qwen-Image-2.1-Turbo, 8 steps (q21-turbo)"]
    assert "turbo" in manager.workers[0].report.features
    with_lora = httpx.post(f"{server.url}/v1/images/generations", timeout=30,
                           json={"prompt": "a fox", "speed": "fast", "cache": "taylorseer"})
    assert with_lora.status_code == 400 and "Turbo steps" in with_lora.json()["error"]["message"]


def test_the_page_offers_both_speeds_with_the_turbo(manager):
    from imgedit.config.settings import load_settings
    from imgedit.web.page.speed import speed_choices

    shown = dict((value, label) for label, value in speed_choices(manager.settings))
    assert list(shown) == ["quality", "fast", "fastest"]
    assert shown["fastest"] == "Fastest (Qwen-Image-2.1-Turbo, 8 steps)"
    assert [v for _, v in speed_choices(load_settings({"QWEN_MODEL_DIR": "x"}))] == ["quality"]


def test_without_the_setting_fast_speeds_are_refused_naming_it(ckpt21):
    from imgedit.config.settings import load_settings
    from imgedit.engine.validation import resolve

    settings = load_settings({"QWEN_MODEL_DIR": str(ckpt21)})
    with pytest.raises(InvalidInput, match="there is no Lightning LoRA for Qwen-Image-2.1: set TURBO_MODEL_DIR"):
        resolve(request("fast"), settings, "21", (SIZE, SIZE), 1)


def test_a_lora_does_not_run_on_the_turbo(manager, turbo_dir):
    from dataclasses import replace

    from imgedit.config.loras import LoraEntry
    from imgedit.engine.validation import resolve

    settings = replace(manager.settings, lora_entries=(LoraEntry("style", "/x.safetensors"),))
    with pytest.raises(InvalidInput, match="runs Qwen-Image-2.1-Turbo's own transformer") as refused:
        resolve(request("fast", lora="style"), settings, "21", (SIZE, SIZE), 1)
    assert refused.value.field == "lora"
    params = resolve(request("fastest"), settings, "21", (SIZE, SIZE), 1)
    assert (params.steps, params.true_cfg_scale, params.scheduler, params.adapters) == (8, 1.0, "turbo", ())


def test_the_setting_is_refused_for_another_family(turbo_dir, tmp_path):
    plus = build_checkpoint(tmp_path / "plus", kind="plus")
    manager = make_manager(plus, load=False, TURBO_MODEL_DIR=str(turbo_dir))
    with pytest.raises(PlacementError, match="TURBO_MODEL_DIR is for Qwen-Image-2.1 .* the served model is "
                                             "Qwen-Image-Edit-2509/2511"):
        manager.prepare()


def _copy(turbo_dir, tmp_path, change) -> str:
    folder = tmp_path / "changed"
    shutil.copytree(turbo_dir, folder)
    change(folder)
    return str(folder)


def _edit_json(path, **values):
    data = json.loads(path.read_text())
    data.update(values)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(("change", "said"), [
    (lambda f: shutil.rmtree(f), "no such folder"),
    (lambda f: (f / "model_index.json").unlink(), "has no model_index.json"),
    (lambda f: _edit_json(f / "model_index.json", sample_sigmas=None), "has no sample_sigmas"),
    (lambda f: _edit_json(f / "model_index.json", _class_name="QwenImageEditPlusPipeline"),
     "holds a QwenImageEditPlusPipeline, not a Qwen-Image-2.1"),
    (lambda f: _edit_json(f / "transformer" / "config.json", num_layers=3),
     r"its transformer is not Qwen-Image-2.1's shape \(num_layers 3, the served model's 2\)"),
    (lambda f: shutil.rmtree(f / "scheduler"), "has no scheduler/scheduler_config.json"),
])
def test_a_folder_that_is_not_the_turbo_is_refused_at_start_up(ckpt21, turbo_dir, tmp_path, change, said):
    folder = _copy(turbo_dir, tmp_path, change)
    manager = make_manager(ckpt21, load=False, TURBO_MODEL_DIR=folder)
    with pytest.raises(PlacementError, match=f"TURBO_MODEL_DIR={folder} cannot be used: .*{said}"):
        manager.prepare()


@pytest.mark.parametrize("env", [{"MAX_MEMORY": "40GiB"}, {"OFFLOAD": "text_encoder"}])
def test_capped_or_streamed_memory_modes_are_refused_with_the_turbo(ckpt21, turbo_dir, env):
    from imgedit.planning.plan import GpuSpec

    manager = make_manager(ckpt21, plan="planner", load=False, DEVICE_MAP="auto", TURBO_MODEL_DIR=str(turbo_dir),
                           **env)
    manager._gpus = [GpuSpec(0, "H100", 80 * 2**30, 79 * 2**30)]
    with pytest.raises(PlacementError, match=f"TURBO_MODEL_DIR keeps a second transformer .* {next(iter(env))}"):
        manager.prepare()


def test_quantize_applies_to_the_turbo_transformer_too(ckpt21, turbo_dir, manager):
    """QUANTIZE=int8 (the CPU's; fp8 on GPUs of capability 8.9+): the Turbo's Linear weights are quantized as the
    model's are, so its image moves off the bf16 Turbo's, a little; /health says how it is held."""
    quantized = make_manager(ckpt21, plan="planner", TURBO_MODEL_DIR=str(turbo_dir), QUANTIZE="int8")
    assert quantized.workers[0].report.turbo == "Qwen-Image-2.1-Turbo, 8 steps (q21-turbo), int8 (QUANTIZE)"
    fast, ran = forwards(quantized, request("fastest"))
    assert ran == {"transformer": 0, "turbo_transformer": 8}
    exact = pixels(manager.edit(request("fastest"))).astype(int)
    difference = np.abs(pixels(fast).astype(int) - exact)
    assert difference.max() > 0 and difference.mean() < 8, difference.mean()
    quantized.close()


def test_the_planner_counts_the_turbo_transformer(tmp_path):
    """Real sizes (7.1 B transformer, 8.8 B text encoder): one 48 GB card holds 2.1 alone, not with its Turbo in
    bf16, and the refusal says so; QUANTIZE=auto then puts both transformers in fp8 on it (lossless first: it
    is lossy), as QUANTIZE=fp8 does; two of them hold both in bf16, both transformers on the first."""
    from imgedit.config.parsers import GIB
    from imgedit.planning.plan import GpuSpec

    real = build_checkpoint(tmp_path / "real21", kind="21", size="real")
    turbo = build_checkpoint(tmp_path / "real21-turbo", kind="21turbo", size="real")
    one = [GpuSpec(0, "L40S", 48 * GIB, 47 * GIB)]
    alone = make_manager(real, plan="planner", load=False, DEVICE_MAP="balanced", QUANTIZE="none",
                         OFFLOAD="none")
    alone._gpus = one
    assert sum(alone.prepare().plan.bytes_per_device.values()) < 33 * GIB
    both = make_manager(real, plan="planner", load=False, DEVICE_MAP="balanced", TURBO_MODEL_DIR=str(turbo),
                        QUANTIZE="none")
    both._gpus = one
    with pytest.raises(PlacementError, match="counting TURBO_MODEL_DIR's second transformer"):
        both.prepare()
    two = make_manager(real, plan="planner", load=False, DEVICE_MAP="balanced", TURBO_MODEL_DIR=str(turbo))
    two._gpus = [GpuSpec(i, "L40S", 48 * GIB, 47 * GIB) for i in range(2)]
    plan = two.prepare().plan
    assert sum(plan.bytes_per_device.values()) > 43 * GIB  # both transformers, the text encoder, the VAE
    assert plan.bytes_per_device["cuda:0"] > 2 * 14e9 and plan.workers[0].memory is None
    for quantize in ("auto", "fp8"):  # both fit one card in fp8
        fp8 = make_manager(real, plan="planner", load=False, DEVICE_MAP="balanced", TURBO_MODEL_DIR=str(turbo),
                           QUANTIZE=quantize)
        fp8._gpus = [GpuSpec(0, "L40S", 48 * GIB, 47 * GIB, capability=(8, 9))]
        plan = fp8.prepare().plan
        assert len(plan.workers) == 1 and plan.workers[0].memory.mode_of("transformer") == "fp8", quantize
        assert 2 * 7e9 < sum(plan.bytes_per_device.values()) < 47 * GIB


def test_the_demo_checkpoints_turbo_kind(ckpt21, turbo_dir, tmp_path):
    """`--kind 21turbo`: the 2.1 checkpoint of the same seed but for its transformer's weights, a scheduler that
    does not shift, the 8 sigmas in model_index.json; `--size real` writes the published configs alone."""
    import torch
    from safetensors.torch import load_file

    from imgedit.model.demo_checkpoint import main
    from imgedit.planning.turbo import open_turbo

    def weights(folder, name):
        return load_file(folder / name / "diffusion_pytorch_model.safetensors")

    index = json.loads((turbo_dir / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImage21Pipeline" and index["sample_sigmas"] == TURBO_SIGMAS
    scheduler = json.loads((turbo_dir / "scheduler" / "scheduler_config.json").read_text())
    assert (scheduler["shift"], scheduler["use_dynamic_shifting"], scheduler["shift_terminal"]) == (1.0, False, None)
    ours, theirs = weights(ckpt21, "transformer"), weights(turbo_dir, "transformer")
    linear = [k for k in ours if k.endswith(".weight") and ours[k].dim() == 2]
    assert ours.keys() == theirs.keys() and linear and not any(torch.equal(ours[k], theirs[k]) for k in linear)
    vae, vae_turbo = weights(ckpt21, "vae"), weights(turbo_dir, "vae")
    assert all(torch.equal(vae[k], vae_turbo[k]) for k in vae)
    main([str(tmp_path / "real"), "--kind", "21turbo", "--size", "real"])
    real = open_turbo(str(tmp_path / "real"))
    assert real.random_weights and real.steps == 8
    assert not list((tmp_path / "real" / "transformer").glob("*.safetensors"))
    assert json.loads((tmp_path / "real" / "transformer" / "config.json").read_text())["num_layers"] == 32


def test_a_cancel_mid_turbo_stops_within_a_step(manager):
    """Cancelled at its 3rd step, a Turbo job reports the step it stopped at of its 8."""
    cancel = threading.Event()
    steps = []

    def on_step(step, total):
        steps.append((step, total))
        if step == 3:
            cancel.set()

    started = time.perf_counter()
    with pytest.raises(Cancelled, match="of 8"):
        manager.edit(request("fastest", prompt="a boat [slow]"), on_step=on_step, cancel=cancel)
    assert steps[0] == (1, 8) and time.perf_counter() - started < 60


@pytest.mark.parametrize("ending", [RuntimeError, KeyboardInterrupt])
def test_the_turbo_part_puts_the_models_transformer_back_however_the_job_ends(ckpt21, turbo_dir, ending):
    """In process, on the loaded tiny pipeline: a Turbo job's part swaps in the Turbo transformer, scheduler and
    sigmas and puts the model's back when the job raises (the LoRAs' part would reset the transformer for the
    next job anyway: this is the part's own promise); a quality job's part touches nothing."""
    import torch
    from conftest import cpu_plan

    from imgedit.planning.checkpoint import open_checkpoint
    from imgedit.planning.turbo import check_turbo
    from imgedit.protocol import Resolved
    from imgedit.runtime import loader, turbo
    from imgedit.runtime.messages import Job
    from imgedit.runtime.runner import Call

    checkpoint = open_checkpoint(str(ckpt21))
    plan = cpu_plan(1).workers[0]
    pipe = loader.load_pipeline(checkpoint, plan, torch.float32)
    part = turbo.load(check_turbo(str(turbo_dir), checkpoint), pipe, plan, torch.float32, memoize=False)
    base, scheduler = pipe.transformer, pipe.scheduler
    assert part.transformer is not base and part.scheduler.config.use_dynamic_shifting is False
    assert next(part.transformer.parameters()).dtype == torch.float32
    assert not torch.equal(next(part.transformer.parameters()), next(base.parameters()))

    def job(name: str, steps: int) -> Job:
        return Job(request(), Resolved(steps=steps, negative_prompt=" ", seed=0, num_images=1, width=SIZE,
                                       height=SIZE, true_cfg_scale=1.0, scheduler=name), "21")

    call = Call(job("turbo", 8), False, True)
    with pytest.raises(ending), part.job(call):
        assert (pipe.transformer, pipe.scheduler) == (part.transformer, part.scheduler)
        assert call.kwargs["sigmas"] == TURBO_SIGMAS
        raise ending
    assert pipe.transformer is base and pipe.scheduler is scheduler
    quality = Call(job("default", 2), False, True)
    with part.job(quality):
        assert pipe.transformer is base and pipe.scheduler is scheduler and "sigmas" not in quality.kwargs
