"""Step caches for quality edits (CACHE, a request's `cache`): diffusers' own cache hooks on the transformer.

- first-block (diffusers FirstBlockCache, the idea of TeaCache and ParaAttention's FBCache): every step runs
  the first transformer block; when its residual changed by less than CACHE_THRESHOLD (relative) since the
  last full step, the other blocks are skipped and their last residual is reused.
- taylorseer (diffusers TaylorSeerCache): full steps every `cache_interval`, the steps between forecast from
  the blocks' recent outputs (a first-order Taylor expansion), after a few full warm-up steps.

Both are lossy and opt-in. The hooks keep per-branch state (the pipelines call the transformer in the
"cond" and "uncond" cache contexts), which diffusers resets at the end of a pipeline call; a job that
ends early (cancelled, failed) would leave it behind, so the runner resets it after every job.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

from diffusers import FirstBlockCacheConfig, TaylorSeerCacheConfig

from imgedit.model import internals

log = logging.getLogger(__name__)

# Full steps every 3 (of 40: 14 full, 26 forecast), after 5 full warm-up steps; first order.
TAYLORSEER = dict(cache_interval=3, disable_cache_before_step=5, max_order=1)


class StepCache:
    def __init__(self, transformer):
        self.transformer = transformer
        self.active: tuple[str, float] = ("none", 0.0)

    def use(self, mode: str, threshold: float) -> None:
        """Before a job: the hooks for `mode` (kept while the following jobs ask the same)."""
        wanted = (mode, threshold if mode == "first-block" else 0.0)
        if wanted == self.active:
            return
        if self.active[0] != "none":
            self.transformer.disable_cache()
            self.active = ("none", 0.0)
        if mode == "first-block":
            self.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
        elif mode == "taylorseer":
            self.transformer.enable_cache(TaylorSeerCacheConfig(**TAYLORSEER))
        self.active = wanted
        shown = mode if mode != "first-block" else f"first-block (threshold {threshold:g})"
        log.info("step cache: %s", shown)

    @contextmanager
    def job(self, call):
        """A job's part (imgedit.runtime.runner.Call): the cache it asks for, none of its state left after."""
        self.use(call.job.params.cache, call.job.params.cache_threshold)
        try:
            yield
        finally:
            self.end()

    def end(self) -> None:
        """After a job, however it ended: no state of it reaches the next one."""
        if self.active[0] != "none":
            internals.reset_stateful_cache(self.transformer)
