"""FAST_QUANTIZE (imgedit.runtime.fast_weights): fast jobs on a copy of the transformer per Lightning LoRA, the LoRA
fused in and the Linear layers quantized; the quality weights untouched. In the test process (the runner as a
worker runs it), then through a worker process and /health. fp8 needs a GPU (tests/test_gpu.py); int8 runs here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import COMPONENTS, ConcurrencyProbe, group_plan, http, make_manager, picture, start_server, wait_job
from test_loras import EIGHT, FOUR, Local, linears, lora_dir, png_bytes, rest_edit  # noqa: F401  (LoRA files, runner)

from imgedit.config.settings import load_settings
from imgedit.errors import ImgEditError, PlacementError, SettingsError
from imgedit.planning import modes
from imgedit.planning.plan import MemoryMode, Placement, WorkerPlan
from imgedit.protocol import EditRequest
from imgedit.runtime.fast_weights import FastWeights, copy_bytes
from imgedit.web.page.panel import panel_html


@pytest.fixture(scope="module")
def int8(plus_ckpt, lora_dir):  # noqa: F811  (the fixture imported above)
    return Local(plus_ckpt, lora_dir, fuse="auto", fast="int8")


@pytest.fixture(scope="module")
def reference(plus_ckpt, lora_dir):  # noqa: F811
    """The same LoRAs, FUSE_LORA=auto, no copy: fast jobs on the quality weights (one pipeline for the module)."""
    return Local(plus_ckpt, lora_dir, fuse="auto")


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b) ** 2))
    return 99.0 if mse == 0 else 10 * np.log10(255.0**2 / mse)


def test_the_copy_is_the_fused_lora_exactly_before_quantizing(reference):
    """Unquantized ("none", for this test), a copy gives the pixels of FUSE_LORA's in-place fusing bit for bit:
    the same W + scaling * B @ A with one rounding, and plain Linear layers where peft's were."""
    local = reference
    fused = local.edit(speed="fastest")  # FUSE_LORA: written into the quality weights
    local.adapters.fusion.restore()
    adapter = local.adapters.adapter_names[FOUR]
    local.adapters.fast = FastWeights(local.adapters.base, {FOUR: adapter}, "none")
    copy = local.adapters.fast.copies[adapter]
    assert not any("lora_" in name for name, _ in copy.named_parameters())
    assert copy_bytes(local.adapters.base, "none") == sum(p.numel() * p.element_size() for p in copy.parameters())
    assert np.array_equal(local.edit(speed="fastest"), fused)
    assert local.pipe.transformer is copy  # a finished job leaves it for the next fast one
    assert np.array_equal(local.edit(), local.baseline)  # the quality weights were never written
    assert local.pipe.transformer is local.adapters.base
    local.adapters.fast = None  # the module's reference again: no copy


def test_fast_jobs_run_on_their_quantized_copy_and_every_other_job_on_the_quality_weights(int8, reference, plus_ckpt,
                                                                                        lora_dir):  # noqa: F811
    fast = int8.adapters.fast
    assert set(fast.copies) == {int8.adapters.adapter_names[n] for n in (FOUR, EIGHT)}
    assert fast.describe().startswith(f"int8: {FOUR}, {EIGHT} (a copy of the transformer each, LoRA fused in, ")
    assert int8.adapters.fusion.can_fuse(int8.adapters.adapter_names[FOUR])  # FUSE_LORA as before, for other jobs
    base, base_params = int8.adapters.base, {n: p.clone() for n, p in int8.adapters.base.named_parameters()}
    for speed, name in (("fastest", FOUR), ("fast", EIGHT)):
        image = int8.edit(speed=speed)
        assert int8.pipe.transformer is fast.copies[int8.adapters.adapter_names[name]], speed
        want = reference.edit(speed=speed)
        # int8 weights: near the bf16 fused image, not equal to it (lossy, opt-in)
        assert not np.array_equal(image, want) and psnr(image, want) > 30, (speed, psnr(image, want))
        without = reference.edit(speed=speed, lora=name, lora_scale=0)  # the same job with the LoRA at 0
        assert np.abs(image - want).mean() < np.abs(image - without).mean(), speed  # the LoRA is in the copy
    for asked in (dict(speed="fastest", lora="style"), dict(speed="fastest", lora=FOUR, lora_scale=0.5),
                  dict(lora=FOUR), dict(lora="style")):  # not a preset's job at strength 1: the quality weights
        assert np.abs(int8.edit(**asked) - reference.edit(**asked)).max() <= 1, asked  # as before: float32 rounding
        assert int8.pipe.transformer is base, asked
    int8.edit(speed="fastest")
    assert np.array_equal(int8.edit(), int8.baseline)  # quality after fast: the pixels of a server without LoRAs
    assert int8.pipe.transformer is base
    assert all(torch.equal(p, base_params[n]) for n, p in base.named_parameters())


def test_a_failed_job_on_the_copy_leaves_the_quality_weights_for_the_next_job(int8):
    copy = int8.adapters.fast.copies[int8.adapters.adapter_names[FOUR]]

    def fail(module, args):
        raise KeyError("fault injected in the fast copy's forward")

    hook = copy.transformer_blocks[0].register_forward_pre_hook(fail)
    try:
        with pytest.raises(ImgEditError, match="internal error"):
            int8.edit(speed="fastest")
    finally:
        hook.remove()
    assert int8.pipe.transformer is int8.adapters.base
    assert np.array_equal(int8.edit(), int8.baseline)


def test_what_cannot_make_the_copies_is_refused_with_the_reason():
    gpu, cpu = ({c: Placement(d) for c in COMPONENTS} for d in ("cuda:0", "cpu"))
    split = {**gpu, "transformer": Placement("cuda:0", ("cuda:0",) * 30 + ("cuda:1",) * 30)}
    fp8, int8 = (load_settings({"FAST_QUANTIZE": m}) for m in ("fp8", "int8"))
    one = WorkerPlan("w", gpu)
    cases = [
        (fp8, [one], 0, "FAST_QUANTIZE=fp8 makes a fp8 copy of the transformer for each Lightning LoRA, and no "
                        "Lightning LoRA is configured"),
        (fp8, [WorkerPlan("w", gpu, "ulysses", ("cuda:0", "cuda:1"), 2)], 1,
         "on workers of one GPU or CFG pairs, and w is a ulysses group of 2"),
        (fp8, [WorkerPlan("w", gpu, "cfg", ("cuda:0",) * 4, 2)], 1, "w is a cfg group of 4"),
        (fp8, [WorkerPlan("w", split)], 1, "splits it over cuda:0, cuda:1"),
        (fp8, [WorkerPlan("w", gpu, memory=MemoryMode(quantize=(("transformer", "fp8"),)))], 1, "is quantized"),
        (int8, [WorkerPlan("w", gpu, memory=MemoryMode(resident_blocks=10))], 1, "is streamed from the CPU"),
        (fp8, [WorkerPlan("w", cpu)], 1,
         "fp8 needs a CUDA GPU of compute capability 8.9+; w runs on the CPU: use int8"),
    ]
    for settings, plans, lightning, says in cases:
        refused = modes.fast_refusal(settings, plans, lightning)
        assert refused is not None and says in refused, (says, refused)
    assert modes.fast_refusal(int8, [WorkerPlan("w", cpu)], 2) is None
    assert modes.fast_refusal(fp8, [one, one], 1) is None  # replicas: a copy in each
    assert modes.fast_refusal(fp8, [WorkerPlan("w", gpu, "cfg", ("cuda:0", "cuda:1"))], 1) is None  # a CFG pair
    assert modes.fast_refusal(load_settings({}), [WorkerPlan("w", cpu)], 0) is None  # none: nothing to make
    only8 = load_settings({"FAST_QUANTIZE": "int8", "FAST_QUANTIZE_SPEEDS": " Fast "})
    assert modes.fast_steps(only8) == (8,) and modes.fast_steps(int8) == (4, 8)
    assert modes.fast_steps(load_settings({})) == ()
    assert "no Lightning LoRA is configured for FAST_QUANTIZE_SPEEDS=fast" in modes.fast_refusal(only8, [one], 0)
    with pytest.raises(SettingsError, match=r"FAST_QUANTIZE_SPEEDS='quality' is not valid: expected fastest, fast"):
        load_settings({"FAST_QUANTIZE_SPEEDS": "quality"})


def test_a_worker_process_serves_fast_jobs_on_the_copy_and_says_so(plus_ckpt, lora_dir):  # noqa: F811
    refused = make_manager(plus_ckpt, load=False, LORA_DIR=str(lora_dir), FAST_QUANTIZE="fp8")
    with pytest.raises(PlacementError, match="fp8 needs a CUDA GPU"):
        refused.prepare()
    assert "use int8" in refused.load_error and not any(w.pids for w in refused.workers)
    manager = make_manager(plus_ckpt, LORA_DIR=str(lora_dir), FAST_QUANTIZE="int8", FAST_QUANTIZE_SPEEDS="fastest")
    status = manager.status()
    assert status.fast_quantize == "int8"
    assert status.workers[0].fast_weights.startswith(f"int8: {FOUR} (a copy of the transformer each")  # 4-step only
    req = dict(prompt="make it red", seed=3, width=64, height=64)
    fast = manager.edit(EditRequest(images=(picture(),), speed="fastest", **req))
    eight = manager.edit(EditRequest(images=(picture(),), speed="fast", **req))  # no copy: the quality weights
    quality = manager.edit(EditRequest(images=(picture(),), num_inference_steps=2, **req))
    assert (fast.steps, eight.steps, quality.steps) == (4, 8, 2) and fast.images[0].size == (64, 64)
    # the lossy copy is named where the image goes: the result, the PNG's settings (REST and the page show it)
    assert (fast.weights, eight.weights, quality.weights) == ("int8", None, None)
    assert fast.images[0].info["weights"] == "int8" and "weights" not in eight.images[0].info
    from imgedit.web.page.speed import speed_choices

    labels = dict((value, label) for label, value in speed_choices(manager.settings))
    assert labels["fastest"] == "Fastest (Lightning, 4 steps, int8 weights)"
    assert labels["fast"] == "Fast (Lightning, 8 steps)" and labels["quality"].endswith("CFG on)")
    with start_server(manager) as server:
        fastest, plain = rest_edit(server.url, speed="fastest"), rest_edit(server.url)
        job = http.post(f"{server.url}/v1/jobs", files=[("image", ("a.png", png_bytes(), "image/png"))],
                        data={"prompt": "make it red", "size": "64x64", "speed": "fastest"}, timeout=60).json()
        view = wait_job(server.url, job["id"])
    assert fastest.status_code == 200 and fastest.json()["weights"] == "int8"
    assert plain.status_code == 200 and "weights" not in plain.json()
    assert view["state"] == "succeeded" and view["items"][0]["weights"] == "int8", view  # /v1/jobs, from History
    from imgedit.engine.workers.gpus import GpuMonitor, snapshot

    data = snapshot(GpuMonitor(), manager.status())
    assert data["fast_quantize"] == "int8" and data["workers"][0]["fast_weights"].startswith("int8: ")
    html = panel_html(data)
    assert "FAST_QUANTIZE: int8" in html and f"fast mode on int8: {FOUR}" in html


def test_a_cfg_pair_runs_fast_jobs_on_both_ranks_copies_split(tmp_path_factory):
    """A CFG pair that splits CFG-off jobs (PAIR_ULYSSES) holds the copy on both ranks, with a Ulysses switch like
    the quality transformer's: a `fastest` job runs on both ranks' copies, each forward's sequence split, and gives
    the image of a pair that does not split (its rank 0 runs the job alone, on the only copy it makes)."""
    from imgedit.model.demo_checkpoint import build_checkpoint
    from imgedit.model.lora_random import random_lora
    from imgedit.model.loras import transformer_linears

    folder = tmp_path_factory.mktemp("fast-pair")
    ckpt = build_checkpoint(folder / "plus2", kind="plus", seed=0, heads=2)  # Ulysses-2 needs even heads
    loras = folder / "loras"
    loras.mkdir()
    random_lora(loras / f"{FOUR}.safetensors", transformer_linears(ckpt), rank=4, std=0.4, seed=1)
    env = dict(LORA_DIR=str(loras), FAST_QUANTIZE="int8")

    def edit(manager, **kw):
        return manager.edit(EditRequest(images=(picture(),), prompt="make it red", seed=5, width=64, height=64, **kw))

    images, forwards = {}, {}
    for split in ("on", "off"):
        pair = make_manager(ckpt, plan=group_plan("cfg", 2, 1), PAIR_ULYSSES=split, **env)
        assert pair.workers[0].info["pair_ulysses"] is (split == "on")
        assert pair.status().workers[0].fast_weights.startswith(f"int8: {FOUR}")
        probe = ConcurrencyProbe(pair)
        fast = edit(pair, speed="fastest")
        if split == "on":
            edit(pair, num_inference_steps=3, true_cfg_scale=4.0)  # a quality edit: the quality transformers
        probe.close()
        pair.close()
        assert fast.weights == "int8"
        images[split], forwards[split] = np.asarray(fast.images[0], dtype=np.int16), probe.forwards
    # float32 on the CPU: the split attention sums in another order, so allow one level of rounding
    assert np.abs(images["on"] - images["off"]).max() <= 1
    # split: both ranks on their copies, 4 steps; the quality edit: 3 steps by branch, one forward per rank each
    assert forwards["on"].get("fast_transformer") == 2 * 4 and forwards["on"]["transformer"] == 2 * 3, forwards
    assert forwards["off"].get("fast_transformer") == 4 and not forwards["off"].get("transformer"), forwards
