"""The GPU panel without a GPU: what it says each GPU holds and runs, how it splits memory, its
history and its HTML, from made-up NVML readings and workers' status."""

from __future__ import annotations

import re

import pytest
from conftest import make_manager
from fake_nvml import FakeGpu, FakeNvml

from imgedit.engine.workers.gpus import GpuMonitor, GpuReading, MemoryHistory, _annotate, snapshot
from imgedit.planning.plan import Placement, Plan, WorkerPlan
from imgedit.protocol import ManagerStatus, WorkerStatus
from imgedit.runtime.messages import Ready, StartupReport
from imgedit.web.page.panel import panel_html


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


# ---- memory split, history and rendering, on made-up GPUs (tests/fake_nvml.py) ----

H100, H200 = 81_559.0, 143_771.0


def worker(name: str, devices: tuple[str, ...], placement: dict[str, str], state: str = "idle", job: str | None = None,
           step: int = 0, total: int = 0, pids: tuple[int, ...] = (), weights: dict[str, float] | None = None,
           parallel: str = "none") -> WorkerStatus:
    return WorkerStatus(name, devices, placement, state, job, step, total, 0, None, parallel=parallel,
                        ranks=2 if parallel == "cfg" else 1, pids=pids, weights_mib=weights or {})


def monitor_for(*gpus: FakeGpu, **history) -> GpuMonitor:
    return GpuMonitor(nvml=FakeNvml(list(gpus)), history=MemoryHistory(**history) if history else None)


def cards(html: str) -> dict[int, str]:
    """Each GPU card's HTML by GPU index."""
    found = re.findall(r'<section class="gp-card gpu" data-index="(\d+)">(.*?)</section>', html, re.S)
    return {int(i): body for i, body in found}


def widths(card: str) -> dict[str, float]:
    return {cls: float(w) for cls, w in re.findall(r'class="gp-seg gp-(\w+)" style="width:([\d.]+)%', card)}


def one_gpu_busy():
    gpu = FakeGpu("NVIDIA H100 80GB HBM3", H100, used_mib=62_500, util=97, processes={101: 61_000, 7: 1_400})
    mon = monitor_for(gpu)
    busy = worker("worker-0", ("cuda:0",), {"transformer": "cuda:0", "text_encoder": "cuda:0", "vae": "cuda:0"},
                  "busy", "job-00042-7", 12, 40, pids=(101,), weights={"cuda:0": 56_000})
    return mon, status(busy)


def two_gpus_split():
    mon = monitor_for(FakeGpu(used_mib=30_000, util=40, processes={201: 29_000}),
                      FakeGpu(used_mib=36_000, util=0, processes={201: 34_500, 9: 1_000}))
    split = worker("worker-0", ("cuda:0", "cuda:1"),
                   {"transformer": "blocks 0-29 -> cuda:0, blocks 30-59 -> cuda:1", "text_encoder": "cuda:1",
                    "vae": "cuda:0"}, pids=(201,))
    planned = ManagerStatus(True, "m", "plus", "balanced", "transformer split by blocks", 0, (split,),
                            weights_mib={"cuda:0": 19_800.0, "cuda:1": 35_000.0})
    return mon, planned


def eight_gpus_in_pairs():
    gpus = [FakeGpu(used_mib=62_000 + 100 * i, util=90 if i < 2 else 0, processes={300 + i // 2: 61_500})
            for i in range(8)]
    pairs = [worker(f"worker-{n}", (f"cuda:{2 * n}", f"cuda:{2 * n + 1}"), {}, "busy" if n == 0 else "idle",
                    "job-8" if n == 0 else None, 5 if n == 0 else 0, 40 if n == 0 else 0, pids=(300 + n,),
                    weights={f"cuda:{2 * n}": 57_000, f"cuda:{2 * n + 1}": 57_000}, parallel="cfg")
             for n in range(4)]
    return monitor_for(*gpus), status(*pairs)


def test_memory_splits_into_weights_activations_other_and_free():
    mon, st = one_gpu_busy()
    (r,) = mon.read(st)
    assert (r.weights_mib, r.activations_mib, r.other_mib, r.free_mib) == (56_000, 5_000, 1_500, H100 - 62_500)
    assert r.weights_source == "measured" and r.workers_mib == 61_000  # pid 7 is not ours
    mon, st = two_gpus_split()  # nothing measured yet: the plan's sizes
    r0, r1 = mon.read(st)
    assert (r0.weights_mib, r0.activations_mib, r0.other_mib) == (19_800, 9_200, 1_000)
    assert (r1.weights_mib, r1.activations_mib, r1.other_mib) == (34_500, 0, 1_500)  # loading: never negative
    assert r0.weights_source == r1.weights_source == "planned"


def test_weights_stay_ours_when_nvml_cannot_see_our_processes():
    """In a container with its own PID namespace NVML lists host PIDs: none of ours match."""
    gpu = FakeGpu(used_mib=60_000, processes={99_999: 60_000})
    idle = worker("worker-0", ("cuda:0",), {"transformer": "cuda:0"}, pids=(12,), weights={"cuda:0": 56_000})
    (r,) = monitor_for(gpu).read(status(idle))
    assert (r.weights_mib, r.activations_mib, r.other_mib) == (56_000, 0, 4_000)
    (r,) = monitor_for(FakeGpu(used_mib=500)).read(status())  # nothing of ours: all of it is other
    assert (r.weights_mib, r.activations_mib, r.other_mib, r.weights_source) == (0, 0, 500, None)


@pytest.mark.parametrize("scenario, count", [(one_gpu_busy, 1), (two_gpus_split, 2), (eight_gpus_in_pairs, 8)])
def test_every_bar_fills_exactly_its_card(scenario, count):
    mon, st = scenario()
    data = snapshot(mon, st, history=True)
    found = cards(panel_html(data))
    assert sorted(found) == list(range(count))
    for g in data["gpus"]:
        w = widths(found[g["index"]])
        assert list(w) == ["weights", "activations", "other", "free"]
        assert abs(sum(w.values()) - 100) < 0.011, w
        assert abs(w["weights"] - 100 * g["weights_mib"] / g["total_mib"]) < 0.01
        assert abs(w["free"] - 100 * g["free_mib"] / g["total_mib"]) < 0.02
        for label in ("our weights", "activations", "other processes", "free"):
            assert label in found[g["index"]]
        assert "<svg" in found[g["index"]] and 'class="gp-area"' in found[g["index"]]


def test_cards_say_what_each_gpu_holds_and_runs():
    mon, st = one_gpu_busy()
    card = cards(panel_html(snapshot(mon, st, history=True)))[0]
    assert "NVIDIA H100 80GB HBM3" in card and "util 97%" in card and "61.0 / 79.6 GiB" in card
    assert "<li>worker-0: transformer</li>" in card and "<li>worker-0: vae</li>" in card
    assert "worker-0: running job-00042-7 — step 12/40" in card and 'style="width:30.0%"' in card  # progress 12/40
    assert "our weights 54.7 GiB" in card and "activations 4.9 GiB" in card

    mon, st = two_gpus_split()
    found = cards(panel_html(snapshot(mon, st, history=True)))
    assert "<li>worker-0: transformer (blocks 0-29)</li>" in found[0] and "(blocks 30-59)" not in found[0]
    assert "<li>worker-0: transformer (blocks 30-59)</li>" in found[1] and "<li>worker-0: text_encoder</li>" in found[1]
    for card in found.values():  # idle: no job, no step
        assert "worker-0: idle" in card and "step" not in card and "gp-progress" not in card

    mon, st = eight_gpus_in_pairs()
    found = cards(panel_html(snapshot(mon, st, history=True)))
    assert "worker-0: running job-8 — step 5/40" in found[0] and "worker-0: running job-8 — step 5/40" in found[1]
    assert "worker-3 rank 1 of a CFG-parallel pair" in found[7] and "worker-3: idle" in found[7]
    assert all("step" not in found[i] for i in range(2, 8))


def test_only_escaped_text_reaches_the_page():
    gpu = FakeGpu('<img src=x onerror="alert(1)">', used_mib=1_000, processes={5: 900})
    evil = worker("worker-0", ("cuda:0",), {"transformer": "cuda:0"}, "busy", "<script>alert(2)</script>", 1, 2,
                  pids=(5,))
    st = ManagerStatus(True, "m", "plus", "<b>mode</b>", "<i>why</i>", 0, (evil,))
    html = panel_html(snapshot(monitor_for(gpu), st))
    assert "<img" not in html and "<script" not in html and "<b>mode" not in html and "<i>why" not in html
    assert "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in html and "&lt;script&gt;alert(2)" in html


def test_without_gpus_one_line_then_each_workers_state():
    mon = GpuMonitor(nvml=FakeNvml([]))
    busy = worker("worker-0", ("cpu",), {"transformer": "cpu"}, "busy", "job-1", 2, 3)
    idle = worker("worker-1", ("cpu",), {"transformer": "cpu"})
    html = panel_html(snapshot(mon, status(busy, idle), history=True))
    assert re.findall(r'<p class="gp-none">(.*?)</p>', html) == ["no GPU is visible: the model runs on the CPU"]
    assert re.findall(r'<p class="gp-worker">(.*?)</p>', html) == ["worker-0 on cpu: busy — job-1 step 2/3",
                                                                   "worker-1 on cpu: idle"]
    assert cards(html) == {} and "<svg" not in html
    assert "batch items" not in html


def test_batch_items_that_wait_in_their_job_are_counted_in_the_panel():
    """Batch items enter the line one at a time: the panel said "waiting: 0" while a batch still had items."""
    data = snapshot(GpuMonitor(nvml=FakeNvml([])), status(worker("worker-0", ("cpu",), {"transformer": "cpu"})))
    html = panel_html({**data, "batch_items": 5})
    assert "waiting: 0; batch items not yet done: 5</small>" in html


def test_history_keeps_one_reading_per_interval_within_the_window():
    history = MemoryHistory(window_s=10, interval_s=2)
    assert history.add(0, 100.0, 1, 2, 3, 80)
    assert not history.add(0, 101.0, 9, 9, 9, 80)  # a second page polling in between
    assert history.add(0, 101.9, 4, 5, 6, 80)  # a tick a little early still counts
    assert history.add(1, 101.9, 7, 7, 7, 80)  # each GPU has its own
    assert history.series(0, 102.0) == [[2.0, 1, 2, 3, 80], [0.1, 4, 5, 6, 80]]
    for t in range(104, 140, 2):
        history.add(0, float(t), t, 0, 0, 80)
    series = history.series(0, 138.0)
    assert [s[0] for s in series] == [10.0, 8.0, 6.0, 4.0, 2.0, 0.0] and series[-1][1] == 138
    assert history.series(0, 200.0) == [] and history.series(5, 138.0) == []


def test_the_monitor_records_what_the_pages_read():
    mon, st = two_gpus_split()
    mon.history = MemoryHistory(window_s=60, interval_s=2)
    for t in (0.0, 0.5, 2.0, 4.0):  # two pages, then one
        snapshot(mon, st, now=t)
    mon._nvml.gpus[0].processes[201] = 31_000
    mon._nvml.gpus[0].used_mib = 32_000
    data = snapshot(mon, st, history=True, now=6.0)
    series = data["gpus"][0]["history"]
    assert [s[0] for s in series] == [6.0, 4.0, 2.0, 0.0]
    assert series[-1][1:] == [19_800, 11_200, 1_000, H200] and series[0][2] == 9_200
    assert "history" not in snapshot(mon, st, now=6.5)["gpus"][0]  # the APIs stay small


def test_the_plot_leaves_a_gap_where_nobody_read_the_gpus():
    mon, st = one_gpu_busy()
    for t in (0.0, 2.0, 4.0, 100.0, 102.0):
        snapshot(mon, st, now=t)
    card = cards(panel_html(snapshot(mon, st, history=True, now=104.0)))[0]
    assert card.count('class="gp-area"') == 6  # two runs of three stacked layers
    assert "5 min ago" in card and "ours at most 59.6 GiB" in card
    fresh, st = one_gpu_busy()
    points = re.findall(r'points="([^"]+)"', cards(panel_html(snapshot(fresh, st, history=True)))[0])
    assert len(points) == 3 and all(len(p.split()) == 4 for p in points)  # one reading, drawn one interval wide
    xs = sorted({float(xy.split(",")[0]) for p in points for xy in p.split()})
    assert xs == [298.0, 300.0]  # at the right edge: now


def test_planned_weights_reach_the_status_and_measured_ones_are_per_gpu(plus_ckpt):
    comps = {"transformer": Placement("cuda:2", ("cuda:2", "cuda:3")), "text_encoder": Placement("cuda:3"),
             "vae": Placement("cuda:2")}
    pair = WorkerPlan("worker-1", {c: Placement("cuda:0") for c in comps}, "cfg", ("cuda:0", "cuda:1"))
    plan = Plan("manual", (pair, WorkerPlan("worker-0", comps)), "made up",
                {"cuda:2": 3 * 1024**3, "cuda:3": 1024**3, "cpu": 5})
    manager = make_manager(plus_ckpt, plan=plan, load=False).prepare()
    assert manager.status().weights_mib == {"cuda:2": 3072.0, "cuda:3": 1024.0}
    handles = {w.name: w for w in manager.workers}
    # rank 1 sees its GPU as 0
    handles["worker-1"]._handle(Ready(1, 11, 1.0, StartupReport(weights_mib={"cuda:0": 500.0})))
    handles["worker-1"]._handle(Ready(0, 10, 1.0, StartupReport(weights_mib={"cuda:0": 400.0})))
    handles["worker-0"]._handle(Ready(0, 12, 1.0, StartupReport(weights_mib={"cuda:0": 2000.0, "cuda:1": 900.0})))
    by_name = {w.name: w for w in manager.status().workers}
    assert by_name["worker-1"].weights_mib == {"cuda:1": 500.0, "cuda:0": 400.0}
    assert by_name["worker-0"].weights_mib == {"cuda:2": 2000.0, "cuda:3": 900.0}


def test_loaded_loras_are_listed_under_the_cards():
    mon, st = one_gpu_busy()
    data = snapshot(mon, st)
    data["loras"] = [{"name": "<fast>", "lightning_steps": 4}, {"name": "style", "lightning_steps": None}]
    assert "LoRAs loaded: &lt;fast&gt; (Lightning 4-step), style</small>" in panel_html(data)


def test_what_a_capped_worker_gives_up_per_job_reaches_the_status_and_the_panel(plus_ckpt):
    """A worker under MAX_MEMORY says what a job may give up there (the VAE decode in tiles, 2.1's prefix cache):
    from its start-up report to /health's worker status and the panel's weights line."""
    comps = {c: Placement("cuda:0") for c in ("transformer", "text_encoder", "vae")}
    plan = Plan("manual", (WorkerPlan("worker-0", comps),), "made up", {"cuda:0": 1024**3})
    manager = make_manager(plus_ckpt, plan=plan, load=False).prepare()
    gives_up = ["VAE decode in tiles for a job whose whole decode would not fit"]
    vae = {"dtype": "bfloat16", "quantization": "none", "location": "GPU 0"}
    report = StartupReport(components={"vae": vae}, under_cap=gives_up, features=["pixels on the GPU", "compile"],
                           phases={"place": 0.0, "load": 1.8, "warm": 74.3})
    manager.workers[0]._handle(Ready(0, 10, 1.0, report))
    worker = manager.status().workers[0]
    assert worker.under_cap == tuple(gives_up) and worker.features == ("pixels on the GPU", "compile")
    assert worker.phases == {"place": 0.0, "load": 1.8, "warm": 74.3}
    mon, _ = one_gpu_busy()
    html = panel_html(snapshot(mon, manager.status()))
    assert "under the memory cap: VAE decode in tiles for a job whose whole decode would not fit" in html
    # the worker's optimisations and its start-up phases (runtime.features, runtime.phases)
    assert "features: pixels on the GPU, compile; start-up: place 0.0 s, load 1.8 s, warm 74.3 s" in html
