"""What the GPU panel says each GPU holds, from the workers' status (no GPU needed)."""

from __future__ import annotations

from imgedit.gpus import GpuReading, _annotate
from imgedit.jobs import ManagerStatus, WorkerStatus


def reading(i: int) -> GpuReading:
    return GpuReading(i, "H200", f"GPU-{i}", 1000.0, 143000.0, 50.0, 900.0)


def status(*workers: WorkerStatus) -> ManagerStatus:
    return ManagerStatus(True, "m", "plus", "auto", "why", 0, workers)


def test_pair_ranks_and_split_blocks_are_labelled_per_gpu():
    pair = WorkerStatus("worker-0", ("cuda:0", "cuda:1"), {"transformer": "cuda:0, cuda:1"}, "busy", "job-1", 3,
                        40, 0, None, parallel="cfg", ranks=2, compiled=True)
    split = WorkerStatus("worker-1", ("cuda:1", "cuda:10"),
                         {"transformer": "blocks 0-29 -> cuda:10, blocks 30-59 -> cuda:1", "vae": "cuda:10"},
                         "idle", None, 0, 0, 0, None)
    readings = {i: reading(i) for i in (0, 1, 10)}
    _annotate(list(readings.values()), status(pair, split))
    assert readings[0].holds == ["worker-0 rank 0 of a CFG-parallel pair: the whole pipeline, compiled"]
    assert readings[1].holds == ["worker-0 rank 1 of a CFG-parallel pair: the whole pipeline, compiled",
                                 "worker-1: transformer (blocks 30-59)"]  # not cuda:10's blocks
    assert readings[10].holds == ["worker-1: transformer (blocks 0-29)", "worker-1: vae"]
    assert readings[0].running == readings[1].running == ["worker-0: job-1 step 3/40"]
    assert readings[10].running == []
