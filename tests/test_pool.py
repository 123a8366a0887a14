"""Parts of the worker pool without worker processes: each rank's GPUs as its process sees them, its memory caps,
and closing its pipes once when two threads reap at once (the process transport's, since the supervisor and
its transports were split: the test moved there with the pipes)."""

from __future__ import annotations

from imgedit.config.parsers import GIB
from imgedit.engine.workers.pool import WorkerHandle, localize
from imgedit.engine.workers.processes import ProcessTransport
from imgedit.planning.plan import Placement, WorkerPlan

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
    transport = ProcessTransport(pair.name, None, None)
    handle = WorkerHandle(pair, None, transport, max_restarts=0, max_memory=(10 * GIB, 20 * GIB, 30 * GIB, 40 * GIB))
    assert handle._caps(pair.for_rank(1)) == (40 * GIB,)
    assert WorkerHandle(pair, None, transport, max_restarts=0,
                        max_memory=(22 * GIB,))._caps(pair.for_rank(0)) == (22 * GIB,)


def test_the_cluster_plan_keeps_each_group_on_one_node(monkeypatch):
    from imgedit.config.settings import load_settings
    from imgedit.engine.workers import ray_pool
    from imgedit.planning.plan import ComponentSpec, GpuSpec

    gpus = {"aaa": [GpuSpec(i, "H200", 140 * GIB, 139 * GIB) for i in range(3)],
            "bbb": [GpuSpec(i, "H200", 140 * GIB, 139 * GIB) for i in range(2)]}
    monkeypatch.setattr(ray_pool, "_node_gpus", lambda node: gpus[node.node_id])  # each node's NVML reading
    nodes = [ray_pool.Node("aaa", "10.0.0.1", 16, 3), ray_pool.Node("bbb", "10.0.0.2", 16, 2),
             ray_pool.Node("ccc", "10.0.0.3", 8, 0)]
    specs = [ComponentSpec("transformer", 40 * GIB, (GIB,) * 30), ComponentSpec("text_encoder", 16 * GIB),
             ComponentSpec("vae", GIB // 4)]
    plan, where = ray_pool.plan_cluster(specs, load_settings({"DEVICE_MAP": "cfg-parallel"}), nodes)
    shape = [(w.name, w.parallel, w.rank_devices or w.devices, where[w.name]) for w in plan.workers]
    assert shape == [("node0-worker-0", "cfg", ("cuda:0", "cuda:1"), "aaa"),
                     ("node0-worker-1", "none", ("cuda:2",), "aaa"),  # the odd GPU serves alone, on its node
                     ("node1-worker-0", "cfg", ("cuda:0", "cuda:1"), "bbb")]
    assert "Ray cluster of 3 node(s)" in plan.reason and "no GPU, no worker" in plan.reason  # e.g. the server's
    cpu_only = [ray_pool.Node(n, "10.0.0.9", 1, 0) for n in ("aaa", "bbb")]
    plan, where = ray_pool.plan_cluster(specs, load_settings({}), cpu_only)  # the CPU tests' cluster
    assert [(w.name, w.devices, where[w.name]) for w in plan.workers] == [
        ("node0-worker-0", ("cpu",), "aaa"), ("node1-worker-0", ("cpu",), "bbb")]


def test_workers_are_numbered_by_the_gpus_this_process_sees(monkeypatch):
    """GPU discovery (NVML) reads this process's CUDA_VISIBLE_DEVICES; settings given as a mapping without it must
    still number the workers' GPUs from it (a benchmark passing a dict once put its worker on the host's GPU 0
    while its process had been given GPU 1)."""
    from imgedit.config.settings import load_settings

    ckpt = "/models/qwen-image-edit"  # read as a path; nothing is loaded
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    settings = load_settings({"QWEN_MODEL_DIR": ckpt, "DEVICE_MAP": "cuda:0"})
    assert settings.cuda_visible_devices == "1"
    one = WorkerPlan("worker-0", {c: Placement("cuda:0") for c in COMPONENTS})
    assert localize(one, settings.cuda_visible_devices)[1] == "1"  # the worker's CUDA_VISIBLE_DEVICES
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert load_settings({"QWEN_MODEL_DIR": ckpt, "CUDA_VISIBLE_DEVICES": "1"}).cuda_visible_devices is None


def test_stop_and_the_pump_may_reap_at_once():
    """A failed load makes the pump thread reap while the manager's stop() reaps too (seen in CI as the pump's
    'OSError: Bad file descriptor'): the pipes are closed once, whoever comes second finds them closed."""
    import multiprocessing
    import threading

    from imgedit.runtime.messages import Channel

    plan = WorkerPlan("worker-0", {c: Placement("cpu") for c in COMPONENTS})
    errors = []

    def reap(transport, start):
        start.wait()
        try:
            transport.reap(0)
        except Exception as exc:  # noqa: BLE001 - what the test looks for
            errors.append(exc)

    for _ in range(300):
        transport = ProcessTransport(plan.name, None, None)
        pipes = [multiprocessing.Pipe(duplex=False) for _ in range(8)]
        transport._inboxes = [Channel(write) for _, write in pipes]
        transport._outboxes = [read for read, _ in pipes]
        start = threading.Barrier(2)
        threads = [threading.Thread(target=reap, args=(transport, start)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors[:3]


def test_every_start_up_field_a_rank_writes_is_a_field_of_its_report():
    """The start-up report is typed (runtime.messages.StartupReport, slots): a field written under a name it lacks
    fails where it is written. Some are written only on GPUs (the memory after loading, the rewrite's warm-up),
    which this machine never runs: every `report.<name> = ...` and `StartupReport(<name>=...)` in the runtime is
    read here and checked against the fields."""
    import ast
    from dataclasses import fields

    from conftest import ROOT

    from imgedit.runtime.messages import StartupReport

    known = {f.name for f in fields(StartupReport)}
    written = set()
    for path in (ROOT / "imgedit" / "runtime").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            # `report.x` and `build.report.x` (runtime.phases and runtime.features write the build's report)
            owner = node.value if isinstance(node, ast.Attribute) else None
            if (isinstance(owner, ast.Name) and owner.id == "report"
                    or isinstance(owner, ast.Attribute) and owner.attr == "report"):
                written.add((path.name, node.attr))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "StartupReport":
                written |= {(path.name, k.arg) for k in node.keywords}
    assert {name for _, name in written} >= {"memory_allocated_gib", "rewrite_warmup_seconds", "compiled"}
    assert [w for w in written if w[1] not in known] == []
