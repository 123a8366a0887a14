"""Shared fixtures: the tiny checkpoints, managers built on them, and a live server on a free port.

Nothing here mocks the pipeline: the tiny checkpoint is a real (2-layer, random-weight) Qwen
image-edit model, loaded through our own settings, planner and loader.
"""

from __future__ import annotations

import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

from imgedit.demo_checkpoint import build_checkpoint
from imgedit.manager import PipelineManager
from imgedit.placement import Placement, Plan, WorkerPlan
from imgedit.settings import load_settings

torch.set_num_threads(2)
ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "artifacts"
COMPONENTS = ("transformer", "text_encoder", "vae")


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count()
    for item in items:
        if "multi_gpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2+ CUDA GPUs, this machine has {gpus}"))
        elif "gpu" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU, this machine has none"))


@pytest.fixture(scope="session")
def plus_ckpt(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "plus", kind="plus", seed=0)


@pytest.fixture(scope="session")
def edit_ckpt(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "edit", kind="edit", seed=0)


def cpu_plan(workers: int) -> Plan:
    return Plan("replicas", tuple(WorkerPlan(f"worker-{i}", {c: Placement("cpu") for c in COMPONENTS})
                                  for i in range(workers)), f"{workers} CPU worker(s) for tests")


def make_manager(ckpt: Path, workers: int = 1, **env) -> PipelineManager:
    env.setdefault("OUTPUT_DIR", tempfile.mkdtemp(prefix="imgedit-outputs-"))  # history: never ~/.cache
    settings = load_settings({"QWEN_MODEL_DIR": str(ckpt), "DEVICE_MAP": "cpu", **env})
    return PipelineManager(settings, plan=cpu_plan(workers)).load()


@pytest.fixture(scope="session")
def plus_manager(plus_ckpt) -> PipelineManager:
    return make_manager(plus_ckpt)


@pytest.fixture(scope="session")
def edit_manager(edit_ckpt) -> PipelineManager:
    return make_manager(edit_ckpt)


def picture(w: int = 80, h: int = 60, color=(30, 120, 200)) -> Image.Image:
    image = Image.new("RGB", (w, h), color)
    for x in range(0, w, 8):
        for y in range(h):
            image.putpixel((x, y), (255, 255, 0))
    return image


class ConcurrencyProbe:
    """Counts forwards in flight per worker over its pipeline's main modules (text encoder,
    transformer, VAE encoder and decoder) and remembers the most seen at once. One pipeline call
    runs them one after another, so more than one at a time means two calls overlapped; a call
    spends nearly all its time inside them, so an overlap cannot hide between forwards."""

    def __init__(self, manager: PipelineManager):
        self.lock = threading.Lock()
        self.active: dict[str, int] = {}
        self.max_active: dict[str, int] = {}
        self.handles = []
        for worker in manager.workers:
            name = worker.name
            self.active[name] = self.max_active[name] = 0
            pipe = worker.pipe
            for module in (pipe.text_encoder, pipe.transformer, pipe.vae.encoder, pipe.vae.decoder):
                self.handles.append(module.register_forward_pre_hook(self._enter(name)))
                self.handles.append(module.register_forward_hook(self._leave(name)))

    def _enter(self, name):
        def hook(module, args):
            with self.lock:
                self.active[name] += 1
                self.max_active[name] = max(self.max_active[name], self.active[name])
        return hook

    def _leave(self, name):
        def hook(module, args, output):
            with self.lock:
                self.active[name] -= 1
        return hook

    def close(self):
        for handle in self.handles:
            handle.remove()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """The real app (REST + Gradio) under uvicorn in a thread, on a free loopback port."""

    def __init__(self, app, port: int):
        import uvicorn

        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)


def start_server(manager) -> LiveServer:
    """A LiveServer for `manager` (use as a context manager); its settings decide auth, limits, ..."""
    from imgedit.server import build_app

    return LiveServer(build_app(manager.settings, manager), free_port())


@pytest.fixture(scope="session")
def server_manager(plus_ckpt) -> PipelineManager:
    """Two CPU workers, so concurrency and the shared line are exercised."""
    return make_manager(plus_ckpt, workers=2, QUEUE_MAX_SIZE="4")


@pytest.fixture(scope="session")
def live_server(server_manager):
    with start_server(server_manager) as server:
        yield server


@pytest.fixture(scope="session")
def image_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("img") / "input.png"
    picture().save(path)
    return path
