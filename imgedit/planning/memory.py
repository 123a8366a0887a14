"""Quantized weights and offloading, planner side: QUANTIZE / QUANTIZE_SKIP / OFFLOAD parsed, the
GPU checks, each component's size per mode, and the memory mode `auto` picks so that a plan fits.

Torch-free at import (the server plans with it); `layer_sizes` reads the configs on the meta device.
The worker side (torchao, diffusers' offload hooks) is imgedit/offload.py.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from imgedit.errors import PlacementError

if TYPE_CHECKING:
    from imgedit.placement import ComponentSpec, GpuSpec, Plan
    from imgedit.settings import Settings

log = logging.getLogger(__name__)

GIB = 1024**3
MODES = ("none", "fp8", "int8", "nf4")
QUANTIZABLE = ("transformer", "text_encoder")  # the VAE is convolutions: nothing for weight quantization
OFFLOADS = ("none", "text_encoder", "blocks")
FP8_CAPABILITY = (8, 9)  # Ada / Hopper and newer: the float8 tensor-core matmuls torchao's fp8 needs
# Bytes per quantized Linear weight, scales included: fp8 and int8 keep one fp32 scale per output row
# (<= 4 bytes per 1024 weights for rows of >= 1024; counted as 1/256 to stay on the safe side); nf4
# keeps 4 bits plus one 8-bit scaler per block of 64 and one fp32 per 256 scalers (torchao NF4Tensor).
BYTES_PER_WEIGHT = {"fp8": 1.0 + 1 / 256, "int8": 1.0 + 1 / 256, "nf4": 0.5 + 1 / 64 + 4 / (64 * 256)}


# ---- settings values ----

def parse_quantize(raw: str) -> tuple[tuple[str, str], ...] | None:
    """QUANTIZE: `auto` (None: the planner decides), `none`, a mode for the transformer (`fp8`), or
    `component=mode,...`. Returns ((component, mode), ...) with the components that are quantized."""
    text = raw.strip().lower()
    allowed = ("auto, none, fp8, int8, nf4 (the transformer), or component=mode pairs such as "
               "transformer=fp8,text_encoder=int8 (components: transformer, text_encoder)")
    if text in ("", "auto"):
        return None
    if text in MODES:
        return () if text == "none" else (("transformer", text),)
    pairs: dict[str, str] = {}
    for part in text.split(","):
        name, sep, mode = (s.strip() for s in part.partition("="))
        if not sep or name not in QUANTIZABLE or mode not in MODES or name in pairs:
            raise ValueError(allowed)
        pairs[name] = mode
    return tuple((n, m) for n, m in pairs.items() if m != "none")


def parse_offload(raw: str) -> tuple[str, ...] | None:
    """OFFLOAD: `auto` (None), `none` (()), or `text_encoder`, `blocks` or both, comma-separated."""
    text = raw.strip().lower()
    if text in ("", "auto"):
        return None
    parts = [p.strip() for p in text.split(",")]
    if parts == ["none"]:
        return ()
    if not parts or any(p not in OFFLOADS[1:] for p in parts) or len(set(parts)) != len(parts):
        raise ValueError("auto, none, text_encoder, blocks, or text_encoder,blocks")
    return tuple(p for p in OFFLOADS if p in parts)


def parse_skip(raw: str) -> tuple[str, ...]:
    """QUANTIZE_SKIP: names of submodules whose Linear layers keep the model dtype (`img_mlp`)."""
    names = tuple(p.strip() for p in raw.split(",") if p.strip())
    if not all(n.replace("_", "").replace(".", "").isalnum() for n in names):
        raise ValueError("comma-separated module names such as img_mlp, or empty to quantize every Linear")
    return names


# ---- the memory mode of one worker ----

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
        return not self.quantize and not self.offload_text_encoder and not self.streams_blocks and not self.batch_cfg

    def streamed(self, total: int) -> list[int]:
        """Indices of the streamed blocks, spread evenly among the resident ones: each streamed
        block is fetched while the blocks before it compute (diffusers prefetches one streamed
        group ahead), so the copies hide behind resident compute instead of queueing at the end."""
        if self.resident_blocks is None:
            return []
        count = total - self.resident_blocks
        return [k * total // count for k in range(count)] if count > 0 else []

    def touches(self, component: str) -> bool:
        return (self.mode_of(component) != "none" or (component == "text_encoder" and self.offload_text_encoder)
                or (component == "transformer" and self.streams_blocks))

    def describe(self, blocks: int | None = None) -> str:
        kept = f" ({', '.join(self.skip)} kept unquantized)" if self.skip else ""
        parts = [f"{n} {m}" + (kept if n == "transformer" else "") for n, m in self.quantize] or ["unquantized weights"]
        if self.offload_text_encoder:
            parts.append("text encoder on the CPU, streamed to the GPU for each prompt")
        if self.streams_blocks:
            of = f" of {blocks}" if blocks else ""
            parts.append(f"{self.resident_blocks}{of} transformer blocks resident, the others streamed from the CPU")
        if self.batch_cfg:
            parts.append("both CFG branches in one forward (batch 2)")
        return "; ".join(parts)


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
        from imgedit.placement import ComponentSpec

        blocks = tuple(b.nbytes(mode, item) for b in self.blocks)
        return ComponentSpec(self.name, self.head.nbytes(mode, item) + sum(blocks), blocks)


def layer_sizes(checkpoint, item: int, skip: Sequence[str] = ()) -> list[ComponentSizes]:
    """Count every component's parameters from its config alone (meta device, no weights)."""
    import torch
    from accelerate import init_empty_weights

    from imgedit.loader import MODEL_COMPONENTS, _from_config, block_container

    out = []
    for name in MODEL_COMPONENTS:
        with init_empty_weights():
            model = _from_config(name, checkpoint.folder)
        container = block_container(model) if name != "vae" else None
        heads: dict[str, int] = {"linear": 0, "kept": 0, "other": 0}
        blocks: list[dict[str, int]] = []
        if container:
            blocks = [{"linear": 0, "kept": 0, "other": 0} for _ in model.get_submodule(container)]
        largest = 0
        for fqn, module in model.named_modules():
            own = list(module.parameters(recurse=False))
            if not own:
                continue
            if not list(module.children()):  # a leaf: what leaf-level streaming moves at once
                largest = max(largest, sum(p.numel() for p in own))
            where = heads
            if container and fqn.startswith(container + "."):
                where = blocks[int(fqn[len(container) + 1:].split(".")[0])]
            for pname, p in module.named_parameters(recurse=False):
                if isinstance(module, torch.nn.Linear) and pname == "weight" and name in QUANTIZABLE:
                    where["kept" if is_skipped(fqn, skip) else "linear"] += p.numel()
                else:
                    where["other"] += p.numel()
        out.append(ComponentSizes(name, PartSize(**heads), tuple(PartSize(**b) for b in blocks), largest))
    return out


def is_skipped(fqn: str, skip: Sequence[str]) -> bool:
    """QUANTIZE_SKIP names match whole dotted segments (`img_mlp` matches blocks.3.img_mlp.net.0)."""
    return any(f".{s}." in f".{fqn}." for s in skip)


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
        raise PlacementError(f"OFFLOAD={','.join(offload)} moves weights between the CPU and a GPU, but the model "
                             "runs on the CPU here; use OFFLOAD=none (or auto)")
    if offload and "text_encoder" in offload and modes.get("text_encoder") == "nf4":
        raise PlacementError(
            "OFFLOAD=text_encoder with QUANTIZE text_encoder=nf4 is not supported: diffusers' offload hooks move "
            "torchao's fp8/int8 tensors but not NF4 ones; use text_encoder=int8 with OFFLOAD=text_encoder")
    if offload and "blocks" in offload and modes.get("transformer") not in (None, "none"):
        # Measured on the GPU machine (H200, torch 2.11, torchao 0.18, diffusers 0.42.1): streaming fp8
        # blocks fails in diffusers' group offloading ("Attempted to set the storage of a tensor on
        # device cuda:0 to a storage on different device cpu" when it moves a torchao tensor).
        raise PlacementError(
            f"OFFLOAD=blocks with QUANTIZE transformer={modes['transformer']} is not supported: diffusers' group "
            "offloading cannot move torchao's quantized tensors to the GPU; stream bf16 blocks (QUANTIZE=none "
            "with OFFLOAD=text_encoder,blocks) or keep a quantized transformer resident")


def check_device(mode: MemoryMode, index: int, name: str, capability: tuple[int, int]) -> None:
    """The worker's own check, with the capability CUDA reports (NVML may be missing)."""
    if "fp8" in dict(mode.quantize).values() and tuple(capability) < FP8_CAPABILITY:
        raise PlacementError(
            f"QUANTIZE=fp8 needs compute capability 8.9 or newer, but cuda:{index} ({name}) has "
            f"{capability[0]}.{capability[1]}; use int8 or nf4 on this GPU")


# ---- the choice ----

def _fast8(gpus: Sequence[GpuSpec]) -> str:
    """fp8 where every GPU runs it (capability known and >= 8.9), int8 weight-only otherwise."""
    ok = gpus and all(g.capability is not None and tuple(g.capability) >= FP8_CAPABILITY for g in gpus)
    return "fp8" if ok else "int8"


def candidates(quantize, offload, gpus: Sequence[GpuSpec], on_cpu: bool) -> list[tuple[tuple, tuple]]:
    """(quantize pairs, offloads) to try, least lossy and fastest first."""
    if on_cpu or not gpus:
        return [(quantize or (), offload or ())]
    q8 = _fast8(gpus)
    quants = [quantize] if quantize is not None else [
        (), (("transformer", q8),), (("transformer", q8), ("text_encoder", "int8"))]
    offloads = [offload] if offload is not None else [(), ("text_encoder",), ("text_encoder", "blocks")]
    out = []
    for off in offloads:
        for q in quants:
            if "text_encoder" in off and dict(q).get("text_encoder") and quantize is None:
                continue  # streaming the text encoder already frees its GPU memory
            out.append((q, off))
    return out


def plan_memory(sizes: Sequence[ComponentSizes], gpus: Sequence[GpuSpec], settings: Settings, item: int) -> Plan:
    """Plan with QUANTIZE and OFFLOAD applied: the first candidate whose sizes fit (bf16 and no
    offload first), or a PlacementError that lists what was tried and why each did not fit."""
    from imgedit.placement import plan_placement

    on_cpu = settings.device_map.mode == "cpu" or not gpus
    check_platform(settings.quantize, settings.offload, gpus, on_cpu)
    tried = []
    for quant, off in candidates(settings.quantize, settings.offload, gpus, on_cpu):
        try:
            check_platform(quant, off, gpus, on_cpu)
            specs, mode = component_specs(sizes, quant, off, settings, gpus, item)
            plan = plan_placement(specs, gpus, settings.device_map, settings.max_memory,
                                  settings.gpu_memory_reserve, settings.activation_reserve)
        except PlacementError as exc:
            tried.append(f"{MemoryMode(quant, settings.quantize_skip, 'text_encoder' in off).describe()}"
                         f"{' + streamed blocks' if 'blocks' in off else ''}: {exc.message}")
            continue
        if mode.trivial:
            return plan
        blocks = len(next(s for s in sizes if s.name == "transformer").blocks)
        why = mode.describe(blocks)
        if tried:
            why += " (less memory-hungry modes first did not fit: " + " | ".join(tried) + ")"
        log.info("QUANTIZE=%s OFFLOAD=%s: %s", _show(settings.quantize), _show(settings.offload), why)
        workers = tuple(replace(w, memory=mode) for w in plan.workers)
        return replace(plan, workers=workers, reason=f"{plan.reason}; memory: {why}")
    raise PlacementError("nothing fits, even quantized and offloaded: " + " | ".join(tried))


def _show(value) -> str:
    if value is None:
        return "auto"
    return ",".join(f"{p[0]}={p[1]}" if isinstance(p, tuple) else p for p in value) or "none"


def component_specs(sizes: Sequence[ComponentSizes], quant, off, settings: Settings, gpus: Sequence[GpuSpec],
                    item: int) -> tuple[list[ComponentSpec], MemoryMode]:
    """What each component costs on the GPU in this mode, and the mode itself (with the number of
    transformer blocks that stay resident when blocks are streamed)."""
    from imgedit.placement import ComponentSpec, budgets

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
    batch = settings.batch_cfg == "on" or (settings.batch_cfg == "auto" and resident is not None)
    memory = MemoryMode(tuple(quant), settings.quantize_skip if modes.get("transformer") else (),
                        "text_encoder" in off, resident, batch)
    return specs, memory


def bytes_item(dtype: str) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]


def summary(components: dict[str, dict] | None) -> str:
    """One short line for the panel (from a worker's status data: transformer fp8 @ GPU 0 + CPU (streamed); ..."""
    if not components:
        return ""
    parts = []
    for name, c in components.items():
        quant = c["quantization"].split(":")[0] if c["quantization"] != "none" else c["dtype"]
        parts.append(f"{name} {quant} @ {c['location']}")
    return "; ".join(parts)
