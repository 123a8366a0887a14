"""Start-up checks and worker specs, before any worker process starts: every mode the settings ask for is
checked against the plan (and refused with the reason, in the user's words, where this machine cannot run
it), and each planned worker gets the spec its processes load from. No torch: the sizes and the LoRA
check came from imgedit.engine.inspection's subprocess."""

from __future__ import annotations

import logging

from imgedit.config.settings import Settings
from imgedit.engine.gpus import host_threads
from imgedit.planning import modes
from imgedit.planning.checkpoint import Checkpoint
from imgedit.planning.families import FAMILIES, not_built
from imgedit.planning.plan import WorkerPlan
from imgedit.runtime.messages import WorkerSpec

log = logging.getLogger(__name__)


def refusal(settings: Settings, plans: list[WorkerPlan], checkpoint: Checkpoint, loras: tuple) -> str | None:
    """The first mode these workers cannot run (the attention kernel, FAST_QUANTIZE, CACHE), or None; each
    mode that can run is logged as it will run."""
    s = settings
    if (refused := family_refusal(s, plans, checkpoint.family)) is not None:
        return refused
    if (refused := modes.kernel_refusal(s, plans, checkpoint.attention_heads)) is not None:
        return refused
    log.info("attention kernel: %s; compile mode: %s", s.attention, modes.compile_mode(s, plans))
    if s.fast_quantize != "none":
        copied = [f for f in loras if f.steps in modes.fast_steps(s)]
        if (refused := modes.fast_refusal(s, plans, len(copied))) is not None:
            return refused
        log.info("fast mode weights: a %s copy of the transformer for %s, the LoRA fused in (FAST_QUANTIZE; "
                 "lossy)", s.fast_quantize, ", ".join(f.name for f in copied))
    if s.cache != "none":
        if (refused := modes.cache_refusal(s, plans)) is not None:
            return f"CACHE={s.cache} cannot run here: {refused}"
        log.info("step cache for quality edits: %s%s", s.cache,
                 f" (threshold {s.cache_threshold:g})" if s.cache == "first-block" else "")
    return None


def family_refusal(settings: Settings, plans: list[WorkerPlan], family: str) -> str | None:
    """The first setting that asks for a mode not built for the checkpoint's model family, or None."""
    s = settings
    model = FAMILIES[family].model
    asked = [("cache", s.cache != "none", f"CACHE={s.cache}"),
             ("lightning", s.fast_quantize != "none", f"FAST_QUANTIZE={s.fast_quantize}"),
             ("batch_cfg", any(p.memory is not None and p.memory.batch_cfg for p in plans), "BATCH_CFG"),
             ("compile", s.compile == "on", "COMPILE=on")]
    for mode, on, setting in asked:
        if on and (why := not_built(family, mode)) is not None:
            return f"{setting} cannot serve {model}: {why}"
    return None


def worker_spec(settings: Settings, plan: WorkerPlan, every: tuple[WorkerPlan, ...], checkpoint: Checkpoint,
                loras: tuple, hook: str | None, warmup_sizes: tuple[tuple[int, int], ...]) -> WorkerSpec:
    """What the processes of `plan`'s worker load and how (rank 0's; each rank gets its own at spawn).
    `every`: all planned workers (WORKER_THREADS shares the host's CPU threads among them)."""
    s = settings
    return WorkerSpec(name=plan.name, rank=0, world=plan.ranks, parallel=plan.parallel, plan=plan,
                      checkpoint=checkpoint, dtype=s.torch_dtype, compile=modes.compile_enabled(s, plan),
                      hook=hook, auto_cleanup=s.auto_cleanup, warmup_sizes=warmup_sizes,
                      ulysses=plan.ulysses, loras=loras,
                      pair_ulysses=modes.pair_ulysses(s, plan, checkpoint.attention_heads),
                      encode_cache=s.encode_cache, attention=s.attention, compile_mode=s.compile_mode,
                      fuse_lora=modes.fuse_lora(s, plan), activation_reserve=s.activation_reserve,
                      fast_quantize=s.fast_quantize, fast_steps=modes.fast_steps(s),
                      cpu_threads=modes.worker_threads(s, plan, every, *host_threads()))
