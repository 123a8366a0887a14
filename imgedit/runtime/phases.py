"""A worker's start-up as named phases: place → load → adapt → optimise → warm → ready.

Each phase is a short function of the `Build` it fills; the optimisations are features
(imgedit.runtime.features) that install in the phase each names. Every phase is logged with its seconds, shown
while loading (/health and the page name the phase), and its seconds go in the start-up report (`phases`).

Imported by imgedit.runtime.worker after the process is prepared (torch reads its environment at import).
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict

import torch

from imgedit.model.encoding import prepare_text_encoder
from imgedit.planning.placement import allocator_budget
from imgedit.runtime import features, loader, offload, pinned
from imgedit.runtime.adapters import Adapters
from imgedit.runtime.build import Build
from imgedit.runtime.group import agree_to_stop, init_group
from imgedit.runtime.messages import StartupReport, WorkerSpec
from imgedit.runtime.runner import Runner
from imgedit.runtime.weights import weights_per_gpu

log = logging.getLogger(__name__)


def place(build: Build) -> None:
    """The process on its devices: threads, the group's process groups, the GPU's capability, the cap."""
    spec, plan = build.spec, build.spec.plan
    torch.set_grad_enabled(False)
    build.cuda = plan.execution_device.startswith("cuda")
    if build.cuda and spec.cpu_threads:  # WORKER_THREADS: a GPU worker's CPU prepares, it does not compute
        torch.set_num_threads(spec.cpu_threads)
    pinned.set_copy_threads(spec.copy_threads if build.cuda else 0)  # its streamed weights' copies: more
    if spec.world > 1:
        build.cpu_group = init_group(spec.rank, spec.world, spec.master_port, build.cuda)
        build.agree = lambda ok: not agree_to_stop(not ok, build.cpu_group)
    offload.check_device(plan.memory, plan.execution_device, spec.fast_quantize)
    if build.capped and not build.late_cap:
        cap_memory(spec.memory_caps)
    build.dtype = loader.DTYPES[spec.dtype]
    if not build.cuda and build.dtype != torch.float32:
        log.info("runs on the CPU: using float32 instead of %s", spec.dtype)  # bf16 convs are emulated, slow
        build.dtype = torch.float32


def load(build: Build) -> None:
    """The weights onto their devices (quantized, offloaded or split as planned), the text encoder
    prepared."""
    build.pipe = loader.load_pipeline(build.spec.checkpoint, build.plan, build.dtype)
    prepare_text_encoder(build.pipe.text_encoder)  # token types, no logits, the vision tower in one call


def adapt(build: Build) -> None:
    """Every configured LoRA, all disabled; FAST_QUANTIZE's copies where fast jobs run (every rank of a pair
    that splits them, else rank 0 alone); FUSE_LORA's room (the ranks of a group fuse all or none)."""
    spec, plan = build.spec, build.plan
    fast_mode = spec.fast_quantize if spec.rank == 0 or spec.pair_ulysses else "none"
    if spec.loras or fast_mode != "none":
        build.say(f"loading {len(spec.loras)} LoRA(s)" + (f", building the {fast_mode} fast-mode copies"
                                                         if fast_mode != "none" else ""))
    # streamed components: their hooks off while the LoRAs load, then on again (offload.lifted)
    devices = {name: placement.device for name, placement in plan.components.items()}
    with offload.lifted(build.pipe, plan.memory if spec.loras else None, devices):
        caps = spec.memory_caps if build.cuda else ()
        build.adapters = Adapters(build.pipe, spec.loras, spec.fuse_lora, spec.activation_reserve, caps,
                                  build.agree, fast_mode, spec.fast_steps,
                                  fast_agree=build.agree if spec.pair_ulysses else None)
    report, adapters = build.report, build.adapters
    report.loras = [f.name for f in spec.loras]
    report.fuse_lora = adapters.fusion.describe() if adapters.fusion is not None else "off"
    report.fast_weights = adapters.fast.describe() if adapters.fast is not None else "none"
    report.fallbacks.extend(adapters.fallbacks)
    report.weights_mib = weights_per_gpu() if build.cuda else {}  # the LoRAs' weights included


def optimise(build: Build) -> None:
    """The runner, for the per-job features of this phase; the cap of a random-weight checkpoint."""
    spec = build.spec
    build.runner = Runner(build.pipe, spec.name, spec.devices or build.plan.devices, spec.rank, spec.world,
                          spec.auto_cleanup)
    if build.capped and build.late_cap:
        torch.cuda.empty_cache()
        cap_memory(spec.memory_caps)


def warm(build: Build) -> None:
    """What the optimised worker holds, before its warm-up features (compile, the rewrite's warm-up) run; a
    test's fault hook goes in here, on the worker as it will serve."""
    spec, report = build.spec, build.report
    report.components = offload.describe(build.pipe, build.plan.memory)
    report.cpu_threads = torch.get_num_threads()
    report.attention = offload.attention_in_use(build.pipe.transformer)  # as the processors have it
    if spec.hook:  # "module:function" called with (pipe, spec)
        module, _, function = spec.hook.partition(":")
        getattr(importlib.import_module(module), function)(build.pipe, spec)


def ready(build: Build) -> None:
    """What loading, the LoRAs and the warm-ups left in reference cycles goes now, not at the first job's OOM:
    on 2x H200 the first edit of a capped worker (the 31 GiB split, 2.1 at 14.5 GiB) came back 507 and the
    same request succeeded once the OOM's cleanup (this one) had run."""
    build.runner.cleanup(force=True)
    if build.cuda:
        build.report.memory_allocated_gib = round(torch.cuda.memory_allocated() / 1024**3, 2)
        build.report.memory_reserved_gib = round(torch.cuda.memory_reserved() / 1024**3, 2)


# (name, what the page shows while it runs, the phase)
PHASES: tuple[tuple[str, str, Callable[[Build], None]], ...] = (
    ("place", "placing", place),
    ("load", "loading the weights", load),
    ("adapt", "loading the adapters", adapt),
    ("optimise", "optimising", optimise),
    ("warm", "warming up", warm),
    ("ready", "getting ready", ready),
)


def build_worker(spec: WorkerSpec, say: Callable[[str], None]) -> tuple[Runner, StartupReport, float]:
    """Run the phases in order, each phase's features after it; returns the runner, the report and the
    seconds."""
    started = time.perf_counter()
    build = Build(spec, say)
    for name, doing, phase in PHASES:
        begun = time.perf_counter()
        say(doing)
        phase(build)
        features.install(build, name)
        build.report.phases[name] = round(time.perf_counter() - begun, 2)
        log.info("phase %s: %.1fs", name, build.report.phases[name])
        if name == "load":
            build.report.load_seconds = round(time.perf_counter() - started, 2)
    log.info("loaded on %s in %.1fs (%s)", ",".join(build.plan.devices), time.perf_counter() - started,
             asdict(build.report))
    return build.runner, build.report, time.perf_counter() - started


def cap_memory(caps: tuple[int, ...]) -> None:
    """MAX_MEMORY is a promise about what nvidia-smi shows: let torch's allocator use at most the cap
    minus the CUDA context and the kernels loaded as jobs run (it frees its cache and retries before it
    gives up with out-of-memory)."""
    # what torch's allocator was started with (prepare_process); torch reads PYTORCH_ALLOC_CONF first
    settings = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "default"
    for index, cap in enumerate(caps):
        total = torch.cuda.get_device_properties(index).total_memory
        fraction = min(1.0, max(0.01, allocator_budget(cap) / total))
        torch.cuda.set_per_process_memory_fraction(fraction, index)
        log.info("cuda:%d: allocator capped at %.1f GiB (MAX_MEMORY; allocator settings: %s)", index,
                 fraction * total / 1024**3, settings)
