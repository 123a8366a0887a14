"""A worker's optimisations and modes as features: one object each, with the same small interface.

- `phase`: when it installs (imgedit.runtime.phases: load, optimise or warm);
- `applies(build)`: whether it is asked for on this worker (settings, placement, GPU);
- `install(build)`: how (diffusers' hooks, a per-job part on the runner, torch's APIs);
- `optional`: an optimisation; if it fails to build, the worker goes on without it and says why in its
  fallbacks (/health, the panel, the page's banner): an optimisation never takes the server down. A mode the
  plan needs (a CFG pair's exchange) is not optional: its failure fails the load, and the pool reports it.
- the start-up report lists every feature installed (`features`), each one's own figures where it has them.

`FAMILY_FEATURES` says which features each model family has; a feature a family lacks is never installed for
it, and the server refuses a request or setting that needs it with the family's reason
(imgedit.planning.families.not_built). Per-job features (`JobFeature`) go on the runner, which enters them for
every job in the order installed (imgedit.runtime.runner).
"""

from __future__ import annotations

import inspect
import logging

import torch

from imgedit.errors import ImgEditError
from imgedit.model import attention21
from imgedit.planning.families import FAMILIES
from imgedit.runtime import (
    compile21,
    encode_cache,
    offload,
    pixels,
    shared_prompt,
    single_frame,
    split21,
    turbo,
    warmup,
)
from imgedit.runtime.budget import TimeBudget
from imgedit.runtime.build import Build
from imgedit.runtime.cfg_batch import CfgBatch
from imgedit.runtime.decode_room import DecodeRoom
from imgedit.runtime.fallback import cause
from imgedit.runtime.fusion import gpu_room
from imgedit.runtime.group import ParallelGroup
from imgedit.runtime.masking import Masking
from imgedit.runtime.pause import Pausing
from imgedit.runtime.prefix_cache import PrefixCache
from imgedit.runtime.preview import LivePreview
from imgedit.runtime.runner import Outlining
from imgedit.runtime.step_cache import StepCache
from imgedit.runtime.weights import weights_per_gpu

log = logging.getLogger(__name__)


class Feature:
    name = ""
    phase = "optimise"
    optional = True  # an optimisation: the worker serves without it when it fails to build
    only: frozenset[str] | None = None  # the families it is written for (None: every family)

    def applies(self, build: Build) -> bool:
        return True

    def install(self, build: Build) -> None:
        raise TypeError(f"{type(self).__name__} does not say how it installs")

    def fall_back(self, build: Build, exc: BaseException) -> None:
        reason = cause(exc)
        log.warning("%s failed → off: %s", self.name, reason)
        build.report.fallbacks.append(f"{self.name} failed → off: {reason}")


# ---- load: around the pipeline as loaded -------------------------------------------------------------------
class Timings(Feature):
    """Where each job's time goes inside the worker (imgedit.runtime.budget): CUDA events, no waiting."""

    name = "time budget"

    def install(self, build: Build) -> None:
        # outermost: the other parts' own work in a job (a prefix cache locking CPU memory) is the job's time
        budget = TimeBudget(build.transformers, build.cuda, build.plan.execution_device)
        build.runner.add(budget, outermost=True)


class SingleFrameVae(Feature):
    """An image is one frame: the VAE's causal 3-D convolutions run as 2-D ones, a third of the work
    (exact)."""

    name, phase = "single-frame VAE", "load"

    def install(self, build: Build) -> None:
        single_frame.install(build.pipe.vae)


class EncodeCache(Feature):
    """ENCODE_CACHE: a repeated input is not encoded again (exact memos of the VAE and prompt encodes)."""

    name, phase = "encode cache", "load"

    def applies(self, build: Build) -> bool:
        return build.spec.encode_cache > 0

    def install(self, build: Build) -> None:
        encode_cache.install(build.pipe, build.spec.encode_cache)
        build.report.encode_cache = build.spec.encode_cache


class PixelsOnGpu(Feature):
    """Pictures cross to and from the VAE's GPU as bytes, the arithmetic there (exact)."""

    name, phase = "pixels on the GPU", "load"

    def applies(self, build: Build) -> bool:
        return pixels.vae_device(build.pipe.vae) is not None

    def install(self, build: Build) -> None:
        on_gpu = pixels.install(build.pipe)
        build.report.pixels = str(on_gpu.device) if on_gpu is not None else "cpu"


class Metadata21(Feature):
    """Qwen-Image-2.1: the rotary table and token metadata built once a request, not once a step (exact; 10
    references: 44 ms a step on one CPU core)."""

    name, phase, only = "2.1 metadata once a request", "load", frozenset({"21"})

    def install(self, build: Build) -> None:
        compile21.memoize_21_metadata(build.pipe.transformer)


# ---- optimise: the runner's per-job parts and the transformer's kernels ------------------------------------
class Parallel(Feature):
    """A worker of several ranks: CFG pair, Ulysses group, a pair's Ulysses for CFG-off jobs (PAIR_ULYSSES).
    The plan needs it: not optional."""

    name, optional = "parallel group", False

    def applies(self, build: Build) -> bool:
        return build.spec.parallel != "none"

    def install(self, build: Build) -> None:
        spec, runner = build.spec, build.runner
        family = FAMILIES[spec.checkpoint.family]
        mode = "cfg-parallel" if spec.parallel == "cfg" else spec.parallel
        if (why := family.not_built.get(mode)) is not None:  # the planner refuses it first: only a bug
            raise ImgEditError(f"a {mode} group is not built for {family.model}: {why}")
        group = ParallelGroup(build.pipe.transformer, spec.parallel, spec.rank, spec.world, spec.ulysses,
                              build.cuda, build.cpu_group, spec.pair_ulysses, build.adapters.copies,
                              family.split)
        runner.add(group)
        if group.splits_cfg_off:  # a split job's prompt: encoded on rank 0, sent to rank 1
            shared_prompt.install(build.pipe, spec.rank, lambda: group.switch.on, group.cpu_group)
        build.report.pair_ulysses = group.splits_cfg_off


class Loras(Feature):
    """The job's LoRAs and scheduler (loaded in the adapt phase): exactly its own, none left after a
    failure."""

    name, optional = "LoRAs", False

    def install(self, build: Build) -> None:
        build.runner.add(build.adapters)


class Turbo(Feature):
    """TURBO_MODEL_DIR (Qwen-Image-2.1): the Turbo transformer beside the model's, its scheduler and sigmas;
    speed=fast/fastest jobs run on them (after the LoRAs' part: it swaps the transformer they set).
    Configured, it is needed: a Turbo that cannot load fails the load, naming the setting."""

    name, optional, only = "turbo", False, frozenset({"21"})

    def applies(self, build: Build) -> bool:
        return build.spec.turbo is not None

    def install(self, build: Build) -> None:
        build.say(f"loading {build.spec.turbo.describe}")
        part = turbo.load(build.spec.turbo, build.pipe, build.plan, build.dtype,
                          memoize=Metadata21.name in build.report.features)
        build.runner.add(part)
        build.turbo = part
        build.pipe.imgedit_turbo_transformer = part.transformer  # for hooks that watch every transformer
        mode = turbo.quantized_as(build.plan)
        build.report.turbo = build.spec.turbo.describe + ("" if mode == "none" else f", {mode} (QUANTIZE)")
        if build.cuda:  # the panel's "our weights": the Turbo's too
            build.report.weights_mib = weights_per_gpu()


class SplitTarget(Feature):
    """DEVICE_MAP=ulysses on Qwen-Image-2.1: the group's ranks split each forward's target image and gather
    its keys and values (imgedit.runtime.split21), on every transformer the worker serves with (the Turbo's
    too, so after it). The plan needs it: not optional."""

    name, optional, only = "2.1 target split", False, frozenset({"21"})

    def applies(self, build: Build) -> bool:
        return build.spec.parallel == "ulysses" and FAMILIES[build.spec.checkpoint.family].split == "target"

    def install(self, build: Build) -> None:
        split = split21.TargetSplit(build.spec.rank, build.spec.world)
        for transformer in build.transformers:
            split.install(transformer)


class BatchCfg(Feature):
    """BATCH_CFG: both CFG branches in one forward (streamed blocks cross once a step). A group splits them
    instead."""

    name = "batched CFG"

    def applies(self, build: Build) -> bool:
        return build.plan.memory is not None and build.plan.memory.batch_cfg and build.spec.parallel == "none"

    def install(self, build: Build) -> None:
        build.runner.add(CfgBatch(build.pipe.transformer))
        build.report.batch_cfg = True


class StepCaches(Feature):
    """CACHE / a request's `cache`: diffusers' first-block and TaylorSeer caches, per job."""

    name = "step cache"

    def install(self, build: Build) -> None:
        build.runner.add(StepCache(build.pipe.transformer))


class Masks(Feature):
    """Masked edits: the latents outside the mask put back at every step, the result laid over the input; a
    mask_prompt's mask outlined first."""

    name, optional = "masks", False

    def install(self, build: Build) -> None:
        build.runner.add(Outlining(build.runner))  # mask_prompt's mask first (imgedit.runtime.grounding)
        build.runner.add(Masking(build.pipe))


class Previews(Feature):
    """A live preview for a watched job: the latents' estimate of the image as a small JPEG every few steps
    (nothing for a job nobody watches; imgedit.runtime.preview). On the rank that reports steps."""

    name = "live preview"

    def applies(self, build: Build) -> bool:
        return build.spec.rank == 0

    def install(self, build: Build) -> None:
        rgba = FAMILIES[build.spec.checkpoint.family].rgba
        build.runner.add(LivePreview(build.pipe, build.spec.rank, rgba))


class Pauses(Feature):
    """An item of a job paused at a step's end for an edit someone waits on, and resumed from that step later
    with the image it makes unpaused (imgedit.runtime.pause; PREEMPT_ITEMS). Entered last of the per-job
    parts."""

    name, optional = "pausing items", False

    def install(self, build: Build) -> None:
        build.runner.add(Pausing(build.pipe))


class DecodeTiling(Feature):
    """Under MAX_MEMORY: the VAE decodes in tiles for a job whose whole decode would not fit."""

    name = "decode tiling"

    def applies(self, build: Build) -> bool:
        return build.capped and torch.device(build.plan.components["vae"].device).type == "cuda"

    def install(self, build: Build) -> None:
        vae, caps = torch.device(build.plan.components["vae"].device), build.spec.memory_caps
        build.runner.add(DecodeRoom(build.pipe.vae, lambda: gpu_room(vae.index or 0, caps)))
        build.report.under_cap.append("VAE decode in tiles for a job whose whole decode would not fit")


class PrefixCacheRoom(Feature):
    """Under MAX_MEMORY: Qwen-Image-2.1's prefix KV cache in CPU memory, or off, for a job it would not fit on
    the GPU."""

    name = "prefix cache under the cap"

    def applies(self, build: Build) -> bool:
        return build.capped and "use_kv_cache" in inspect.signature(build.pipe.__call__).parameters

    def install(self, build: Build) -> None:
        # the GPUs of the transformer's blocks as this process numbers them (the plan's; the runner's devices
        # are the server's names, for messages: a second replica's cuda:1 is this process's cuda:0)
        blocks = {torch.device(d) for d in build.plan.components["transformer"].devices}
        indices = sorted(d.index or 0 for d in blocks if d.type == "cuda")
        caps, reserve = build.spec.memory_caps, build.spec.activation_reserve
        # a compiled block would trace the CPU cache's copies: compiled workers keep it on the GPU or off
        report = build.report
        build.runner.add(PrefixCache(build.pipe.transformer,
                                     lambda: min(gpu_room(i, caps) for i in indices) - reserve,
                                     build.transformers, lambda: report.compiled))
        report.under_cap.append("prefix cache in CPU memory (eager) or off for a job it would not fit")


class Attention21(Feature):
    """Qwen-Image-2.1: its attention with the rotary embedding in real arithmetic (a compiled step fuses it
    with the Q/K norm; diffusers' complex64 rotation runs as separate kernels), and under MAX_MEMORY the
    projections and feed-forward a slice of the sequence at a time, for steps that run a long prefix
    (imgedit.model.attention21). The same image up to rounding (tests/test_compile21.py)."""

    name, only = "2.1 attention: real RoPE", frozenset({"21"})

    def install(self, build: Build) -> None:
        chunk = attention21.CHUNK if build.capped else None
        for transformer in build.transformers:
            attention21.install(transformer, chunk)
        if chunk:
            build.report.under_cap.append(f"2.1's projections and feed-forward {chunk} tokens at a time")


class AttentionKernel(Feature):
    """ATTENTION: every attention of the transformer(s) through one of PyTorch's kernels."""

    name = "attention kernel"

    def applies(self, build: Build) -> bool:
        return build.spec.attention != "native"

    def install(self, build: Build) -> None:
        for transformer in build.transformers:
            offload.use_attention(transformer, build.spec.attention)


# ---- warm: compiled before any user waits ----------------------------------------------------------
class Compile(Feature):
    """COMPILE: the transformer's repeated blocks compiled and every variant warmed up. Its own fallback: the
    ranks of a group vote, and all of them run eager if any failed (runtime.warmup)."""

    name, phase = "compile", "warm"

    def applies(self, build: Build) -> bool:
        return build.spec.compile

    def install(self, build: Build) -> None:
        warmup.compile_and_warm_up(build.spec, build.runner, build.transformers, build.report, build.agree,
                                   build.say)
        if not build.report.compiled:
            raise _Reported()


class RewriteWarmup(Feature):
    """A short prompt rewrite before any user waits (its first ran 1.6-2.3x slower a token). On the rank that
    writes a group's rewrites; not where the text encoder is streamed (rewrites are refused there)."""

    name, phase = "rewrite warm-up", "warm"

    def applies(self, build: Build) -> bool:
        streamed = build.plan.memory is not None and build.plan.memory.offload_text_encoder
        return build.cuda and build.spec.rank == 0 and not streamed

    def install(self, build: Build) -> None:
        build.say("warming up prompt rewriting")
        build.report.rewrite_warmup_seconds = warmup.warm_up_rewrite(build.pipe, build.report.fallbacks,
                                                                     build.spec.compile)


class FirstJob(Feature):
    """A GPU worker that does not compile (COMPILE=off; Qwen-Image-2.1 under MAX_MEMORY, the streamed plans)
    runs its family's first warm-up job before it says it is ready, as a compiled worker's warm-up does: the
    first job's one-time costs (CUDA's kernels loading, cuDNN's and cuBLAS's choices, the streamed weights'
    first pass, the page-locked buffers) are paid before any user waits. Not in a group (its ranks would run
    the job in step) nor after compile failed (compile's fallback runs the same job: warmup.check_eager).
    Not an optimisation that can fall back: a worker whose first job fails fails to load, saying why
    (Unservable)."""

    name, phase, optional = "first-job warm-up", "warm", False

    def applies(self, build: Build) -> bool:
        return build.cuda and not build.spec.compile and build.spec.world == 1

    def install(self, build: Build) -> None:
        build.say("warming up: a first job")
        report = build.report
        report.first_job_seconds = warmup.run_first_job(build.runner, build.spec, report.fallbacks)


class _Reported(Exception):
    """A feature that reported its own fallback already."""


FEATURES: tuple[Feature, ...] = (
    SingleFrameVae(), EncodeCache(), PixelsOnGpu(), Metadata21(),
    Parallel(), Loras(), Turbo(), SplitTarget(), BatchCfg(), StepCaches(), DecodeTiling(), PrefixCacheRoom(),
    Masks(), Previews(), Attention21(), AttentionKernel(), Timings(), Pauses(),
    Compile(), RewriteWarmup(), FirstJob(),
)
EVERY = frozenset(f.name for f in FEATURES)
FOR = {f.name: f.only for f in FEATURES if f.only is not None}
# The modes imgedit.planning.families' `not_built` names per family (the server refuses them with its reason),
# as the features they are here.
NOT_BUILT_AS = {"batch_cfg": "batched CFG", "cache": "step cache", "compile": "compile",
                "cfg-parallel": "parallel group", "ulysses": "parallel group"}
# Which family has which feature: every one but those its `not_built` names (Qwen-Image-2.1: no CFG batch,
# as it runs without CFG; no step caches, as its steps after the first already skip the prefix; ...). A
# feature that serves several modes (the parallel group: CFG pairs and Ulysses groups) is missing only where
# none of them is built; the one it serves there refuses the others (Parallel).
FAMILY_FEATURES: dict[str, frozenset[str]] = {
    key: EVERY - {feature for feature in set(NOT_BUILT_AS.values())
                  if all(mode in family.not_built for mode, f in NOT_BUILT_AS.items() if f == feature)}
    - {name for name, families in FOR.items() if key not in families}
    for key, family in FAMILIES.items()
}


def install(build: Build, phase: str) -> None:
    """Install this phase's features that the family has and that apply, in FEATURES' order."""
    family = build.spec.checkpoint.family
    for feature in FEATURES:
        if feature.phase != phase or not feature.applies(build):
            continue
        if feature.name not in FAMILY_FEATURES[family]:
            if not feature.optional:  # the planner refuses these first: only a bug gets here
                raise ImgEditError(f"{feature.name} is not built for {FAMILIES[family].model}")
            continue
        try:
            feature.install(build)
        except _Reported:
            continue
        except warmup.Unservable:  # not an optimisation's failure: the worker itself cannot edit
            raise
        except Exception as exc:
            if not feature.optional:
                raise
            feature.fall_back(build, exc)
            continue
        build.report.features.append(feature.name)
