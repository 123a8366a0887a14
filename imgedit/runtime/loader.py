"""Load a checkpoint's components onto the devices a `WorkerPlan` names and assemble the pipeline.

Each component is loaded on its own (`from_pretrained(..., device_map=...)`) so that a component
split by blocks gets accelerate's device hooks, and is then handed to the pipeline class named in
`model_index.json`. For benchmarks, `random_weights=True` builds the components from their configs
directly on the GPU (no weight files needed; speed and memory do not depend on the values).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from imgedit.checkpoint import MODEL_COMPONENTS, Checkpoint, open_checkpoint  # noqa: F401  (re-exported)
from imgedit.errors import PlacementError
from imgedit.placement import ComponentSpec, Placement, WorkerPlan
from imgedit.processor import load_processor

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _classes():
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    return {"transformer": QwenImageTransformer2DModel, "vae": AutoencoderKLQwenImage,
            "text_encoder": Qwen2_5_VLForConditionalGeneration}


def _from_config(name: str, folder: Path):
    cls = _classes()[name]
    if name == "text_encoder":
        from transformers import AutoConfig

        return cls._from_config(AutoConfig.from_pretrained(folder / name))
    return cls.from_config(cls.load_config(folder / name))


def block_container(model: torch.nn.Module) -> str:
    """Dotted path of the model's largest ModuleList: the repeated blocks a split divides."""
    best, best_size = "", -1
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList):
            size = sum(p.numel() for p in module.parameters())
            if size > best_size:
                best, best_size = name, size
    return best


def component_specs(checkpoint: Checkpoint, dtype: torch.dtype) -> list[ComponentSpec]:
    """Sizes of each component and of its blocks in `dtype`, from the configs alone (meta device)."""
    from accelerate import init_empty_weights

    item = torch.finfo(dtype).bits // 8
    specs = []
    for name in MODEL_COMPONENTS:
        with init_empty_weights():
            model = _from_config(name, checkpoint.folder)
        total = sum(p.numel() for p in model.parameters()) * item
        blocks: tuple[int, ...] = ()
        if name != "vae":
            container = model.get_submodule(block_container(model))
            blocks = tuple(sum(p.numel() for p in b.parameters()) * item for b in container)
        specs.append(ComponentSpec(name, total, blocks))
    return specs


def module_device_map(model: torch.nn.Module, placement: Placement) -> dict[str, str]:
    """An accelerate device map for a split component: blocks as planned; every module outside the
    block list (embeddings, norms, heads) on the first block's device, where the planner counts
    their bytes and where the component's inputs and outputs live anyway."""
    path = block_container(model)
    first = placement.block_devices[0]
    device_map: dict[str, str] = {}
    node, prefix = model, ""
    for part in path.split("."):
        for pname, _ in node.named_parameters(recurse=False):
            device_map[prefix + pname] = first
        for cname, _ in node.named_children():
            if cname != part:
                device_map[prefix + cname] = first
        node, prefix = getattr(node, part), prefix + part + "."
    for i, device in enumerate(placement.block_devices):
        device_map[f"{path}.{i}"] = device
    return device_map


def _load_component(name: str, checkpoint: Checkpoint, placement: Placement, dtype: torch.dtype):
    cls = _classes()[name]
    if placement.is_split:
        from accelerate import init_empty_weights

        with init_empty_weights():
            device_map = module_device_map(_from_config(name, checkpoint.folder), placement)
    else:
        device_map = {"": placement.device}
    if checkpoint.random_weights:
        return _random_component(name, checkpoint.folder, device_map, dtype)
    kwargs = {"dtype" if name == "text_encoder" else "torch_dtype": dtype}
    if name == "text_encoder":
        return cls.from_pretrained(checkpoint.folder / name, device_map=device_map, **kwargs)
    return cls.from_pretrained(checkpoint.folder, subfolder=name, device_map=device_map, **kwargs)


def _random_component(name: str, folder: Path, device_map: dict[str, str], dtype: torch.dtype):
    """Build on the first device in `dtype` (fast on a GPU), then dispatch like from_pretrained does."""
    from accelerate import dispatch_model

    first = next(iter(device_map.values()))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    torch.manual_seed(0)  # every rank and replica builds the same weights (conv layers keep the default init)
    try:
        with torch.device(first):
            model = _from_config(name, folder)
    finally:
        torch.set_default_dtype(previous)
    trained_like_init(model)
    model.eval()
    if len(set(device_map.values())) > 1:
        dispatch_model(model, device_map=device_map)
    return model


@torch.no_grad()
def trained_like_init(model: torch.nn.Module, seed: int = 0) -> None:
    """Give random weights the scale of trained ones (Linear/Embedding N(0, 0.02), biases 0, norms 1).

    diffusers' default init can drive a whole random pipeline (random text encoder -> transformer ->
    VAE) to inf/NaN activations, and NaN data runs a power-capped GPU faster: benchmarks would be
    flattered. With this init the activations stay finite (benchmarks assert it)."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            module.weight.normal_(0.0, 0.02, generator=generator)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, (torch.nn.LayerNorm, torch.nn.GroupNorm)) or type(module).__name__.endswith("RMSNorm"):
            if getattr(module, "weight", None) is not None:
                module.weight.fill_(1.0)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()


def _move_inputs(model: torch.nn.Module, device: str) -> None:
    """Give a whole component that sits off the execution device a hook moving its inputs there
    and its outputs back (the pipeline creates inputs on its execution device)."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    if not hasattr(model, "_hf_hook"):
        add_hook_to_module(model, AlignDevicesHook(execution_device=device, io_same_device=True))


def load_pipeline(checkpoint: Checkpoint, worker: WorkerPlan, dtype: torch.dtype):
    """Build one worker's pipeline on its devices."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import Qwen2Tokenizer

    folder = checkpoint.folder
    parts = {}
    for name in MODEL_COMPONENTS:
        placement = worker.components[name]
        if worker.memory is not None and worker.memory.touches(name):  # QUANTIZE / OFFLOAD
            from imgedit.offload import load_component

            model = load_component(name, checkpoint, placement, dtype, worker.memory)
        else:
            model = _load_component(name, checkpoint, placement, dtype)
        if not placement.is_split and placement.device != worker.execution_device:
            _move_inputs(model, placement.device)
        parts[name] = model.eval().requires_grad_(False)
    if len(worker.devices) > 1 and not hasattr(parts["vae"], "_hf_hook"):
        # diffusers' _execution_device asks the first registered component (the VAE); one without a
        # hook falls back to pipe.device, the first module by *name* (text_encoder), which may sit
        # on another GPU. A no-op hook on the VAE (already on the execution device) pins the answer.
        from accelerate.hooks import AlignDevicesHook, add_hook_to_module

        add_hook_to_module(parts["vae"], AlignDevicesHook(execution_device=worker.execution_device))
    pipeline_cls = getattr(diffusers, checkpoint.pipeline_class)
    pipe = pipeline_cls(
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler"),
        tokenizer=Qwen2Tokenizer.from_pretrained(folder / "tokenizer"),
        processor=load_processor(folder / "processor"),
        **parts,
    )
    pipe.set_progress_bar_config(disable=True)
    if pipe._execution_device != torch.device(worker.execution_device):
        raise PlacementError(
            f"{worker.name}: the pipeline would run on {pipe._execution_device}, "
            f"but the plan puts the latents on {worker.execution_device}")
    return pipe
