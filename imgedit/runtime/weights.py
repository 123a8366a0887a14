"""One component's weights onto the devices its placement names: whole on one device, or its
repeated blocks split over several (accelerate's device hooks), from the checkpoint's files or, for
a random-weight benchmark checkpoint, built from the config directly on the GPU.
"""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate import dispatch_model, init_empty_weights
from accelerate.hooks import remove_hook_from_submodules

from imgedit.model import internals
from imgedit.model.components import block_container, component_classes, from_config, trained_like_init
from imgedit.planning.checkpoint import Checkpoint
from imgedit.planning.plan import Placement


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


def load_component(name: str, checkpoint: Checkpoint, placement: Placement, dtype: torch.dtype):
    cls = component_classes(checkpoint.folder)[name]
    if placement.is_split:
        with init_empty_weights():
            device_map = module_device_map(from_config(name, checkpoint.folder), placement)
    else:
        device_map = {"": placement.device}
    if checkpoint.random_weights:
        return random_component(name, checkpoint.folder, device_map, dtype)
    kwargs = {"dtype" if name == "text_encoder" else "torch_dtype": dtype}
    if name == "text_encoder":
        return cls.from_pretrained(checkpoint.folder / name, device_map=device_map, **kwargs)
    return cls.from_pretrained(checkpoint.folder, subfolder=name, device_map=device_map, **kwargs)


def random_component(name: str, folder: Path, device_map: dict[str, str], dtype: torch.dtype):
    """Build on the first device in `dtype` (fast on a GPU), then dispatch like from_pretrained does."""
    first = next(iter(device_map.values()))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    torch.manual_seed(0)  # every rank and replica builds the same weights (conv layers keep the default init)
    try:
        with torch.device(first):
            model = from_config(name, folder)
    finally:
        torch.set_default_dtype(previous)
    trained_like_init(model)
    model.eval()
    if len(set(device_map.values())) > 1:
        dispatch_model(model, device_map=device_map)
    return model


def keep_block_hooks(model: torch.nn.Module) -> int:
    """After a split's dispatch: keep the device hook of each module the device map names (a block, an
    embedding) and drop the hooks accelerate put inside it, where the module's weights all sit on the hook's
    own device. accelerate's `attach_execution_device_hook` gives every submodule with weights its own
    AlignDevicesHook (a block's `img_mod`, `ff`, ...); inside a block wholly on one GPU they move inputs to
    where the block's hook already moved them, and their `pre_forward` is torch.compiler.disable'd, so a
    block compiled with fullgraph=True fails on them: the 2x 31 GiB split's compile warm-up fell back to eager
    on `img_mod`'s hook on 2x H200 (docs/gpu-runs/2026-11-28-2xh200.md, code at dada870). Returns how many it
    dropped."""
    dropped = 0
    for module in list(model.modules()):
        hook = internals.device_hook(module)
        if module is model or hook is None or getattr(hook, "offload", False):
            continue
        home = getattr(hook, "execution_device", None)
        tensors = [*module.parameters(), *module.buffers()]
        if home is None or not tensors or any(t.device != torch.device(home) for t in tensors):
            continue
        for child in module.children():
            before = sum(internals.has_device_hook(m) for m in child.modules())
            remove_hook_from_submodules(child)
            dropped += before
    return dropped


def weights_per_gpu() -> dict[str, float]:
    """MiB torch holds on each of this rank's GPUs right after loading, before any job or warm-up: the
    weights (the GPU panel's "our weights"; keyed cuda:0.. as this process numbers its GPUs)."""
    return {f"cuda:{i}": round(torch.cuda.memory_allocated(i) / 1024**2, 1)
            for i in range(torch.cuda.device_count())}
