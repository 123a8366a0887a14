"""Quantized weights and offloading, planner side: the GPU checks, each component's size per mode,
and the memory mode `auto` picks so that a plan fits.

Pure and torch-free: the sizes come from the worker side's inspection of the checkpoint's configs
(imgedit.model.inspect, run in a subprocess). Applying a mode is imgedit/runtime/offload.py.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

from imgedit.config.parsers import GIB
from imgedit.config.settings import Settings
from imgedit.errors import PlacementError
from imgedit.planning.families import FAMILIES, not_built
from imgedit.planning.placement import budgets, plan_placement
from imgedit.planning.plan import ComponentSpec, GpuSpec, MemoryMode, Plan

log = logging.getLogger(__name__)
HOST_RESERVE = 8 * GIB  # CPU memory left to the processes themselves (torch, the server, the page's files)

FP8_CAPABILITY = (8, 9)  # Ada / Hopper and newer: the float8 tensor-core matmuls torchao's fp8 needs
# Bytes per quantized Linear weight, scales included: fp8 and int8 keep one fp32 scale per output row
# (<= 4 bytes per 1024 weights for rows of >= 1024; counted as 1/256 to stay on the safe side); nf4
# keeps 4 bits plus one 8-bit scaler per block of 64 and one fp32 per 256 scalers (torchao NF4Tensor).
BYTES_PER_WEIGHT = {"fp8": 1.0 + 1 / 256, "int8": 1.0 + 1 / 256, "nf4": 0.5 + 1 / 64 + 4 / (64 * 256)}


def available_host_memory() -> int | None:
    """Bytes of CPU memory available now (Linux's MemAvailable): for the planner's streamed weights and a
    worker's prefix cache in CPU memory; None when unknown. Read here (a few lines) rather than through
    psutil, which the server does not need."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


# ---- sizes ----

@dataclass(frozen=True)
class PartSize:
    """Parameters of one part of a component (its head, or one repeated block)."""

    linear: int = 0  # Linear weights that QUANTIZE converts
    kept: int = 0  # Linear weights QUANTIZE_SKIP keeps in the model dtype
    other: int = 0  # every other parameter (biases, norms, embeddings, convolutions)

    def nbytes(self, mode: str, item: int) -> int:
        weight = item if mode == "none" else BYTES_PER_WEIGHT[mode]
        return int(self.linear * weight) + (self.kept + self.other) * item


@dataclass(frozen=True)
class ComponentSizes:
    name: str
    head: PartSize
    blocks: tuple[PartSize, ...] = ()
    largest_leaf: int = 0  # parameters of the largest leaf module (what streaming holds at once)

    def spec(self, mode: str, item: int) -> ComponentSpec:
        blocks = tuple(b.nbytes(mode, item) for b in self.blocks)
        return ComponentSpec(self.name, self.head.nbytes(mode, item) + sum(blocks), blocks)


def sizes_from_json(data: list[dict]) -> list[ComponentSizes]:
    """ComponentSizes from the worker side's inspection (imgedit.model.inspect), as plain JSON."""
    return [ComponentSizes(c["name"], PartSize(**c["head"]), tuple(PartSize(**b) for b in c["blocks"]),
                           c["largest_leaf"]) for c in data]


# ---- start-up checks ----

def check_platform(quantize: Sequence[tuple[str, str]] | None, offload: Sequence[str] | None,
                   gpus: Sequence[GpuSpec], on_cpu: bool) -> None:
    """Refuse a mode this machine cannot run, naming the GPU and why."""
    modes = dict(quantize or ())
    if "fp8" in modes.values():
        if on_cpu or not gpus:
            raise PlacementError(
                "QUANTIZE=fp8 needs a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper), but the "
                "model runs on the CPU here; use int8 or nf4 on the CPU")
        for g in gpus:
            if g.capability is not None and tuple(g.capability) < FP8_CAPABILITY:
                raise PlacementError(
                    f"QUANTIZE=fp8 needs compute capability 8.9 or newer, but GPU {g.index} ({g.name}) has "
                    f"{g.capability[0]}.{g.capability[1]}; use int8 or nf4 on this GPU")
    if offload and (on_cpu or not gpus):
        raise PlacementError(f"OFFLOAD={','.join(offload)} moves weights between the CPU and a GPU, "
                             "but the model runs on the CPU here; use OFFLOAD=none (or auto)")
    if offload and "text_encoder" in offload and modes.get("text_encoder") == "nf4":
        raise PlacementError(
            "OFFLOAD=text_encoder with QUANTIZE text_encoder=nf4 is not "
            "supported: diffusers' offload hooks move torchao's fp8/int8 tensors "
            "but not NF4 ones; use text_encoder=int8 with OFFLOAD=text_encoder")
    if offload and "blocks" in offload and modes.get("transformer") not in (None, "none"):
        # Measured on the GPU machine (H200, torch 2.11, torchao 0.18, diffusers 0.42.1): streaming fp8
        # blocks fails in diffusers' group offloading ("Attempted to set the storage of a tensor on
        # device cuda:0 to a storage on different device cpu" when it moves a torchao tensor).
        raise PlacementError(
            f"OFFLOAD=blocks with QUANTIZE transformer={modes['transformer']} is not supported: "
            "diffusers' group offloading cannot move torchao's quantized tensors to the GPU; "
            "stream bf16 blocks (QUANTIZE=none with OFFLOAD=text_encoder,blocks) "
            "or keep a quantized transformer resident")


def fp8_uses(mode: MemoryMode | None, fast_quantize: str = "none") -> list[tuple[str, str]]:
    """(setting, what to use instead) for each fp8 a worker is asked to run: QUANTIZE, FAST_QUANTIZE."""
    quantized_fp8 = mode is not None and "fp8" in dict(mode.quantize).values()
    uses = [("QUANTIZE=fp8", "int8 or nf4")] if quantized_fp8 else []
    return uses + ([("FAST_QUANTIZE=fp8", "int8")] if fast_quantize == "fp8" else [])


def check_device(mode: MemoryMode | None, index: int, name: str, capability: tuple[int, int],
                 fast_quantize: str = "none") -> None:
    """The worker's own check, with the capability CUDA reports (NVML may be missing)."""
    for what, instead in fp8_uses(mode, fast_quantize):
        if tuple(capability) < FP8_CAPABILITY:
            raise PlacementError(
                f"{what} needs compute capability 8.9 or newer, but cuda:{index} ({name}) has "
                f"{capability[0]}.{capability[1]}; use {instead} on this GPU")


# ---- the choice ----

def _fast8(gpus: Sequence[GpuSpec]) -> str:
    """fp8 where every GPU runs it (capability known and >= 8.9), int8 weight-only otherwise."""
    ok = gpus and all(g.capability is not None and tuple(g.capability) >= FP8_CAPABILITY for g in gpus)
    return "fp8" if ok else "int8"


def candidates(quantize, offload, gpus: Sequence[GpuSpec], on_cpu: bool) -> list[tuple[tuple, tuple]]:
    """(quantize pairs, offloads) to try in this order: every lossless plan before any lossy one (bf16 with
    the text encoder and then transformer blocks streamed from the CPU, before fp8/int8 weights), and
    within each, the one that moves the fewest weights first. The placement (one GPU, pairs, a split over
    several) is the planner's for each: a bf16 split over two GPUs comes before fp8 on one."""
    if on_cpu or not gpus:
        return [(quantize or (), offload or ())]
    q8 = _fast8(gpus)
    quants = [quantize] if quantize is not None else [
        (), (("transformer", q8),), (("transformer", q8), ("text_encoder", "int8"))]
    offloads = [offload] if offload is not None else [(), ("text_encoder",), ("text_encoder", "blocks")]
    out = []
    for q in quants:
        for off in offloads:
            modes = dict(q)
            if quantize is None and "text_encoder" in off and modes.get("text_encoder"):
                continue  # streaming the text encoder already frees its GPU memory
            out.append((q, off))
    return out


def host_bytes(sizes: Sequence[ComponentSizes], mode: MemoryMode, item: int) -> int:
    """The weights one worker process keeps in CPU memory to stream them: the text encoder when it is
    offloaded, the transformer blocks that are not resident."""
    by_name = {s.name: s for s in sizes}
    held = 0
    if mode.offload_text_encoder:
        held += by_name["text_encoder"].spec(mode.mode_of("text_encoder"), item).nbytes
    if mode.streams_blocks:
        blocks = by_name["transformer"].blocks
        held += sum(blocks[i].nbytes(mode.mode_of("transformer"), item) for i in mode.streamed(len(blocks)))
    return held


def plan_memory(sizes: Sequence[ComponentSizes], gpus: Sequence[GpuSpec], settings: Settings, item: int,
                host_memory: int | None = None, family: str = "plus") -> Plan:
    """Plan with QUANTIZE and OFFLOAD applied: the first candidate whose sizes fit (lossless first, see
    `candidates`), or a PlacementError that lists what was tried and why each did not fit. `host_memory`
    (bytes of CPU memory available, when known) bounds what the workers may keep there to stream: every
    worker process holds its own copy."""
    if settings.quantize_skip is None:  # QUANTIZE_SKIP=auto: the family's
        settings = replace(settings, quantize_skip=FAMILIES[family].quantize_skip)
    on_cpu = settings.device_map.mode == "cpu" or not gpus
    check_platform(settings.quantize, settings.offload, gpus, on_cpu)
    tried = []
    for quant, off in candidates(settings.quantize, settings.offload, gpus, on_cpu):
        try:
            check_platform(quant, off, gpus, on_cpu)
            specs, mode = component_specs(sizes, quant, off, settings, gpus, item, family)
            plan = plan_placement(specs, gpus, settings.device_map, settings.max_memory,
                                  settings.gpu_memory_reserve, settings.activation_reserve, family)
            held = host_bytes(sizes, mode, item) * sum(w.ranks for w in plan.workers)
            if held and host_memory is not None and held > host_memory - HOST_RESERVE:
                raise PlacementError(
                    f"{sum(w.ranks for w in plan.workers)} worker process(es) would keep "
                    f"{held / GIB:.1f} GiB of weights in CPU memory to stream them, "
                    f"but {host_memory / GIB:.1f} GiB is available "
                    f"(less {HOST_RESERVE / GIB:.0f} GiB kept free)")
        except PlacementError as exc:
            tried.append(f"{MemoryMode(quant, settings.quantize_skip, 'text_encoder' in off).describe()}"
                         f"{' + streamed blocks' if 'blocks' in off else ''}: {exc.message}")
            continue
        if mode.trivial:
            return plan
        blocks = len(next(s for s in sizes if s.name == "transformer").blocks)
        why = mode.describe(blocks)
        if tried:
            why += " (tried first, did not fit: " + " | ".join(tried) + ")"
        log.info("QUANTIZE=%s OFFLOAD=%s: %s", _show(settings.quantize), _show(settings.offload), why)
        workers = tuple(replace(w, memory=mode) for w in plan.workers)
        return replace(plan, workers=workers, reason=f"{plan.reason}; memory: {why}")
    raise PlacementError("nothing fits, even quantized and offloaded: " + " | ".join(tried))


def _show(value) -> str:
    if value is None:
        return "auto"
    return ",".join(f"{p[0]}={p[1]}" if isinstance(p, tuple) else p for p in value) or "none"


def component_specs(sizes: Sequence[ComponentSizes], quant, off, settings: Settings, gpus: Sequence[GpuSpec],
                    item: int, family: str = "plus") -> tuple[list[ComponentSpec], MemoryMode]:
    """What each component costs on the GPU in this mode, and the mode itself (with the number of
    transformer blocks that stay resident when blocks are streamed)."""
    modes = dict(quant)
    specs = []
    by_name = {s.name: s for s in sizes}
    for s in sizes:
        spec = s.spec(modes.get(s.name, "none"), item)
        if s.name == "text_encoder" and "text_encoder" in off:
            # Streamed leaf by leaf (two at a time: the one running and the one being fetched), and
            # only while the prompt is encoded, before the denoising activations exist: it shares
            # the activation reserve instead of adding to it.
            stream = 2 * s.largest_leaf * item
            spec = ComponentSpec(s.name, max(0, stream - settings.activation_reserve))
        specs.append(spec)
    resident = None
    if "blocks" in off:
        t = by_name["transformer"]
        mode = modes.get("transformer", "none")
        block_bytes = [b.nbytes(mode, item) for b in t.blocks]
        # the block running, the one being prefetched on the copy stream, and the one just used whose
        # memory the allocator takes back only once the compute stream is past it (record_stream)
        buffer = 3 * max(block_bytes)
        if settings.batch_cfg != "off":
            # a forward of batch 2 holds twice the activations; two more streamed blocks cost nothing
            # there, since one forward per step leaves the copies time to spare (BENCHMARKS.md)
            buffer += 2 * max(block_bytes)
        room = min(budgets(gpus, settings.max_memory, settings.gpu_memory_reserve).values())
        others = sum(sp.nbytes for sp in specs if sp.name != "transformer")
        free = room - settings.activation_reserve - others - t.head.nbytes(mode, item) - buffer
        if free < 0:
            raise PlacementError(
                f"even with every transformer block streamed, the GPU needs {(room - free) / GIB:.1f} GiB "
                f"but can take {room / GIB:.1f} GiB")
        resident, used = 0, 0
        while resident < len(block_bytes) and used + block_bytes[resident] <= free:
            used += block_bytes[resident]
            resident += 1
        if resident == len(block_bytes):
            resident = None  # every block fits: nothing to stream
        else:
            head = t.head.nbytes(mode, item)
            specs = [ComponentSpec("transformer", head + used + buffer) if sp.name == "transformer" else sp
                     for sp in specs]
    batch = settings.batch_cfg == "on" or (settings.batch_cfg == "auto" and resident is not None
                                           and not_built(family, "batch_cfg") is None)
    memory = MemoryMode(tuple(quant), settings.quantize_skip if modes.get("transformer") else (),
                        "text_encoder" in off, resident, batch)
    return specs, memory


def bytes_item(dtype: str) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]
