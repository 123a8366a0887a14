"""Live per-GPU readings for the panel, /gpu_status and /health: what each GPU holds and does.

NVML (nvidia-ml-py) sees every process's memory, as nvidia-smi does, and needs no CUDA context: the
server process reads GPUs only through it, so the GPUs hold only the worker processes' memory.
CUDA indices are mapped to NVML handles through CUDA_VISIBLE_DEVICES (indices or UUIDs).
"""

from __future__ import annotations

import html
import logging
import os
import threading
from dataclasses import asdict, dataclass, field

from imgedit.jobs import ManagerStatus
from imgedit.placement import GpuSpec
from imgedit.quantize import summary as components_line

log = logging.getLogger(__name__)
MIB = 1024**2


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


def _nvml():
    import pynvml

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
            handle = (nvml.nvmlDeviceGetHandleByIndex(int(part)) if part.isdigit()
                      else nvml.nvmlDeviceGetHandleByUUID(part if part.startswith(("GPU-", "MIG-")) else "GPU-" + part))
        except Exception:  # CUDA stops at the first invalid entry; so do we
            break
        handles[len(handles)] = handle
    return handles


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


class GpuMonitor:
    """Reads NVML; one instance per process (NVML is initialised once)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._handles: dict[int, object] | None = None
        self._nvml = None
        self.problem: str | None = None

    def _init(self) -> dict[int, object]:
        if self._handles is not None:
            return self._handles
        self._handles = {}
        try:
            self._nvml = _nvml()
            self._handles = visible_handles(self._nvml)
            if not self._handles:
                self.problem = "no GPU is visible: the model runs on the CPU"
        except Exception as exc:  # NVML missing or no driver: the panel says so instead of failing
            log.info("GPU readings unavailable: %s", exc)
            self.problem = "no GPU is visible: the model runs on the CPU"
        return self._handles

    def read(self, status: ManagerStatus | None = None) -> list[GpuReading]:
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
        if worker.state == "busy" and worker.job_id:
            for device in worker.devices:
                if device in by_device:
                    by_device[device].running.append(
                        f"{worker.name}: {worker.job_id} step {worker.step}/{worker.total_steps}")


def _blocks_on(describe: str, device: str) -> str:
    return ", ".join(part.split(" -> ")[0] for part in describe.split(", ") if part.endswith(f" -> {device}"))


def snapshot(monitor: GpuMonitor, status: ManagerStatus) -> dict:
    """The panel's data as JSON-able dict (the /gpu_status API and /health use it)."""
    readings = monitor.read(status)
    return {
        "gpus": [asdict(r) for r in readings],
        "message": None if readings else (monitor.problem or "no GPU is visible: the model runs on the CPU"),
        "placement_mode": status.mode,
        "placement_reason": status.reason,
        "workers": [asdict(w) for w in status.workers],
        "waiting": status.waiting,
        "ready": status.ready,
        "loras": list(status.loras),
    }


def _readiness(data: dict) -> str:
    """The panel's first line: the same readiness /health reports."""
    if data["ready"]:
        return "ready"
    if any(w["state"] == "failed" for w in data["workers"]):
        return "not ready: a worker failed (see /health)"
    return "loading the model"


def _worker_doing(w: dict) -> str:
    """A busy worker's job and step (or "preparing" before its first step); an idle one shows no stale step."""
    state = html.escape(w["state"])
    if w["state"] != "busy" or not w["job_id"]:
        return state
    job = html.escape(w["job_id"])
    if not w["step"]:
        return f"{state} — {job} preparing"
    return f"{state} — {job} step {w['step']}/{w['total_steps']}"


def panel_html(data: dict) -> str:
    """One bar per GPU: memory used of total, utilisation, what it holds, what it runs."""
    parts = ['<div class="gpu-panel">', f'<p class="gpu-ready"><b>{_readiness(data)}</b></p>']
    remote = any(w.get("node") for w in data["workers"])
    if not data["gpus"]:
        parts.append(f'<p class="gpu-none">{html.escape(data["message"] or "")}</p>')
    if not data["gpus"] or remote:  # WORKERS=ray: the workers' GPUs are on other machines
        for w in data["workers"]:
            node = f' (Ray node {html.escape(w["node"][:8])})' if w.get("node") else ""
            why = f' — {html.escape(w["error"] or w["detail"] or "")}' if w["state"] in ("failed", "restarting") else ""
            parts.append(f'<p>{html.escape(w["name"])} on {html.escape(", ".join(w["devices"]))}{node}: '
                         f'{_worker_doing(w)}{why}</p>')
    for g in data["gpus"]:
        pct = 100 * g["used_mib"] / g["total_mib"] if g["total_mib"] else 0
        util = "n/a" if g["utilization_percent"] is None else f'{g["utilization_percent"]:.0f}%'
        holds = html.escape("; ".join(g["holds"]) or "nothing of ours")
        running = html.escape("; ".join(g["running"]) or "idle")
        parts.append(
            f'<div class="gpu" data-index="{g["index"]}"><b>GPU {g["index"]}</b> {html.escape(g["name"])} — '
            f'{g["used_mib"] / 1024:.1f} / {g["total_mib"] / 1024:.1f} GiB, util {util}'
            f'<div style="background:#ddd;height:12px;border-radius:4px">'
            f'<div style="background:#3b82f6;width:{pct:.1f}%;height:12px;border-radius:4px"></div></div>'
            f'<small>holds: {holds}<br>runs: {running}</small></div>')
    if data.get("loras"):
        names = ", ".join(lora["name"] + (f' (Lightning {n}-step)' if (n := lora["lightning_steps"]) else "")
                          for lora in data["loras"])
        parts.append(f'<small class="gpu-loras">LoRAs loaded: {html.escape(names)}</small><br>')
    for w in data["workers"]:  # one line per worker: each component's dtype/quantization and where it lives
        if line := components_line(w.get("components")):
            name = html.escape(w["name"])
            parts.append(f'<small class="worker-weights">{name} weights: {html.escape(line)}</small><br>')
    parts.append(f'<small>placement: {html.escape(data["placement_mode"])} — '
                 f'{html.escape(data["placement_reason"])}; waiting: {data["waiting"]}</small></div>')
    return "".join(parts)
