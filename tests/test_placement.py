"""The placement planner on made-up GPUs: pure, so no torch and no checkpoint needed."""

from __future__ import annotations

import pytest

from imgedit.config.parsers import GIB, parse_device_map
from imgedit.errors import PlacementError
from imgedit.planning.placement import plan_placement, standby_gpus
from imgedit.planning.plan import ComponentSpec, GpuSpec

# Real bf16 sizes of Qwen-Image-Edit (GiB): transformer 60 blocks, text encoder 28 layers, VAE whole.
TRANSFORMER = ComponentSpec("transformer", int(38.05 * GIB), (int(0.633 * GIB),) * 60)
TEXT_ENCODER = ComponentSpec("text_encoder", int(15.45 * GIB), (int(0.434 * GIB),) * 28)
VAE = ComponentSpec("vae", int(0.24 * GIB))
MODEL = [TRANSFORMER, TEXT_ENCODER, VAE]
TOTAL = sum(c.nbytes for c in MODEL)


def gpus(*sizes_gib: float) -> list[GpuSpec]:
    return [GpuSpec(i, f"GPU{i}", int(s * GIB), int((s - 0.5) * GIB)) for i, s in enumerate(sizes_gib)]


def plan(device_map: str, gpu_list, max_memory=(), reserve=1 * GIB):
    return plan_placement(MODEL, gpu_list, parse_device_map(device_map), max_memory, reserve)


def per_gpu(p) -> dict[str, float]:
    return {d: n / GIB for d, n in p.bytes_per_device.items()}


def need(p) -> dict[str, float]:
    """GiB each device must hold: weights, plus the 4 GiB activation reserve on the execution device."""
    exec_device = p.workers[0].execution_device
    return {d: v + (4 if d == exec_device else 0) for d, v in per_gpu(p).items()}


def test_one_80gb_gpu_holds_everything():
    p = plan("balanced", gpus(80))
    assert len(p.workers) == 1
    assert {pl.device for pl in p.workers[0].components.values()} == {"cuda:0"}
    assert not any(pl.is_split for pl in p.workers[0].components.values())


def test_two_80gb_gpus_balanced_spreads_whole_components():
    p = plan("balanced", gpus(80, 80))
    w = p.workers[0]
    assert w.components["transformer"].device == "cuda:0"
    assert w.components["text_encoder"].device == "cuda:1"
    assert w.components["vae"].device == "cuda:0"  # rides with the latents
    assert not w.components["transformer"].is_split


def test_two_80gb_gpus_replicas_and_auto():
    p = plan("replicas", gpus(80, 80))
    assert [w.execution_device for w in p.workers] == ["cuda:0", "cuda:1"]
    assert all(len(w.devices) == 1 for w in p.workers)
    auto = plan("auto", gpus(80, 80))  # a copy fits each: a CFG-parallel pair (half the latency)
    assert auto.mode == "auto" and len(auto.workers) == 1 and "CFG-parallel pair" in auto.reason
    assert auto.workers[0].parallel == "cfg" and auto.workers[0].rank_devices == ("cuda:0", "cuda:1")
    assert plan("auto", gpus(80)).workers[0].parallel == "none"  # one GPU: one pipeline on it


def test_cfg_parallel_pairs_gpus_and_an_odd_one_serves_alone():
    p = plan("cfg-parallel", gpus(141, 141, 141))
    assert [(w.parallel, w.rank_devices) for w in p.workers] == [("cfg", ("cuda:0", "cuda:1")), ("none", ())]
    assert p.workers[1].devices == ("cuda:2",) and "left over" in p.reason
    rank1 = p.workers[0].for_rank(1)
    assert {pl.device for pl in rank1.components.values()} == {"cuda:1"}
    eight = plan("cfg-parallel", gpus(*[141] * 8))
    assert len(eight.workers) == 4 and all(w.ranks == 2 for w in eight.workers)


def test_cfg_parallel_refuses_what_cannot_hold_a_copy_per_gpu():
    with pytest.raises(PlacementError, match="cfg-parallel needs groups of 2 GPUs but 1 are visible"):
        plan("cfg-parallel", gpus(141))
    with pytest.raises(PlacementError, match="each take a full copy .* use DEVICE_MAP=balanced"):
        plan("cfg-parallel", gpus(48, 48))
    assert plan("auto", gpus(24, 24, 24, 24)).workers[0].parallel == "none"  # split instead


def test_four_24gb_gpus_split_the_transformer_instead_of_falling_to_cpu():
    p = plan("balanced", gpus(24, 24, 24, 24))
    w = p.workers[0]
    assert w.components["transformer"].is_split
    assert "cpu" not in w.devices
    assert all(v <= 24 - 0.5 - 1 for v in need(p).values()), need(p)
    assert sum(p.bytes_per_device.values()) == TOTAL
    blocks = w.components["transformer"].block_devices
    assert len(blocks) == 60
    # contiguous runs: each device appears in one run only
    runs = [d for i, d in enumerate(blocks) if i == 0 or blocks[i - 1] != d]
    assert len(runs) == len(set(runs))
    assert w.components["vae"].device == w.components["transformer"].device == w.execution_device
    auto = plan("auto", gpus(24, 24, 24, 24))
    assert len(auto.workers) == 1 and "does not fit every GPU" in auto.reason


def test_eight_141gb_gpus_replicas_gives_eight_workers():
    p = plan("replicas", gpus(*[141] * 8))
    assert len(p.workers) == 8
    assert [w.name for w in p.workers] == [f"worker-{i}" for i in range(8)]


def test_uneven_caps_are_honoured():
    p = plan("balanced", gpus(80, 80), max_memory=(42 * GIB, 21 * GIB))
    usage = need(p)  # reserve 1 GiB and the CUDA context 0.6 GiB stay free under each cap
    assert usage["cuda:0"] <= 42 - 1.6 and usage["cuda:1"] <= 21 - 1.6, usage
    assert p.workers[0].components["transformer"].is_split


def test_caps_31gib_on_two_gpus_force_a_split_and_30_do_not_fit():
    p = plan("balanced", gpus(141, 141), max_memory=(31 * GIB,))
    assert p.workers[0].components["transformer"].is_split
    assert all(v <= 31 - 1.6 for v in need(p).values()), need(p)
    with pytest.raises(PlacementError, match="can take 56.8 GiB in all"):
        plan("balanced", gpus(141, 141), max_memory=(30 * GIB,))


def test_too_small_fails_clearly():
    with pytest.raises(PlacementError, match=r"needs 57.7 GiB \(weights and activations\).*can take"):
        plan("balanced", gpus(16, 16))
    with pytest.raises(PlacementError, match="replicas needs .* every GPU"):
        plan("replicas", gpus(24, 24, 24, 24))
    with pytest.raises(PlacementError, match="use DEVICE_MAP=balanced"):
        plan("cuda", gpus(24, 24))


def test_max_memory_count_must_match():
    with pytest.raises(PlacementError, match="MAX_MEMORY has 3 values but 2 GPUs"):
        plan("balanced", gpus(80, 80), max_memory=(10 * GIB,) * 3)


def test_single_gpu_modes():
    p = plan("cuda:1", gpus(80, 80))
    assert p.workers[0].devices == ("cuda:1",)
    with pytest.raises(PlacementError, match="cuda:3 but only GPUs"):
        plan("cuda:3", gpus(80, 80))


def test_no_gpu_falls_back_to_cpu_for_balanced_but_not_for_cuda():
    p = plan("balanced", [])
    assert p.workers[0].devices == ("cpu",) and "CPU" in p.reason
    with pytest.raises(PlacementError, match="needs a GPU"):
        plan("replicas", [])


def test_manual_map_with_block_ranges():
    manual = '{"transformer": {"0-29": "cuda:0", "30-59": "cuda:1"}, "text_encoder": "cuda:1", "vae": "cuda:0"}'
    p = plan(manual, gpus(80, 80))
    t = p.workers[0].components["transformer"]
    assert t.block_devices == ("cuda:0",) * 30 + ("cuda:1",) * 30
    assert p.workers[0].components["text_encoder"].device == "cuda:1"
    assert t.describe() == "blocks 0-29 -> cuda:0, blocks 30-59 -> cuda:1"


@pytest.mark.parametrize("manual, message", [
    ('{"transformer": {"0-29": "cuda:0"}, "text_encoder": "cuda:1"}', "blocks 30..59 have no device"),
    ('{"transformer": {"0-40": "cuda:0", "30-59": "cuda:1"}, "text_encoder": "cuda:1"}', "placed twice"),
    ('{"transformer": "cuda:0", "text_encoder": "cuda:7"}', "visible GPUs are"),
    ('{"transformer": "cuda:0"}', "does not place text_encoder"),
    ('{"transformer": "cuda:0", "text_encoder": "cuda:1", "unet": "cuda:0"}', "unknown components"),
    ('{"transformer": "cuda:0", "text_encoder": "cuda:1", "vae": "cuda:1"}', "vae must be on"),
    ('{"transformer": {"0-70": "cuda:0"}, "text_encoder": "cuda:1"}', "outside 0-59"),
])
def test_manual_map_errors(manual, message):
    with pytest.raises(PlacementError, match=message):
        plan(manual, gpus(80, 80))


def test_manual_map_over_budget_is_refused():
    with pytest.raises(PlacementError, match="can take"):
        plan('{"transformer": "cuda:0", "text_encoder": "cuda:0"}', gpus(48, 48))


@pytest.mark.parametrize("device_map, gpus, expected", [
    ("cpu", 0, [()]), ("cpu", 4, [()]), ("cuda", 2, [(0,)]), ("cuda:1", 2, [(1,)]), ("balanced", 4, [(0, 1, 2, 3)]),
    ("balanced", 0, [()]), ('{"transformer": "cuda:0", "text_encoder": "cuda:1", "vae": "cuda:0"}', 2, [(0, 1)]),
    ("replicas", 3, [(0,), (1,), (2,)]), ("cfg-parallel:4", 4, [(0,), (1,), (2,), (3,)]),
    ("ulysses:2", 2, [(0,), (1,)]),
    ("auto", 2, [(0,), (1,)]), ("auto", 1, [(0,)]), ("auto", 0, [()]), ("replicas", 0, [()]),
])
def test_the_standby_processes_are_one_for_each_set_of_gpus_a_rank_may_own(device_map, gpus, expected):
    """What app.py starts before the checkpoint is known (engine.workers.standby), each with its GPUs fixed:
    one process for the modes of one worker of one rank (its GPUs: none, GPU N, or all), else one per GPU."""
    assert standby_gpus(parse_device_map(device_map), gpus) == expected
