"""Made-up GPUs behind the pynvml calls imgedit.engine.workers.gpus makes (the lowest seam of the GPU readings):
the panel's arithmetic and rendering are tested on a machine without GPUs."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

MIB = 1024**2


@dataclass
class FakeGpu:
    name: str = "NVIDIA H200"
    total_mib: float = 143_771.0
    used_mib: float = 0.0
    util: float = 0.0
    processes: dict[int, float] = field(default_factory=dict)  # pid -> MiB


class FakeNvml:
    nvmlMemory_v2 = 2

    def __init__(self, gpus: list[FakeGpu]):
        self.gpus = gpus

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if not 0 <= index < len(self.gpus):
            raise ValueError(f"no GPU {index}")
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        return self.nvmlDeviceGetHandleByIndex(int(uuid.rsplit("-", 1)[-1]))

    def nvmlDeviceGetMemoryInfo(self, handle: int, version: int | None = None):
        gpu = self.gpus[handle]
        return SimpleNamespace(total=int(gpu.total_mib * MIB), used=int(gpu.used_mib * MIB),
                               free=int((gpu.total_mib - gpu.used_mib) * MIB))

    def nvmlDeviceGetUtilizationRates(self, handle: int):
        return SimpleNamespace(gpu=self.gpus[handle].util)

    def nvmlDeviceGetName(self, handle: int) -> bytes:
        return self.gpus[handle].name.encode()

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return f"GPU-fake-{handle}"

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int):
        processes = self.gpus[handle].processes
        return [SimpleNamespace(pid=pid, usedGpuMemory=int(mib * MIB)) for pid, mib in processes.items()]
