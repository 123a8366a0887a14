"""GPU checks (run on the GPU machine; skipped elsewhere): placements, the memory panel against
nvidia-smi, out-of-memory recovery on a real oversize request, 1-3 input images on a split.

They use a real-size random-weight checkpoint (published configs; weights made on the GPU), as the
benchmark does: placement and memory do not depend on the weights' values.
"""

from __future__ import annotations

import subprocess

import pytest
import torch
from conftest import picture

from imgedit.demo_checkpoint import build_checkpoint
from imgedit.errors import OutOfGpuMemory
from imgedit.gpus import GpuMonitor
from imgedit.jobs import EditRequest
from imgedit.manager import PipelineManager
from imgedit.settings import GIB, load_settings


@pytest.fixture(scope="module")
def real_ckpt(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("real") / "qwen", kind="plus", size="real")


def load(ckpt, **env) -> PipelineManager:
    return PipelineManager(load_settings({"QWEN_MODEL_DIR": str(ckpt), **env})).load()


def release(manager: PipelineManager) -> None:
    for worker in manager.workers:
        worker.pipe = None
    import gc

    gc.collect()
    torch.cuda.empty_cache()


def edit(manager, n_images=1, size=512, steps=2):
    return manager.edit(EditRequest(images=(picture(96, 64),) * n_images, prompt="make it red", seed=0,
                                    num_inference_steps=steps, width=size, height=size, source="test"))


@pytest.mark.multi_gpu
@pytest.mark.parametrize("device_map, max_memory, expect_split", [
    ("balanced", "", False), ("replicas", "", False), ("cuda:1", "", False), ("balanced", "31GiB", True),
])
def test_placements_run_without_device_errors(real_ckpt, device_map, max_memory, expect_split):
    manager = load(real_ckpt, DEVICE_MAP=device_map, MAX_MEMORY=max_memory)
    try:
        split = any(p.is_split for w in manager.plan.workers for p in w.components.values())
        assert split == expect_split
        if device_map == "replicas":
            assert len(manager.workers) == torch.cuda.device_count()
        for i in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(i)
        for n in (1, 2, 3):  # the latents, masks and rotary embeddings must follow every block
            assert edit(manager, n_images=n).images[0].size == (512, 512)
        if max_memory:
            cap = 31 * GIB
            for i in range(torch.cuda.device_count()):
                assert torch.cuda.max_memory_allocated(i) < cap, f"cuda:{i} went over its cap"
    finally:
        release(manager)


@pytest.mark.gpu
def test_panel_memory_matches_nvidia_smi(real_ckpt):
    manager = load(real_ckpt, DEVICE_MAP="balanced")
    try:
        readings = GpuMonitor().read(manager.status())
        smi = subprocess.run(["nvidia-smi", "--query-gpu=uuid,memory.used,memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, check=True)
        by_uuid = {u.strip(): (float(used), float(total))
                   for u, used, total in (line.split(",") for line in smi.stdout.strip().splitlines())}
        for r in readings:
            used, total = by_uuid[r.uuid]
            assert abs(r.used_mib - used) <= 0.02 * max(used, 1024), (r, used)
            assert abs(r.total_mib - total) <= 0.02 * total
        assert any("transformer" in h for r in readings for h in r.holds)
    finally:
        release(manager)


@pytest.mark.gpu
def test_out_of_memory_on_a_real_oversize_request_then_recovery(real_ckpt):
    manager = load(real_ckpt, DEVICE_MAP="cuda:0", MAX_OUTPUT_PIXELS="16777216")
    try:
        total = torch.cuda.get_device_properties(0).total_memory
        # Leave 10 GiB above the weights: a 512x512 edit fits, a 4096x4096 one needs far more.
        fraction = min(1.0, (torch.cuda.memory_allocated(0) + 10 * GIB) / total)
        torch.cuda.set_per_process_memory_fraction(fraction, 0)
        with pytest.raises(OutOfGpuMemory, match="out of GPU memory on cuda:0"):
            edit(manager, size=4096)
        assert manager.workers[0].state == "idle"
        assert edit(manager, size=512).images
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        release(manager)
