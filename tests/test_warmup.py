"""The compile warm-up covers what users send: no job compiles after the server is ready.

A CFG pair that splits CFG-off jobs (PAIR_ULYSSES) pads a text of odd length to even, with a mask; an even one
goes unpadded and unmasked. Under torch.compile those are two variants of the block, and the warm-up's one
prompt compiled only one of them at each size (each then static in the text's length): on 2x H200 the first
`speed=fastest` edit of a prompt of the other kind took 23.2 s, the next 1.30 s. The warm-up now runs prompts
of both kinds at every size (worker.warmup_prompts)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import _MANAGERS, cfg_plan, cpu_plan, make_manager, picture
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from imgedit.config.settings import load_settings
from imgedit.engine.manager import PipelineManager
from imgedit.engine.workers.gpus import GpuMonitor
from imgedit.model.demo_checkpoint import build_checkpoint
from imgedit.model.lora_random import random_lora
from imgedit.model.loras import transformer_linears
from imgedit.protocol import EditRequest
from imgedit.runtime.budget import WARMUP, TimeBudget
from imgedit.runtime.warmup import warmup_prompts
from imgedit.web.metrics import Metrics

FOUR = "Qwen-Image-Edit-2509-Lightning-4steps-V1.0-bf16"


@pytest.fixture(scope="module")
def pair_ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("warmup")
    ckpt = build_checkpoint(folder / "plus2", kind="plus", seed=0, heads=2)  # Ulysses-2 needs even heads
    loras = folder / "loras"
    loras.mkdir()
    random_lora(loras / f"{FOUR}.safetensors", transformer_linears(ckpt), rank=4, std=0.4, seed=1)
    return ckpt, loras


@contextlib.contextmanager
def compile_log():
    """The file faults.count_compiles writes one line to per graph compiled (the forkserver's workers inherit
    the variable); yields a function that reads its lines."""
    path = tempfile.NamedTemporaryFile(prefix="imgedit-compiles-", delete=False).name
    os.environ["IMGEDIT_TEST_COMPILES"] = path
    try:
        yield lambda: Path(path).read_text().splitlines()
    finally:
        os.environ.pop("IMGEDIT_TEST_COMPILES", None)
        os.unlink(path)


def test_warmup_prompts_leave_every_remainder(pair_ckpt):
    tokenizer = AutoTokenizer.from_pretrained(pair_ckpt[0] / "tokenizer")
    counts = [len(tokenizer(p)["input_ids"]) for p in warmup_prompts(tokenizer, 2)]
    assert sorted(c % 2 for c in counts) == [0, 1]
    counts = [len(tokenizer(p)["input_ids"]) for p in warmup_prompts(tokenizer, 4)]
    assert sorted(c % 4 for c in counts) == [0, 1, 2, 3]
    assert warmup_prompts(tokenizer, 1) == warmup_prompts(None, 2) == ["warm up"]


def test_a_compiled_splitting_pair_compiles_nothing_after_its_warm_up(pair_ckpt):
    ckpt, loras = pair_ckpt
    tokenizer = AutoTokenizer.from_pretrained(ckpt / "tokenizer")
    prompts = ["make it red", "make it blue", "turn the sky into a sunset and keep everything else unchanged"]
    assert {len(tokenizer(p)["input_ids"]) % 2 for p in prompts} == {0, 1}  # both kinds of text
    with compile_log() as compiled:
        settings = load_settings({"QWEN_MODEL_DIR": str(ckpt), "DEVICE_MAP": "cpu", "COMPILE": "on",
                                  "PAIR_ULYSSES": "on", "LORA_DIR": str(loras), "WORKER_START": "forkserver",
                                  "OUTPUT_DIR": tempfile.mkdtemp(prefix="imgedit-out-")})
        manager = PipelineManager(settings, plan=cfg_plan(1), worker_hook="faults:count_compiles",
                                  warmup_sizes=((64, 64), (64, 96)))
        _MANAGERS.append(manager)
        manager.load()
        worker = manager.workers[0].info
        assert (worker.get("compiled"), worker.get("pair_ulysses"), worker.get("fallbacks")) == (True, True, []), worker
        at_ready = compiled()
        assert at_ready  # the warm-up compiled
        # the block compiled inside its context-parallel hooks: 3 variants (split with and without the text
        # mask, not split) and their graph breaks, where compiling the hook chain gave 9-10 graphs a rank; and
        # as many on rank 1 as on rank 0 (its shard's storage offset made 7 there, block_compile._from_offset_zero)
        per_rank = Counter(line.split()[0] for line in at_ready)
        assert len(per_rank) == 2 and len(set(per_rank.values())) == 1 and max(per_rank.values()) <= 5, per_rank
        def request(prompt, speed):
            steps = {} if speed == "fastest" else {"num_inference_steps": 2}
            return EditRequest(images=(picture(64, 64),), prompt=prompt, seed=1, width=64, height=64, speed=speed,
                               **steps)

        split = {}
        for prompt in prompts:
            for speed in ("fastest", "quality"):
                result = manager.edit(request(prompt, speed))
                assert len(result.images) == 1
                split[prompt, speed] = np.asarray(result.images[0], dtype=np.int16)
        after = compiled()
        assert after == at_ready, f"compiled after the warm-up: {after[len(at_ready):]}"
    manager.close()
    # the compiled split (CFG off: fastest) and the compiled CFG pair give one eager process's images
    one = make_manager(ckpt, LORA_DIR=str(loras))
    for (prompt, speed), image in split.items():
        eager = np.asarray(one.edit(request(prompt, speed)).images[0], dtype=np.int16)
        assert np.abs(image - eager).max() <= 1 and image.std() > 1.0, (prompt, speed)


def test_the_blocks_compile_dynamic_from_the_first_size(pair_ckpt):
    """One warm-up size, then edits at other sizes: nothing compiles after ready (the blocks are compiled
    dynamic in the sequence lengths; a static first compile cost every variant one more compile at start-up).
    What does compile after ready is counted: two images a prompt, which the warm-up leaves out (the known
    limit "n=2 compiles on first use"), reports its graphs with its result and in /metrics, and the worker
    logs it (imgedit.runtime.budget)."""
    ckpt, _ = pair_ckpt
    with compile_log() as compiled:
        settings = load_settings({"QWEN_MODEL_DIR": str(ckpt), "DEVICE_MAP": "cpu", "COMPILE": "on",
                                  "WORKER_START": "forkserver", "OUTPUT_DIR": tempfile.mkdtemp(prefix="imgedit-out-")})
        manager = PipelineManager(settings, plan=cpu_plan(1), worker_hook="faults:count_compiles",
                                  warmup_sizes=((64, 64),))
        _MANAGERS.append(manager)
        metrics = Metrics(manager, GpuMonitor(nvml=SimpleNamespace()))
        manager.load()
        assert manager.workers[0].info.get("compiled") is True, manager.workers[0].info
        at_ready = compiled()
        assert at_ready
        for width, height in ((96, 64), (64, 128)):
            result = manager.edit(EditRequest(images=(picture(width, height),), prompt="make it red", seed=1,
                                              width=width, height=height, num_inference_steps=2))
            assert result.images[0].size == (width, height)
            assert result.compiled_graphs == 0
        after = compiled()
        assert after == at_ready, f"compiled after the warm-up: {after[len(at_ready):]}"
        assert compiled_total(metrics) == 0
        two = manager.edit(EditRequest(images=(picture(64, 64),), prompt="make it red", seed=1, width=64,
                                       height=64, num_inference_steps=2, num_images=2))
        assert len(two.images) == 2
        recompiled = len(compiled()) - len(after)
        # should a warm-up learn two images a prompt, this needs another job the warm-up leaves out
        assert recompiled > 0, "n=2 compiled nothing after the warm-up: pick a job that still compiles"
        assert two.compiled_graphs == recompiled, (recompiled, two.compiled_graphs)
        assert compiled_total(metrics) == recompiled


def compiled_total(metrics: Metrics) -> float:
    """/metrics' imgedit_compiled_graphs_total, read from its text by prometheus_client's own parser."""
    values = [sample.value for family in text_string_to_metric_families(metrics.render().decode())
              for sample in family.samples if sample.name == "imgedit_compiled_graphs_total"]
    assert len(values) == 1, values
    return values[0]


def test_a_compiled_qwen_image_21_worker_compiles_nothing_after_its_warm_up(tmp_path):
    """Qwen-Image-2.1's later steps (its prefix K/V cached) compile once, dynamic in the prefix and target lengths
    (runtime.compile21): after the warm-up, text to image and edits with 1-4 references, prompts of other lengths,
    other sizes and two images per prompt compile nothing (its blocks compiled whole recompiled for every new
    prompt length and image count). With TURBO_MODEL_DIR the Turbo's blocks run the same compiled steps (one
    block function for both transformers) and speed=fastest compiles nothing either (one worker with the Turbo
    runs both: the suite stays under its 10 minutes). A LoRA that runs unfused (FUSE_LORA=off here; a quantized
    transformer's too) is a variant of its own, with one image and with two, warmed up too: a LoRA job at another
    strength and with two images compiles nothing (which LoRAs are warmed: the unit test below)."""
    from imgedit.model.lora_random import random_lora
    from imgedit.model.loras import transformer_linears

    ckpt = build_checkpoint(tmp_path / "q21", kind="21", seed=0)
    (tmp_path / "loras").mkdir()
    random_lora(tmp_path / "loras" / "style21.safetensors", transformer_linears(ckpt), rank=4, std=0.02,
                style="diffusers")
    extra = {"TURBO_MODEL_DIR": str(build_checkpoint(tmp_path / "q21turbo", kind="21turbo", seed=0)),
             "LORA_DIR": str(tmp_path / "loras"), "FUSE_LORA": "off"}
    with compile_log() as compiled:
        settings = load_settings({"QWEN_MODEL_DIR": str(ckpt), "DEVICE_MAP": "cpu", "COMPILE": "on",
                                  "WORKER_START": "forkserver", "OUTPUT_DIR": str(tmp_path / "out"), **extra})
        manager = PipelineManager(settings, plan=cpu_plan(1), worker_hook="faults:count_compiles",
                                  warmup_sizes=((320, 320), (320, 384)))
        _MANAGERS.append(manager)
        manager.load()
        worker = manager.workers[0].info
        assert (worker.get("compiled"), worker.get("fallbacks")) == (True, []), worker
        assert "compile" in worker["features"] and list(worker["phases"])[-1] == "ready"
        at_ready = compiled()
        assert at_ready  # the warm-up compiled
        asks = [((), "a red apple on a table", 384, 320, 1),
                ((picture(96, 64),), "paint it", 320, 320, 1),
                (tuple(picture(64, 64, (10 * i, 90, 200)) for i in range(4)),
                 "put all four of them together in one quiet picture of a garden at dusk", 352, 320, 1),
                ((picture(64, 80), picture(80, 64)), "blend them", 320, 352, 2)]
        for images, prompt, width, height, n in asks:
            result = manager.edit(EditRequest(images=images, prompt=prompt, seed=1, width=width, height=height,
                                              num_inference_steps=2, num_images=n))
            assert len(result.images) == n and result.images[0].size == (width, height)
            assert result.compiled_graphs == 0  # the worker's own count (imgedit.runtime.budget) agrees
            # the fast tier: the Turbo's 8 steps
            result = manager.edit(EditRequest(images=images, prompt=prompt + " now", seed=1, width=width,
                                              height=height, speed="fastest", num_images=n))
            assert len(result.images) == n and result.steps == 8
        styled = manager.edit(EditRequest(images=(picture(96, 64),), prompt="paint it", seed=1, width=320,
                                          height=320, num_inference_steps=2, lora="style21", lora_scale=0.5,
                                          num_images=2))
        assert len(styled.images) == 2 and styled.images[0].size == (320, 320)
        after = compiled()
        assert after == at_ready, f"compiled after the warm-up: {after[len(at_ready):]}"


def test_the_2_1_warm_up_runs_each_lora_that_runs_unfused():
    """warmup.unfused_adapters: every LoRA alone where nothing fuses (FUSE_LORA off, a quantized transformer);
    where FUSE_LORA fuses, only those it cannot fuse (a 2.1 job has one LoRA at most: a fused one runs the no-LoRA
    variant); none without LoRAs."""
    from types import SimpleNamespace

    from imgedit.runtime.warmup import unfused_adapters

    names = {"style": "lora_0", "other": "lora_1"}
    assert unfused_adapters(None) == []
    assert unfused_adapters(SimpleNamespace(adapter_names={}, fusion=None)) == []
    assert unfused_adapters(SimpleNamespace(adapter_names=names, fusion=None)) == [(("style", 1.0),),
                                                                                   (("other", 1.0),)]
    fuses_style = SimpleNamespace(can_fuse=lambda internal: internal == "lora_0")
    assert unfused_adapters(SimpleNamespace(adapter_names=names, fusion=fuses_style)) == [(("other", 1.0),)]
    fuses_all = SimpleNamespace(can_fuse=lambda internal: True)
    assert unfused_adapters(SimpleNamespace(adapter_names=names, fusion=fuses_all)) == []


def test_the_recompile_limit_counts_every_gpu_a_split_transformers_blocks_sit_on(plus_ckpt):
    """The blocks share one compiled code object whose guards hold each tensor's device: a transformer split
    over two GPUs compiles every variant twice, and dynamo's limit must leave room for all of them."""
    from dataclasses import replace

    from imgedit.planning.checkpoint import open_checkpoint
    from imgedit.planning.plan import Placement, WorkerPlan
    from imgedit.runtime.messages import WorkerSpec
    from imgedit.runtime.warmup import recompile_limit

    def spec(transformer: Placement, loras=()) -> WorkerSpec:
        plan = WorkerPlan("worker-0", {"transformer": transformer, "text_encoder": Placement("cuda:0"),
                                       "vae": Placement("cuda:0")})
        made = WorkerSpec(name="worker-0", rank=0, world=1, parallel="none", plan=plan,
                          checkpoint=open_checkpoint(str(plus_ckpt)), dtype="bfloat16", compile=True)
        return replace(made, loras=loras)

    whole, split = Placement("cuda:0"), Placement("cuda:0", ("cuda:0", "cuda:1"))
    assert recompile_limit(spec(whole), 1, False) is None  # dynamo's default
    assert recompile_limit(spec(split), 1, False) == 2 * 8
    two = ("four", "eight")  # stand-ins: only their number counts
    assert recompile_limit(spec(split, two), 2, False) == 2 * (8 + 2 * 2 + 2 * 1)
    assert recompile_limit(spec(whole, two), 2, False) == 8 + 2 * 2 + 2 * 1


def test_a_job_that_compiles_is_counted_and_logged_unless_it_is_the_warm_ups(caplog):
    """imgedit.runtime.budget: the graphs dynamo compiled while a job ran go on its call (the result, /metrics)
    and a WARNING names the job; the warm-up's own jobs compile on purpose and log nothing above DEBUG."""
    layer = torch.nn.Linear(4, 4)
    budget = TimeBudget([], cuda=False)
    compiled = torch.compile(lambda x: layer(x).relu(), backend="eager", dynamic=False)

    def job(source: str, rows: int, fails: bool = False) -> SimpleNamespace:
        call = SimpleNamespace(job=SimpleNamespace(request_id=f"{source}-{rows}", request=SimpleNamespace(
            source=source)), step_marks=[], timings={}, compiled_graphs=None)
        with contextlib.suppress(RuntimeError), budget.job(call):
            compiled(torch.ones(rows, 4))
            if fails:
                raise RuntimeError("the job failed after compiling")
        return call

    with caplog.at_level("DEBUG", "imgedit.runtime.budget"):
        assert job(WARMUP, 2).compiled_graphs == 1  # a first shape
        assert job("rest", 2).compiled_graphs == 0  # the same shape: nothing compiles
        assert job("rest", 3).compiled_graphs == 1  # a new static shape recompiles
        assert job("rest", 5, fails=True).compiled_graphs == 1  # counted and logged however the job ends
    said = [(r.levelname, r.getMessage().split(":")[0]) for r in caplog.records]
    assert said == [("DEBUG", "warmup-2"), ("WARNING", "rest-3"), ("WARNING", "rest-5")], said
    assert "torch.compile compiled 1 graph(s) during the job (a shape or variant the warm-up did not cover" in (
        caplog.records[1].getMessage())
