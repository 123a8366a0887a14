"""The modes a plan's workers run in, decided from the settings and the plan alone: compile, the step
cache, the attention kernel, the compile mode, LoRA fusion, a CFG pair's Ulysses; and why a mode cannot run
on these workers (the start-up refuses it with that reason; a request asking for it gets a 400).
"""

from __future__ import annotations

from collections.abc import Sequence

from imgedit.config.loras import SPEEDS
from imgedit.config.settings import Settings
from imgedit.planning.plan import WorkerPlan


def compile_enabled(settings: Settings, plan: WorkerPlan) -> bool:
    """COMPILE=auto compiles GPU workers, unless CACHE is on (the cache hooks are measured eager)."""
    mode = settings.compile
    on_gpu = plan.execution_device.startswith("cuda")
    return mode == "on" or (mode == "auto" and on_gpu and settings.cache == "none")


def cache_refusal(settings: Settings, plans: Sequence[WorkerPlan]) -> str | None:
    """Why these workers cannot run a step cache, or None."""
    if any(p.ulysses > 1 for p in plans):
        return ("a Ulysses group splits each forward's sequence over its GPUs, and each would decide to skip "
                "blocks on its own part")
    if any(compile_enabled(settings, p) for p in plans):
        how = ("COMPILE=on" if settings.compile == "on"
               else "COMPILE=auto compiles GPU workers when CACHE is none")
        return (f"the workers are compiled ({how}); a step cache runs on eager workers: "
                "set CACHE for the whole server (auto then leaves them eager) or COMPILE=off")
    return None


def enhance_refusal(plans: Sequence[WorkerPlan]) -> str | None:
    """Why these workers cannot have their text encoder write words (rewrite prompts, outline mask_prompt),
    or None."""
    if any(p.memory is not None and p.memory.offload_text_encoder for p in plans):
        # measured on an H200 under MAX_MEMORY=22GiB (2026-11-27): the stream's prefetch order, traced on
        # prompt encoding, misses the rotary embedding on generate()'s decoding steps (no vision tower):
        # a device error
        return ("the text encoder is kept on the CPU and streamed to the GPU for each prompt "
                "(MAX_MEMORY leaves no room for it), and every word it writes (a rewrite, mask_prompt's "
                "outline) would stream all of its weights again; edit without it, or give the server a GPU "
                "with room for the text encoder")
    return None


def kernel_refusal(settings: Settings, plans: Sequence[WorkerPlan], heads: int | None = None) -> str | None:
    """Why these workers cannot run ATTENTION / COMPILE_MODE as set, or None."""
    s = settings
    if s.compile_mode != "default" and not any(compile_enabled(s, p) for p in plans):
        return (f"COMPILE_MODE={s.compile_mode} applies to compiled workers, and none is compiled here "
                f"(COMPILE={s.compile}; auto compiles GPU workers when CACHE is none)")
    on_cpu = any(not p.execution_device.startswith("cuda") for p in plans)
    if s.attention in ("cudnn", "efficient") and on_cpu:
        return f"ATTENTION={s.attention} is a CUDA kernel, and a worker here runs on the CPU"
    if s.attention == "flash" and any(p.memory is not None and p.memory.batch_cfg for p in plans):
        return ("ATTENTION=flash takes no attention mask, and BATCH_CFG pads the shorter prompt "
                "of the two CFG branches and masks it; use ATTENTION=cudnn or native")
    split_sequence = any(p.ulysses > 1 or pair_ulysses(s, p, heads) for p in plans)
    if s.attention in ("flash", "efficient") and split_sequence:
        why = ("takes no attention mask, and a Ulysses group pads the text to the degree and masks it"
               if s.attention == "flash" else "does not run with diffusers' Ulysses attention")
        return f"ATTENTION={s.attention} {why}; use ATTENTION=cudnn or native"
    return None


def fuse_lora(settings: Settings, plan: WorkerPlan) -> str:
    """FUSE_LORA as this worker can run it: off when its transformer is quantized (torchao's weights take no
    in-place add) or has blocks streamed from the CPU (the offload hooks put back their own copies)."""
    memory = plan.memory
    if memory is not None and (memory.mode_of("transformer") != "none" or memory.streams_blocks):
        return "off"
    return settings.fuse_lora


def fast_steps(settings: Settings) -> tuple[int, ...]:
    """The Lightning step counts whose LoRA gets a FAST_QUANTIZE copy (FAST_QUANTIZE_SPEEDS); () when off."""

    return () if settings.fast_quantize == "none" else tuple(SPEEDS[s] for s in settings.fast_quantize_speeds)


def fast_refusal(settings: Settings, plans: Sequence[WorkerPlan], lightning: int) -> str | None:
    """Why these workers cannot make FAST_QUANTIZE's copies (one per Lightning LoRA of FAST_QUANTIZE_SPEEDS,
    `lightning` of them configured), or None."""
    mode = settings.fast_quantize
    if mode == "none":
        return None
    what = f"FAST_QUANTIZE={mode} makes a {mode} copy of the transformer for each Lightning LoRA"
    if not lightning:
        return (f"{what}, and no Lightning LoRA is configured for FAST_QUANTIZE_SPEEDS="
                f"{','.join(settings.fast_quantize_speeds)} (FAST_LORA_4STEP/8STEP, LORA_DIR, LORAS)")
    for p in plans:
        if p.parallel != "none" and (p.parallel != "cfg" or p.ulysses != 1):
            return (f"{what} on workers of one GPU or CFG pairs, and {p.name} is a {p.parallel} group "
                    f"of {p.ranks} GPUs; use DEVICE_MAP=cfg-parallel, replicas or cuda:N, "
                    "or FAST_QUANTIZE=none")
        if p.components["transformer"].is_split:
            return (f"{what} on the transformer's one GPU, and {p.name} splits it over "
                    f"{', '.join(p.components['transformer'].devices)}; use FAST_QUANTIZE=none here")
        if p.memory is not None and (p.memory.mode_of("transformer") != "none" or p.memory.streams_blocks):
            how = "streamed from the CPU" if p.memory.streams_blocks else "quantized"
            return (f"{what} from the bf16 weights, and {p.name}'s transformer is {how}; "
                    "use FAST_QUANTIZE=none")
        if mode == "fp8" and not p.execution_device.startswith("cuda"):
            return (f"{what}, and fp8 needs a CUDA GPU of compute capability 8.9+; "
                    f"{p.name} runs on the CPU: use int8")
    return None


def pair_ulysses(settings: Settings, plan: WorkerPlan, heads: int | None = None) -> bool:
    """PAIR_ULYSSES: whether this CFG pair runs CFG-off jobs on both ranks, the sequence split in two. auto:
    GPU pairs whose attention kernel runs diffusers' Ulysses with a masked (padded) text, native or cudnn,
    and whose transformer's `heads` divide by two (Ulysses-2 gives each rank half of them); on: any pair
    (the CPU tests; flash and efficient are refused then, kernel_refusal; odd heads by the worker)."""
    if plan.parallel != "cfg" or plan.ulysses != 1 or settings.pair_ulysses == "off":
        return False
    if settings.pair_ulysses == "auto" and heads is not None and heads % 2:
        return False
    return settings.pair_ulysses == "on" or (settings.attention in ("native", "cudnn")
                                             and plan.execution_device.startswith("cuda"))


def worker_threads(settings: Settings, plan: WorkerPlan, plans: Sequence[WorkerPlan], cpus: int,
                   omp: str | None) -> int:
    """WORKER_THREADS for one worker's processes: 0 (PyTorch's default) on the CPU, and under WORKERS=ray
    unless set (Ray sets each actor's OMP_NUM_THREADS); auto = OMP_NUM_THREADS where set, else the machine's
    CPUs shared out over its GPU processes (the ranks of all `plans` on GPUs), at most 4 for a one-GPU worker.
    Measured on a 32-CPU 2x H100 host (docs/BENCHMARKS.md): PyTorch's default (every CPU in every process)
    made the steps before the loop 0.07 s slower on one GPU and 0.1-0.2 s on a pair; 4 threads kept one GPU's
    steps as they were but slowed an eager split pair's (0.273 -> 0.333 s); 16 kept them."""
    if not plan.execution_device.startswith("cuda"):
        return 0
    if settings.worker_threads or settings.workers == "ray":  # Ray gives each actor its own OMP_NUM_THREADS
        return settings.worker_threads
    if omp and omp.strip().isdigit() and int(omp) > 0:
        return int(omp)
    share = _gpu_share(plans, cpus)
    return min(4, share) if plan.ranks == 1 else share


def copy_threads(settings: Settings, plan: WorkerPlan, plans: Sequence[WorkerPlan], cpus: int) -> int:
    """torch's CPU threads in a GPU worker's process while it copies its streamed weights into page-locked
    memory (imgedit.runtime.pinned: GiBs of fresh pages, filled fastest on many threads): the machine's CPUs
    shared out over its GPU processes, which load at the same time; 0 (its threads as for jobs) on the CPU and
    under WORKERS=ray (an actor's node and share are Ray's). On a 16-CPU one-GPU host that is 16 where its
    jobs keep 4: 27 GiB copied and locked in 3.7-6.0 s (benchmarks/probe_pinning.py; docs/BENCHMARKS.md,
    24 GB)."""
    if not plan.execution_device.startswith("cuda") or settings.workers == "ray":
        return 0
    return _gpu_share(plans, cpus)


def _gpu_share(plans: Sequence[WorkerPlan], cpus: int) -> int:
    """The CPUs each GPU process (every rank of every plan on a GPU) gets of `cpus`."""
    return max(1, cpus // max(1, sum(p.ranks for p in plans if p.execution_device.startswith("cuda"))))


def compile_mode(settings: Settings, plans: Sequence[WorkerPlan]) -> str:
    """COMPILE_MODE as the workers run it: off when none is compiled."""
    return settings.compile_mode if any(compile_enabled(settings, p) for p in plans) else "off"
