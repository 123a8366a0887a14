"""The placement planner: a pure function from (component sizes, GPUs, DEVICE_MAP, MAX_MEMORY) to a plan.

A plan is a list of workers; a worker is one pipeline and the devices it owns. Each component of a
worker sits whole on one device, or (transformer, text encoder) has its repeated blocks split over
several. The VAE always sits on the worker's execution device (where the transformer's first block
and the latents live), because the pipeline calls `vae.encode/decode` directly, which device hooks
do not see. No torch here: tests feed made-up sizes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from imgedit.config.parsers import GIB, DeviceMap
from imgedit.errors import PlacementError
from imgedit.planning.families import FAMILIES, not_built
from imgedit.planning.manual_map import manual_plan
from imgedit.planning.plan import (
    ANCHOR,
    FOLLOWER,
    ComponentSpec,
    GpuSpec,
    Placement,
    Plan,
    WorkerPlan,
    bytes_per_device,
)

log = logging.getLogger(__name__)

def _gpu(index: int) -> str:
    return f"cuda:{index}"


# Memory a worker process holds on each GPU it uses outside torch's allocator, measured on the GPU
# machine (2xH200, NVML process memory minus torch's reserved memory): the CUDA context 0.60 GiB; a
# rank of a CFG-parallel pair 0.96 GiB (context plus NCCL's buffers). docs/BENCHMARKS.md.
CUDA_CONTEXT = int(0.6 * GIB)
NCCL_BUFFERS = int(0.4 * GIB)
# ...and what it adds while jobs run: CUDA loads kernels lazily, on first use, and each loaded module
# takes GPU memory outside torch's allocator. Measured on an H200 under MAX_MEMORY=22GiB with the
# allocator capped at the cap minus CUDA_CONTEXT: NVML's peak for the process reached 22.3 GiB.
# The worker caps its allocator this much lower again (runtime.phases.cap_memory).
LAZY_KERNELS = int(0.4 * GIB)


def allocator_budget(cap: int) -> int:
    """What torch's allocator may hold on a GPU capped at `cap` bytes (MAX_MEMORY, as nvidia-smi shows it):
    the cap less the CUDA context and the kernels loaded as jobs run."""
    return cap - CUDA_CONTEXT - LAZY_KERNELS


def budgets(gpus: Sequence[GpuSpec], max_memory: Sequence[int], reserve: int) -> dict[int, int]:
    """Bytes of weights each GPU may take: min(cap, free) minus the reserve and the worker process's
    CUDA context (the activation reserve is taken where the latents live)."""
    if max_memory and len(max_memory) not in (1, len(gpus)):
        raise PlacementError(
            f"MAX_MEMORY has {len(max_memory)} values but {len(gpus)} GPUs are visible: "
            "give one value per visible GPU, or one for all")
    caps = list(max_memory) * len(gpus) if len(max_memory) == 1 else list(max_memory)
    result = {}
    for i, gpu in enumerate(gpus):
        limit = min(gpu.free_bytes, caps[i]) if caps else gpu.free_bytes
        result[gpu.index] = max(0, limit - reserve - CUDA_CONTEXT)
    return result


def _whole(components: Sequence[ComponentSpec], device: str) -> dict[str, Placement]:
    return {c.name: Placement(device) for c in components}


def _total(components: Sequence[ComponentSpec]) -> int:
    return sum(c.nbytes for c in components)


def _fits_every_gpu(need: int, budget: Mapping[int, int]) -> bool:
    return bool(budget) and all(b >= need for b in budget.values())


def plan_placement(
    components: Sequence[ComponentSpec],
    gpus: Sequence[GpuSpec],
    device_map: DeviceMap,
    max_memory: Sequence[int] = (),
    reserve: int = int(1.5 * GIB),
    activation_reserve: int = 4 * GIB,
    family: str = "plus",
) -> Plan:
    """Decide where every component of every worker goes. Raises PlacementError when it cannot fit.
    `family` (planning.families): a family without CFG-parallel pairs or Ulysses groups gets neither.

    `reserve` is kept free on every GPU (CUDA context, fragmentation); `activation_reserve` on each
    worker's execution device, where the latents, the attention activations and the VAE's
    encode/decode live (measured on 2xH200 at 1024x1024: 4.2 GiB above the weights there, up to
    1.3 GiB on a GPU holding only transformer blocks and the text encoder; docs/BENCHMARKS.md).
    """
    names = {c.name for c in components}
    if ANCHOR not in names:
        raise PlacementError(f"the checkpoint has no {ANCHOR}")
    mode = device_map.mode
    if mode == "cpu":
        return _single(components, "cpu", "cpu", "DEVICE_MAP=cpu")
    if not gpus:
        if mode in ("balanced", "auto"):
            return _single(components, "cpu", mode, "no GPU is visible, so everything runs on the CPU (slow)")
        raise PlacementError(f"DEVICE_MAP={mode} needs a GPU, but none is visible (CUDA_VISIBLE_DEVICES?)")
    budget = budgets(gpus, max_memory, reserve)
    total = _total(components) + activation_reserve
    if mode == "cuda":
        index = device_map.gpu or 0
        if index not in budget:
            raise PlacementError(f"DEVICE_MAP=cuda:{index} but only GPUs {sorted(budget)} are visible")
        if budget[index] < total:
            raise PlacementError(
                f"the model needs {total / GIB:.1f} GiB but cuda:{index} can take "
                f"{budget[index] / GIB:.1f} GiB (cap/free minus {reserve / GIB:.1f} GiB reserve); "
                "use DEVICE_MAP=balanced to spread it")
        return _single(components, _gpu(index), "cuda", f"everything on cuda:{index}")
    if mode == "replicas":
        if not _fits_every_gpu(total, budget):
            smallest = min(budget.values())
            raise PlacementError(
                f"DEVICE_MAP=replicas needs {total / GIB:.1f} GiB on every GPU but the smallest can take "
                f"{smallest / GIB:.1f} GiB; use DEVICE_MAP=balanced")
        return _replicas(components, budget, "replicas", f"one full pipeline on each of {len(budget)} GPUs")
    if mode in ("cfg-parallel", "ulysses"):
        size = device_map.group
        name = mode if size == 2 else f"{mode}:{size}"
        if (refused := not_built(family, mode)) is not None:
            raise PlacementError(f"DEVICE_MAP={name} cannot serve this model: {refused}; "
                                 "use DEVICE_MAP=replicas (a job per GPU) or auto")
        if len(budget) < size:
            instead = ("use DEVICE_MAP=cuda or balanced" if size == 2 else
                       "use DEVICE_MAP=cfg-parallel (pairs) or a smaller group")
            raise PlacementError(f"DEVICE_MAP={name} needs groups of {size} GPUs "
                                 f"but {len(budget)} are visible; " + instead)
        if not _fits_every_gpu(total + NCCL_BUFFERS, budget):
            smallest = min(budget.values())
            raise PlacementError(
                f"DEVICE_MAP={name} needs {size} or more GPUs that each take a full copy "
                f"({total / GIB:.1f} GiB); {len(budget)} GPU(s) visible, the smallest can take "
                f"{smallest / GIB:.1f} GiB; use DEVICE_MAP=balanced (or replicas with one GPU)")
        if mode == "ulysses" or size > 2:
            return _groups(components, budget, name, mode, size, family)
        return _pairs(components, budget, "cfg-parallel")
    if mode == "auto":
        pairs = not_built(family, "cfg-parallel") is None
        if pairs and _fits_every_gpu(total + NCCL_BUFFERS, budget) and len(budget) >= 2:
            return _pairs(components, budget, "auto")
        if _fits_every_gpu(total, budget):
            if len(budget) >= 2 and not pairs:
                why = not_built(family, "cfg-parallel")
                latency = ("; DEVICE_MAP=ulysses splits each image over 2 GPUs instead"
                           if not_built(family, "ulysses") is None else "")
                return _replicas(components, budget, "auto",
                                 f"a full copy ({total / GIB:.1f} GiB) fits every GPU, "
                                 f"so one pipeline on each of {len(budget)} "
                                 f"(no CFG-parallel pairs for this model: {why}{latency})")
            return _replicas(components, budget, "auto",
                             f"a full copy ({total / GIB:.1f} GiB) fits the GPU, so one pipeline on it")
        plan = _balanced(components, budget, activation_reserve)
        why = f"a full copy ({total / GIB:.1f} GiB) does not fit every GPU, so one pipeline spread over them"
        log.info("DEVICE_MAP=auto: %s", why)
        return Plan("auto", plan.workers, why + "; " + plan.reason, plan.bytes_per_device)
    if mode == "balanced":
        return _balanced(components, budget, activation_reserve)
    if mode == "manual":
        return manual_plan(components, budget, device_map.manual, activation_reserve)
    raise PlacementError(f"unknown DEVICE_MAP mode {mode!r}")


def standby_gpus(device_map: DeviceMap, gpus: int) -> list[tuple[int, ...]]:
    """The GPUs (by index among the visible ones) of each worker process a plan for `device_map` may start on
    `gpus` visible GPUs, guessed before the checkpoint is known: engine.workers.standby starts a process for
    each ahead of the plan and gives it to a rank of exactly those GPUs. One process for cpu (no GPU: ()),
    cuda:N (GPU N), balanced and a manual map (every GPU); one per GPU for replicas, the ranks of CFG-parallel
    pairs and Ulysses groups, and auto's choice among them."""
    if gpus == 0 or device_map.mode == "cpu":
        return [()]
    if device_map.mode == "cuda":
        return [(device_map.gpu or 0,)]
    if device_map.mode in ("balanced", "manual"):
        return [tuple(range(gpus))]
    return [(i,) for i in range(gpus)]


def _single(components: Sequence[ComponentSpec], device: str, mode: str, reason: str) -> Plan:
    return Plan(mode, (WorkerPlan("worker-0", _whole(components, device)),), reason,
                {device: _total(components)})


def _replicas(components: Sequence[ComponentSpec], budget: Mapping[int, int], mode: str, reason: str) -> Plan:
    workers = tuple(WorkerPlan(f"worker-{i}", _whole(components, _gpu(i))) for i in sorted(budget))
    return Plan(mode, workers, reason, {_gpu(i): _total(components) for i in sorted(budget)})


def _pairs(components: Sequence[ComponentSpec], budget: Mapping[int, int], mode: str) -> Plan:
    """CFG-parallel pairs: GPUs (0,1), (2,3), ...; an odd GPU left over is a one-GPU worker. A pair
    edits one image in about half the time of one GPU (cond and uncond forwards run at once) and
    serves as many images per minute as two replicas."""
    indices = sorted(budget)
    workers = []
    for n, i in enumerate(range(0, len(indices) - 1, 2)):
        devices = (_gpu(indices[i]), _gpu(indices[i + 1]))
        workers.append(WorkerPlan(f"worker-{n}", _whole(components, devices[0]), "cfg", devices))
    if len(indices) % 2:
        workers.append(WorkerPlan(f"worker-{len(workers)}", _whole(components, _gpu(indices[-1]))))
    reason = (f"a full copy fits every GPU and there are {len(indices)}: "
              f"{len(indices) // 2} CFG-parallel pair(s) "
              "(each runs the conditional and unconditional forwards at once: half the latency of one GPU, "
              "the throughput of two replicas)")
    if len(indices) % 2:
        reason += f"; cuda:{indices[-1]} is left over and serves alone"
    return Plan(mode, tuple(workers), reason, {_gpu(i): _total(components) for i in indices})


def _groups(components: Sequence[ComponentSpec], budget: Mapping[int, int], mode: str, kind: str,
            size: int, family: str = "plus") -> Plan:
    """Groups of `size` GPUs, a full pipeline on each. `cfg`: the two halves run the two CFG branches
    and each half splits every forward's sequence over its GPUs (Ulysses); `ulysses`: all GPUs of the
    group split every forward (CFG off runs on all of them too). GPUs left over form CFG pairs, then
    one-GPU workers."""
    indices = sorted(budget)
    whole = len(indices) // size * size
    workers = []
    for start in range(0, whole, size):
        devices = tuple(_gpu(i) for i in indices[start:start + size])
        ulysses = size // 2 if kind == "cfg-parallel" else size
        workers.append(WorkerPlan(f"worker-{len(workers)}", _whole(components, devices[0]),
                                  "cfg" if kind == "cfg-parallel" else "ulysses", devices, ulysses))
    rest = indices[whole:]
    for i in range(0, len(rest) - 1, 2):
        devices = (_gpu(rest[i]), _gpu(rest[i + 1]))
        workers.append(WorkerPlan(f"worker-{len(workers)}", _whole(components, devices[0]), "cfg", devices))
    if len(rest) % 2:
        workers.append(WorkerPlan(f"worker-{len(workers)}", _whole(components, _gpu(rest[-1]))))
    if kind == "cfg-parallel":
        what = ("2 halves running the two CFG branches, each half splitting the sequence "
                f"(Ulysses-{size // 2})")
    elif FAMILIES[family].split == "target":
        what = f"each forward's target image split over its {size} GPUs (keys and values gathered)"
    else:
        what = f"every forward split over its {size} GPUs (Ulysses-{size})"
    reason = f"{whole // size} group(s) of {size} GPUs, {what}"
    if rest:
        reason += f"; {', '.join(_gpu(i) for i in rest)} left over (CFG pairs, then one-GPU workers)"
    return Plan(mode, tuple(workers), reason, {_gpu(i): _total(components) for i in indices})


def _order(budget: Mapping[int, int]) -> list[int]:
    """GPUs with the most room first; ties by index."""
    return sorted(budget, key=lambda i: (-budget[i], i))


def _balanced(components: Sequence[ComponentSpec], budget: Mapping[int, int],
              activation_reserve: int) -> Plan:
    """Whole components on the roomiest GPU, largest first; a component that fits no GPU has its
    blocks split over GPUs (placed after the whole ones, so they can fill the gaps)."""
    room = dict(budget)
    # The VAE and the activations ride with the transformer's first device: plan them as one unit
    # whose head grows by their size.
    follower = next((c for c in components if c.name == FOLLOWER), None)
    units = []
    for c in components:
        if c.name == FOLLOWER:
            continue
        if c.name == ANCHOR:
            extra = (follower.nbytes if follower else 0) + activation_reserve
            c = ComponentSpec(c.name, c.nbytes + extra, c.blocks)
        units.append(c)
    units.sort(key=lambda c: -c.nbytes)
    need = sum(c.nbytes for c in units)
    if need > sum(room.values()):
        raise PlacementError(
            f"the model needs {need / GIB:.1f} GiB (weights and activations) but the visible GPUs can take "
            f"{sum(room.values()) / GIB:.1f} GiB in all (caps/free memory minus the per-GPU reserve and "
            "CUDA context); "
            "add GPUs, raise MAX_MEMORY, or lower GPU_MEMORY_RESERVE")
    placed: dict[str, Placement] = {}
    to_split = []
    for unit in units:
        best = _order(room)[0]
        if room[best] >= unit.nbytes:
            placed[unit.name] = Placement(_gpu(best))
            room[best] -= unit.nbytes
        elif unit.blocks:
            to_split.append(unit)
        else:
            raise PlacementError(
                f"{unit.name} ({unit.nbytes / GIB:.1f} GiB) cannot be split and fits no single GPU "
                f"(largest room {room[best] / GIB:.1f} GiB)")
    for unit in to_split:
        placed[unit.name] = _split(unit, room)
    if follower:
        placed[FOLLOWER] = Placement(placed[ANCHOR].device)
    ordered = {c.name: placed[c.name] for c in components}
    split = [n for n, p in ordered.items() if p.is_split]
    reason = (f"whole components spread over {len(budget)} GPU(s)" if not split
              else f"{', '.join(split)} split by blocks because no single GPU can hold it")
    return Plan("balanced", (WorkerPlan("worker-0", ordered),), reason, bytes_per_device(components, ordered))


def _split(unit: ComponentSpec, room: dict[int, int]) -> Placement:
    """Fill GPUs in order of room with contiguous runs of blocks; the head goes on the first."""
    order = _order(room)
    devices: list[str] = []
    pos = 0
    first = True
    for gpu in order:
        take = room[gpu] - (unit.head_bytes if first else 0)
        if take < 0:
            continue
        start = pos
        while pos < len(unit.blocks) and unit.blocks[pos] <= take:
            take -= unit.blocks[pos]
            pos += 1
        if pos == start and first:
            continue  # the head fits but no block does: try the next GPU as the first
        used = sum(unit.blocks[start:pos]) + (unit.head_bytes if first else 0)
        room[gpu] -= used
        devices.extend([_gpu(gpu)] * (pos - start))
        first = False
        if pos == len(unit.blocks):
            return Placement(devices[0], tuple(devices))
    raise PlacementError(
        f"{unit.name} ({unit.nbytes / GIB:.1f} GiB) does not fit even when split: "
        f"{len(unit.blocks) - pos} of {len(unit.blocks)} blocks find no room "
        "(add GPUs, raise MAX_MEMORY, or lower GPU_MEMORY_RESERVE)")
