"""Shared fixtures: the tiny checkpoints, managers built on them, and a live server on a free port.

Nothing here mocks the pipeline: the tiny checkpoint is a real (2-layer, random-weight) Qwen
image-edit model, loaded through our own settings, planner and loader.
"""

from __future__ import annotations

import multiprocessing.util
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
from http.cookiejar import CookieJar, DefaultCookiePolicy
from pathlib import Path

import pytest

# Two test processes (xdist) on a 2-core machine, each with worker processes of its own: one compute
# thread per process. Measured on this machine: two processes of two threads each edit 2.5x slower
# than one alone (OpenMP threads spin while they wait for a core); with one thread each, 2x.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# One temporary folder for the whole run, its children (xdist workers, servers, worker processes, Ray,
# Chromium) included, removed when the run ends. Before it, every run left thousands of entries in /tmp:
# the tests' OUTPUT_DIRs and probes, and an empty folder per file gradio_client downloads (2.7.2's
# _download_file makes tempfile.gettempdir()/<token_hex(20)>/, moves the file out and keeps the folder);
# a machine's disk filled, and CI failed with "No space left on device".
_OWN_TMP = "IMGEDIT_TEST_TMP" not in os.environ
if _OWN_TMP:
    os.environ["IMGEDIT_TEST_TMP"] = tempfile.mkdtemp(prefix="imgedit-tests-")
os.environ["TMPDIR"] = tempfile.tempdir = os.environ["IMGEDIT_TEST_TMP"]
# A home of its own in there: servers and settings a test makes with the defaults wrote under ~/.cache/imgedit
# (the History of every run, the sizes of every checkpoint a test built: 1,200 files after a few days' runs),
# and Chromium under ~/.config.
os.environ["HOME"] = os.path.join(os.environ["TMPDIR"], "home")
os.makedirs(os.environ["HOME"], exist_ok=True)
# One Gradio cache per test process: a stopping server deletes the cached copies it handed out (Gradio's
# delete_cache), and the same file (an example image) has the same cached path in every server, so a
# server of another test process stopping took the file from under a browser test (seen in CI).
os.environ["GRADIO_TEMP_DIR"] = tempfile.mkdtemp(prefix=f"gradio-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-")
# glibc's malloc hands every block over 32 MB (a 1-megapixel activation of the tiny VAE is ~100 MB) back
# to the kernel when it is freed, and the next one costs a page fault per 4 KB: measured on this
# machine, three 1 MP VAE encodes and a decode took 18.5 s, 7.2 s of them in the kernel; from the heap
# (no mmap, no trim below 256 MB) 12.6 s, 0.4 s in the kernel, for ~0.6 GB more resident per process.
# Children (worker processes, servers, Ray) read these at start; this process sets them after its imports.
# A server (app.py) then sets its own (imgedit.engine.heap.map_large_blocks: freed pixels go back).
os.environ.setdefault("MALLOC_MMAP_MAX_", "0")
os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(256 << 20))
# Ray's own out-of-memory monitor kills actors once the machine is 95 % full. The Ray tests run last,
# beside two test processes that still hold their session's worker pools (each process keeps up to 256 MB
# of freed heap, above), and a full local run lost both actors to it while they loaded ("22.44GB used / 23.54GB").
# The kernel's OOM killer still guards the machine; the tests' Ray clusters (children) start without Ray's.
os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
# Every gr.Blocks built with Gradio's analytics on starts a thread that asks pypi for Gradio's latest version
# (an HTTPS call from a fresh client); the tests build dozens of apps.
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import httpx  # noqa: E402
import torch  # noqa: E402  (after OMP_NUM_THREADS, which torch reads at import)
from PIL import Image  # noqa: E402

from imgedit.config.settings import load_settings  # noqa: E402
from imgedit.engine.manager import PipelineManager  # noqa: E402
from imgedit.model.demo_checkpoint import build_checkpoint  # noqa: E402
from imgedit.planning.plan import Placement, Plan, WorkerPlan  # noqa: E402


def _malloc_from_the_heap() -> None:
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt(-4, int(os.environ["MALLOC_MMAP_MAX_"]))  # M_MMAP_MAX
        libc.mallopt(-1, int(os.environ["MALLOC_TRIM_THRESHOLD_"]))  # M_TRIM_THRESHOLD
    except (OSError, AttributeError, ValueError):  # not glibc: its defaults
        pass


_malloc_from_the_heap()
torch.set_num_threads(int(os.environ['OMP_NUM_THREADS']))
ROOT = Path(__file__).resolve().parents[1]
# The tests' HTTP calls share one client per test process. Each httpx.get() builds a client of its own,
# and with it an SSL context that loads the CA bundle: 32 ms of CPU a call on this machine, even for an
# http:// URL, against 0.25 ms through a client. A py-spy profile of a full run found 39 % of the test
# processes' busy samples there, mostly in polls (wait_for asks 20 times a second while a server starts).
# No keep-alive: a test may kill a server between two calls, and a pooled connection to it would fail the
# next call. No cookie jar either: like httpx.get(), no call carries a cookie another call was given.
http = httpx.Client(timeout=5.0, limits=httpx.Limits(max_keepalive_connections=0),
                    cookies=CookieJar(DefaultCookiePolicy(allowed_domains=[])))


def _one_ssl_context_per_setting():
    """gradio_client opens a new httpx client for every upload, prediction, cancel and download, and each
    builds an SSL context that loads the CA bundle: 30 ms of CPU on this machine, for http:// URLs too. In
    the test processes one context per (verify, cert, trust_env) serves them all (a context is shareable)."""
    import functools

    import httpx._transports.default as transports

    original = transports.create_ssl_context
    build = functools.lru_cache(maxsize=8)(original)

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if isinstance(verify, (bool, str)) and cert is None:
            return build(verify=verify, cert=None, trust_env=trust_env)
        return original(verify=verify, cert=cert, trust_env=trust_env)

    transports.create_ssl_context = create_ssl_context


_one_ssl_context_per_setting()
sys.path.insert(0, str(ROOT / "tests"))  # worker processes import tests/faults.py as "faults"
ARTIFACTS = ROOT / "artifacts"
COMPONENTS = ("transformer", "text_encoder", "vae")


# pytest-xdist (`-n 2 --dist loadgroup`, pyproject's addopts) runs whole modules on one worker each,
# so a module's shared server and worker pool start once; the two Ray modules share one group, so one
# Ray cluster at a time exists on this machine. xdist's own reorder (most tests first) is off in
# pyproject.toml (--no-loadscope-reorder); the order is this one:
# - the longest groups first, by their seconds in a full run on the loaded 2-core machine (ray ~360 with
#   its two modules, test_loras ~170, test_shutdown ~160, test_browser ~155, ... test_settings ~25); then
#   the rest, a few seconds each, in file order. Longest first, the run ends on short groups: the groups
#   left out of this list once included test_warmup and test_servers (~110 s each), which then started
#   last, 13-14 minutes into a 16-minute run, and ran on after the other test processes were done;
# - the Ray group fourth, taken by the first test process to finish its first group. First, beside two
#   test processes building their pools, a fresh-clone CI run waited over 90 s for a killed actor to
#   come back (the restart imports torch afresh; test_ray now waits up to 240 s). Last, it ran ~110 s
#   mostly alone with a core idle.
# Two test processes on the 2-core machine, not three (2026-11-30, 806 tests): 10:26-10:45 against 11:04 with
# three; the tests' own seconds summed 1,214 against 1,905 (three processes and their servers' workers contended
# for the two cores), and this order splits them 605 / 609 s between the two.
XDIST_GROUPS = {"test_ray": "ray", "test_ray_local": "ray"}
ORDER = ("test_loras", "test_shutdown", "test_browser", "ray", "test_workers", "test_warmup", "test_manager",
         "test_security", "test_memory", "test_fallbacks", "test_fast_weights", "test_jobs_api", "test_pause",
         "test_qwen21", "test_line", "test_servers", "test_standby", "test_parallel_groups", "test_split21",
         "test_quant", "test_fusion", "test_enhance", "test_split_compile", "test_ui", "test_step_cache", "test_readme",
         "test_adversarial", "test_rest", "test_history", "test_batch_cfg", "test_architecture",
         "test_browser_batch", "test_masks", "test_connections", "test_encode_cache", "test_deploy",
         "test_browser_panel", "test_settings")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(config, items):
    def group(item) -> str:
        return XDIST_GROUPS.get(item.path.stem, item.path.stem)

    for item in items:
        item.add_marker(pytest.mark.xdist_group(group(item)))
    def rank(item) -> int:
        name = group(item)
        return ORDER.index(name) if name in ORDER else len(ORDER)

    items.sort(key=rank)  # stable: each module keeps its own order
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


@pytest.fixture(scope="session")
def ckpt21(tmp_path_factory) -> Path:
    """The tiny Qwen-Image-2.1 checkpoint (read only: each module makes its own managers of it)."""
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "q21", kind="21", seed=0)


def cpu_plan(workers: int) -> Plan:
    return Plan("replicas", tuple(WorkerPlan(f"worker-{i}", {c: Placement("cpu") for c in COMPONENTS})
                                  for i in range(workers)), f"{workers} CPU worker(s) for tests")


def cfg_plan(pairs: int = 1) -> Plan:
    """CFG-parallel pairs on the CPU (two processes each, over gloo)."""
    return Plan("cfg-parallel", tuple(WorkerPlan(f"worker-{i}", {c: Placement("cpu") for c in COMPONENTS}, "cfg",
                                                 ("cpu", "cpu")) for i in range(pairs)), "CPU pairs for tests")


def group_plan(parallel: str, ranks: int, ulysses: int) -> Plan:
    """One parallel group of `ranks` CPU processes (gloo), `ulysses` of them splitting each forward's sequence."""
    worker = WorkerPlan("worker-0", {c: Placement("cpu") for c in COMPONENTS}, parallel, ("cpu",) * ranks, ulysses)
    return Plan(parallel, (worker,), f"a CPU {parallel} group of {ranks} for tests")


_MANAGERS: list[PipelineManager] = []
_SESSION_MANAGERS: list[PipelineManager] = []


def make_manager(ckpt: Path, workers: int = 1, plan: Plan | str | None = None, load: bool = True,
                 **env) -> PipelineManager:
    """A real manager with real worker processes on the tiny checkpoint; faults.install runs in every
    worker (prompts with markers inject faults). Closed at the end of the test module that made it
    (the session fixtures' at the end of the session), so worker processes do not pile up."""
    env.setdefault("OUTPUT_DIR", tempfile.mkdtemp(prefix="imgedit-outputs-"))  # history: never ~/.cache
    if not torch.cuda.is_available():  # CPU runs: workers forked from one process that imported torch (fast)
        env.setdefault("WORKER_START", "forkserver")
    settings = load_settings({"QWEN_MODEL_DIR": str(ckpt), "DEVICE_MAP": "cpu", **env})
    plan = None if plan == "planner" else plan or cpu_plan(workers)  # "planner": plan from the settings
    manager = PipelineManager(settings, plan=plan, worker_hook="faults:install")
    _MANAGERS.append(manager)
    return manager.load() if load else manager


def session_manager(ckpt: Path, **kw) -> PipelineManager:
    manager = make_manager(ckpt, **kw)
    _SESSION_MANAGERS.append(manager)
    return manager


@pytest.fixture(scope="module", autouse=True)
def _close_module_managers():
    """Set up before (so torn down after) the module's own fixtures: their servers are stopped by then."""
    yield
    for manager in [m for m in _MANAGERS if m not in _SESSION_MANAGERS]:
        manager.close()
        _MANAGERS.remove(manager)


@pytest.fixture(scope="session", autouse=True)
def _close_managers():
    yield
    for manager in _MANAGERS:
        manager.close()


@pytest.fixture(scope="session")
def plus_manager(plus_ckpt) -> PipelineManager:
    return session_manager(plus_ckpt)


@pytest.fixture(scope="session")
def edit_manager(edit_ckpt) -> PipelineManager:
    return session_manager(edit_ckpt)


class LocalPipeline:
    """A pipeline loaded in the test process through our loader (for component-level checks such as
    the encoding fix; jobs always run in worker processes). Like a worker's (ENCODE_CACHE's default), it
    keeps its last input encodings: a repeated input is not encoded at 1 MP again (exact; `memo=0`: none)."""

    def __init__(self, ckpt: Path, memo: int = 8):
        from imgedit.model.encoding import prepare_text_encoder
        from imgedit.runtime import encode_cache, loader, single_frame

        plan = WorkerPlan("local", {c: Placement("cpu") for c in COMPONENTS})
        self.pipe = loader.load_pipeline(loader.open_checkpoint(str(ckpt)), plan, torch.float32)
        single_frame.install(self.pipe.vae)  # the worker's load-phase features: runtime.features
        self.encoding_fix = prepare_text_encoder(self.pipe.text_encoder)  # as the worker does
        self.memo = encode_cache.install(self.pipe, memo)


@pytest.fixture(scope="session")
def plus_pipe(plus_ckpt) -> LocalPipeline:
    return LocalPipeline(plus_ckpt)


@pytest.fixture(scope="session")
def edit_pipe(edit_ckpt) -> LocalPipeline:
    return LocalPipeline(edit_ckpt)


def picture(w: int = 80, h: int = 60, color=(30, 120, 200)) -> Image.Image:
    image = Image.new("RGB", (w, h), color)
    for x in range(0, w, 8):
        for y in range(h):
            image.putpixel((x, y), (255, 255, 0))
    return image


# One probe file per test process: each xdist worker its own; its children (worker processes, scripts
# importing conftest) inherit the name.
_TEST_PROCESS = os.environ.get("PYTEST_XDIST_WORKER", "main")
if f"-{_TEST_PROCESS}-" not in os.environ.get("IMGEDIT_TEST_PROBE", ""):
    os.environ["IMGEDIT_TEST_PROBE"] = tempfile.mktemp(prefix=f"imgedit-probe-{_TEST_PROCESS}-")
PROBE_FILE = Path(os.environ["IMGEDIT_TEST_PROBE"])


class Blocks(torch.nn.Module):
    """Layers outside a block list and three blocks (a transformer's shape, for offload.stream())."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 8)
        self.modulation = torch.nn.Sequential(torch.nn.SiLU(), torch.nn.Linear(8, 8))  # as 2.1's: not a block list
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 16) if i == 0 else torch.nn.Linear(16, 16)
                                          for i in range(3))
        self.out = torch.nn.Linear(16, 8)

    def forward(self, x):
        x = self.embed(x) + self.modulation(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class ConcurrencyProbe:
    """Counts forwards in flight per worker over its pipeline's main modules (text encoder,
    transformer, VAE encoder and decoder), as the worker processes log them (tests/faults.py), and
    remembers the most seen at once. One pipeline call runs them one after another, so more than
    one at a time on a worker means two jobs overlapped there."""

    def __init__(self, manager: PipelineManager):
        self.manager = manager
        self.start = PROBE_FILE.stat().st_size if PROBE_FILE.exists() else 0
        self.max_active: dict[str, int] = {}
        self.forwards: dict[str, int] = {}  # module -> forwards seen (all workers)

    def close(self) -> None:
        owner = {pid: w.name for w in self.manager.status().workers for pid in w.pids}
        active: dict[str, int] = {}
        self.max_active = {w.name: 0 for w in self.manager.status().workers}
        with PROBE_FILE.open() as f:
            f.seek(self.start)
            for line in f:
                pid, what, _module = line.split()
                name = owner.get(int(pid))
                if what == "enter":
                    self.forwards[_module] = self.forwards.get(_module, 0) + 1
                if name is None:
                    continue
                active[name] = active.get(name, 0) + (1 if what == "enter" else -1)
                self.max_active[name] = max(self.max_active[name], active[name])


def decoder_outputs() -> tuple[torch.Tensor, torch.Tensor]:
    """runtime.pixels' test values, shaped as decoded pictures (1, 3, h, 16): every finite bfloat16, and float32
    at each byte's rounding tie ((k + 0.5) / 255 once denormalized), the floats beside each, and a spread."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    k = torch.arange(256, dtype=torch.float64)
    ties = (((k + 0.5) / 255 - 0.5) / 0.5).float()
    floats = torch.cat([ties, torch.nextafter(ties, torch.tensor(2.0)), torch.nextafter(ties, torch.tensor(-2.0)),
                        torch.linspace(-1.2, 1.2, 4096)])
    return tuple(v[: v.numel() // 48 * 48].reshape(1, 3, -1, 16) for v in (bits[torch.isfinite(bits)], floats))


def wait_for(condition, timeout: float, what: str = "timed out") -> None:
    """Poll `condition` until it holds, failing with `what` after `timeout` seconds."""
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, what
        time.sleep(0.05)


def alive(pid: int) -> bool:
    """The process runs (an exited child waiting to be reaped, a zombie, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def processes() -> list[tuple[int, str, int, int]]:
    """Every process now, as (pid, state, parent pid, process group), read from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # it ended meanwhile
            continue
        found.append((int(stat.parent.name), fields[0], int(fields[1]), int(fields[2])))
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """The real app (REST + Gradio) under uvicorn in a thread, on a free loopback port."""

    def __init__(self, app, port: int, **options):
        import uvicorn

        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **options))
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
    from imgedit.web.app import build_app
    from imgedit.web.connections import uvicorn_options

    return LiveServer(build_app(manager.settings, manager), free_port(), **uvicorn_options(manager.settings))


@pytest.fixture(scope="session")
def server_manager(plus_ckpt) -> PipelineManager:
    """Two CPU workers, so concurrency and the shared line are exercised."""
    # CLIENT_SHARE=1: tests here fill the line from one client on purpose (the share is tested in
    # test_manager.py and test_jobs_api.py).
    return session_manager(plus_ckpt, workers=2, QUEUE_MAX_SIZE="4", CLIENT_SHARE="1")


@pytest.fixture(scope="session")
def live_server(server_manager):
    with start_server(server_manager) as server:
        yield server


@pytest.fixture(scope="session")
def image_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("img") / "input.png"
    picture().save(path)
    return path


@pytest.fixture(scope="module")
def browser():
    """Debian's Chromium through Playwright, one per test module (the browser tests)."""
    playwright = pytest.importorskip("playwright.sync_api")
    if not shutil.which("chromium"):
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update"])
        yield browser
        browser.close()


def open_app(page, url: str | None = None, timeout: float = 60_000) -> None:
    """Load the app in `page` (`url`) or reload it (no `url`), and wait until Gradio has drawn it and its
    load event has filled the GPU panel. Not Playwright's "networkidle" (500 ms without a request): the
    panel's 2 s refresh keeps the network busy, and on the loaded 2-core machine two full runs timed out
    waiting for such a gap."""
    if url is None:
        page.reload(wait_until="load", timeout=timeout)
    else:
        page.goto(url, wait_until="load", timeout=timeout)
    page.locator("#edit-button").wait_for(state="visible", timeout=timeout)
    page.wait_for_function("() => document.querySelector('#gpu-panel')?.innerText.trim().length > 0",
                           timeout=timeout)


def pytest_unconfigure(config):
    shutil.rmtree(os.environ["GRADIO_TEMP_DIR"], ignore_errors=True)
    if _OWN_TMP:  # the process that made the run's folder (pytest itself, or xdist's controller)
        # At exit, after multiprocessing's removal of its own pymp- folder in there (exit priority -100),
        # which prints a traceback when the folder is already gone.
        multiprocessing.util.Finalize(None, shutil.rmtree, args=(os.environ["IMGEDIT_TEST_TMP"], True),
                                      exitpriority=-200)


def ray_report() -> str:
    """What Ray says when workers do not come up in time (a CI run once waited 300 s for them, silent):
    its actors and placement groups, then the warnings and errors in the newest session's logs."""
    import ray
    from ray._private import state

    lines = []
    if ray.is_initialized():
        lines += [f"actor {a.get('ActorID', '?')[:8]} {a.get('State')} {a.get('DeathCause') or ''}"[:300]
                  for a in state.actors().values()]
        lines += [f"placement group {g['name']} {g['state']}" for g in ray.util.placement_group_table().values()]
    logs = Path(tempfile.gettempdir(), "ray", "session_latest", "logs")  # Ray follows TMPDIR
    for path in sorted(logs.glob("*")) if logs.is_dir() else ():
        if path.suffix not in (".out", ".err", ".log") or not path.is_file():
            continue
        text = path.read_text(errors="replace").splitlines()
        bad = [line for line in text if re.match(r"\[\S+ \S+ [WEF] ", line) or "Error" in line or "Traceback" in line]
        if bad:
            lines += [f"--- {path.name}"] + [line[:300] for line in bad[-8:]]
    return "\n".join(lines[-120:]) or "Ray reported nothing"


def wait_job(url: str, job_id: str, timeout: float = 240, headers: dict | None = None) -> dict:
    """GET /v1/jobs/<id> until the job has ended (a deadline, not a sleep): its last view."""
    deadline = time.monotonic() + timeout
    while (view := http.get(f"{url}/v1/jobs/{job_id}", headers=headers, timeout=30).json())["state"] in (
            "queued", "running", "cancelling"):
        assert time.monotonic() < deadline, view
        time.sleep(0.3)
    return view
