"""QUANTIZE / OFFLOAD: the settings, the sizes the planner works from (real parameter counts of the
full-size configs), its choices for made-up GPUs, the refusals, and real edits on the CPU with the
tiny checkpoint quantized (int8, nf4) and with the offload hooks (streamed blocks and text encoder).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import COMPONENTS, Blocks, make_manager, picture

from imgedit.config.parsers import GIB, parse_offload, parse_quantize
from imgedit.config.settings import load_settings
from imgedit.engine.workers.gpus import GpuMonitor, snapshot
from imgedit.engine.workers.inspection import inspect_checkpoint
from imgedit.errors import InvalidInput, PlacementError, SettingsError
from imgedit.model.demo_checkpoint import build_checkpoint
from imgedit.planning.memory import (
    BYTES_PER_WEIGHT,
    MemoryMode,
    candidates,
    check_device,
    host_bytes,
    plan_memory,
)
from imgedit.planning.plan import ComponentSpec, GpuSpec, Placement, Plan, WorkerPlan
from imgedit.protocol import EditRequest
from imgedit.runtime import loader, weights
from imgedit.web.page.panel import panel_html

ADA, AMPERE = (8, 9), (8, 6)


# ---- settings ----

@pytest.mark.parametrize("raw, expected", [
    ("auto", None), ("", None), ("none", ()), ("fp8", (("transformer", "fp8"),)),
    ("INT8", (("transformer", "int8"),)),
    ("transformer=fp8,text_encoder=int8", (("transformer", "fp8"), ("text_encoder", "int8"))),
    ("text_encoder=nf4, transformer=none", (("text_encoder", "nf4"),)),
])
def test_quantize_values(raw, expected):
    assert parse_quantize(raw) == expected
    assert load_settings({"QUANTIZE": raw}).quantize == expected


@pytest.mark.parametrize("raw, expected", [
    ("auto", None), ("none", ()), ("text_encoder", ("text_encoder",)),
    ("blocks,text_encoder", ("text_encoder", "blocks")),
])
def test_offload_values(raw, expected):
    assert parse_offload(raw) == expected


@pytest.mark.parametrize("var, raw, says", [
    ("QUANTIZE", "fp4", "auto, none, fp8, int8, nf4"),
    ("QUANTIZE", "vae=int8", "components: transformer, text_encoder"),
    ("QUANTIZE", "transformer=fp8,transformer=int8", "component=mode pairs"),
    ("QUANTIZE", "transformer:fp8", "component=mode pairs"),
    ("OFFLOAD", "gpu", "auto, none, text_encoder, blocks"),
    ("OFFLOAD", "blocks,blocks", "text_encoder,blocks"),
    ("QUANTIZE_SKIP", "img_mlp;rm -rf", "module names such as img_mlp"),
])
def test_bad_values_stop_start_up_naming_variable_value_and_allowed(var, raw, says):
    with pytest.raises(SettingsError) as err:
        load_settings({var: raw})
    assert f"{var}={raw!r} is not valid" in err.value.message and says in err.value.message


# ---- sizes from the real configs ----

@pytest.fixture(scope="module")
def real_sizes(tmp_path_factory):
    folder = build_checkpoint(tmp_path_factory.mktemp("real") / "plus", size="real")  # configs only
    checkpoint = loader.open_checkpoint(str(folder))
    # as a CPU server plans (WORKER_START=forkserver): in a fork of the forkserver
    return checkpoint, inspect_checkpoint(checkpoint, ("img_mlp",), start="forkserver")[0]


def component_specs(checkpoint, item: int) -> dict[str, ComponentSpec]:
    """The loader's sizes before QUANTIZE existed: every parameter at `item` bytes, blocks by container."""
    from accelerate import init_empty_weights

    from imgedit.model.components import MODEL_COMPONENTS, block_container, from_config

    specs = {}
    for name in MODEL_COMPONENTS:
        with init_empty_weights():
            model = from_config(name, checkpoint.folder)
        blocks: tuple[int, ...] = ()
        if name != "vae":
            container = model.get_submodule(block_container(model))
            blocks = tuple(sum(p.numel() for p in b.parameters()) * item for b in container)
        specs[name] = ComponentSpec(name, sum(p.numel() for p in model.parameters()) * item, blocks)
    return specs


def test_sizes_match_the_loader_and_the_published_model(real_sizes):
    checkpoint, sizes = real_sizes
    by = {s.name: s for s in sizes}
    plain = component_specs(checkpoint, 2)
    for name in COMPONENTS:  # unquantized, the planner sees exactly what it saw before QUANTIZE existed
        assert by[name].spec("none", 2) == plain[name]
    t = by["transformer"]
    params = (t.head.linear + t.head.kept + t.head.other
              + sum(b.linear + b.kept + b.other for b in t.blocks))
    assert 20.0e9 < params < 20.6e9 and len(t.blocks) == 60  # 20.4 B, 60 blocks
    block = t.blocks[0]
    # one block: img_mlp is 2 x 3072 x 12288 weights, kept in bf16 by default
    assert block.kept == 2 * 3072 * 12288
    fp8 = block.nbytes("fp8", 2)
    assert fp8 == int(block.linear * BYTES_PER_WEIGHT["fp8"]) + (block.kept + block.other) * 2
    assert 0.38 * GIB < fp8 < 0.40 * GIB  # vs 0.633 GiB in bf16
    assert 23.0 * GIB < t.spec("fp8", 2).nbytes < 23.6 * GIB  # transformer fp8, img_mlp bf16
    assert 15.3 * GIB < by["text_encoder"].spec("none", 2).nbytes < 15.6 * GIB
    assert 7.8 * GIB < by["text_encoder"].spec("int8", 2).nbytes < 8.5 * GIB  # embeddings stay bf16


def gpus(*sizes_gib: float, capability=ADA) -> list[GpuSpec]:
    return [GpuSpec(i, f"GPU{i}", int(s * GIB), int((s - 0.5) * GIB), capability) for i, s in enumerate(sizes_gib)]


def plan_for(sizes, gpu_list, host_gib: float | None = None, **env):
    env = {"DEVICE_MAP": "auto", **env}
    return plan_memory(sizes, gpu_list, load_settings(env), 2, None if host_gib is None else int(host_gib * GIB))


def test_one_24gb_card_arithmetic(real_sizes):
    """22 GiB cap: 22 - 1.5 reserve - 0.6 CUDA context = 19.9 GiB; minus 4 GiB of activations, the
    VAE, the transformer's head, three blocks in flight and two more for the batch-2 activations of
    BATCH_CFG (on by default when blocks stream): what is left holds the resident blocks. The blocks
    stream in bf16: streaming torchao-quantized blocks failed on the GPU machine (docs/BENCHMARKS.md)."""
    _, sizes = real_sizes
    p = plan_for(sizes, gpus(24), MAX_MEMORY="22GiB")
    mode = p.workers[0].memory
    assert dict(mode.quantize) == {} and mode.offload_text_encoder and mode.streams_blocks and mode.batch_cfg
    t = next(s for s in sizes if s.name == "transformer")
    vae = next(s for s in sizes if s.name == "vae").spec("none", 2).nbytes
    block = t.blocks[0].nbytes("none", 2)
    room = int(22 * GIB) - int(1.5 * GIB) - int(0.6 * GIB) - 4 * GIB - vae - t.head.nbytes("none", 2) - 5 * block
    assert mode.resident_blocks == room // block
    assert 16 <= mode.resident_blocks <= 22  # 21 of 60 stayed on the GPU in the unbatched measured run
    assert p.bytes_per_device["cuda:0"] + 4 * GIB <= 19.9 * GIB
    assert f"{mode.resident_blocks} of 60 transformer blocks resident" in p.reason
    assert "both CFG branches in one forward (batch 2)" in p.reason
    unbatched = plan_for(sizes, gpus(24), MAX_MEMORY="22GiB", BATCH_CFG="off").workers[0].memory
    assert not unbatched.batch_cfg and unbatched.resident_blocks == mode.resident_blocks + 2
    # What was tried first and why it was not taken: the lossless plans only (nothing lossy was needed).
    assert "unquantized weights; text encoder on the CPU, streamed to the GPU for each prompt: the model needs" \
        in p.reason and "fp8" not in p.reason
    streamed = mode.streamed(60)  # spread out, so each copy overlaps the resident blocks before it
    assert len(streamed) == 60 - mode.resident_blocks and len(set(streamed)) == len(streamed)


@pytest.mark.parametrize("card, cap, host, quant, te_offload, streams, split, workers", [
    # Every lossless plan (bf16, splits included; the text encoder, then blocks streamed from the CPU) before
    # any quantization: 2x31 GiB once got fp8 on one GPU where a bf16 split fits (#24).
    ((32, 32), "30GiB", 64, {}, True, False, True, 1),
    ((24, 24), "22GiB", 128, {}, True, True, False, 2),  # a streaming replica per card: 2 x 42 GiB of CPU copies
    ((24, 24), "22GiB", 64, {"transformer": "fp8"}, True, False, True, 1),  # too little CPU memory for two
    ((24, 24, 24, 24), "22GiB", 64, {}, False, False, True, 1),
    ((48,), "46GiB", 64, {}, True, False, False, 1),
    ((32,), "30GiB", 64, {}, True, True, False, 1),
    ((32,), "30GiB", 24, {"transformer": "fp8"}, True, False, False, 1),  # streaming needs 29 GiB of CPU memory
    ((80,), "", 64, {}, False, False, False, 1),
])
def test_auto_tries_every_lossless_plan_before_a_lossy_one(real_sizes, card, cap, host, quant, te_offload, streams,
                                                             split, workers):
    _, sizes = real_sizes
    p = plan_for(sizes, gpus(*card), host, MAX_MEMORY=cap)
    mode = p.workers[0].memory or MemoryMode()
    assert dict(mode.quantize) == quant
    assert mode.offload_text_encoder == te_offload and mode.streams_blocks == streams
    assert any(c.is_split for c in p.workers[0].components.values()) == split and len(p.workers) == workers
    if quant:
        assert "memory:" in p.reason and "did not fit" in p.reason  # the log and the panel say why
        # every lossless candidate was tried and named before the lossy one was taken
        tried = p.reason[p.reason.index("tried first"):]
        assert "unquantized weights: " in tried and "unquantized weights; text encoder on the CPU" in tried
        assert "streamed blocks" in tried and tried.index("streamed blocks") < tried.index("fp8")
    if streams:
        held = host_bytes(sizes, mode, 2) * len(p.workers)
        assert held <= (host - 8) * GIB  # the CPU copies fit the machine's memory


def test_the_order_of_candidates_is_lossless_first():
    order = candidates(None, None, gpus(24), on_cpu=False)
    lossy = [i for i, (q, _) in enumerate(order) if q]
    assert lossy and min(lossy) == 3
    assert [o for _, o in order[:3]] == [(), ("text_encoder",), ("text_encoder", "blocks")]
    assert candidates(None, None, [], on_cpu=True) == [((), ())]


def test_fp8_only_where_the_gpu_runs_it(real_sizes):
    _, sizes = real_sizes
    # a 32 GB Ampere card where a lossy mode is needed (too little CPU memory to stream bf16 blocks): int8
    p = plan_for(sizes, gpus(32, capability=AMPERE), 24, MAX_MEMORY="30GiB")
    assert dict(p.workers[0].memory.quantize) == {"transformer": "int8"}
    with pytest.raises(PlacementError) as err:
        plan_for(sizes, gpus(24, capability=AMPERE), QUANTIZE="fp8")
    assert "GPU 0 (GPU0) has 8.6" in err.value.message and "8.9" in err.value.message
    with pytest.raises(PlacementError) as err:
        check_device(MemoryMode((("transformer", "fp8"),)), 0, "NVIDIA A100-SXM4-80GB", (8, 0))
    assert "cuda:0 (NVIDIA A100-SXM4-80GB) has 8.0" in err.value.message
    with pytest.raises(PlacementError, match=r"FAST_QUANTIZE=fp8 needs compute capability 8.9 .* has 8.0; use int8"):
        check_device(None, 0, "NVIDIA A100-SXM4-80GB", (8, 0), "fp8")
    check_device(None, 0, "NVIDIA H100 80GB HBM3", (9, 0), "fp8")  # Hopper runs it


def test_nothing_fits_is_refused_with_what_was_tried(real_sizes):
    _, sizes = real_sizes
    with pytest.raises(PlacementError) as err:
        plan_for(sizes, gpus(8), MAX_MEMORY="6GiB")
    message = err.value.message
    assert message.startswith("nothing fits, even quantized and offloaded")
    assert "streamed blocks" in message and "transformer fp8" in message


def test_explicit_modes_and_refusals(real_sizes):
    _, sizes = real_sizes
    p = plan_for(sizes, gpus(141), QUANTIZE="transformer=int8", QUANTIZE_SKIP="")
    assert dict(p.workers[0].memory.quantize) == {"transformer": "int8"} and p.workers[0].memory.skip == ()
    p = plan_for(sizes, gpus(141), OFFLOAD="none", QUANTIZE="none")
    assert p.workers[0].memory is None
    # explicit quantization, offload left to auto: the int8 text encoder is streamed too (it runs once
    # per prompt, the blocks every step: its room goes to resident blocks)
    # (an int8 transformer does not fit a 22 GiB card resident, and quantized blocks cannot be streamed)
    m = plan_for(sizes, gpus(32), MAX_MEMORY="30GiB", QUANTIZE="transformer=int8,text_encoder=int8").workers[0].memory
    assert dict(m.quantize) == {"transformer": "int8", "text_encoder": "int8"} and not m.streams_blocks
    with pytest.raises(PlacementError, match="diffusers' group offloading cannot move torchao's quantized tensors"):
        plan_for(sizes, gpus(24), MAX_MEMORY="22GiB", QUANTIZE="transformer=int8,text_encoder=int8")
    # explicit streaming, quantization left to auto: bf16 streamed first (lossless), nothing quantized
    m = plan_for(sizes, gpus(24), MAX_MEMORY="22GiB", OFFLOAD="text_encoder,blocks").workers[0].memory
    assert m.quantize == () and m.offload_text_encoder and 5 < m.resident_blocks < 30
    with pytest.raises(PlacementError, match="OFFLOAD=blocks with QUANTIZE transformer=nf4 is not supported"):
        plan_for(sizes, gpus(24), QUANTIZE="nf4", OFFLOAD="blocks")
    with pytest.raises(PlacementError, match="QUANTIZE=fp8 needs a CUDA GPU .* runs on the CPU here"):
        plan_for(sizes, [], QUANTIZE="fp8")
    with pytest.raises(PlacementError, match="OFFLOAD=text_encoder moves weights between the CPU and a GPU"):
        plan_for(sizes, [], OFFLOAD="text_encoder")
    p = plan_for(sizes, [], QUANTIZE="int8")  # the CPU runs int8 weight-only
    assert p.workers[0].execution_device == "cpu" and dict(p.workers[0].memory.quantize) == {"transformer": "int8"}


# ---- real edits on the CPU ----

def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def request(seed: int = 3) -> EditRequest:
    return EditRequest(images=(picture(),), prompt="make it blue", seed=seed, num_inference_steps=3,
                       width=64, height=64, source="test")


@pytest.fixture(scope="module")
def quantized_manager(plus_ckpt):
    return make_manager(plus_ckpt, plan="planner", QUANTIZE="transformer=int8,text_encoder=nf4")


def test_quantized_worker_edits_and_reports_its_weights(quantized_manager, plus_manager):
    result = quantized_manager.edit(request())
    reference = plus_manager.edit(request())
    a, b = np.asarray(result.images[0]), np.asarray(reference.images[0])
    assert a.shape == b.shape
    assert 25 < psnr(a, b) < float("inf")  # close to the unquantized edit, but not the same weights
    status = quantized_manager.status()
    components = status.workers[0].components
    assert components["transformer"]["quantization"].startswith("int8: ")
    assert "Int8Tensor" in components["transformer"]["quantization"]
    assert "img_mlp" in quantized_manager.plan.reason  # kept in full precision by default
    assert components["text_encoder"]["quantization"].startswith("nf4: ")
    assert components["vae"]["quantization"] == "none" and components["vae"]["dtype"] == "float32"
    assert components["transformer"]["location"].startswith("CPU ")
    data = snapshot(GpuMonitor(), status)  # /health and /gpu_status carry the same data
    assert data["workers"][0]["components"]["transformer"]["quantization"].startswith("int8")
    html = panel_html(data)
    assert "worker-0 weights: transformer int8 @ CPU" in html and "text_encoder nf4 @ CPU" in html


@pytest.mark.parametrize("mode, kind", [("int8", "Int8Tensor"), ("nf4", "NF4Tensor")])
def test_kept_layers_are_not_quantized_and_the_rest_still_computes(plus_ckpt, mode, kind):
    from imgedit.runtime.offload import quantize_module

    model = weights.load_component("transformer", loader.open_checkpoint(str(plus_ckpt)), Placement("cpu"),
                                   torch.float32)
    x = torch.randn(3, model.img_in.in_features)
    before = model.img_in(x)
    changed = quantize_module(model, mode, ("img_mlp",))
    kinds = {name: type(m.weight).__name__ for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert changed == sum(1 for n in kinds if "img_mlp" not in n.split("."))
    assert all(k == "Parameter" for n, k in kinds.items() if "img_mlp" in n.split("."))
    assert all(k == kind for n, k in kinds.items() if "img_mlp" not in n.split("."))
    after = model.img_in(x)
    assert torch.nn.functional.cosine_similarity(before.flatten(), after.flatten(), dim=0) > 0.98
    assert not torch.equal(before, after)


def test_a_worker_on_the_cpu_refuses_fp8():
    from imgedit.runtime.offload import check_device as worker_check

    with pytest.raises(PlacementError, match="fp8 needs a CUDA GPU .* this worker runs on the CPU"):
        worker_check(MemoryMode((("transformer", "fp8"),)), "cpu")
    worker_check(MemoryMode((("transformer", "int8"),)), "cpu")  # int8 runs there
    with pytest.raises(PlacementError, match="FAST_QUANTIZE=fp8 needs a CUDA GPU .* the CPU; use int8 on the CPU"):
        worker_check(None, "cpu", "fp8")  # FAST_QUANTIZE's copies: the same check
    worker_check(None, "cpu", "int8")


def test_offload_hooks_keep_resident_blocks_and_stream_the_rest(plus_ckpt, plus_pipe):
    """The hooks on the CPU (the onload device is the CPU here, so nothing moves, but every hook
    runs): the same edit as without them, block 0 and the text encoder hooked, block 1 resident."""
    from diffusers.hooks.group_offloading import _GROUP_OFFLOADING

    from imgedit.model.encoding import prepare_text_encoder
    from imgedit.runtime import single_frame

    checkpoint = loader.open_checkpoint(str(plus_ckpt))

    def edit(pipe):
        return pipe(image=[picture()], prompt="make it blue", negative_prompt=" ", true_cfg_scale=4.0,
                    num_inference_steps=2, height=64, width=64, output_type="np",
                    generator=torch.Generator().manual_seed(0)).images[0]

    memory = MemoryMode(offload_text_encoder=True, resident_blocks=1)
    assert memory.streamed(2) == [0]  # of the tiny model's two blocks, block 0 is streamed
    plan = WorkerPlan("local", {c: Placement("cpu") for c in COMPONENTS}, memory=memory)
    pipe = loader.load_pipeline(checkpoint, plan, torch.float32)
    prepare_text_encoder(pipe.text_encoder)  # as the worker does, and as plus_pipe has
    single_frame.install(pipe.vae)  # the worker's load-phase feature, which plus_pipe has too
    reference, streamed = edit(plus_pipe.pipe), edit(pipe)  # the same weights, with and without the hooks
    blocks = pipe.transformer.transformer_blocks

    def hooked(module):
        return hasattr(module, "_diffusers_hook") and module._diffusers_hook.get_hook(_GROUP_OFFLOADING) is not None

    assert hooked(blocks[0]) and not hooked(blocks[1])
    assert any(hooked(m) for m in pipe.text_encoder.modules())
    np.testing.assert_array_equal(streamed, reference)
    # BATCH_CFG over the hooks, as the 24 GB mode runs: one forward per step, the same edit
    from imgedit.runtime.cfg_batch import CfgBatch

    batch = CfgBatch(pipe.transformer)
    batch.begin(True)
    batched = edit(pipe)
    assert batch.forwards == 2  # 2 steps, one forward each
    np.testing.assert_allclose(batched, reference, atol=1e-3)


def test_streamed_blocks_leave_the_models_own_layers_on_the_gpu_between_forwards():
    """diffusers' group offloading moves a model's layers outside its block list back to the CPU after every
    forward (2.1 at 16 GB: 0.1 s a step of synchronous copies); stream() keeps them where the plan counts
    them. On the CPU a move shows only in where the group offloads to: "cpu:0" stands for the GPU here (a
    device other than the CPU the streamed blocks go back to). tests/test_gpu.py checks the tensors on a GPU."""
    from diffusers.hooks import HookRegistry
    from diffusers.hooks.group_offloading import _GROUP_OFFLOADING

    from imgedit.runtime.offload import stream

    model = Blocks()
    stream(model, "cpu:0", MemoryMode(resident_blocks=1))
    model(torch.zeros(2, 8))

    def offloads_to(module):
        return HookRegistry.check_if_exists_or_initialize(module).get_hook(_GROUP_OFFLOADING).group.offload_device

    assert offloads_to(model) == torch.device("cpu:0")  # the model's own layers stay
    assert [offloads_to(model.blocks[i]) for i in MemoryMode(resident_blocks=1).streamed(3)] == \
        [torch.device("cpu")] * 2  # the streamed blocks go back
    # a Sequential beside the blocks (2.1's shared modulation) is not streamed as blocks of its own
    assert all(HookRegistry.check_if_exists_or_initialize(m).get_hook(_GROUP_OFFLOADING) is None
               for m in model.modulation)


def test_a_masked_edit_on_streamed_blocks_is_the_resident_image(plus_ckpt, plus_manager):
    """#26 on OFFLOAD's hooks (text encoder and block 0 streamed), in a worker process: the mask's own VAE
    encode of the input and the per-step blend run through the hooked components; the same pixels."""
    from PIL import Image

    from imgedit.planning.plan import Plan

    memory = MemoryMode(offload_text_encoder=True, resident_blocks=1)
    worker = WorkerPlan("worker-0", {c: Placement("cpu") for c in COMPONENTS}, memory=memory)
    streamed = make_manager(plus_ckpt, plan=Plan("replicas", (worker,), "a CPU worker with streamed blocks"))
    mask = Image.new("L", (80, 60), 0)
    mask.paste(255, (8, 8, 56, 48))
    ask = dict(images=(picture(),), prompt="make it blue", seed=4, num_inference_steps=2, width=80, height=64,
               mask=mask, mask_feather=3)
    hooked, resident = streamed.edit(EditRequest(**ask)), plus_manager.edit(EditRequest(**ask))
    assert np.array_equal(np.asarray(hooked.images[0]), np.asarray(resident.images[0]))
    outside = np.asarray(mask) == 0
    assert (np.asarray(hooked.images[0])[outside] == np.asarray(picture())[outside]).all()
    components = streamed.status().workers[0].components  # what the worker read from its own modules
    assert "streamed" in components["transformer"]["location"] and "streamed" in components["text_encoder"]["location"]


def test_ray_workers_refuse_quantize_before_joining_a_cluster(plus_ckpt):
    from imgedit.engine.manager import PipelineManager

    settings = load_settings({"QWEN_MODEL_DIR": str(plus_ckpt), "WORKERS": "ray", "QUANTIZE": "int8"})
    with pytest.raises(PlacementError, match="QUANTIZE and OFFLOAD work with WORKERS=local only"):
        PipelineManager(settings).prepare()


def test_locations_are_named_as_the_panel_names_gpus():
    from imgedit.runtime.offload import _where

    assert (_where("cuda:1"), _where("cuda"), _where("cpu")) == ("GPU 1", "GPU 0", "CPU")


def test_a_prompt_rewrite_runs_on_a_streamed_text_encoder_and_writes_the_same(plus_ckpt, plus_pipe):
    """#25 on OFFLOAD=text_encoder's hooks (every generated token runs the hooked layers): the same greedy
    answer, token for token, as the text encoder without them."""
    import threading

    from imgedit.model.encoding import prepare_text_encoder
    from imgedit.runtime.enhance import rewrite

    memory = MemoryMode(offload_text_encoder=True)
    plan = WorkerPlan("local", {c: Placement("cpu") for c in COMPONENTS}, memory=memory)
    pipe = loader.load_pipeline(loader.open_checkpoint(str(plus_ckpt)), plan, torch.float32)
    prepare_text_encoder(pipe.text_encoder)  # as the worker does
    images = [picture(96, 64), picture(64, 64, (200, 40, 40))]
    streamed = rewrite(pipe, images, "make it winter", 24, threading.Event())
    plain = rewrite(plus_pipe.pipe, images, "make it winter", 24, threading.Event())
    assert streamed.new_tokens == plain.new_tokens == 24 and streamed.token_ids == plain.token_ids
    assert len(set(plain.token_ids)) > 1  # a varied sequence, so the equality says something


def test_fp8_activations_of_padded_text_rows_are_zeros_not_nan():
    """A pair that splits a job's sequence pads the text with zero rows. fp8's per-row activation scale of a zero
    row was 0 and the row quantized to NaN: every fp8-copy job of a pair came out non-finite on 2x H200. The
    activation quantization each fp8 Linear applies (torchao's own, with our config's bounds; its torch path,
    which the CPU runs) must give zeros there and leave the real rows as they were."""
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

    from imgedit.runtime.offload import torchao_config
    from imgedit.runtime.ulysses import pad_text

    config = torchao_config("fp8")
    text = torch.randn(1, 7, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    padded, mask = pad_text(text, None, multiple=2)
    assert padded.shape[1] == 8 and not mask[0, 7] and not padded[0, 7].any()

    def activations(lower_bound):
        return Float8Tensor.from_hp(padded[0], float8_dtype=config.activation_dtype, granularity=config.granularity[0],
                                    hp_value_lb=lower_bound, hp_value_ub=config.activation_value_ub).dequantize()

    assert not torch.isfinite(activations(None)[7]).any()  # torchao's default: the NaN seen on the GPUs
    rows = activations(config.activation_value_lb)
    assert torch.isfinite(rows).all() and not rows[7].any()
    torch.testing.assert_close(rows[:7], padded[0, :7], atol=0.02, rtol=0.07)  # fp8 e4m3 rounding


def test_a_server_whose_text_encoder_is_streamed_refuses_prompt_rewrites_by_name_and_edits_on(plus_ckpt):
    """On an H200 capped at 22 GiB (2026-11-27) every rewrite on the streamed text encoder failed with a device
    error (the stream's prefetch order, traced on prompt encoding, misses the rotary embedding on generate()'s
    decoding steps), and each word would stream its 15 GiB again: the server refuses rewrites with a 400 instead
    of a 500, and edits go on."""
    memory = MemoryMode(offload_text_encoder=True)
    plan = Plan("balanced", (WorkerPlan("worker-0", {c: Placement("cpu") for c in COMPONENTS}, memory=memory),),
                "a CPU worker with its text encoder streamed")
    manager = make_manager(plus_ckpt, plan=plan)
    request = EditRequest(images=(picture(64, 64),), prompt="make it winter", num_inference_steps=2, width=64,
                          height=64, source="test")
    with pytest.raises(InvalidInput, match="prompt rewriting is not available on this server: the text encoder "
                                           "is kept on the CPU") as refused:
        manager.enhance(request)
    assert refused.value.field is None
    with pytest.raises(InvalidInput) as refused:
        manager.edit(replace(request, enhance_prompt=True))
    assert refused.value.field == "enhance_prompt"
    assert manager.edit(request).images[0].size == (64, 64)


def test_loading_a_lora_keeps_the_resident_blocks_resident(plus_ckpt, tmp_path):
    """diffusers' load_lora_weights re-applies group offloading to a whole streamed model, once per LoRA (seen on
    an H200 under MAX_MEMORY=22GiB with a Lightning LoRA: the compile warm-up then met the hooks and fell back to
    eager; and every resident block was copied to pinned CPU memory and back, 21 s of a restart). The worker
    takes the streaming hooks off while LoRAs load (offload.lifted): diffusers then re-applies nothing, and the
    layout comes back as at loading: block 1 resident, block 0 and the text encoder streamed with their LoRA
    layers, and a LoRA edit equals the same edit on the resident pipeline."""
    from diffusers.hooks.group_offloading import _GROUP_OFFLOADING

    from imgedit.config.loras import LoraFile
    from imgedit.model.lora_random import random_lora
    from imgedit.model.loras import transformer_linears
    from imgedit.runtime.adapters import Adapters
    from imgedit.runtime.offload import lifted

    def hooked(module):
        return hasattr(module, "_diffusers_hook") and module._diffusers_hook.get_hook(_GROUP_OFFLOADING) is not None

    path = random_lora(tmp_path / "style.safetensors", transformer_linears(plus_ckpt), rank=4)
    lora = (LoraFile("style", str(path), None, 4, 0),)
    memory = MemoryMode(offload_text_encoder=True, resident_blocks=1)
    checkpoint = loader.open_checkpoint(str(plus_ckpt))
    streamed = loader.load_pipeline(checkpoint, WorkerPlan("s", {c: Placement("cpu") for c in COMPONENTS},
                                                           memory=memory), torch.float32)
    resident = loader.load_pipeline(checkpoint, WorkerPlan("r", {c: Placement("cpu") for c in COMPONENTS}),
                                    torch.float32)
    blocks = streamed.transformer.transformer_blocks
    assert hooked(blocks[0]) and not hooked(blocks[1])
    with lifted(streamed, memory, {c: "cpu" for c in COMPONENTS}):
        Adapters(streamed, lora)
        # diffusers applied nothing again (with the hooks on, it left every block streamed)
        assert not any(hooked(m) for m in [*streamed.transformer.modules(), *streamed.text_encoder.modules()])
    assert hooked(blocks[0]) and not hooked(blocks[1])
    assert any(hooked(m) for m in streamed.text_encoder.modules())
    assert any("lora_A" in name for name, _ in blocks[0].named_modules())
    images = []
    for pipe in (streamed, resident):
        if pipe is resident:
            Adapters(pipe, lora)
        pipe.enable_lora()
        pipe.set_adapters(["lora_0"], [1.0])
        images.append(pipe(image=[picture()], prompt="make it blue", negative_prompt=" ", true_cfg_scale=4.0,
                           num_inference_steps=2, height=64, width=64, output_type="np",
                           generator=torch.Generator().manual_seed(0)).images[0])
    np.testing.assert_array_equal(images[0], images[1])


def test_loras_on_a_device_mapped_pipeline_leave_a_streamed_text_encoders_hooks_alone(plus_ckpt, tmp_path):
    """A streamed text encoder on another GPU than the latents (2x 24 GB, balanced) also carries the loader's
    accelerate hook, and the pipeline is marked device-mapped: diffusers then re-applies no offloading while LoRAs
    load, and group offloading cannot be applied over an accelerate hook (it raises). offload.lifted leaves such
    a pipeline as it is; the LoRA loads and both kinds of hook stay."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module
    from diffusers.hooks.group_offloading import _GROUP_OFFLOADING

    from imgedit.config.loras import LoraFile
    from imgedit.model.lora_random import random_lora
    from imgedit.model.loras import transformer_linears
    from imgedit.runtime.adapters import Adapters
    from imgedit.runtime.offload import lifted

    path = random_lora(tmp_path / "style.safetensors", transformer_linears(plus_ckpt), rank=4)
    memory = MemoryMode(offload_text_encoder=True)
    plan = WorkerPlan("s", {c: Placement("cpu") for c in COMPONENTS}, memory=memory)
    pipe = loader.load_pipeline(loader.open_checkpoint(str(plus_ckpt)), plan, torch.float32)
    # what the loader does for a component off the execution device (loader._move_inputs, hf_device_map)
    add_hook_to_module(pipe.text_encoder, AlignDevicesHook(execution_device="cpu", io_same_device=True))
    pipe.hf_device_map = {name: "cpu" for name in COMPONENTS}
    with lifted(pipe, memory, {c: "cpu" for c in COMPONENTS}):
        Adapters(pipe, (LoraFile("style", str(path), None, 4, 0),))
    assert hasattr(pipe.text_encoder, "_hf_hook")
    assert any(hasattr(m, "_diffusers_hook") and m._diffusers_hook.get_hook(_GROUP_OFFLOADING) is not None
               for m in pipe.text_encoder.modules())
    assert any("lora_A" in name for name, _ in pipe.transformer.named_modules())


def test_a_lora_that_fails_to_load_leaves_the_streaming_as_it_was_lifted(plus_ckpt, tmp_path):
    """The worker fails with the LoRA's own message; nothing is laid out again (minutes of pinning on a GPU)."""
    from imgedit.config.loras import LoraFile
    from imgedit.errors import ImgEditError
    from imgedit.runtime import offload
    from imgedit.runtime.adapters import Adapters

    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"not a safetensors file")
    memory = MemoryMode(resident_blocks=1)
    plan = WorkerPlan("s", {c: Placement("cpu") for c in COMPONENTS}, memory=memory)
    pipe = loader.load_pipeline(loader.open_checkpoint(str(plus_ckpt)), plan, torch.float32)
    calls = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(offload, "stream", lambda *a, **k: calls.append(a))
        with pytest.raises(ImgEditError, match="'broken'"):
            with offload.lifted(pipe, memory, {c: "cpu" for c in COMPONENTS}):
                Adapters(pipe, (LoraFile("broken", str(broken), None, None, 0),))
    assert calls == []


@pytest.mark.parametrize("mode", ["fp8", "int8"])
def test_quantizing_leaves_inductors_tuning_settings_alone(monkeypatch, mode):
    """torchao's quantize_ turned on inductor's coordinate-descent tuning for the whole process by default: every
    block compiled after a fast copy was quantized, bf16 ones included, benchmarked hundreds of kernel
    configurations (one real-size fp8 block: 122.5 s to compile, 103.4 s of it that tuning; bf16 21.0 s, 2x H200).
    Quantizing must leave the compile settings as they were; torchao's own default is shown to change them."""
    import torch._inductor.config as inductor_config
    import torchao.quantization.quant_api as quant_api
    from torchao.quantization import quantize_

    from imgedit.runtime.offload import quantize_module, torchao_config

    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda *a, **k: None)  # fp8 on a CPU: the config only
    tuning = ("coordinate_descent_tuning", "coordinate_descent_check_all_directions")

    def linear():
        return torch.nn.Sequential(torch.nn.Linear(64, 64)).to(torch.bfloat16)

    with inductor_config.patch({name: False for name in tuning}):
        quantize_module(linear(), mode)
        assert [getattr(inductor_config, name) for name in tuning] == [False, False]
        default = type(torchao_config(mode))(**{k: v for k, v in vars(torchao_config(mode)).items()
                                                if k != "set_inductor_config"})
        quantize_(linear(), default)
        assert [getattr(inductor_config, name) for name in tuning] == [True, True]
