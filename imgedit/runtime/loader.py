"""Load a checkpoint's components onto the devices a `WorkerPlan` names and assemble the pipeline.

Each component is loaded on its own (`from_pretrained(..., device_map=...)`) so that a component
split by blocks gets accelerate's device hooks, and is then handed to the pipeline class named in
`model_index.json`. For benchmarks, `random_weights=True` builds the components from their configs
directly on the GPU (no weight files needed; speed and memory do not depend on the values).
"""

from __future__ import annotations

import logging

import diffusers
import torch
from accelerate.hooks import AlignDevicesHook, add_hook_to_module
from diffusers import FlowMatchEulerDiscreteScheduler
from transformers import Qwen2Tokenizer

from imgedit.errors import PlacementError
from imgedit.model import internals
from imgedit.model.processor import load_processor, processor_class

# open_checkpoint is re-exported: tests and benchmarks open a checkpoint through the loader
from imgedit.planning.checkpoint import MODEL_COMPONENTS, Checkpoint, open_checkpoint  # noqa: F401
from imgedit.planning.plan import WorkerPlan
from imgedit.runtime import offload, weights

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _move_inputs(model: torch.nn.Module, device: str) -> None:
    """Give a whole component that sits off the execution device a hook moving its inputs there
    and its outputs back (the pipeline creates inputs on its execution device)."""
    if not internals.has_device_hook(model):
        add_hook_to_module(model, AlignDevicesHook(execution_device=device, io_same_device=True))


def load_model(name: str, checkpoint: Checkpoint, worker: WorkerPlan, dtype: torch.dtype) -> torch.nn.Module:
    """One component of `checkpoint` onto the devices `worker` plans for `name` (quantized or streamed as its
    memory mode says), with the device hooks its placement needs. TURBO_MODEL_DIR's transformer is loaded
    this way too, onto the model's transformer's devices."""
    placement = worker.components[name]
    if worker.memory is not None and worker.memory.touches(name):  # QUANTIZE / OFFLOAD
        model = offload.load_component(name, checkpoint, placement, dtype, worker.memory)
    else:
        model = weights.load_component(name, checkpoint, placement, dtype)
    if placement.is_split:
        # a block's own device hook only: the ones inside it would stop its compile (keep_block_hooks)
        dropped = weights.keep_block_hooks(model)
        log.info("%s split over %s: kept the device hooks of its blocks, dropped %d inside them",
                 name, ", ".join(placement.devices), dropped)
    elif placement.device != worker.execution_device:
        _move_inputs(model, placement.device)
    return model.eval().requires_grad_(False)


def load_pipeline(checkpoint: Checkpoint, worker: WorkerPlan, dtype: torch.dtype):
    """Build one worker's pipeline on its devices."""
    folder = checkpoint.folder
    parts = {name: load_model(name, checkpoint, worker, dtype) for name in MODEL_COMPONENTS}
    if len(worker.devices) > 1 and not internals.has_device_hook(parts["vae"]):
        # diffusers' _execution_device asks the first registered component (the VAE); one without a
        # hook falls back to pipe.device, the first module by *name* (text_encoder), which may sit
        # on another GPU. A no-op hook on the VAE (already on the execution device) pins the answer.
        add_hook_to_module(parts["vae"], AlignDevicesHook(execution_device=worker.execution_device))
    pipeline_cls = getattr(diffusers, checkpoint.pipeline_class)
    kwargs = {}
    # the edit pipelines take a tokenizer; Qwen-Image-2.1's processor has it
    if (folder / "tokenizer").is_dir():
        kwargs["tokenizer"] = Qwen2Tokenizer.from_pretrained(folder / "tokenizer")
    pipe = pipeline_cls(
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler"),
        processor=load_processor(folder / "processor", processor_class(folder)),
        **kwargs,
        **parts,
    )
    pipe.set_progress_bar_config(disable=True)
    if any(internals.has_device_hook(model) for model in parts.values()):
        # A pipeline placed by a device map, marked as diffusers' own from_pretrained(device_map=...) marks
        # it. Unmarked, load_lora_weights() takes our device hooks for sequential CPU offload: it removes
        # every hook, the block splits' too, then calls enable_sequential_cpu_offload(), which streams the
        # whole pipeline from the CPU (lora_base._func_optionally_disable_offloading; measured on 2x H200: the
        # default balanced placement with a LoRA failed its compile warm-up on AlignDevicesHook.pre_forward).
        pipe.hf_device_map = {name: worker.components[name].describe() for name in parts}
    if internals.execution_device(pipe) != torch.device(worker.execution_device):
        raise PlacementError(
            f"{worker.name}: the pipeline would run on {internals.execution_device(pipe)}, "
            f"but the plan puts the latents on {worker.execution_device}")
    return pipe
