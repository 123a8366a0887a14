"""Batched CFG: both branches of true CFG in one transformer forward of batch 2 (BATCH_CFG).

Why: when transformer blocks are streamed from the CPU (OFFLOAD=blocks, the 24 GB mode), every
forward copies each streamed block to the GPU. The diffusers edit pipelines call the transformer
twice per step (cond, then uncond), so each streamed block crossed PCIe twice per step and the step
was bound by the copies (measured on an H200 under a 22 GiB cap: 1.124 s/step against 0.744 s
resident). One forward of batch 2 copies each block once per step and does the same arithmetic.

How: the pipeline's loop is left untouched (as in runtime.cfg_parallel) and this instance's
`forward` is overridden. At the cond call it keeps the arguments and answers with a buffer; at the
uncond call it runs one forward on both (the two prompts padded to the same length, the padding
masked out: runtime.ulysses.pad_text), fills the buffer in place with the cond half and returns the
uncond half. The pipeline keeps `noise_pred[:, :n]`, a view of that buffer, and reads it only when
it combines the two, after the uncond call. Real text tokens keep their rotary positions, so each
half equals its own unbatched forward up to floating-point rounding (a batch of two and a masked
attention pick other kernels than two batches of one: tests/test_batch_cfg.py bounds the difference
on the CPU, benchmarks/bench_quant.py measures it on the GPU).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from imgedit.runtime.cfg_parallel import ForwardOverride
from imgedit.runtime.cfg_parallel import wrap_output as _wrap
from imgedit.runtime.ulysses import pad_text


class CfgBatch:
    """Installs the batching forward on `transformer`; `begin(active)` before each pipeline call."""

    def __init__(self, transformer: torch.nn.Module):
        self.active = False
        self.forwards = 0  # transformer forwards run while active (tests count them)
        self._calls = 0
        self._cond: dict | None = None
        self._buffer: torch.Tensor | None = None
        self._text: tuple | None = None  # this job's merged prompts (merge_text)
        self._out_features = transformer.proj_out.out_features
        self._override = ForwardOverride(transformer, self._make_forward())

    def begin(self, active: bool) -> None:
        """active: this job runs true CFG (two calls per step). Off, the transformer behaves as usual."""
        self._override.keep()
        self.active = active
        self._calls = 0
        self._cond = self._buffer = self._text = None

    @contextmanager
    def job(self, call):
        """A job's part (imgedit.runtime.runner.Call): batched while it runs true CFG."""
        self.begin(call.cfg_on)
        try:
            yield
        finally:
            self.begin(False)

    def _make_forward(self):
        batch = self

        def forward(module, *args, **kwargs):
            if not batch.active or args:  # the pipelines pass keywords only; anything else runs as it is
                return batch._override.call(*args, **kwargs)
            branch = batch._calls % 2  # 0: cond call, 1: uncond call
            batch._calls += 1
            return batch._cond_call(kwargs) if branch == 0 else batch._uncond_call(kwargs)

        return forward

    def _cond_call(self, kwargs: dict):
        if self._cond is not None:  # the last cond call got no uncond call: this job does not run CFG
            raise RuntimeError("BATCH_CFG: two cond calls in a row (the job was armed as a true-CFG job)")
        self._cond = kwargs
        hidden = kwargs["hidden_states"]
        self._buffer = torch.empty(hidden.shape[:-1] + (self._out_features,),
                                   dtype=hidden.dtype, device=hidden.device)
        return _wrap(self._buffer, kwargs.get("return_dict", True))

    def _uncond_call(self, uncond: dict):
        cond, self._cond = self._cond, None
        n = cond["hidden_states"].shape[0]
        if self._text is None:
            self._text = merge_text(cond, uncond)
        out = self._override.call(**merge(cond, uncond, self._text))
        self.forwards += 1
        both = out[0] if isinstance(out, tuple) else out.sample
        self._buffer.copy_(both[:n])
        return _wrap(both[n:], uncond.get("return_dict", True))


def merge(cond: dict, uncond: dict, text: tuple | None = None) -> dict:
    """One forward's keyword arguments for both branches: batch = cond's samples, then uncond's.
    `text`: merge_text's result for this job, when already made (the prompts do not change per step)."""
    hidden, mask = text or merge_text(cond, uncond)
    merged = dict(uncond)
    merged.update(
        hidden_states=torch.cat([cond["hidden_states"], uncond["hidden_states"]]),
        encoder_hidden_states=hidden,
        encoder_hidden_states_mask=mask,
        timestep=torch.cat([cond["timestep"], uncond["timestep"]]),
        return_dict=False,
    )
    if cond.get("img_shapes") is not None:
        n = cond["hidden_states"].shape[0]
        merged["img_shapes"] = per_sample(cond["img_shapes"], n) + per_sample(uncond["img_shapes"], n)
    if cond.get("guidance") is not None:
        merged["guidance"] = torch.cat([cond["guidance"], uncond["guidance"]])
    return merged


def per_sample(img_shapes, n: int) -> list:
    """`img_shapes` with one entry per sample of a branch of `n` samples. The pipelines give it once per
    prompt (not per image: n=2 has one entry for two samples), which a forward of its own broadcasts;
    2511's condition index (zero_cond_t) is built per entry, so a merged batch needs one entry each."""
    shapes = list(img_shapes)
    return shapes * n if len(shapes) == 1 else shapes


def merge_text(cond: dict, uncond: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Both prompts' embeddings padded to one length and stacked, with the mask (None when nothing
    is padded). Once per job: `mask.all()` waits for the GPU."""
    texts = [cond["encoder_hidden_states"], uncond["encoder_hidden_states"]]
    masks = [cond.get("encoder_hidden_states_mask"), uncond.get("encoder_hidden_states_mask")]
    length = max(t.shape[1] for t in texts)
    padded = [pad_text(t, m, length=length) for t, m in zip(texts, masks, strict=True)]
    if any(m is not None for _, m in padded):
        mask = torch.cat([_ones(t) if m is None else m.to(torch.bool) for t, m in padded])
        mask = None if bool(mask.all()) else mask  # no padding anywhere: no mask, the fast attention kernels
    else:
        mask = None
    return torch.cat([t for t, _ in padded]), mask


def _ones(text: torch.Tensor) -> torch.Tensor:
    return torch.ones(text.shape[:2], dtype=torch.bool, device=text.device)
