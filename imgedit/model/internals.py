"""Every touch of a library's private member, in one module, with the library version it was read from.

A diffusers, transformers, accelerate or torch upgrade may move any of these without notice: `MEMBERS`
lists each one (the library, the version the code below was written against, where the member lives), and
tests/test_internals.py looks every one of them up on the installed libraries (it fails when one moves)
and checks that no other worker-side module of ours reaches into a library's private member. Everything
else uses the libraries' public API (diffusers' HookRegistry/ModelHook, set_attention_backend, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
import torch.fx.experimental._config  # noqa: F401 - no_duck_shapes patches it
from diffusers.hooks import context_parallel
from diffusers.models.attention_dispatch import AttentionBackendName


@dataclass(frozen=True)
class Member:
    library: str
    version: str  # the version this module was written against
    # where the member lives: a module or class path, or, ending in "()", what makes an instance holding it
    owner: str
    name: str
    why: str


DIFFUSERS, ACCELERATE, TORCH = "diffusers 0.42.1", "accelerate 1.15.0", "torch 2.13.0"
TRANSFORMERS = "transformers 5.17.0"

MEMBERS = (
    Member("diffusers", DIFFUSERS, "diffusers.DiffusionPipeline", "_execution_device",
           "the device the pipeline makes its latents on (the loader checks the plan against it)"),
    Member("diffusers", DIFFUSERS, "diffusers.QwenImageEditPlusPipeline", "_encode_vae_image",
           "the VAE encode of one condition image: memoised (encode_cache), used for a mask's latents"),
    Member("diffusers", DIFFUSERS, "diffusers.QwenImageEditPipeline", "_encode_vae_image",
           "as above, Qwen-Image-Edit's"),
    Member("diffusers", DIFFUSERS, "diffusers.QwenImageEditPlusPipeline", "_pack_latents",
           "latents packed as the transformer reads them (masked edits blend them per step)"),
    Member("diffusers", DIFFUSERS, "diffusers.models.cache_utils.CacheMixin", "_reset_stateful_cache",
           "a step cache's state dropped after a job that ended early"),
    Member("diffusers", DIFFUSERS, "diffusers.image_processor.VaeImageProcessor",
           "_denormalize_conditionally",
           "the postprocess arithmetic run on the GPU (pixels)"),
    Member("diffusers", DIFFUSERS,
           "diffusers.models.autoencoders.autoencoder_kl_qwenimage.QwenImageCausalConv3d()", "_padding",
           "a causal 3-D convolution's padding, to run one frame as a 2-D convolution (single_frame)"),
    Member("diffusers", DIFFUSERS,
           "diffusers.models.transformers.transformer_qwenimage.QwenDoubleStreamAttnProcessor2_0",
           "_attention_backend", "the attention kernel a processor is set to, read back for /health"),
    Member("diffusers", DIFFUSERS,
           "diffusers.models.transformers.transformer_qwenimage21.QwenImage21AttnProcessor",
           "_attention_backend", "as above, Qwen-Image-2.1's"),
    Member("diffusers", DIFFUSERS,
           "diffusers.models.transformers.transformer_qwenimage.QwenDoubleStreamAttnProcessor2_0",
           "_parallel_config", "a CFG pair's Ulysses switched off per job (PAIR_ULYSSES)"),
    Member("diffusers", DIFFUSERS, "diffusers.hooks.context_parallel",
           "_CONTEXT_PARALLEL_INPUT_HOOK_TEMPLATE",
           "the names of the context-parallel split hooks, switched off per job"),
    Member("diffusers", DIFFUSERS, "diffusers.hooks.context_parallel",
           "_CONTEXT_PARALLEL_OUTPUT_HOOK_TEMPLATE",
           "the names of the context-parallel gather hooks, switched off per job"),
    Member("diffusers", DIFFUSERS, "diffusers.models.attention_dispatch.AttentionBackendName",
           "_NATIVE_FLASH",
           "PyTorch's own FlashAttention-2 kernel through dispatch_attention_fn: 2.1's causal text segment "
           "(attention21)"),
    Member("diffusers", DIFFUSERS, "diffusers.hooks.HookRegistry.check_if_exists_or_initialize()",
           "_diffusers_hook", "a module's HookRegistry, to find the context-parallel hooks"),
    Member("diffusers", DIFFUSERS, "diffusers.hooks.HookRegistry()", "_fn_refs",
           "a hooked block's own forward (the first hook's reference), compiled under its "
           "context-parallel hooks"),
    Member("diffusers", DIFFUSERS, "diffusers.loaders.peft.PeftAdapterMixin", "_hf_peft_config_loaded",
           "a fused copy of a transformer is no peft model (fast_weights)"),
    Member("accelerate", ACCELERATE, "accelerate.hooks.add_hook_to_module()", "_hf_hook",
           "accelerate's device hook of a module (placement, block splits, streaming)"),
    Member("accelerate", ACCELERATE, "accelerate.hooks.add_hook_to_module()", "_old_forward",
           "the forward an accelerate hook wraps: a split block compiles inside its hook"),
    Member("transformers", TRANSFORMERS, "transformers.GenerationMixin", "_valid_auto_compile_criteria",
           "generate() runs its decoding steps through get_compiled_call when this says so (a static cache "
           "on a GPU, compile not disabled): decode_graphs is installed as that call"),
    Member("transformers", TRANSFORMERS, "transformers.PretrainedConfig()", "_attn_implementation",
           "the attention a text encoder's vision tower runs (vision_attention replaces its window loop)"),
    Member("torch", TORCH, "torch.nn.Module()", "_parameters",
           "a parameter held directly by an intermediate module, moved on its own"),
    Member("torch", TORCH, "torch.nn.Module.compile()", "_compiled_call_impl",
           "Module.compile undone (a compile that failed its warm-up falls back to eager)"),
    Member("torch", TORCH, "torch.fx.experimental._config", "use_duck_shape",
           "2.1's compiled steps: equal sizes not unified into one symbol (compile21)"),
    Member("torch", TORCH, "torch.distributed._functional_collectives", "all_gather_tensor",
           "2.1's split (split21): keys, values and output gathered inside a compiled block (traceable)"),
    Member("torch", TORCH, "torch._dynamo.config", "recompile_limit",
           "room for every compiled variant a worker warms up (LoRAs, copies, Ulysses states)"),
    Member("torch", TORCH, "torch._dynamo.utils", "counters",
           "the graphs dynamo has compiled in this process (counters['stats']['unique_graphs']): a job that "
           "compiled after the warm-up is counted and logged (budget)"),
)


# ---- diffusers -----------------------------------------------------------------------------------
def execution_device(pipe) -> torch.device:
    return pipe._execution_device


def encode_vae_image(pipe, image: torch.Tensor, generator=None) -> torch.Tensor:
    return pipe._encode_vae_image(image, generator=generator)


def vae_encode(pipe):
    """The pipeline's own `_encode_vae_image`, bound (to wrap it)."""
    return pipe._encode_vae_image


def replace_vae_encode(pipe, function) -> None:
    """This instance's `_encode_vae_image` (the pipelines call it by keyword: `image=`, `generator=`)."""
    pipe._encode_vae_image = function


def pack_latents(pipe, latents: torch.Tensor) -> torch.Tensor:
    return pipe._pack_latents(latents, 1, latents.shape[1], *latents.shape[-2:])


def reset_stateful_cache(transformer) -> None:
    transformer._reset_stateful_cache()


def denormalize_conditionally(processor, image: torch.Tensor, do_denormalize) -> torch.Tensor:
    return processor._denormalize_conditionally(image, do_denormalize)


def causal_padding(conv) -> tuple | None:
    """A QwenImage causal 3-D convolution's padding (left/right of width, height, time), or None."""
    return getattr(conv, "_padding", None)


def attention_backend(processor):
    return getattr(processor, "_attention_backend", None)


def set_attention_backend(processor, backend) -> None:
    """A processor made by us takes the kernel of the one it replaces (set_attention_backend's value)."""
    processor._attention_backend = backend


def native_flash_backend():
    """diffusers' name for SDPA restricted to PyTorch's FlashAttention-2 kernel."""
    return AttentionBackendName._NATIVE_FLASH


def parallel_config(processor):
    return getattr(processor, "_parallel_config", None)


def set_parallel_config(processor, config) -> None:
    processor._parallel_config = config


def context_parallel_hooks(module: torch.nn.Module) -> list:
    """The context-parallel split and gather hooks diffusers' enable_parallelism registered on `module`."""
    registry = getattr(module, "_diffusers_hook", None)
    if registry is None:
        return []
    prefixes = (context_parallel._CONTEXT_PARALLEL_INPUT_HOOK_TEMPLATE.format(""),
                context_parallel._CONTEXT_PARALLEL_OUTPUT_HOOK_TEMPLATE.format(""))
    return [hook for name, hook in registry.hooks.items() if name.startswith(prefixes)]


def innermost_forward(module: torch.nn.Module):
    """The module's own forward under its diffusers hooks (the first hook's reference to it), or None for a
    module without them."""
    registry = hook_registry(module)
    return registry._fn_refs[0].forward if registry is not None and registry._fn_refs else None


def replace_innermost_forward(module: torch.nn.Module, forward) -> None:
    hook_registry(module)._fn_refs[0].forward = forward


def hook_registry(module: torch.nn.Module):
    """The module's diffusers HookRegistry, or None (HookRegistry.check_if_exists_or_initialize makes one)."""
    return getattr(module, "_diffusers_hook", None)


def has_diffusers_hooks(module: torch.nn.Module) -> bool:
    return hasattr(module, "_diffusers_hook")


def unmark_peft(model: torch.nn.Module) -> None:
    model._hf_peft_config_loaded = False


# ---- transformers --------------------------------------------------------------------------------
def attention_implementation(config) -> str:
    return str(getattr(config, "_attn_implementation", "") or "")


def replace_compiled_call(model: torch.nn.Module, call) -> None:
    """generate()'s decoding steps run `call` instead of the compiled forward transformers would build (the
    instance's `get_compiled_call`, which generate() asks when _valid_auto_compile_criteria holds)."""
    model.get_compiled_call = lambda compile_config=None: call


def restore_compiled_call(model: torch.nn.Module) -> None:
    model.__dict__.pop("get_compiled_call", None)


# ---- accelerate ----------------------------------------------------------------------------------
def device_hook(module: torch.nn.Module):
    """accelerate's hook of this module (AlignDevicesHook, a SequentialHook...), or None."""
    return getattr(module, "_hf_hook", None)


def has_device_hook(module: torch.nn.Module) -> bool:
    return hasattr(module, "_hf_hook")


def hooked_forward(module: torch.nn.Module):
    """The forward accelerate's hook calls after its pre_forward, or None for a module without one."""
    return getattr(module, "_old_forward", None) if has_device_hook(module) else None


def replace_hooked_forward(module: torch.nn.Module, forward) -> None:
    module._old_forward = forward


# ---- torch ---------------------------------------------------------------------------------------
def replace_parameter(module: torch.nn.Module, name: str, device: str) -> None:
    """Move a parameter held directly by `module` (not one of its submodules) to `device`."""
    data = module._parameters[name].to(device)
    module._parameters[name] = torch.nn.Parameter(data, requires_grad=False)


def drop_compiled_call(module: torch.nn.Module) -> bool:
    """Undo Module.compile on this module; whether it was compiled."""
    if getattr(module, "_compiled_call_impl", None) is None:
        return False
    module._compiled_call_impl = None
    return True


def no_duck_shapes():
    """A context in which dynamo gives every dimension a symbol of its own, even two of equal size."""
    return torch.fx.experimental._config.patch(use_duck_shape=False)


_GATHER = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def all_gather(tensor: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    """Every rank's `tensor` of `group` (`size` ranks), concatenated on `dim` in rank order; dynamo traces it
    (a compiled block keeps its exchange in the graph), where torch.distributed.all_gather_into_tensor breaks
    the graph."""
    return all_gather_finish(all_gather_start(tensor, group), dim, size)


def all_gather_start(tensor: torch.Tensor, group) -> torch.Tensor:
    """Begin gathering every rank's `tensor` on dim 0. Eager, the collective runs on its own stream and the
    result (an AsyncCollectiveTensor) waits at its first use, so kernels issued before `all_gather_finish`
    run beside it. Compiled, inductor by default waits right after the start; its reordering passes
    (`reorder_for_compute_comm_overlap`, sink_waits + raise_comms) move the wait to the use, but did not
    change a split 2.1 step on 2x H200 (66.0 ms against 66.1, 2026-11-29 at 4eb5783) and are not used.
    torch 2.13 names it all_gather_single (all_gather_tensor warns there); torch 2.11 all_gather_tensor."""
    return _GATHER(tensor.contiguous(), 0, group)


def all_gather_finish(gathered: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """The (size·B, ...) result of `all_gather_start` as the ranks' tensors concatenated on `dim`. Not
    the library's concatenation for a dim other than 0 (torch._utils._maybe_view_chunk_cat), which torch
    2.11's dynamo skips (2.13 traces it): the compiled block failed and fell back to eager (the 2-GPU split's
    run on 2026-11-29). A reshape instead of a cat: at batch 1 on dim 1 the ranks' rows already lie in
    order, so it is a view and copies nothing."""
    dim %= gathered.dim()  # a negative dim counts from the end, as torch.cat's does
    if dim == 0:
        return gathered
    return gathered.unflatten(0, (size, -1)).movedim(0, dim).flatten(dim, dim + 1)


def raise_recompile_limit(limit: int) -> None:
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)


def graphs_compiled() -> int:
    """The graphs dynamo has compiled in this process so far (one per graph its backend compiled)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
