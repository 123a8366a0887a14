"""Quantized weights and offloading, worker side: load a component quantized with torchao and/or held
on the CPU and streamed to the GPU with diffusers' group offloading, and report each component's dtype,
quantization and location (the panel and /health show it). Compiling the blocks: runtime/block_compile.py.

The planner side (settings, sizes, the choice) is imgedit/planning/memory.py.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from contextlib import contextmanager

import torch
from accelerate import dispatch_model
from diffusers.hooks import HookRegistry, apply_group_offloading
from diffusers.hooks.group_offloading import (
    _GROUP_OFFLOADING,
    _LAYER_EXECUTION_TRACKER,
    _LAZY_PREFETCH_GROUP_OFFLOADING,
)
from torchao.quantization import (
    Float8DynamicActivationFloat8WeightConfig,
    Int8WeightOnlyConfig,
    PerRow,
    quantize_,
)
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

from imgedit.config.parsers import is_skipped
from imgedit.errors import PlacementError
from imgedit.model import internals
from imgedit.model.components import block_container
from imgedit.planning.memory import check_device as check_capability
from imgedit.planning.memory import fp8_uses
from imgedit.planning.plan import MemoryMode, Placement
from imgedit.runtime import pinned, weights

log = logging.getLogger(__name__)
GIB = 1024**3
FP8_ROW_FLOOR = 1e-12  # torchao activation_value_lb: see torchao_config


def torchao_config(mode: str):
    """The torchao config of a QUANTIZE mode (fp8: dynamic per-row activations and weights, the
    setting measured on the H200; int8: weight-only, per output row, runs on the CPU too).

    fp8's activation scale is a row's largest magnitude / 448, so an all-zero row gets scale 0 and quantizes
    to 0/0 = NaN. A CFG pair that splits a job's sequence pads the text with zero rows (masked out of
    attention, but a NaN value times a zero attention weight is NaN): on 2x H200 every fp8-copy job of a pair
    came out non-finite. `activation_value_lb` is torchao's own floor on that magnitude; a zero row then
    quantizes to zeros, as bf16 computes it, and no other row changes (none is that small).

    `set_inductor_config=False`: by default torchao's quantize_ turns on inductor's coordinate-descent tuning
    for the whole process (`recommended_inductor_config_setter`), so every block compiled after it, the bf16
    quality ones included, benchmarked hundreds of kernel configurations: one real-size fp8 block compiled in
    122.5 s, of which 103.4 s were that tuning, against 21.0 s for a bf16 block (2x H200,
    benchmarks/probe_fp8_compile.py, 2026-11-27). That was the fp8 fast mode's start-up of over 9 minutes."""
    if mode == "fp8":
        return Float8DynamicActivationFloat8WeightConfig(
            granularity=PerRow(), activation_value_lb=FP8_ROW_FLOOR, set_inductor_config=False)
    if mode == "int8":
        return Int8WeightOnlyConfig(set_inductor_config=False)
    raise ValueError(mode)


def _nf4_scaler_block(n_weights: int, block: int = 64) -> int | None:
    """torchao's NF4Tensor needs the weights in blocks of 64 and the block scalers in groups; the
    real model's layers take the default group of 256, tiny test layers a smaller divisor."""
    if n_weights % block:
        return None
    scalers = n_weights // block
    return next((s for s in (256, 128, 64, 32, 16, 8, 4, 2, 1) if scalers % s == 0), None)


def quantize_module(model: torch.nn.Module, mode: str, skip: tuple[str, ...] = (), prefix: str = "") -> int:
    """Quantize the Linear weights of `model` in place on the device they are on; `skip` names
    submodules kept in the model dtype (QUANTIZE_SKIP). Returns how many Linear layers changed."""
    def wanted(module: torch.nn.Module, fqn: str) -> bool:
        return isinstance(module, torch.nn.Linear) and not is_skipped(prefix + fqn, skip)

    if mode in ("fp8", "int8"):
        before = sum(wanted(m, n) for n, m in model.named_modules())
        quantize_(model, torchao_config(mode), filter_fn=wanted)
        return before
    if mode == "nf4":
        # torchao 0.18 has no quantize_ config for NF4; its NF4Tensor (the QLoRA format) replaces the
        # weight and dispatches F.linear to a dequantize-then-matmul, on the CPU and the GPU alike.
        changed = 0
        for fqn, module in model.named_modules():
            if not wanted(module, fqn):
                continue
            group = _nf4_scaler_block(module.weight.numel())
            if group is None:
                continue
            module.weight = torch.nn.Parameter(to_nf4(module.weight.data, 64, group), requires_grad=False)
            changed += 1
        return changed
    raise ValueError(mode)


def _parts(model: torch.nn.Module, placement: Placement):
    """(module or parameter name, device) covering the whole component: every block on its
    planned device, the rest on the first one (the loader's device map for a split)."""
    blocks = len(model.get_submodule(block_container(model)))
    whole = placement.block_devices or (placement.device,) * blocks
    return weights.module_device_map(model, Placement(whole[0], tuple(whole))).items()


def _move(model: torch.nn.Module, name: str, device: str) -> torch.nn.Module | None:
    try:
        part = model.get_submodule(name)
    except AttributeError:  # a parameter held directly by an intermediate module
        owner, _, pname = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        internals.replace_parameter(module, pname, device)
        return None
    return part.to(device)


def load_component(name: str, checkpoint, placement: Placement, dtype: torch.dtype, memory: MemoryMode):
    """Load one component quantized and/or offloaded as `memory` says, never holding more than its
    quantized size plus one part in the model dtype on a GPU (random-weight benchmark checkpoints
    excepted: they are built whole in the model dtype on the GPU, as the reference is)."""
    mode = memory.mode_of(name)
    skip = memory.skip if name == "transformer" else ()
    streamed = ((name == "text_encoder" and memory.offload_text_encoder)
                or (name == "transformer" and memory.streams_blocks))
    streams_blocks = name == "transformer" and memory.streams_blocks
    if checkpoint.random_weights:
        # Same weights as the bf16 reference (same build, same seed), then quantized in place.
        model = weights.load_component(name, checkpoint, placement, dtype).eval().requires_grad_(False)
        if mode != "none":
            quantize_module(model, mode, skip)
        # streamed parts go to the CPU when the offload hooks are set up (below)
    else:
        model = weights.load_component(name, checkpoint, Placement("cpu"), dtype).eval().requires_grad_(False)
        _place_parts(model, placement, memory, mode, skip, streamed, streams_blocks)
    if streamed:
        started = time.perf_counter()
        stream(model, placement.device, memory if streams_blocks else None)
        log.info("%s: streaming set up in %.1fs (weights to pinned CPU memory)", name,
                 time.perf_counter() - started)
    return model


def _place_parts(model: torch.nn.Module, placement: Placement, memory: MemoryMode, mode: str, skip: tuple,
                 streamed: bool, streams_blocks: bool) -> None:
    """A component loaded on the CPU, part by part onto its planned device (quantized there first), the
    streamed parts back to the CPU: never more than its quantized size plus one part in the model dtype on a
    GPU."""
    work = placement.device  # fp8 is made on the GPU (torchao checks the capability there)
    for part, device in _parts(model, placement):
        offloaded = streamed and (not streams_blocks or not _is_resident(model, part, memory))
        home = "cpu" if offloaded else device
        moved = _move(model, part, work if mode != "none" else home)
        if moved is not None and mode != "none":
            quantize_module(moved, mode, skip, prefix=part + ".")
        if moved is not None and home != work:
            moved.to(home)
    if placement.is_split:
        dispatch_model(model, device_map=weights.module_device_map(model, placement))


def _is_resident(model: torch.nn.Module, part: str, memory: MemoryMode) -> bool:
    """True for the repeated blocks that stay on the GPU (not in memory.streamed)."""
    container = block_container(model)
    if not part.startswith(container + "."):
        return False
    index = int(part[len(container) + 1:].split(".")[0])
    return index not in memory.streamed(len(model.get_submodule(container)))


def stream(model: torch.nn.Module, device: str, memory: MemoryMode | None) -> None:
    """diffusers' group offloading: weights stay in (pinned) CPU memory and reach `device` just in
    time, the next group fetched on a CUDA stream while the current one computes.

    memory=None: the text encoder, leaf by leaf (it has no top-level block list, and runs only to
    encode the prompt). Otherwise the transformer, block by block, but only the blocks in
    memory.streamed: diffusers streams all or nothing, and a 24 GB card has room for most blocks
    (measured: everything streamed peaks at 2.1 GiB of 22 and runs 2.17x slower)."""
    cuda = torch.device(device).type == "cuda"
    # record_stream: no device-wide synchronize after every streamed group (3 blocks of room are
    # planned for it, imgedit.planning.memory.component_specs). low_cpu_mem_usage: diffusers keeps the CPU
    # weights as they are instead of pinning each one (_into_pinned_memory moves them into one locked buffer
    # first, _pin_once any added after); not for quantized weights (torchao tensors: diffusers pins them
    # itself, once, as before)
    plain = all(type(p.data) is torch.Tensor for p in model.parameters())
    options = dict(onload_device=device, use_stream=cuda, record_stream=cuda,
                   low_cpu_mem_usage=cuda and plain)
    if memory is None:
        _into_pinned_memory([model], options)
        apply_group_offloading(model, offload_type="leaf_level", **options)
        _pin_once(model)
        if cuda:
            _buffers_load_themselves_after_the_trace(model)
        return
    path = block_container(model)
    owner_path, _, attr = path.rpartition(".")
    owner = model.get_submodule(owner_path) if owner_path else model
    blocks = getattr(owner, attr)
    streamed = set(memory.streamed(len(blocks)))
    _into_pinned_memory([b for i, b in enumerate(blocks) if i in streamed], options)
    # diffusers groups every block of a top-level block list: show it only the streamed ones while it
    # sets up its hooks, then put the whole list back. The prefetch order it traces on the first
    # forward follows the hooked blocks; the resident ones carry no hook and never leave the GPU.
    # It streams any other top-level ModuleList or Sequential as blocks too (2.1's shared modulation, an
    # nn.Sequential of 134 MB, copied every forward): it sees those empty and they stay on the GPU, where the
    # plan counts them (the transformer's head).
    others = {name: child for name, child in model.named_children()
              if isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)) and child is not blocks}
    setattr(owner, attr, torch.nn.ModuleList([b for i, b in enumerate(blocks) if i in streamed]))
    for name in others:
        setattr(model, name, torch.nn.ModuleList())
    try:
        apply_group_offloading(model, offload_type="block_level", num_blocks_per_group=1, **options)
    finally:
        setattr(owner, attr, blocks)
        for name, child in others.items():
            setattr(model, name, child)
    for i, block in enumerate(blocks):
        if i not in streamed:
            block.to(device)
    for child in others.values():
        child.to(device)
    _keep_head_resident(model, device)
    _pin_once(model)


def _buffers_load_themselves_after_the_trace(model: torch.nn.Module) -> None:
    """diffusers' lazy prefetching (group offloading on a stream) traces the order of the streamed groups in
    the model's first forward; from then on each group is loaded by the one before it in that order. A group
    whose forerunner does not run (Qwen-Image-2.1's text encoder, traced on a prompt with a picture, then
    given text alone: its vision tower is skipped) must load itself: diffusers 0.42.1 does so for a group
    with parameters, but a group of buffers alone (the language model's rotary inv_freq) was left on the CPU,
    and every prompt without a picture failed from then on ("Expected all tensors to be on the same device
    ... cpu", 2026-11-30, 2.1 at MAX_MEMORY=14.5GiB on an H200, its first job an edit). So once the trace is
    made, each group of buffers alone loads itself, waiting for its copy (a few bytes: rotary tables); its
    forerunner then no longer prefetches it. The hook goes once it has run after a completed trace."""
    def after_forward(module, args, output) -> None:
        registry = internals.hook_registry(model)
        if registry is not None and registry.get_hook(_LAZY_PREFETCH_GROUP_OFFLOADING) is not None:
            return  # the traced forward failed before its end: the next forward traces
        for group in _offload_groups(model):
            own = [p for m in group.modules for p in m.parameters()]
            if not (own or group.parameters):
                group.onload_self, group.non_blocking = True, False
        handle.remove()

    handle = model.register_forward_hook(after_forward)


def _into_pinned_memory(modules: list[torch.nn.Module], options: dict) -> None:
    """Where diffusers keeps the CPU weights as they are (`options`' low_cpu_mem_usage: a CUDA worker's plain
    weights), the weights and buffers of the modules about to be streamed, moved into one page-locked CPU
    buffer (imgedit.runtime.pinned) before diffusers' group offloading sees them: its CPU copy of a weight
    already on the CPU is that weight (`.data.cpu()`), so it keeps these. A weight on a GPU (the benchmarks'
    random weights are built there) reaches its place by DMA instead of through pageable memory: a 24 GB
    worker set up 2509's 26 GiB of streamed blocks in 25.5 s through pageable memory (9.5 s of it the lock),
    and in 3.6-5.7 s this way (H200 hosts, 2026-11-30: docs/gpu-runs/2026-11-30-1xh200.md and its server
    logs)."""
    if not options["low_cpu_mem_usage"]:  # quantized weights, or the CPU: diffusers' own copies
        return
    tensors = list({id(t): t for m in modules for t in (*m.parameters(), *m.buffers())
                    if type(t.data) is torch.Tensor
                    and not (t.device.type == "cpu" and t.is_pinned())}.values())

    def place(i: int, copy: torch.Tensor) -> None:
        tensors[i].data = copy  # the old memory (GPU or pageable) goes with its last reference

    pinned.copy_into_one([t.data for t in tensors], place)


def _pin_once(model: torch.nn.Module) -> None:
    """The streamed weights' CPU copies that are not page-locked yet (the LoRAs' layers, added after loading;
    `_into_pinned_memory` has moved the weights loaded before them) into one page-locked buffer
    (imgedit.runtime.pinned) instead of one pinned block each; a copy pinned before stays where it is.
    diffusers 0.42.1: each group-offloading hook's `group.cpu_param_dict` maps a parameter or buffer to the
    CPU tensor its onload copies from, and offload sets `.data` back to it."""
    found = [(group, tensor, cpu) for group in _offload_groups(model) if group.offload_device.type == "cpu"
             for tensor, cpu in group.cpu_param_dict.items()
             if type(cpu) is torch.Tensor and not cpu.is_pinned()]
    if not found:
        return
    size = sum(cpu.numel() * cpu.element_size() for _, _, cpu in found)
    started = time.perf_counter()
    targets = [(group, tensor) for group, tensor, _ in found]
    sources = [cpu for _, _, cpu in found]
    del found  # the old CPU tensors now referenced by `sources` alone, which copy_into_one lets go of

    def place(i: int, copy: torch.Tensor) -> None:  # again for the same i where the lock is refused
        group, tensor = targets[i]
        group.cpu_param_dict[tensor] = copy
        if tensor.device.type == "cpu":  # offloaded now: its data is the copy, and the old memory goes
            tensor.data = copy

    pinned.copy_into_one(sources, place)
    log.debug("%.2f GiB of streamed weights locked in CPU memory in %.1fs", size / 1024**3,
              time.perf_counter() - started)


def _offload_groups(model: torch.nn.Module) -> list:
    """Every group-offloading group of the model's modules (a group's hook sits on each of its modules)."""
    groups: dict[int, object] = {}
    for module in model.modules():
        registry = internals.hook_registry(module)
        hook = registry.get_hook(_GROUP_OFFLOADING) if registry is not None else None
        if hook is not None:
            groups.setdefault(id(hook.group), hook.group)
    return list(groups.values())


def _keep_head_resident(model: torch.nn.Module, device: str) -> None:
    """Keep the model's own layers, those outside the block list (2.1: the embedders, the output norm and
    projections; 0.137 GB), on the GPU between forwards. diffusers gathers them in one group that it moves
    to the CPU after every forward, synchronously and into pageable memory, and back before the next: on
    2.1's 16 GB plan 87 ms + 18 ms of a 0.31 s step (torch.profiler, benchmarks/profile_21_step.py
    --resident 13). The plan already counts them resident (planning.memory: the transformer's head).
    diffusers 0.42.1: that group is the top-level module's group-offloading hook's; its offload_device is
    where offload_() sends it, so the GPU makes both moves no-ops."""
    hook = HookRegistry.check_if_exists_or_initialize(model).get_hook(_GROUP_OFFLOADING)
    if hook is None:  # nothing outside the blocks
        return
    hook.group.offload_device = torch.device(device)
    hook.group.onload_()


@contextmanager
def lifted(pipe, memory: MemoryMode | None, devices: dict[str, str]):
    """Take the streaming hooks off while LoRAs load, then lay the components out as at loading. With the
    hooks on, diffusers' load_lora_weights removes a group-offloaded model's hooks and applies them again to
    the whole model, once per LoRA and per streamed component: every block streamed, the resident ones too,
    each copied from the GPU to pinned CPU memory (about 13 GiB of resident blocks per LoRA on a 24 GB card),
    and compiled blocks then meet the hooks' functions. Without hooks it sees no offloading: peft adds each
    LoRA's layers beside their weights (on the GPU or in pinned CPU memory), and stream() here pins only
    those new layers (a weight already pinned is not copied again).

    Nothing to do for a pipeline the loader marked device-mapped (a component with an accelerate hook, e.g.
    a streamed text encoder on another GPU than the latents): diffusers then re-applies no offloading, and
    group offloading cannot be applied again over an accelerate hook. A LoRA that fails to load fails the
    worker: nothing is laid out again then."""
    streamed = [] if memory is None or pipe.hf_device_map is not None else (
        ["transformer"] * memory.streams_blocks + ["text_encoder"] * memory.offload_text_encoder)
    for name in streamed:
        _unstream(getattr(pipe, name))
    yield
    for name in streamed:
        started = time.perf_counter()
        stream(getattr(pipe, name), devices[name], memory if name == "transformer" else None)
        log.info("%s streamed again after the LoRAs in %.1fs", name, time.perf_counter() - started)


def _unstream(model: torch.nn.Module) -> None:
    registry = HookRegistry.check_if_exists_or_initialize(model)
    for name in (_GROUP_OFFLOADING, _LAYER_EXECUTION_TRACKER, _LAZY_PREFETCH_GROUP_OFFLOADING):
        registry.remove_hook(name, recurse=True)


def check_device(memory: MemoryMode | None, device: str, fast_quantize: str = "none") -> None:
    """fp8 (QUANTIZE, FAST_QUANTIZE) needs compute capability 8.9+: say which GPU this worker has and what
    it lacks."""
    uses = fp8_uses(memory, fast_quantize)
    if uses and not device.startswith("cuda"):
        what, instead = uses[0]
        raise PlacementError(f"{what} needs a CUDA GPU of compute capability 8.9 or newer, "
                             f"but this worker runs on the CPU; use {instead} on the CPU")
    if uses:
        index = torch.device(device).index or 0
        check_capability(memory, index, torch.cuda.get_device_name(index),
                         torch.cuda.get_device_capability(index), fast_quantize)


# ATTENTION -> diffusers' backend names: PyTorch's own SDPA kernels, nothing to download.
ATTENTION_BACKENDS = {"flash": "_native_flash", "cudnn": "_native_cudnn", "efficient": "_native_efficient"}


def use_attention(transformer: torch.nn.Module, name: str) -> None:
    """ATTENTION: every attention of the transformer through
    this kernel (diffusers' set_attention_backend)."""
    transformer.set_attention_backend(ATTENTION_BACKENDS[name])
    log.info("attention kernel: %s (%s)", name, ATTENTION_BACKENDS[name])


def attention_in_use(transformer: torch.nn.Module) -> str:
    """The kernel(s) the transformer's attention processors are set to, read back from them."""
    names = {backend: name for name, backend in ATTENTION_BACKENDS.items()}
    found = set()
    for processor in transformer.attn_processors.values():
        backend = internals.attention_backend(processor)
        backend = getattr(backend, "value", backend)
        found.add("native" if backend in (None, "native") else names.get(backend, str(backend)))
    return ", ".join(sorted(found))


def _nbytes(t: torch.Tensor) -> int:
    """Bytes a (possibly quantized, tensor-subclass) weight really holds."""
    if hasattr(t, "__tensor_flatten__") and type(t) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return sum(_nbytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def _kind(t: torch.Tensor) -> str:
    return type(t).__name__ if type(t) not in (torch.Tensor, torch.nn.Parameter) else ""


def _where(device: str) -> str:
    """cuda:1 -> GPU 1, cpu -> CPU (as the panel names them)."""
    return f"GPU {device.partition(':')[2] or 0}" if device.startswith("cuda") else device.upper()


def describe(pipe, memory: MemoryMode | None) -> dict[str, dict]:
    """Each component's dtype, quantization and where its weights are now (read from the tensors)."""
    return {name: _describe(name, getattr(pipe, name), memory)
            for name in ("transformer", "text_encoder", "vae")}


def _describe(name: str, model: torch.nn.Module, memory: MemoryMode | None) -> dict:
    where: Counter = Counter()
    dtypes: Counter = Counter()
    linear = quantized = 0
    kinds: Counter = Counter()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            linear += 1
            if _kind(module.weight):
                quantized += 1
                kinds[_kind(module.weight)] += 1
    for p in model.parameters():
        where[str(p.device)] += _nbytes(p)
        if not _kind(p):
            dtypes[str(p.dtype).replace("torch.", "")] += p.numel()
    mode = memory.mode_of(name) if memory is not None else "none"
    streamed = memory is not None and ((name == "text_encoder" and memory.offload_text_encoder)
                                       or (name == "transformer" and memory.streams_blocks))
    locations = ", ".join(f"{_where(d)} {n / GIB:.2f} GiB" for d, n in sorted(where.items()))
    return {
        "dtype": dtypes.most_common(1)[0][0] if dtypes else "",
        "quantization": (f"{mode}: {quantized} of {linear} Linear layers ({', '.join(kinds)})"
                         if quantized else "none"),
        "location": locations + (" (streamed to the GPU when it runs)" if streamed else ""),
        "bytes": dict(where),
    }

