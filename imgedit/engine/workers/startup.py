"""Start-up, before any worker process starts: the family's settings, the workers planned (Ray's cluster or
this machine's GPUs, from the sizes and the LoRA check of engine.workers.inspection's subprocess: no torch
here), every mode the settings ask for checked against the plan (and refused with the reason, in the user's
words, where this machine cannot run it), and each planned worker's spec and handle (a process or a Ray
actor under one supervisor)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from imgedit.config.settings import Settings
from imgedit.engine.workers import ray_pool
from imgedit.engine.workers.gpus import discover_gpus, host_threads
from imgedit.engine.workers.inspection import inspect_checkpoint, inspection_start
from imgedit.engine.workers.pool import WorkerHandle
from imgedit.engine.workers.processes import ProcessTransport
from imgedit.engine.workers.standby import StandbyPool
from imgedit.errors import PlacementError, WorkerFailed
from imgedit.planning import modes, turbo
from imgedit.planning.checkpoint import Checkpoint
from imgedit.planning.families import FAMILIES, not_built
from imgedit.planning.memory import available_host_memory, bytes_item, plan_memory
from imgedit.planning.plan import GpuSpec, Plan, WorkerPlan
from imgedit.runtime.messages import WorkerSpec

log = logging.getLogger(__name__)


def family_settings(settings: Settings, family: str) -> Settings:
    """The settings whose `auto` depends on the model family, made the family's: QUANTIZE_SKIP, and COMPILE
    where compiling is not built for it (COMPILE=on is refused at start-up then: family_refusal) or, for
    Qwen-Image-2.1, under MAX_MEMORY."""
    if settings.quantize_skip is None:
        settings = replace(settings, quantize_skip=FAMILIES[family].quantize_skip)
    if settings.compile == "auto" and (why := not_built(family, "compile")) is not None:
        log.info("COMPILE=auto: off for %s (%s)", FAMILIES[family].model, why)
        settings = replace(settings, compile="off")
    if settings.compile == "auto" and family == "21" and settings.max_memory:
        # its compiled steps (runtime.compile21) are measured on whole GPUs only; under a cap its prefix cache
        # goes off for the jobs it would not fit, and those run eager anyway
        log.info("COMPILE=auto: off for %s under MAX_MEMORY (its compiled steps are not measured under a "
                 "cap)", FAMILIES[family].model)
        settings = replace(settings, compile="off")
    return settings


@dataclass(frozen=True)
class Planned:
    plan: Plan
    nodes: dict[str, str]  # WORKERS=ray: each planned worker's Ray node id
    loras: tuple  # imgedit.config.loras.LoraFile: the LoRAs every worker loads, checked
    error: str | None = None  # WORKERS=ray could not reach its cluster: nothing planned, and why


def plan_workers(settings: Settings, checkpoint: Checkpoint, plan: Plan | None,
                 gpus: Sequence[GpuSpec] | None) -> Planned:
    """The workers to start: `plan` as given (tests), or planned from the checkpoint's sizes for Ray's nodes
    or this machine's GPUs (`gpus`: discovered when None)."""
    s = settings
    fast = check_turbo(s, checkpoint)  # TURBO_MODEL_DIR: refused before anything is inspected or planned
    if fast is not None:  # never streamed (memory_refusal refused it); QUANTIZE=auto: lossless first, as ever
        s = replace(s, offload=())
    if s.workers == "ray":
        if s.quantize or s.offload:
            raise PlacementError("QUANTIZE and OFFLOAD work with WORKERS=local only for now; "
                                 "leave them at auto (or none) with WORKERS=ray")
        try:
            ray_pool.connect(s.ray_address, s.ray_connect_timeout)
        except WorkerFailed as exc:
            log.error("%s", exc.message)
            return Planned(Plan("ray", (), exc.message), {}, (), exc.message)
    # Sizes (from the configs) and the LoRA check, measured on the worker side in a subprocess
    sizes, loras = inspect_checkpoint(checkpoint, s.quantize_skip, s.lora_entries, sizes=plan is None,
                                      start=inspection_start(s))
    nodes: dict[str, str] = {}
    if fast is not None and sizes:
        sizes = turbo.with_turbo(sizes)  # a second transformer, block for block beside the model's
    if plan is None:
        item = bytes_item(s.torch_dtype)  # QUANTIZE / OFFLOAD: the planner sizes each mode
        if s.workers == "ray":
            specs = [c.spec("none", item) for c in sizes]
            plan, nodes = ray_pool.plan_cluster(specs, s, ray_pool.alive_nodes(), checkpoint.family)
        else:
            gpus = discover_gpus() if gpus is None else list(gpus)
            try:
                host = available_host_memory() if gpus else None
                plan = plan_memory(sizes, gpus, s, item, host, checkpoint.family)
            except PlacementError as exc:
                if fast is None:
                    raise
                raise PlacementError(f"{exc.message} (counting {turbo.SETTING}'s second transformer: "
                                     f"unset {turbo.SETTING} to serve without it)") from exc
    return Planned(plan, nodes, loras)


def check_turbo(settings: Settings, checkpoint: Checkpoint) -> turbo.TurboCheckpoint | None:
    """TURBO_MODEL_DIR checked against the served model and the memory settings (None when unset)."""
    if not settings.turbo_model_dir:
        return None
    fast = turbo.check_turbo(settings.turbo_model_dir, checkpoint)
    refused = turbo.memory_refusal(settings.max_memory, settings.offload)
    if refused is not None:
        raise PlacementError(refused)
    log.info("speed=fast/fastest: %s on the same GPU(s) as the model", fast.describe)
    return fast


def worker_handle(settings: Settings, plan: WorkerPlan, spec: WorkerSpec, node: str | None,
                  on_change: Callable[[], None], standbys: StandbyPool | None = None) -> WorkerHandle:
    """The supervisor of one planned worker over its transport: local processes (its ranks taken from
    `standbys` where it has some), or Ray actors on `node`."""
    s = settings
    if s.workers == "ray":
        transport = ray_pool.RayTransport(plan.name, s.compile_cache_dir, s.log_level, node_id=node)
    else:
        transport = ProcessTransport(plan.name, s.cuda_visible_devices, s.compile_cache_dir, s.log_level,
                                     s.worker_start, standbys)
    return WorkerHandle(plan, spec, transport, max_restarts=s.worker_restarts, on_change=on_change,
                        max_memory=s.max_memory)


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
    cpus, omp = host_threads()
    return WorkerSpec(name=plan.name, rank=0, world=plan.ranks, parallel=plan.parallel, plan=plan,
                      checkpoint=checkpoint, dtype=s.torch_dtype, compile=modes.compile_enabled(s, plan),
                      hook=hook, auto_cleanup=s.auto_cleanup, warmup_sizes=warmup_sizes,
                      ulysses=plan.ulysses, loras=loras,
                      pair_ulysses=modes.pair_ulysses(s, plan, checkpoint.attention_heads),
                      encode_cache=s.encode_cache, attention=s.attention, compile_mode=s.compile_mode,
                      fuse_lora=modes.fuse_lora(s, plan), activation_reserve=s.activation_reserve,
                      fast_quantize=s.fast_quantize, fast_steps=modes.fast_steps(s),
                      turbo=turbo.open_turbo(s.turbo_model_dir) if s.turbo_model_dir else None,
                      cpu_threads=modes.worker_threads(s, plan, every, cpus, omp),
                      copy_threads=modes.copy_threads(s, plan, every, cpus))
