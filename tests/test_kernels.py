"""ATTENTION and COMPILE_MODE (#24 item 4): the transformer's attention kernel and torch.compile's mode.

On the CPU only `flash` runs (PyTorch's CPU flash kernel); the GPU machine measures every kernel and mode
(benchmarks/bench_kernels.py, docs/BENCHMARKS.md). Here: the setting reaches the worker, which reads the
kernel back from its own attention processors; the pixels are the native kernel's; /health and the panel
say which; and what cannot run is refused at start-up with the reason.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import COMPONENTS, http, make_manager, picture, start_server

from imgedit.errors import PlacementError
from imgedit.planning.plan import MemoryMode, Placement, Plan, WorkerPlan
from imgedit.protocol import EditRequest
from imgedit.web.page.panel import panel_html


def request(**kw) -> EditRequest:
    return EditRequest(**{**dict(images=(picture(),), prompt="make it red", negative_prompt="blurry", seed=3,
                                 num_inference_steps=2, width=64, height=64), **kw})


def test_flash_attention_reaches_the_worker_and_gives_the_native_pixels(plus_ckpt, plus_manager):
    flash = make_manager(plus_ckpt, ATTENTION="flash")
    worker = flash.status().workers[0]
    assert worker.attention == "flash" and plus_manager.status().workers[0].attention == "native"
    ours, native = flash.edit(request()), plus_manager.edit(request())
    # float32 on the CPU: the explicit flash kernel and PyTorch's own pick may sum in another order
    assert np.abs(np.asarray(ours.images[0], np.int16) - np.asarray(native.images[0], np.int16)).max() <= 1
    with start_server(flash) as server:
        health = http.get(f"{server.url}/health", timeout=30).json()
        assert (health["attention"], health["compile_mode"]) == ("flash", "off")
        assert health["workers"][0]["attention"] == "flash"
        panel = panel_html(health)
        assert "ATTENTION: flash" in panel and "compile: off" in panel


def cpu_plan(memory: MemoryMode | None = None, parallel: str = "none", ranks: int = 1, ulysses: int = 1) -> Plan:
    worker = WorkerPlan("worker-0", {c: Placement("cpu") for c in COMPONENTS}, parallel,
                        ("cpu",) * ranks if ranks > 1 else (), ulysses, memory)
    return Plan(parallel if parallel != "none" else "replicas", (worker,), "a CPU plan for tests")


@pytest.mark.parametrize("env, plan, says", [
    ({"ATTENTION": "cudnn"}, None, "ATTENTION=cudnn is a CUDA kernel, and a worker here runs on the CPU"),
    ({"ATTENTION": "efficient"}, None, "ATTENTION=efficient is a CUDA kernel"),
    ({"COMPILE_MODE": "max-autotune-no-cudagraphs"}, None,
     "COMPILE_MODE=max-autotune-no-cudagraphs applies to compiled workers, and none is compiled here (COMPILE=auto"),
    ({"ATTENTION": "flash"}, cpu_plan(MemoryMode(batch_cfg=True)),
     "ATTENTION=flash takes no attention mask, and BATCH_CFG pads the shorter prompt"),
    ({"ATTENTION": "flash"}, cpu_plan(parallel="ulysses", ranks=2, ulysses=2),
     "ATTENTION=flash takes no attention mask, and a Ulysses group pads the text"),
], ids=["cudnn-cpu", "efficient-cpu", "mode-uncompiled", "flash-batch-cfg", "flash-ulysses"])
def test_what_cannot_run_is_refused_at_start_up_with_the_reason(plus_ckpt, env, plan, says):
    manager = make_manager(plus_ckpt, plan=plan, load=False, **env)
    with pytest.raises(PlacementError, match=says.replace("(", r"\(")):
        manager.prepare()
    assert says in manager.load_error and not any(w.pids for w in manager.workers)  # nothing was started


def test_bad_values_stop_start_up_naming_the_choices():
    from imgedit.config.settings import load_settings
    from imgedit.errors import SettingsError

    with pytest.raises(SettingsError, match="ATTENTION='sage'.*native, flash, cudnn, efficient"):
        load_settings({"ATTENTION": "sage"})
    with pytest.raises(SettingsError, match="COMPILE_MODE='max-autotune' .*default, max-autotune-no-cudagraphs"):
        load_settings({"COMPILE_MODE": "max-autotune"})  # CUDA graphs: measured to fail on the per-block compile


def test_an_image_runs_the_vaes_causal_3d_convolutions_as_2d_ones_with_the_same_result(plus_pipe):
    """One frame meets only the last time tap of each causal 3x3x3 kernel (the other two meet the causal zero
    padding), so imgedit/runtime/single_frame.py runs a 2-D convolution: a third of the work, and on the CPU
    not PyTorch's slow vol2col path. Same sums as diffusers' own forward; several frames keep its path."""
    import torch
    import torch.nn.functional as F

    vae = plus_pipe.pipe.vae
    from imgedit.runtime.single_frame import HOOK

    routed = [m for m in vae.modules() if getattr(m, "_diffusers_hook", None) and m._diffusers_hook.get_hook(HOOK)]
    assert all(isinstance(m, torch.nn.Conv3d) and "forward" in vars(m) for m in routed)
    assert len(routed) >= 10 and vae.encoder.conv_in in routed and vae.decoder.conv_out in routed

    def own(conv, x, cache=None):  # diffusers' QwenImageCausalConv3d.forward, as the class defines it
        return type(conv).forward(conv, x, cache)

    torch.manual_seed(0)
    for conv, size in ((vae.encoder.conv_in, 256), (vae.decoder.conv_out, 64)):
        frame = torch.randn(1, conv.in_channels, 1, size, size)
        with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            ours = conv(frame)
        calls = {e.key for e in prof.key_averages()}
        assert "aten::conv2d" in calls and "aten::conv3d" not in calls
        with torch.no_grad():
            assert torch.allclose(ours, own(conv, frame), atol=1e-5)
            frames, cache = torch.randn(1, conv.in_channels, 3, 32, 32), torch.randn(1, conv.in_channels, 2, 32, 32)
            assert torch.equal(conv(frames), own(conv, frames))  # video: diffusers' own path
            assert torch.equal(conv(frames[:, :, :1], cache), own(conv, frames[:, :, :1], cache))
    with torch.no_grad():  # the VAE as a whole: an encode through the routed convolutions and diffusers' own
        image = F.interpolate(torch.rand(1, 3, 1, 64, 64) * 2 - 1, size=(1, 128, 128))
        ours = vae.encode(image).latent_dist.mean
        saved = {m: vars(m).pop("forward") for m in routed}
        try:
            theirs = vae.encode(image).latent_dist.mean
        finally:
            for m, forward in saved.items():
                m.forward = forward
    assert torch.allclose(ours, theirs, atol=1e-4)


def test_the_planner_decides_fusing_and_a_pairs_split_from_the_settings_and_the_plan():
    """modes.fuse_lora / modes.pair_ulysses / kernel_refusal: pure decisions, shown in /health and the panel."""
    from imgedit.config.settings import load_settings
    from imgedit.planning import modes

    gpu = {c: Placement("cuda:0") for c in COMPONENTS}
    one = WorkerPlan("w", gpu)
    pair = WorkerPlan("w", gpu, "cfg", ("cuda:0", "cuda:1"))
    cpu_pair = WorkerPlan("w", {c: Placement("cpu") for c in COMPONENTS}, "cfg", ("cpu", "cpu"))
    group4 = WorkerPlan("w", gpu, "cfg", ("cuda:0", "cuda:1", "cuda:2", "cuda:3"), ulysses=2)
    quantized = WorkerPlan("w", gpu, memory=MemoryMode(quantize=(("transformer", "fp8"),)))
    streamed = WorkerPlan("w", gpu, memory=MemoryMode(resident_blocks=10))
    auto, off, on = (load_settings({"PAIR_ULYSSES": v, "FUSE_LORA": "off" if v == "off" else "auto"})
                     for v in ("auto", "off", "on"))
    assert [modes.fuse_lora(auto, p) for p in (one, pair, quantized, streamed)] == ["auto", "auto", "off", "off"]
    assert modes.fuse_lora(off, one) == "off"
    # auto: GPU pairs only (the CPU pair of the tests needs `on`); never a single worker or a Ulysses group
    assert [modes.pair_ulysses(auto, p) for p in (pair, cpu_pair, one, group4)] == [True, False, False, False]
    assert [modes.pair_ulysses(on, p) for p in (pair, cpu_pair, one)] == [True, True, False]
    assert not modes.pair_ulysses(off, pair)
    # Ulysses-2 gives each rank half of the heads: auto leaves a transformer of odd heads unsplit
    assert [modes.pair_ulysses(auto, pair, heads) for heads in (24, 3, None)] == [True, False, True]
    assert modes.pair_ulysses(on, pair, 3)  # `on` is the user's word: the worker refuses it, naming the setting
    assert not modes.pair_ulysses(load_settings({"ATTENTION": "efficient"}), pair)  # auto leaves it off
    refused = modes.kernel_refusal(load_settings({"PAIR_ULYSSES": "on", "ATTENTION": "flash"}), [pair])
    assert refused is not None and "ATTENTION=flash takes no attention mask" in refused
    assert modes.kernel_refusal(load_settings({"ATTENTION": "flash"}), [pair]) is None  # auto: no split, no mask


def test_a_pair_asked_to_split_a_transformer_of_odd_heads_is_refused_naming_the_setting(plus_ckpt):
    """The tiny transformer has one head: the planner reads it from the config (auto: no split), and a pair
    told PAIR_ULYSSES=on stops with a message naming the setting, before any collective is set up."""
    from diffusers import QwenImageTransformer2DModel

    from imgedit.errors import ImgEditError
    from imgedit.planning.checkpoint import open_checkpoint
    from imgedit.runtime.group import ParallelGroup

    assert open_checkpoint(str(plus_ckpt)).attention_heads == 1
    transformer = QwenImageTransformer2DModel.from_pretrained(plus_ckpt / "transformer")
    with pytest.raises(ImgEditError, match="PAIR_ULYSSES=on splits CFG-off jobs' attention heads over the pair's "
                                           "2 GPUs, but this transformer has 1 heads; set PAIR_ULYSSES=auto"):
        ParallelGroup(transformer, "cfg", 0, 2, 1, False, None, pair_ulysses=True)
