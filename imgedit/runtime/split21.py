"""Qwen-Image-2.1 on a group of GPUs with CFG off: each forward's target image split over the ranks.

2.1's transformer (diffusers 0.42.1 QwenImage21Transformer2DModel) runs one joint sequence: the prefix (the
prompt's tokens, then each condition image's) and the target image's tokens last. Its attention is
block-causal: the prefix never sees the target, and every target token sees the whole prefix and the whole
target. With the prefix KV cache (the pipeline's default) the first step writes the prefix's keys and values
and every later step runs the target's tokens alone against them.

Here each of the group's n ranks runs every forward with the whole prefix and 1/n of the target's tokens
(rows `[r·T/n, (r+1)·T/n)` of the target): the projections, the feed-forward, the norms and the attention's
queries of the other rows are some other rank's work. Before each attention the ranks all-gather the target's
keys and values (keys from every rank's rows, in order), so every query row still sees the keys it would see
on one GPU; after the last block the ranks all-gather the output's target rows. The prefix rows are computed
on every rank (so each holds the whole prefix cache): at text to image that is the prompt, ~1-4 % of the
tokens; a condition image's 4,096 tokens at 1024² run on every rank in the first step only.

Why this and not diffusers' context parallelism (Ulysses): 2.1's transformer has no `_cp_plan` in diffusers
0.42.1, and its prefix cache, block-causal prefill and per-token modulation do not fit an even split of the
whole sequence. Communication is the same as Ulysses-2's at n = 2 (each rank receives T·inner·2 bytes of keys
and values a block), and the attention's work divides as the rest does.

Hooks (diffusers' HookRegistry, and the instance's `build_token_metadata`): the rotary table and the token
metadata come out of `pos_embed`/`build_token_metadata` with this rank's rows; block 0 takes this rank's rows
of the joint hidden states (it stays outside a compiled block: imgedit.runtime.compile21 keeps `HOOK`
outermost); every attention module carries the split (`ATTR`) that imgedit.model.attention21's processor
gathers keys and values over; `proj_out` gathers the output. A target whose token count the degree does not
divide runs whole on every rank (the same image, no gain): with 2.1's 32-pixel sides the latent sides are
even, so 2 and 4 always divide it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from diffusers.hooks import HookRegistry, ModelHook

from imgedit.model import attention21, internals

log = logging.getLogger(__name__)

HOOK = "imgedit_split21"
ATTR = attention21.SPLIT_ATTR  # on every attention module of a split transformer: its TargetSplit


@dataclass(frozen=True)
class Geometry:
    """One forward's split: prefix rows kept whole, the target's T rows cut into n shares of T/n."""

    prefix: int
    target: int
    share: int
    rows: torch.Tensor  # this rank's rows of the whole joint sequence: the prefix, then its share


class TargetSplit:
    """One rank's part of a group that splits 2.1's target tokens. `group`: the process group of the ranks
    that split (default: the worker's world, every rank of its group); `install` on each transformer the
    worker serves with."""

    def __init__(self, rank: int, degree: int, group=None):
        if degree < 2 or not 0 <= rank < degree:
            raise ValueError(f"rank {rank} of a split over {degree}")
        self.rank, self.degree = rank, degree
        self.group = group if group is not None else dist.group.WORLD
        self.on = False  # this forward is split (set per forward, from its target's size)
        self.geometry: Geometry | None = None
        self._whole_logged = False
        self._last: Geometry | None = None

    # ---- the forward's geometry -------------------------------------------------------------------------
    def plan(self, img_shapes, full_length: int, device) -> None:
        """Called with the forward's rotary inputs (its first hook): decide this forward's rows."""
        target = math.prod(img_shapes[-1])
        if target % self.degree:
            if not self._whole_logged:
                log.info("a target of %d tokens does not split %d ways: such forwards run whole on "
                         "every rank", target, self.degree)
                self._whole_logged = True
            self.on, self.geometry = False, None
            return
        prefix, share = full_length - target, target // self.degree
        last = self._last
        if last is None or (last.prefix, last.target, last.rows.device) != (prefix, target,
                                                                             torch.device(device)):
            start = prefix + self.rank * share
            rows = torch.cat([torch.arange(prefix), torch.arange(start, start + share)]).to(device)
            self._last = Geometry(prefix, target, share, rows)
        self.on, self.geometry = True, self._last

    def rows_of(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's rows of a tensor laid out over the whole joint sequence (on `dim`)."""
        return tensor.index_select(dim, self.geometry.rows)

    # ---- the exchanges ----------------------------------------------------------------------------------
    def gather(self, tensor: torch.Tensor, prefix: int) -> torch.Tensor:
        """(B, prefix + T/n, ...) on each rank → (B, prefix + T, ...): the target rows of every rank, in
        order, after this rank's prefix rows."""
        return self.finish(self.start(tensor, prefix))

    def start(self, tensor: torch.Tensor, prefix: int):
        """`gather` begun: the kernels the caller issues before `finish` run beside the exchange (the
        attention projects the queries while the keys and values travel)."""
        return tensor[:, :prefix], internals.all_gather_start(tensor[:, prefix:], self.group)

    def finish(self, started) -> torch.Tensor:
        head, gathered = started
        target = internals.all_gather_finish(gathered, 1, self.degree)
        return target if head.shape[1] == 0 else torch.cat([head, target], dim=1)

    # ---- installing ---------------------------------------------------------------------------------------
    def install(self, transformer: torch.nn.Module) -> None:
        if is_split(transformer):
            return
        blocks = transformer.transformer_blocks
        if not all(isinstance(b.attn.processor, attention21.Attention21) for b in blocks):
            attention21.install(transformer)  # the processor that gathers; the Attention21 feature keeps it
        for block in blocks:
            setattr(block.attn, ATTR, self)
        _register(transformer.pos_embed, _Rotary(self))
        _register(blocks[0], _FirstBlock(self))
        _register(transformer.proj_out, _Output(self))
        original = transformer.build_token_metadata  # the class's, or Metadata21's memo on the instance

        def build_token_metadata(image_pad_mask, img_shapes):
            image_ids, target_mask = original(image_pad_mask, img_shapes)
            if not self.on:
                return image_ids, target_mask
            return self.rows_of(image_ids, 0), self.rows_of(target_mask, 0)

        transformer.build_token_metadata = build_token_metadata
        HookRegistry.check_if_exists_or_initialize(transformer).invalidate_child_registries_cache()


def is_split(transformer: torch.nn.Module) -> bool:
    return getattr(transformer.transformer_blocks[0].attn, ATTR, None) is not None


def _register(module: torch.nn.Module, hook: ModelHook) -> None:
    HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, HOOK)


class _Rotary(ModelHook):
    """pos_embed(img_shapes, image_pad_mask, device): plans the forward; its table comes back with this rank's
    rows (the transformer slices the prefix off it in a cached step: the share stays)."""

    def __init__(self, split: TargetSplit):
        super().__init__()
        self.split = split

    def pre_forward(self, module, *args, **kwargs):
        img_shapes, pad_mask = args[:2]  # diffusers 0.42.1 passes both by position
        self.split.plan(img_shapes, pad_mask.shape[-1], pad_mask.device)
        return args, kwargs

    def post_forward(self, module, output):
        return self.split.rows_of(output, 0) if self.split.on else output


class _FirstBlock(ModelHook):
    """Block 0 takes this rank's rows of the joint hidden states: the prefix and its share in a step that runs
    the prefix, its share of the target in a cached step."""

    def __init__(self, split: TargetSplit):
        super().__init__()
        self.split = split

    def pre_forward(self, module, *args, **kwargs):
        geometry = self.split.geometry
        if not self.split.on:
            return args, kwargs
        hidden = kwargs["hidden_states"]
        if hidden.shape[1] == geometry.prefix + geometry.target:
            kwargs["hidden_states"] = self.split.rows_of(hidden, 1)
        elif hidden.shape[1] == geometry.target:
            start = self.split.rank * geometry.share
            kwargs["hidden_states"] = hidden[:, start:start + geometry.share]
        else:
            raise RuntimeError(f"2.1 split: block 0 got {hidden.shape[1]} rows; expected "
                               f"{geometry.prefix + geometry.target} or {geometry.target}")
        return args, kwargs


class _Output(ModelHook):
    """proj_out: every rank's target rows gathered, after this rank's prefix rows (the whole output)."""

    def __init__(self, split: TargetSplit):
        super().__init__()
        self.split = split

    def post_forward(self, module, output):
        if not self.split.on:
            return output
        return self.split.gather(output, output.shape[1] - self.split.geometry.share)
