"""The worker built in phases, its optimisations as features (imgedit.runtime.phases, imgedit.runtime.features):
the phases run in order and are reported, a feature that fails to build falls back and says so while the worker
serves, the family table comes from the families' own refusals, and per-job features are entered for a job and
left however it ends."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import picture

from imgedit.config.settings import load_settings
from imgedit.engine.validation import resolve
from imgedit.errors import Cancelled, ImgEditError
from imgedit.planning.checkpoint import open_checkpoint
from imgedit.planning.families import FAMILIES
from imgedit.planning.plan import Placement, WorkerPlan
from imgedit.protocol import EditRequest
from imgedit.runtime import features, phases, single_frame, warmup
from imgedit.runtime.messages import Job, WorkerSpec

COMPONENTS = ("transformer", "text_encoder", "vae")


def spec_for(ckpt, **kw) -> WorkerSpec:
    plan = WorkerPlan("worker-0", {c: Placement("cpu") for c in COMPONENTS})
    return WorkerSpec(name="worker-0", rank=0, world=1, parallel="none", plan=plan,
                      checkpoint=open_checkpoint(str(ckpt)), dtype="float32", compile=False, **kw)


def job_for(ckpt, family="plus", **kw) -> Job:
    settings = load_settings({"QWEN_MODEL_DIR": str(ckpt)})
    req = EditRequest(**{**dict(images=(picture(),), prompt="make it red", seed=3, num_inference_steps=2,
                                width=64, height=64), **kw})
    params = resolve(req, settings, family, req.images[-1].size, len(req.images))
    return Job(req, params, family)


def edit(runner, ckpt, family="plus", cancel=None, **kw) -> np.ndarray:
    result = runner.run(job_for(ckpt, family, **kw), cancel or threading.Event())
    return np.asarray(result.images[0], dtype=np.int16)


@pytest.fixture(scope="module")
def built(plus_ckpt):
    said: list[str] = []
    runner, report, seconds = phases.build_worker(spec_for(plus_ckpt, encode_cache=4), said.append)
    return runner, report, said


def test_the_phases_run_in_order_and_each_is_shown_and_reported(built):
    runner, report, said = built
    names = [name for name, _, _ in phases.PHASES]
    assert names == ["place", "load", "adapt", "optimise", "warm", "ready"]
    assert list(report.phases) == names and all(s >= 0 for s in report.phases.values())
    assert said == [doing for _, doing, _ in phases.PHASES]  # what /health and the page show while loading
    # the features this CPU worker has: a VAE on the CPU keeps the processor's own pixels; no cap, no group
    assert report.features == ["single-frame VAE", "encode cache", "LoRAs", "step cache", "masks",
                               "live preview", "time budget", "pausing items"], report.features
    assert report.pixels == "cpu" and report.encode_cache == 4 and report.fallbacks == []
    # the masks feature's two parts: mask_prompt's outline, then the mask itself
    # the time budget outermost: the other parts' own work counts in the job's time; pausing innermost: the
    # latents it keeps are those every other part handed back
    assert [type(p).__name__ for p in runner.parts] == ["TimeBudget", "Adapters", "StepCache", "Outlining",
                                                        "Masking", "LivePreview", "Pausing"]


def test_a_feature_that_fails_to_build_falls_back_and_the_worker_serves(plus_ckpt, built, monkeypatch):
    """An optimisation never takes the server down: the single-frame VAE failing to install leaves the VAE's own
    3-D convolutions (the same image up to rounding), says why in the fallbacks, and the worker edits."""
    def broken(vae):
        raise RuntimeError("a diffusers that lays its convolutions out otherwise")

    monkeypatch.setattr(single_frame, "install", broken)
    runner, report, _ = phases.build_worker(spec_for(plus_ckpt), lambda doing: None)
    assert "single-frame VAE" not in report.features
    assert report.fallbacks == ["single-frame VAE failed → off: RuntimeError: a diffusers that lays its "
                                "convolutions out otherwise"]
    fallen, usual = edit(runner, plus_ckpt), edit(built[0], plus_ckpt)
    assert fallen.shape == usual.shape and np.abs(fallen - usual).max() <= 2


def test_a_mode_the_plan_needs_fails_the_load_instead(plus_ckpt, monkeypatch):
    """Not an optimisation: a mode the plan needs (here the job's LoRAs) failing to install fails the load,
    which the pool reports; it is not served without it."""
    def broken(self, build):
        raise RuntimeError("no adapters")

    monkeypatch.setattr(features.Loras, "install", broken)
    with pytest.raises(RuntimeError, match="no adapters"):
        phases.build_worker(spec_for(plus_ckpt), lambda doing: None)


def test_the_family_table_is_the_families_own_refusals():
    only_21 = {"2.1 metadata once a request", "2.1 attention: real RoPE", "turbo", "2.1 target split"}
    assert features.FAMILY_FEATURES["plus"] == features.FAMILY_FEATURES["edit"] == features.EVERY - only_21
    lacks = features.EVERY - features.FAMILY_FEATURES["21"]
    assert lacks == {features.NOT_BUILT_AS[mode] for mode in FAMILIES["21"].not_built
                     if mode in features.NOT_BUILT_AS and mode != "cfg-parallel"} == {"batched CFG", "step cache"}
    # its groups split the target image (DEVICE_MAP=ulysses); its CFG pairs stay refused (the next test)
    assert "parallel group" not in lacks and "masks" not in lacks and "compile" not in lacks
    # every feature a family may lack is named as the server refuses it
    assert set(features.NOT_BUILT_AS.values()) <= features.EVERY


def test_a_mode_a_family_lacks_is_refused_not_skipped(plus_ckpt):
    """A CFG pair is not built for Qwen-Image-2.1: the planner refuses it first; a spec that asks anyway is
    refused at loading, never served by a half-built group."""
    spec = spec_for(plus_ckpt)
    as_21 = replace(spec.checkpoint, pipeline_class="QwenImage21Pipeline")
    spec = replace(spec, parallel="cfg", world=2, checkpoint=as_21)
    build = phases.Build(spec, lambda doing: None)
    with pytest.raises(ImgEditError, match="a cfg-parallel group is not built for Qwen-Image-2.1"):
        features.install(build, "optimise")


class Recorder:
    """A per-job feature that records what it saw."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    @contextmanager
    def job(self, call):
        self.log.append(("enter", self.name))
        call.step_hooks.append(lambda step, tensors: self.log.append(("step", self.name, step)))
        try:
            yield
        except BaseException as exc:
            self.log.append(("failed", self.name, type(exc).__name__))
            raise
        finally:
            self.log.append(("exit", self.name))


def test_per_job_features_are_entered_in_order_and_left_however_the_job_ends(plus_ckpt, built):
    runner = built[0]
    log: list = []
    first, second = Recorder("first", log), Recorder("second", log)
    runner.parts[:0] = [first, second]
    try:
        edit(runner, plus_ckpt)
        assert log == [("enter", "first"), ("enter", "second"), ("step", "first", 0), ("step", "second", 0),
                       ("step", "first", 1), ("step", "second", 1), ("exit", "second"), ("exit", "first")]
        log.clear()
        cancel = threading.Event()
        cancel.set()
        with pytest.raises(Cancelled):
            edit(runner, plus_ckpt, cancel=cancel)
        assert log == [("enter", "first"), ("enter", "second"), ("failed", "second", "Cancelled"),
                       ("exit", "second"), ("failed", "first", "Cancelled"), ("exit", "first")]
    finally:
        del runner.parts[:2]
    assert torch.is_grad_enabled() is False  # the place phase turned autograd off for the worker


def test_an_uncompiled_one_process_gpu_worker_runs_its_first_job_before_ready(plus_ckpt, built):
    """An uncompiled GPU worker not in a group runs its family's first warm-up job in the warm phase, so that no
    user pays the first job's one-time costs. A compiled worker warms up in compile, a group's ranks would have
    to run it in step, and a CPU worker has no such costs. Here its install runs on the CPU worker: the job goes
    through the runner's per-job parts (a CFG edit of two steps at the first warm-up size)."""
    spec = spec_for(plus_ckpt, warmup_sizes=((64, 64), (48, 64)))

    def applies(cuda=True, **kw) -> bool:
        return features.FirstJob().applies(phases.Build(replace(spec, **kw), lambda doing: None, cuda=cuda))

    assert applies() and not applies(cuda=False) and not applies(compile=True) and not applies(world=2)
    warm = [type(f) for f in features.FEATURES if f.phase == "warm"]
    assert warm.index(features.FirstJob) > warm.index(features.Compile)  # compile's fallback runs it itself
    said: list[str] = []
    runner, log = built[0], []
    runner.parts.insert(0, Recorder("seen", log))
    build = phases.Build(spec, said.append, runner=runner)
    try:
        features.FirstJob().install(build)
    finally:
        del runner.parts[0]
    assert log == [("enter", "seen"), ("step", "seen", 0), ("step", "seen", 1), ("exit", "seen")], log
    assert said == ["warming up: a first job"] and build.report.first_job_seconds > 0
    assert build.report.fallbacks == []
    # a family with no warm-up job (no warm-up size, no Lightning LoRA) runs none
    build = phases.Build(replace(spec, warmup_sizes=()), said.append, runner=runner)
    features.FirstJob().install(build)
    assert build.report.first_job_seconds == 0.0


class Failing:
    """A per-job part that fails the job as it starts, with `error`."""

    def __init__(self, error: BaseException):
        self.error = error

    @contextmanager
    def job(self, call):
        raise self.error
        yield


def test_a_first_job_that_fails_fails_the_load_and_one_out_of_memory_is_reported(plus_ckpt, built):
    """Not an optimisation: a worker whose first job fails cannot edit, and fails to load saying why
    (warmup.Unservable; the pool shows the cause) rather than serve an internal error to every job. Out of GPU
    memory at the warm-up's size is not such a failure: the worker serves, the report's fallbacks say it."""
    spec = spec_for(plus_ckpt, warmup_sizes=((64, 64),))
    runner = built[0]

    def first_job(error: BaseException) -> phases.Build:
        build = phases.Build(spec, lambda doing: None, runner=runner)
        runner.parts.insert(0, Failing(error))
        try:
            features.FirstJob().install(build)
        finally:
            del runner.parts[0]
        return build

    with pytest.raises(warmup.Unservable, match="this worker cannot edit: RuntimeError: a device mismatch"):
        first_job(RuntimeError("a device mismatch"))
    build = first_job(torch.OutOfMemoryError("CUDA out of memory"))
    assert build.report.fallbacks == ["the warm-up job ran out of GPU memory at 64x64: jobs that large may too"]
    assert edit(runner, plus_ckpt).shape == (64, 64, 3)  # the runner serves after both


class Slow:
    """A per-job part whose own work before the pipeline call takes `seconds` (as a prefix cache's locking of
    CPU memory does), or whose step hook does at the job's last step (`at_step`)."""

    def __init__(self, seconds: float, at_step: int | None = None):
        self.seconds, self.at_step = seconds, at_step

    @contextmanager
    def job(self, call):
        if self.at_step is None:
            time.sleep(self.seconds)
        else:
            call.step_hooks.append(lambda step, tensors: time.sleep(self.seconds) if step == self.at_step else None)
        yield


def test_a_parts_own_work_before_the_pipeline_counts_in_the_jobs_prepare_time(plus_ckpt, built):
    runner = built[0]
    runner.run(job_for(plus_ckpt), threading.Event())  # the prompt and the picture in the encode cache
    alone = runner.run(job_for(plus_ckpt), threading.Event()).timings["prepare"]
    runner.parts.insert(1, Slow(1.0))  # after the time budget, which the worker installs outermost
    try:
        slowed = runner.run(job_for(plus_ckpt), threading.Event()).timings["prepare"]
    finally:
        del runner.parts[1]
    assert slowed - alone >= 0.8, (alone, slowed)


def test_a_step_hooks_work_counts_in_its_step_not_in_the_finish(plus_ckpt, built):
    """The time budget marks a step's end after every step hook (Call.step_marks), although it is entered
    first: a hook's work at the last step (a mask's blend, a preview) is that step's time."""
    runner = built[0]
    runner.parts.insert(1, Slow(1.0, at_step=1))  # the last of the job's two steps
    try:
        timings = runner.run(job_for(plus_ckpt), threading.Event()).timings
    finally:
        del runner.parts[1]
    assert timings["later_steps"] >= 0.9 and timings["finish"] < 0.9, timings


def test_the_prefix_cache_room_is_read_on_the_transformers_gpus_as_this_process_numbers_them(monkeypatch):
    """Under MAX_MEMORY the 2.1 prefix cache's room is measured on the GPUs the transformer's blocks sit on, in
    this process's numbering (the plan's). A second replica is the server's cuda:1 and this process's cuda:0:
    measured at the server's index, every job asked the driver about a GPU the process cannot see."""
    from types import SimpleNamespace

    gib = 1024**3
    free = {0: 10 * gib, 1: 7 * gib}  # this process's GPUs: cuda:0 and cuda:1 only
    asked: list[int] = []

    def gpu_room(index, caps):  # the seam that calls the driver (torch.cuda.mem_get_info)
        asked.append(index)
        return free[index]

    monkeypatch.setattr(features, "gpu_room", gpu_room)
    blocks = Placement("cuda:0", ("cuda:0", "cuda:0", "cuda:1", "cuda:1"))
    parts: list = []
    build = SimpleNamespace(
        plan=WorkerPlan("worker-1", {"transformer": blocks, "text_encoder": Placement("cuda:1"),
                                     "vae": Placement("cuda:0")}),
        spec=SimpleNamespace(memory_caps=(12 * gib, 12 * gib), activation_reserve=gib),
        pipe=SimpleNamespace(transformer=SimpleNamespace(config={})),
        runner=SimpleNamespace(devices=("cuda:2", "cuda:3"), add=parts.append),  # the server's names
        transformers=(torch.nn.Linear(1, 1),), report=SimpleNamespace(under_cap=[], compiled=False))
    features.PrefixCacheRoom().install(build)
    assert parts[0].room() == 6 * gib  # the tighter of the two, less the reserve
    assert sorted(asked) == [0, 1]
