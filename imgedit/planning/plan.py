"""The plan's dataclasses: what the planner knows of components and GPUs, and what it decides
(placements, workers, memory modes). Pure data; the worker side reads them too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from imgedit.config.parsers import GIB


@dataclass(frozen=True)
class MemoryMode:
    """How one worker holds its weights: quantized components, the text encoder kept on the CPU and
    streamed to the GPU for each prompt, and how many transformer blocks stay resident (the rest are
    streamed from the CPU during every forward)."""

    quantize: tuple[tuple[str, str], ...] = ()
    skip: tuple[str, ...] = ()
    offload_text_encoder: bool = False
    resident_blocks: int | None = None  # None: every block on the GPU
    batch_cfg: bool = False  # both true-CFG branches in one forward of batch 2 (runtime.cfg_batch)

    def mode_of(self, component: str) -> str:
        return dict(self.quantize).get(component, "none")

    @property
    def streams_blocks(self) -> bool:
        return self.resident_blocks is not None

    @property
    def trivial(self) -> bool:
        return (not self.quantize and not self.offload_text_encoder and not self.streams_blocks
                and not self.batch_cfg)

    def streamed(self, total: int) -> list[int]:
        """Indices of the streamed blocks, spread evenly among the resident ones: each streamed
        block is fetched while the blocks before it compute (diffusers prefetches one streamed
        group ahead), so the copies hide behind resident compute instead of queueing at the end."""
        if self.resident_blocks is None:
            return []
        count = total - self.resident_blocks
        return [k * total // count for k in range(count)] if count > 0 else []

    def touches(self, component: str) -> bool:
        return (self.mode_of(component) != "none"
                or (component == "text_encoder" and self.offload_text_encoder)
                or (component == "transformer" and self.streams_blocks))

    def describe(self, blocks: int | None = None) -> str:
        kept = f" ({', '.join(self.skip)} kept unquantized)" if self.skip else ""
        parts = ([f"{n} {m}" + (kept if n == "transformer" else "") for n, m in self.quantize]
                 or ["unquantized weights"])
        if self.offload_text_encoder:
            parts.append("text encoder on the CPU, streamed to the GPU for each prompt")
        if self.streams_blocks:
            of = f" of {blocks}" if blocks else ""
            parts.append(f"{self.resident_blocks}{of} transformer blocks resident, "
                         "the others streamed from the CPU")
        if self.batch_cfg:
            parts.append("both CFG branches in one forward (batch 2)")
        return "; ".join(parts)


# The component the latents live with; the VAE follows it.
ANCHOR = "transformer"
FOLLOWER = "vae"


@dataclass(frozen=True)
class ComponentSpec:
    """What the planner knows of one component: total bytes and the sizes of its splittable blocks."""

    name: str
    nbytes: int
    blocks: tuple[int, ...] = ()  # bytes of each repeated block, in order; () = cannot be split

    @property
    def head_bytes(self) -> int:
        """Bytes outside the repeated blocks (embeddings, norms, heads)."""
        return self.nbytes - sum(self.blocks)


@dataclass(frozen=True)
class GpuSpec:
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    capability: tuple[int, int] | None = None  # CUDA compute capability (NVML); None = unknown


@dataclass(frozen=True)
class Placement:
    """Where one component lives: one device, or one device per block (the parts outside the
    blocks go with the first block)."""

    device: str
    block_devices: tuple[str, ...] = ()

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((self.device, *self.block_devices)))

    @property
    def is_split(self) -> bool:
        return len(self.devices) > 1

    def describe(self) -> str:
        if not self.is_split:
            return self.device
        runs, start = [], 0
        for i in range(1, len(self.block_devices) + 1):
            if i == len(self.block_devices) or self.block_devices[i] != self.block_devices[start]:
                runs.append(f"blocks {start}-{i - 1} -> {self.block_devices[start]}")
                start = i
        return ", ".join(runs)


@dataclass(frozen=True)
class WorkerPlan:
    """One worker: one pipeline and the devices it owns. A parallel worker is a group of ranks, one
    process each, every rank holding a full pipeline on one GPU (`rank_devices`); `components`
    then describes rank 0 and `for_rank(r)` the others."""

    name: str
    components: Mapping[str, Placement]
    parallel: str = "none"  # none | cfg (the group's halves run the two CFG branches) | ulysses
    rank_devices: tuple[str, ...] = ()
    ulysses: int = 1  # ranks that split each forward's sequence (Ulysses): the half of a cfg group, or all
    memory: MemoryMode | None = None  # quantized / offloaded weights (planning.memory); None = bf16, resident

    @property
    def cfg(self) -> int:
        """Ways the CFG branches are split: 2 for a cfg group, else 1."""
        return 2 if self.parallel == "cfg" else 1

    @property
    def ranks(self) -> int:
        return max(1, len(self.rank_devices))

    @property
    def execution_device(self) -> str:
        return self.components[ANCHOR].device

    @property
    def devices(self) -> tuple[str, ...]:
        found: dict[str, None] = dict.fromkeys(self.rank_devices)
        for placement in self.components.values():
            found.update(dict.fromkeys(placement.devices))
        return tuple(sorted(found, key=_device_key))

    def for_rank(self, rank: int) -> WorkerPlan:
        """The single-process plan of one rank (everything on that rank's GPU)."""
        if self.ranks == 1:
            return self
        device = self.rank_devices[rank]
        return WorkerPlan(f"{self.name}.rank{rank}", {n: Placement(device) for n in self.components},
                          memory=self.memory)

    def describe(self) -> str:
        on = ", ".join(self.rank_devices)
        if self.parallel == "cfg" and self.ulysses > 1:
            return f"CFG-parallel group of {self.ranks} (2 halves x Ulysses-{self.ulysses}) on {on}"
        if self.parallel == "cfg":
            return f"CFG-parallel group of {self.ranks} on {on}"
        if self.parallel == "ulysses":
            return f"Ulysses group of {self.ranks} on {on}"
        return ", ".join(self.devices)


def _device_key(device: str) -> tuple[int, int]:
    return (0, int(device[5:])) if device.startswith("cuda:") else (1, 0)


@dataclass(frozen=True)
class Plan:
    mode: str
    workers: tuple[WorkerPlan, ...]
    reason: str
    bytes_per_device: Mapping[str, int] = field(default_factory=dict)

    def describe(self) -> list[str]:
        lines = [f"placement mode={self.mode}: {self.reason}"]
        for worker in self.workers:
            if worker.parallel != "none":
                lines.append(f"  {worker.name}: {worker.describe()}, a full pipeline on each")
                continue
            for name, placement in worker.components.items():
                lines.append(f"  {worker.name}: {name} -> {placement.describe()}")
            if worker.memory is not None:
                lines.append(f"  {worker.name}: memory: {worker.memory.describe()}")
        for device, nbytes in sorted(self.bytes_per_device.items()):
            lines.append(f"  weights on {device}: {nbytes / GIB:.2f} GiB")
        return lines

    def gpu_weights_mib(self) -> dict[str, float]:
        """MiB of weights the plan puts on each GPU."""
        return {d: round(n / 1024**2, 1) for d, n in self.bytes_per_device.items() if d.startswith("cuda:")}


def bytes_per_device(components: Sequence[ComponentSpec], placed: Mapping[str, Placement]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in components:
        p = placed[c.name]
        if not p.is_split:
            out[p.device] = out.get(p.device, 0) + c.nbytes
            continue
        out[p.device] = out.get(p.device, 0) + c.head_bytes
        for size, dev in zip(c.blocks, p.block_devices, strict=True):
            out[dev] = out.get(dev, 0) + size
    return out
