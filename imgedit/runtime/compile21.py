"""COMPILE for Qwen-Image-2.1 (QwenImage21Transformer2DModel, diffusers 0.42.1): compile only the cached
("decode") steps, keep the first step (the prefill that writes the prefix key/value cache) eager.

Why not `compile_repeated_blocks(fullgraph=True, dynamic=True)` as the other families: the prefill's
attention (QwenImage21AttnProcessor) loops over `segments`, a Python list of (start, end, is_text) runs of
text and condition images, and stores the cache through `cache_write_slice = slice(0, prefix_len)`. Dynamo
unrolls the loop and guards on the list and on `cache_write_slice.stop == <prefix length>`, so every new
prompt length or reference count compiled the blocks again (tiny 2.1 on the CPU: one new graph for every one
of 6 requests after the first; TORCH_LOGS=recompiles names the guards).

The cached steps (kv_cache_mode="cached", steps 2..N with the pipeline's default use_kv_cache=True) take no
Python int that depends on the request: the block's inputs are the target tokens (B, T, D), the shared
modulation (B+1, 4D), the target's RoPE (T, d/2), a bool row mask (T,), and the layer cache's K/V
(B, P, H, d) with P the prefix length. All of T and P are symbolic with `dynamic=True`, so one graph serves
every prompt length, reference count and resolution. The prefill (one step of N; with use_kv_cache=False
every step, e.g. imgedit's prefix_cache on a capped GPU) runs the original eager block.

`compile_21(transformer)` installs it: a diffusers ModelHook on every block routes a call by its
`kv_cache_mode` keyword (the transformer passes it by keyword in 0.42.1) to one torch.compile'd copy of the
block class's forward (one code object: every block shares the compiled graph) or to the eager forward.
`uncompile_21(transformer)` removes the hooks. `warmup_requests()` lists what the warm-up must run.
"""

from __future__ import annotations

import weakref

import torch
import torch.fx.experimental._config  # noqa: F401 - torch private config, see new_forward
from diffusers.hooks import HookRegistry, ModelHook

from imgedit.model import internals
from imgedit.runtime import split21

HOOK_NAME = "imgedit_compile21_decode"
# Hooks that change a block's inputs before it runs (imgedit.runtime.split21's first block takes this rank's
# rows): the compiled routing calls the block class's forward itself, past any hook under it, so these stay
# above it (compile_21 lifts them and registers them again over its hook).
OUTSIDE = frozenset({split21.HOOK})
# diffusers 0.42.1: the keyword the transformer passes each block (QwenImage21Transformer2DModel.forward)
CACHED_MODE = "cached"


class _DecodeCompiledHook(ModelHook):
    """Calls with kv_cache_mode="cached" go to the compiled forward; every other call (the prefill with
    "extract", or None without the cache) to the block's eager forward."""

    def __init__(self, compiled, owned: dict):
        super().__init__()
        self.compiled = compiled
        self.owned = owned  # shared by every block's hook: per keyword, the last view made whole and its copy

    def new_forward(self, module, *args, **kwargs):
        return self.route(module, self.fn_ref.original_forward, *args, **kwargs)

    def route(self, module, eager, *args, **kwargs):
        if kwargs.get("kv_cache_mode") != CACHED_MODE:
            return eager(*args, **kwargs)
        kwargs = {k: self._whole(k, v) for k, v in kwargs.items()}
        # No duck sizing while this block compiles. With it, dynamo gives two dimensions of equal size
        # one symbol: the target's token count equals the inner dim at 1024² on the real model (64x64 = 4096
        # = 32 heads x 128) and at 64² on the tiny one (16), and layer_norm's normalized_shape guard then
        # fixed the target length (the next resolution compiled again); the cache's and the hidden states'
        # strides were unified the same way.
        with internals.no_duck_shapes():
            return self.compiled(module, *args, **kwargs)

    def _whole(self, name: str, value):
        """A tensor laid out as a fresh one (offset 0, row-major strides) for a view of a larger one. The
        decode step hands the first block `joint_hidden_states[:, prefix_len:]` and every block
        `rotary_emb[prefix_len:]` and the mask's tail. Given as they are, dynamo guarded on their storage
        offset (0/1-specialised: >= 2), on the first block's strides (a batch of 2's slice is not contiguous),
        and through `_base` (outside inference_mode) on the base's size: the first block and the others
        were two graphs, and the target length was fixed. The copy of a tensor every block gets (RoPE, mask)
        is made once per step: the same object comes again."""
        if not isinstance(value, torch.Tensor) or _is_fresh(value):
            return value
        last = self.owned.get(name)
        if last is None or last[0]() is not value:
            # a weak reference: the view keeps its base alive (the whole joint sequence, ~0.4 GB at 10
            # references), the copy holds the target's rows only
            last = self.owned[name] = (weakref.ref(value), value.clone(memory_format=torch.contiguous_format))
        return last[1]


def _is_fresh(t: torch.Tensor) -> bool:
    """Offset 0 and row-major strides, size-1 dimensions included (a slice of a batch of 1 is contiguous for
    torch but keeps its base's outer stride)."""
    if t.storage_offset() != 0:
        return False
    expected = 1
    for size, stride in zip(reversed(t.shape), reversed(t.stride()), strict=True):
        if stride != expected:
            return False
        expected *= size
    return True


def _block_class(transformer):
    blocks = transformer.transformer_blocks
    if not len(blocks):
        raise ValueError("the transformer has no blocks")
    return type(blocks[0])


def compile_21(transformer: torch.nn.Module, mode: str = "default", fullgraph: bool = True,
               backend: str = "inductor") -> int:
    """Compile the cached steps of every block of a QwenImage21Transformer2DModel, dynamic in the prefix and
    target lengths from the first compile. Returns how many blocks run compiled.

    - a plain block: a diffusers ModelHook routes each call;
    - a block under an accelerate device hook (a transformer split over GPUs, imgedit's
      weights.keep_block_hooks): the routing goes inside the hook, in place of `_old_forward`, so the hook
      still moves the inputs to the block's GPU first (its pre_forward is torch.compiler.disable'd: it must
      stay outside the graph);
    - a block whose hooks change its inputs first (OUTSIDE): the routing goes under them;
    - a block under any other diffusers hook (group offloading streams its weights in hooks): stays eager, as
      block_compile.compile_transformer keeps streamed blocks eager (the compiled call would skip the
      onloading)."""
    cls = _block_class(transformer)
    options: dict = {"fullgraph": fullgraph, "dynamic": True, "backend": backend} \
        | ({"mode": mode} if mode != "default" else {})
    # the class's function, not a bound method: one code object, so one cache entry for all blocks (the
    # blocks' weights are graph inputs, torch>=2.5 inline_inbuilt_nn_modules)
    compiled = torch.compile(cls.forward, **options)
    owned: dict = {}
    done = 0
    for block in transformer.transformer_blocks:
        registry = internals.hook_registry(block)
        if registry is not None and registry.get_hook(HOOK_NAME) is not None:
            done += 1
            continue
        eager = internals.hooked_forward(block)  # under accelerate's device hook (a split transformer)
        if eager is not None:
            hook = _DecodeCompiledHook(compiled, owned)
            block._imgedit_21_eager_forward = eager

            def routed(*args, _hook=hook, _block=block, _eager=eager, **kwargs):
                return _hook.route(_block, _eager, *args, **kwargs)

            internals.replace_hooked_forward(block, routed)
            done += 1
            continue
        outside = _lift_outside(registry)
        if registry is not None and registry.hooks:  # group offloading or another diffusers hook
            _put_back(registry, outside)
            continue
        registry = HookRegistry.check_if_exists_or_initialize(block)
        registry.register_hook(_DecodeCompiledHook(compiled, owned), HOOK_NAME)
        _put_back(registry, outside)
        done += 1
    HookRegistry.check_if_exists_or_initialize(transformer).invalidate_child_registries_cache()
    return done


def _lift_outside(registry) -> list:
    """Remove the hooks that must run before a compiled block (OUTSIDE) from its registry: (name, hook) in
    the order registered. Put back over the compiled routing, they still see every call first."""
    if registry is None:
        return []
    lifted = [(name, hook) for name, hook in registry.hooks.items() if name in OUTSIDE]
    for name, _ in lifted:
        registry.remove_hook(name, recurse=False)
    return lifted


def _put_back(registry, lifted: list) -> None:
    for name, hook in lifted:
        registry.register_hook(hook, name)


def uncompile_21(transformer: torch.nn.Module) -> None:
    """Every block runs eager again (the compiled graphs stay in dynamo's cache until
    torch.compiler.reset())."""
    for block in transformer.transformer_blocks:
        registry = internals.hook_registry(block)
        if registry is not None and registry.get_hook(HOOK_NAME) is not None:
            registry.remove_hook(HOOK_NAME, recurse=False)
        eager = block.__dict__.pop("_imgedit_21_eager_forward", None)
        if eager is not None:
            internals.replace_hooked_forward(block, eager)
    HookRegistry.check_if_exists_or_initialize(transformer).invalidate_child_registries_cache()


def is_compiled_21(transformer: torch.nn.Module) -> bool:
    block = transformer.transformer_blocks[0]
    registry = internals.hook_registry(block)
    return (registry is not None and registry.get_hook(HOOK_NAME) is not None) \
        or "_imgedit_21_eager_forward" in block.__dict__


def warmup_requests(max_images_per_prompt: int = 1, cfg: bool = False,
                    sizes: tuple = ((1024, 1024), (768, 1024))) -> list[dict]:
    """The pipeline calls the warm-up must make before users come: keyword arguments of
    QwenImage21Pipeline.__call__ except the prompt (`words`: a prompt of about that many words) and the
    condition images (`images`: how many, any content and size). Two steps each are enough: step 1 (the
    prefill) runs eager, step 2 compiles. `sizes`: (width, height) output sizes, the first two used.

    - one call, 1 image per prompt, one condition image: the first compile. Prefix and target lengths are
      symbolic from it (dynamic=True, no duck sizing): every later prompt length, reference count (0-10) and
      output size reuses it;
    - a second call with another prompt length, no condition image, another output size: checks that no guard
      specialised a length (it must compile nothing: assert it, or log the graphs it made);
    - with num_images_per_prompt > 1 allowed: one call at 2 images per prompt (dynamo specialises a batch of 1
      apart from larger ones; 2 covers every batch above 1: the batch symbol's range is [2, inf));
    - `cfg`: the same calls with true CFG (its negative branch runs the same block shapes, its own cache: it
      adds no graph; warm it only to load its kernels).
    The KV cache must be on (use_kv_cache=True, the default): without it no step runs compiled (the prefill
    path runs every step, eager), so imgedit's prefix_cache turning it off for a job is safe, just eager.
    """
    first, second = sizes[0], sizes[1] if len(sizes) > 1 else sizes[0]
    runs = [dict(images=1, words=3, width=first[0], height=first[1], num_images_per_prompt=1),
            dict(images=0, words=11, width=second[0], height=second[1], num_images_per_prompt=1)]
    if max_images_per_prompt > 1:
        runs.append(dict(images=2, words=5, width=first[0], height=first[1], num_images_per_prompt=2))
    if cfg:
        for run in runs:
            run.update(true_cfg_scale=4.0, negative_prompt=" ")
    return [dict(run, num_inference_steps=2) for run in runs]


# --- per-request memo of the transformer's token metadata (optional, independent of compile_21) -------------

MEMO_HOOK = "imgedit_21_metadata_memo"


class _RequestKey(ModelHook):
    """On the transformer: remembers which request a forward belongs to. The pipeline passes the same
    `img_mask` tensor object at every step of a call (diffusers 0.42.1 QwenImage21Pipeline.__call__:
    `image_pad_mask`, and `negative_image_pad_mask` for CFG's other branch), a new one for every call."""
    def __init__(self, state: dict):
        super().__init__()
        self.state = state

    def pre_forward(self, module, *args, **kwargs):
        img_mask, shapes = kwargs.get("img_mask"), kwargs.get("img_shapes")
        self.state["key"] = None
        if isinstance(img_mask, torch.Tensor) and shapes is not None:
            self.state["key"] = (weakref.ref(img_mask), tuple(tuple(s) for s in shapes[0]))
        return args, kwargs


def _same(key, other) -> bool:
    return key is not None and other is not None and key[0]() is not None and key[0]() is other[0]() \
        and key[1] == other[1]


class _RopeMemo(ModelHook):
    """On `transformer.pos_embed` (QwenImage21Rope): the rotary table of the whole joint sequence, built once
    per request and branch instead of at every step. diffusers 0.42.1 rebuilds it in Python lists from
    `image_pad_mask.tolist()` (a device sync) at every step, the cached ones included: 33 ms of one CPU core
    at 10 condition images at 1024² (45,356 tokens), against ~0.3 s of GPU work a cached step."""

    def __init__(self, state: dict):
        super().__init__()
        self.state = state
        self.memo: list = []  # [(key, rotary)], the last two (a CFG call's two branches)

    def new_forward(self, module, *args, **kwargs):
        key = self.state.get("key")
        for k, value in self.memo:
            if _same(key, k):
                return value
        value = self.fn_ref.original_forward(*args, **kwargs)
        if key is not None:
            self.memo = [*self.memo[-1:], (key, value)]
        return value


def memoize_21_metadata(transformer: torch.nn.Module) -> None:
    """Build the rotary table (and the token metadata: `build_token_metadata`, whose `nonzero` and Python list
    of 45k ids cost 11 ms a step at 10 references) once per request instead of once per step. Same values, so
    the same images bit for bit. Hooks only; `uncompile`-like removal: unmemoize_21_metadata."""
    state: dict = {}
    registry = HookRegistry.check_if_exists_or_initialize(transformer)
    if registry.get_hook(MEMO_HOOK) is not None:
        return
    registry.register_hook(_RequestKey(state), MEMO_HOOK)
    rope = HookRegistry.check_if_exists_or_initialize(transformer.pos_embed)
    rope.register_hook(_RopeMemo(state), MEMO_HOOK)
    # diffusers 0.42.1: the model calls `self.build_token_metadata(image_pad_mask, img_shapes[0])`, a
    # staticmethod; an instance attribute of the same name takes its place for this model only
    original = type(transformer).build_token_metadata
    memo: list = []

    def build_token_metadata(image_pad_mask, img_shapes):
        key = state.get("key")
        for k, value in memo:
            if _same(key, k):
                return value
        value = original(image_pad_mask, img_shapes)
        if key is not None:
            memo[:] = [*memo[-1:], (key, value)]
        return value

    transformer.build_token_metadata = build_token_metadata
    registry.invalidate_child_registries_cache()


def unmemoize_21_metadata(transformer: torch.nn.Module) -> None:
    for module in (transformer, transformer.pos_embed):
        registry = internals.hook_registry(module)
        if registry is not None and registry.get_hook(MEMO_HOOK) is not None:
            registry.remove_hook(MEMO_HOOK, recurse=False)
    transformer.__dict__.pop("build_token_metadata", None)
    HookRegistry.check_if_exists_or_initialize(transformer).invalidate_child_registries_cache()
