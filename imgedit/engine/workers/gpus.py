"""Live per-GPU readings for the panel, /gpu_status and /health: what each GPU holds and does.

NVML (nvidia-ml-py) sees every process's memory, as nvidia-smi does, and needs no CUDA context: the
server process reads GPUs only through it, so the GPUs hold only the worker processes' memory.
CUDA indices are mapped to NVML handles through CUDA_VISIBLE_DEVICES (indices or UUIDs).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field

import pynvml

from imgedit.planning.plan import GpuSpec
from imgedit.protocol import ManagerStatus, WorkerState

log = logging.getLogger(__name__)
MIB = 1024**2
NO_GPU = "no GPU is visible: the model runs on the CPU"


@dataclass
class GpuReading:
    index: int
    name: str
    uuid: str
    used_mib: float
    total_mib: float
    utilization_percent: float | None
    workers_mib: float  # held by our worker processes (NVML per-process reading)
    holds: list[str] = field(default_factory=list)
    running: list[str] = field(default_factory=list)
    # The memory bar: used = weights + activations + other; weights + activations + other + free = total.
    # our weights on this GPU (what the workers measured after loading, else planned)
    weights_mib: float = 0.0
    # the rest of our processes' memory: activations, allocator cache, CUDA context
    activations_mib: float = 0.0
    other_mib: float = 0.0  # other processes (and the driver)
    free_mib: float = 0.0
    weights_source: str | None = None  # measured | planned | None (nothing of ours is planned here)


def _nvml():
    pynvml.nvmlInit()
    return pynvml


def visible_handles(nvml) -> dict[int, object]:
    """NVML handles of the GPUs this process may use, keyed by CUDA index (CUDA_VISIBLE_DEVICES
    applies: indices or UUIDs, in its order). Needs no CUDA context, unlike torch.cuda queries."""
    count = nvml.nvmlDeviceGetCount()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return {i: nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)}
    handles: dict[int, object] = {}
    for part in visible.split(","):
        part = part.strip()
        if not part:
            break
        try:
            uuid = part if part.startswith(("GPU-", "MIG-")) else "GPU-" + part
            handle = (nvml.nvmlDeviceGetHandleByIndex(int(part)) if part.isdigit()
                      else nvml.nvmlDeviceGetHandleByUUID(uuid))
        except Exception:  # CUDA stops at the first invalid entry; so do we
            break
        handles[len(handles)] = handle
    return handles


def host_threads() -> tuple[int, str | None]:
    """The CPUs this process may run on (its affinity, and a container's CPU quota where it has one), and
    OMP_NUM_THREADS as set (planning.modes.worker_threads)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:  # cgroup v2: "max 100000" = no quota
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = max(1, min(cpus, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cpus, os.environ.get("OMP_NUM_THREADS")


def discover_gpus() -> list[GpuSpec]:
    """Visible GPUs with their free memory now, read through NVML (the server never touches CUDA)."""
    try:
        nvml = _nvml()
        handles = visible_handles(nvml)
    except Exception as exc:  # no driver or no NVML: no GPU
        log.info("no GPU found through NVML (%s)", type(exc).__name__)
        return []
    gpus = []
    for index, handle in handles.items():
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        gpus.append(GpuSpec(index, _text(nvml.nvmlDeviceGetName(handle)), int(memory.total), int(memory.free),
                            _capability(nvml, handle)))
    return gpus


def _capability(nvml, handle) -> tuple[int, int] | None:
    """CUDA compute capability through NVML (QUANTIZE=fp8 needs 8.9+); None when the driver cannot say."""
    try:
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
        return (int(major), int(minor))
    except Exception:
        return None


class MemoryHistory:
    """A short ring buffer of memory readings per GPU for the panel's plot: at most one sample per
    `interval_s` (however many pages poll), none older than `window_s`. Pure: the caller gives the time."""

    def __init__(self, window_s: float = 300.0, interval_s: float = 2.0):
        self.window_s, self.interval_s = window_s, interval_s
        # Pages tick every interval_s, with jitter: a sample ~10 % early still counts.
        self._min_gap = 0.9 * interval_s
        self._samples: dict[int, collections.deque] = {}
        self._lock = threading.Lock()

    def add(self, index: int, now: float, weights: float, activations: float, other: float,
            total: float) -> bool:
        """Record a reading (MiB) of GPU `index` taken at `now` (seconds); False when one was taken less
        than an interval ago."""
        with self._lock:
            size = int(self.window_s / self.interval_s) + 2
            samples = self._samples.setdefault(index, collections.deque(maxlen=size))
            if samples and now - samples[-1][0] < self._min_gap:
                return False
            samples.append((now, weights, activations, other, total))
            while samples and now - samples[0][0] > self.window_s:
                samples.popleft()
            return True

    def series(self, index: int, now: float) -> list[list[float]]:
        """[seconds ago, weights, activations, other, total] per sample within the window, oldest first."""
        with self._lock:
            samples = list(self._samples.get(index, ()))
        return [[round(now - t, 1), w, a, o, total] for t, w, a, o, total in samples
                if now - t <= self.window_s]


class GpuMonitor:
    """Reads NVML; one instance per process (NVML is initialised once). `nvml` replaces the pynvml
    module (tests hand in made-up GPUs); `history` keeps the readings the panel plots."""

    def __init__(self, nvml=None, history: MemoryHistory | None = None):
        self._lock = threading.Lock()
        self._handles: dict[int, object] | None = None
        self._nvml = nvml
        self.history = history or MemoryHistory()
        self.problem: str | None = None

    def _init(self) -> dict[int, object]:
        if self._handles is not None:
            return self._handles
        self._handles = {}
        try:
            if self._nvml is None:
                self._nvml = _nvml()
            self._handles = visible_handles(self._nvml)
            if not self._handles:
                self.problem = NO_GPU
        except Exception as exc:  # NVML missing or no driver: the panel says so instead of failing
            log.info("GPU readings unavailable: %s", exc)
            self.problem = NO_GPU
        return self._handles

    def read(self, status: ManagerStatus | None = None, now: float | None = None) -> list[GpuReading]:
        """One reading per visible GPU; with `status`, what each holds and runs and its memory split
        into weights / activations / other / free, also recorded in `history`."""
        pids = {pid for w in status.workers for pid in w.pids} if status is not None else set()
        with self._lock:
            handles = self._init()
            if not handles:
                return []
            nvml = self._nvml
            readings = []
            for index, handle in handles.items():
                try:
                    memory = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
                except Exception:
                    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                try:
                    util = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
                except Exception:
                    util = None
                readings.append(GpuReading(
                    index=index, name=_text(nvml.nvmlDeviceGetName(handle)),
                    uuid=_text(nvml.nvmlDeviceGetUUID(handle)), used_mib=round(memory.used / MIB, 1),
                    total_mib=round(memory.total / MIB, 1), utilization_percent=util,
                    workers_mib=round(_process_memory(nvml, handle, pids) / MIB, 1)))
        if status is not None:
            _annotate(readings, status)
            now = time.monotonic() if now is None else now
            for r in readings:
                self.history.add(r.index, now, r.weights_mib, r.activations_mib, r.other_mib, r.total_mib)
        return readings


def _process_memory(nvml, handle, pids: set[int]) -> int:
    """Bytes our worker processes hold on this GPU (NVML sees every process)."""
    if not pids:
        return 0
    try:
        procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception:
        return 0
    return sum(int(p.usedGpuMemory or 0) for p in procs if p.pid in pids)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _annotate(readings: list[GpuReading], status: ManagerStatus) -> None:
    by_device = {f"cuda:{r.index}": r for r in readings}
    for worker in status.workers:
        compiled = ", compiled" if worker.compiled else ""
        if worker.parallel != "none":  # every rank holds the whole pipeline on its GPU
            size = len(worker.devices)
            group = ("a CFG-parallel pair" if worker.parallel == "cfg" and size == 2 else
                     f"a {'CFG-parallel' if worker.parallel == 'cfg' else 'Ulysses'} group of {size}")
            for rank, device in enumerate(worker.devices):
                if device in by_device:
                    by_device[device].holds.append(
                        f"{worker.name} rank {rank} of {group}: the whole pipeline{compiled}")
        else:
            for component, where in worker.placement.items():
                extra = compiled if component == "transformer" else ""
                for device in worker.devices:
                    if device not in by_device:
                        continue
                    if where == device:
                        by_device[device].holds.append(f"{worker.name}: {component}{extra}")
                    elif any(part.endswith(f" -> {device}") for part in where.split(", ")):
                        label = f"{component} ({_blocks_on(where, device)}){extra}"
                        by_device[device].holds.append(f"{worker.name}: {label}")
        if worker.state is WorkerState.BUSY and worker.job_id:
            for device in worker.devices:
                if device in by_device:
                    by_device[device].running.append(
                        f"{worker.name}: {worker.job_id} {worker.progress.text()}")
    _split_memory(by_device, status)


def _split_memory(by_device: dict[str, GpuReading], status: ManagerStatus) -> None:
    """Split each GPU's memory into our weights, our activations, other processes and free.

    Weights: what the workers measured right after loading (torch's allocated bytes per GPU), else
    what the plan put there. Activations: the rest of our processes' NVML memory (never negative).
    Where NVML lists none of our processes although a loaded worker uses the GPU (a container with
    its own PID namespace), the weights are still counted as ours rather than as another process's.
    """
    measured: dict[str, float] = {}
    for worker in status.workers:
        for device, mib in worker.weights_mib.items():
            measured[device] = measured.get(device, 0.0) + mib
    loaded = {d for w in status.workers if w.state.serving for d in w.devices}
    for device, r in by_device.items():
        if device in measured:
            weights, r.weights_source = measured[device], "measured"
        elif device in status.weights_mib:
            weights, r.weights_source = status.weights_mib[device], "planned"
        else:
            weights = 0.0
        used = max(0.0, min(r.used_mib, r.total_mib))
        ours = r.workers_mib if r.workers_mib > 0 or device not in loaded else weights
        ours = min(ours, used)
        r.weights_mib = round(min(weights, ours), 1)
        r.activations_mib = round(ours - r.weights_mib, 1)
        r.other_mib = round(used - ours, 1)
        r.free_mib = round(max(0.0, r.total_mib - used), 1)


def _blocks_on(describe: str, device: str) -> str:
    return ", ".join(part.split(" -> ")[0] for part in describe.split(", ") if part.endswith(f" -> {device}"))


def snapshot(monitor: GpuMonitor, status: ManagerStatus, history: bool = False,
             now: float | None = None) -> dict:
    """The panel's data as JSON-able dict (the /gpu_status API and /health use it). `history` adds
    each GPU's recent memory readings (the panel's plot; left out of the APIs to keep them small)."""
    now = time.monotonic() if now is None else now
    readings = monitor.read(status, now)
    gpus = [asdict(r) for r in readings]
    if history:
        for g in gpus:
            g["history"] = monitor.history.series(g["index"], now)
    return {
        "gpus": gpus,
        "message": None if readings else (monitor.problem or NO_GPU),
        "placement_mode": status.mode,
        "placement_reason": status.reason,
        "workers": [asdict(w) for w in status.workers],
        "waiting": status.waiting,
        "ready": status.ready,
        "loras": list(status.loras),
        "cache": status.cache,
        "attention": status.attention,
        "compile_mode": status.compile_mode,
        "fast_quantize": status.fast_quantize,
        "defaults": dict(status.defaults),
        "history_window_s": monitor.history.window_s,
        "history_interval_s": monitor.history.interval_s,
    }
