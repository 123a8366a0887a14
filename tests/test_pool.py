"""Pure parts of the worker pool: each rank's GPUs as its process sees them, and its memory caps."""

from __future__ import annotations

from imgedit.placement import Placement, WorkerPlan
from imgedit.pool import WorkerHandle, localize
from imgedit.settings import GIB

COMPONENTS = ("transformer", "text_encoder", "vae")


def test_a_split_worker_sees_only_its_gpus_renumbered():
    plan = WorkerPlan("worker-0", {"transformer": Placement("cuda:2", ("cuda:2",) * 30 + ("cuda:3",) * 30),
                                   "text_encoder": Placement("cuda:3"), "vae": Placement("cuda:2")})
    local, visible = localize(plan, "4,5,GPU-aaa,GPU-bbb")
    assert visible == "GPU-aaa,GPU-bbb"  # the server's CUDA_VISIBLE_DEVICES entries 2 and 3
    assert local.components["transformer"].block_devices == ("cuda:0",) * 30 + ("cuda:1",) * 30
    assert local.components["text_encoder"].device == "cuda:1" and local.execution_device == "cuda:0"
    assert localize(plan, None)[1] == "2,3"


def test_each_rank_of_a_pair_gets_one_gpu_and_its_cap():
    pair = WorkerPlan("worker-1", {c: Placement("cuda:2") for c in COMPONENTS}, "cfg", ("cuda:2", "cuda:3"))
    rank1, visible = localize(pair.for_rank(1), None)
    assert visible == "3" and {p.device for p in rank1.components.values()} == {"cuda:0"}
    handle = WorkerHandle(pair, None, visible=None, cache_dir=None, max_restarts=0,
                          max_memory=(10 * GIB, 20 * GIB, 30 * GIB, 40 * GIB))
    assert handle._caps(pair.for_rank(1)) == (40 * GIB,)
    assert WorkerHandle(pair, None, visible=None, cache_dir=None, max_restarts=0,
                        max_memory=(22 * GIB,))._caps(pair.for_rank(0)) == (22 * GIB,)
