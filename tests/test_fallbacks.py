"""An optimisation never takes the server down: a compile that fails at warm-up leaves its worker serving
eager and saying so (/health, the panel, the page's banner); a LoRA on a pipeline placed over devices keeps
the placement; a loading worker says what it is doing."""

from __future__ import annotations

import base64
import io
import tempfile

import httpx
import pytest
import torch
from conftest import _MANAGERS, cfg_plan, cpu_plan, free_port, start_server
from PIL import Image

from imgedit.config.settings import load_settings
from imgedit.engine.manager import PipelineManager
from imgedit.engine.workers.gpus import GpuMonitor
from imgedit.engine.workers.pool import WorkerHandle
from imgedit.errors import WorkerFailed
from imgedit.model.lora_random import random_lora
from imgedit.model.loras import transformer_linears
from imgedit.planning.checkpoint import MODEL_COMPONENTS
from imgedit.planning.plan import Placement, WorkerPlan
from imgedit.protocol import EditRequest, WorkerState
from imgedit.runtime import loader
from imgedit.runtime.adapters import Adapters
from imgedit.runtime.messages import Loading
from imgedit.web.page.panel import banner_html, panel_html
from imgedit.web.public import open_snapshot


def compiling_manager(ckpt, plan, hook: str = "faults:break_compile", load: bool = True) -> PipelineManager:
    """COMPILE=on CPU workers, loaded unless `load` is false; by default their compile fails at warm-up exactly
    as it did on the GPUs (faults.break_compile)."""
    settings = load_settings({"QWEN_MODEL_DIR": str(ckpt), "DEVICE_MAP": "cpu", "COMPILE": "on",
                              "WORKER_START": "forkserver", "OUTPUT_DIR": tempfile.mkdtemp(prefix="imgedit-out-"),
                              "GRADIO_SERVER_PORT": str(free_port())})
    manager = PipelineManager(settings, plan=plan, worker_hook=hook, warmup_sizes=((64, 64),))
    _MANAGERS.append(manager)  # closed with the module
    return manager.load() if load else manager


@pytest.mark.parametrize("plan", [cpu_plan(1), cfg_plan(1)], ids=["one-process", "pair"])
def test_a_compile_that_fails_at_warm_up_serves_eager_and_says_so(plus_ckpt, plan):
    manager = compiling_manager(plus_ckpt, plan)
    with start_server(manager) as server:
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 200, health.text
        worker = health.json()["workers"][0]
        assert worker["state"] == "idle" and worker["compiled"] is False
        (fallback,) = worker["fallbacks"]
        assert fallback.startswith("compile failed → eager: Unsupported: "), fallback
        assert "accelerate/hooks.py" in fallback and "Traceback" not in fallback and "\n" not in fallback
        assert_edits(server)
    data = open_snapshot(GpuMonitor(), manager.status())
    assert "compile failed → eager: Unsupported" in banner_html(data)
    assert "compile failed → eager: Unsupported" in panel_html(data)


def test_a_warm_up_failure_that_is_not_compiles_fails_the_worker_with_its_cause(plus_ckpt):
    """A warm-up that fails outside compile (the prompt encode, as the default placement's did on 2x H200) was
    taken for a compile failure: the worker fell back to eager, /health said ok, and every edit answered 500.
    After the fallback the first warm-up job runs once more without compile; failing again, the worker fails
    to load and says why, in the user's words, no traceback."""
    manager = compiling_manager(plus_ckpt, cpu_plan(1), hook="faults:break_encode", load=False)
    with pytest.raises(WorkerFailed) as failed:
        manager.load()
    (worker,) = manager.status().workers
    assert worker.state == WorkerState.FAILED, worker
    assert "cannot edit, with or without compile: RuntimeError: indices should be either on cpu" in worker.error
    assert "Traceback" not in worker.error and "\n" not in worker.error
    assert "cannot edit, with or without compile" in str(failed.value)


def test_a_warm_up_out_of_memory_without_compile_too_leaves_the_worker_serving(plus_ckpt):
    """Out of GPU memory at the warm-up's size, compiled and eager alike, is the card's size, not a broken
    worker: it serves (eager, saying why) the jobs that fit."""
    manager = compiling_manager(plus_ckpt, cpu_plan(1), hook="faults:oom_at_warm_up")
    (worker,) = manager.status().workers
    assert worker.state == WorkerState.IDLE and worker.compiled is False, worker
    fallback, eager = worker.fallbacks  # and the eager check's own out of memory, at the warm-up's size
    assert fallback.startswith("compile failed → eager: OutOfGpuMemory"), fallback
    assert eager == "the warm-up job ran out of GPU memory at 64x64: jobs that large may too", eager
    result = manager.edit(EditRequest(images=(Image.new("RGB", (64, 64), "red"),), prompt="make it blue",
                                      num_inference_steps=2, width=64, height=64, source="test"))
    assert result.images[0].size == (64, 64)


def test_a_transformer_split_over_devices_compiles_inside_its_block_hooks(plus_ckpt):
    """A transformer split over GPUs has an accelerate device hook on every block (and, from dispatch_model, on
    every submodule with weights inside it: the loader drops those), whose pre_forward fullgraph compiling
    refuses: on 2x H200 the 31 GiB split's warm-up failed and its worker served eager. The blocks now compile
    inside their own hooks: the worker is compiled, with no fallback, and serves."""
    manager = compiling_manager(plus_ckpt, cpu_plan(1), hook="faults:hook_blocks")
    worker = manager.status().workers[0]
    assert worker.state == "idle" and worker.compiled is True and not worker.fallbacks, worker
    with start_server(manager) as server:
        assert_edits(server)
        health = httpx.get(f"{server.url}/health", timeout=10).json()["workers"][0]
        assert health["compiled"] is True and health["fallbacks"] == []


def assert_edits(server) -> None:
    """A 2-step REST edit answers with a 64x64 image."""
    reply = httpx.post(f"{server.url}/v1/images/edits", timeout=120,
                       files={"image": ("in.png", _png(), "image/png")},
                       data={"prompt": "make it blue", "size": "64x64", "num_inference_steps": "2",
                             "response_format": "b64_json"})
    assert reply.status_code == 200, reply.text
    image = Image.open(io.BytesIO(base64.b64decode(reply.json()["data"][0]["b64_json"])))
    assert image.size == (64, 64)


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (30, 120, 200)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_lora_on_a_pipeline_placed_over_devices_keeps_the_placement(plus_ckpt, tmp_path):
    """diffusers' load_lora_weights took our device hooks for sequential CPU offload: it removed them all and
    offloaded the whole pipeline (on a GPU; on the CPU it raised). "cpu:0" is a second device name for the
    CPU, so the loader hooks the text encoder and the VAE as it does a GPU worker spread over two GPUs."""
    plan = WorkerPlan("split", {name: Placement("cpu:0" if name == "text_encoder" else "cpu")
                                for name in MODEL_COMPONENTS})
    pipe = loader.load_pipeline(loader.open_checkpoint(str(plus_ckpt)), plan, torch.float32)
    assert hasattr(pipe.text_encoder, "_hf_hook") and hasattr(pipe.vae, "_hf_hook")
    from imgedit.config.loras import LoraFile

    path = random_lora(tmp_path / "style.safetensors", transformer_linears(plus_ckpt), rank=4)
    Adapters(pipe, (LoraFile("style", str(path), None, 4, 0),))
    assert hasattr(pipe.text_encoder, "_hf_hook") and hasattr(pipe.vae, "_hf_hook")  # the placement's hooks stay
    hooked = [name for name, module in pipe.transformer.named_modules() if hasattr(module, "_hf_hook")]
    assert hooked == []  # no offload hooks put inside the blocks (torch.compile refuses them)
    assert pipe.hf_device_map["text_encoder"] == "cpu:0"


def test_a_loading_worker_says_what_it_is_doing_and_a_failed_one_why():
    handle = WorkerHandle.__new__(WorkerHandle)
    handle.state, handle.detail, handle._events = WorkerState.LOADING, "starting", None
    handle._handle(Loading(0, "compiling: warm-up 2 of 5 (quality at 1024x1024)", 73.4))
    assert handle.detail == "compiling: warm-up 2 of 5 (quality at 1024x1024) (73 s)"
    handle._handle(Loading(1, "loading the weights", 1.0))  # rank 0 speaks for its group
    assert handle.detail.startswith("compiling")
    loading = {"ready": False, "workers": [{"name": "gpu0", "state": "loading", "detail": handle.detail}]}
    assert "Loading the model — gpu0: compiling: warm-up 2 of 5" in banner_html(loading)
    failed = {"ready": False, "workers": [{"name": "gpu0", "state": "failed",
                                           "error": "rank 0: CUDA out of memory <b>"}]}
    assert "gpu0 could not load: rank 0: CUDA out of memory &lt;b&gt;" in banner_html(failed)
    assert banner_html({"ready": True, "workers": [{"name": "gpu0", "state": "idle"}]}) == ""
