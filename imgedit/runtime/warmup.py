"""Compile and warm up, in a worker process before it says it is ready: no user waits for a compile or a cold
first call. An optimisation never takes the server down: a compile or a rewrite warm-up that fails leaves the
worker eager, with the reason in its fallbacks (/health, the panel, the page's banner). A one-process worker
whose first warm-up job fails without compile too fails to load instead (Unservable: the fault is not an
optimisation's)."""

from __future__ import annotations

import logging
import threading
import time
import traceback

import torch
from PIL import Image

from imgedit.errors import ImgEditError, OutOfGpuMemory
from imgedit.model import internals
from imgedit.planning.families import BY_PIPELINE
from imgedit.protocol import EditRequest, Resolved
from imgedit.runtime import block_compile, compile21, decode_graphs, enhance
from imgedit.runtime.budget import WARMUP
from imgedit.runtime.fallback import agreed, cause
from imgedit.runtime.messages import Job, StartupReport, WorkerSpec

log = logging.getLogger(__name__)


def compile_and_warm_up(spec: WorkerSpec, runner, transformers: tuple, report: StartupReport, agree,
                        say) -> None:
    """COMPILE: compile the transformer(s) and warm every variant up before any user waits. An
    optimisation never takes the server down: if compiling or the warm-up fails (on any rank of a group:
    they vote), the worker runs eager and says why in its fallbacks (/health, the panel, the page)."""
    started = time.perf_counter()
    group = runner.group
    split = group is not None and (group.splits_cfg_off or group.layout.ulysses > 1)
    limit = recompile_limit(spec, len(transformers), split)
    if limit is not None:
        internals.raise_recompile_limit(limit)
    failure: BaseException | None = None
    qwen21 = spec.checkpoint.family == "21"
    try:
        for transformer in transformers:
            if qwen21:  # its cached steps only, dynamic in the prefix and target lengths (runtime.compile21)
                compile21.compile_21(transformer, spec.compile_mode)
            else:
                block_compile.compile_transformer(transformer, spec.plan.memory, spec.compile_mode)
        report.warmup_seconds = warm_up_21(runner, spec, say) if qwen21 else warm_up(runner, spec, say)
    except Exception as exc:  # noqa: BLE001 - reported below; the worker serves eager
        failure = exc
        log.debug("the compile warm-up failed:\n%s", traceback.format_exc())
    failure = agreed(failure, agree, "its compiled transformer")
    if failure is None:
        report.compiled = True
        report.compile_seconds = round(time.perf_counter() - started, 2)
        return
    for transformer in transformers:
        (compile21.uncompile_21 if qwen21 else block_compile.uncompile_transformer)(transformer)
    torch.compiler.reset()
    runner.cleanup(force=True)
    reason = cause(failure)
    log.warning("compile failed → eager: %s", reason)
    report.fallbacks.append(f"compile failed → eager: {reason}")
    if spec.world == 1:
        # not in a group: its ranks run a job in step, and a rank failing before a collective would leave the
        # others waiting in it (a group whose edits fail outside compile still serves errors: a known gap)
        check_eager(runner, spec, report.fallbacks, say)


class Unservable(ImgEditError):
    """The worker's edits fail without any optimisation too: it fails to load, saying why, rather than serve
    an internal error to every job."""


def check_eager(runner, spec: WorkerSpec, notes: list[str], say=lambda doing: None) -> None:
    """After compile's fallback, the first warm-up job once more, eager. A failure that compile did not cause
    (on 2x H200 the default placement's prompt encode failed on a device mismatch) otherwise read as "compile
    failed → eager", and the worker then answered every edit with an internal error while /health said ok.
    Out of GPU memory at the warm-up's size is not such a failure: a capped worker still serves smaller
    jobs."""
    say("checking a job without compile")
    run_first_job(runner, spec, notes, after_compile=True)


def run_first_job(runner, spec: WorkerSpec, notes: list[str], after_compile: bool = False) -> float:
    """The family's first warm-up job, run once (its seconds; 0 where the family has none). Out of GPU
    memory at the warm-up's size goes in `notes` (the report's fallbacks: /health, the banner), not raised:
    a capped worker still serves smaller jobs. Any other failure is the worker's own: Unservable (its load
    fails, saying why, rather than serve an internal error to every job)."""
    job = first_job(runner, spec)
    if job is None:
        return 0.0
    started = time.perf_counter()
    try:
        runner.run(job, threading.Event())
    except (torch.OutOfMemoryError, OutOfGpuMemory) as exc:
        size = f"{job.params.width}x{job.params.height}"
        log.warning("the warm-up job ran out of GPU memory at %s; serving: %s", size, cause(exc))
        notes.append(f"the warm-up job ran out of GPU memory at {size}: jobs that large may too")
    except Exception as exc:  # noqa: BLE001 - the worker's load failure (the worker logs its traceback)
        how = ", with or without compile" if after_compile else ""
        log.warning("the warm-up job failed%s: %s", how, cause(exc))
        raise Unservable(f"this worker cannot edit{how}: {cause(exc)}") from exc
    runner.cleanup(force=True)
    return round(time.perf_counter() - started, 2)


def first_job(runner, spec: WorkerSpec) -> Job | None:
    """The first job the family's warm-up runs (None: it runs none)."""
    if spec.checkpoint.family == "21":
        sizes = spec.warmup_sizes or ((1024, 1024),)
        return _job_21(spec, 1, compile21.warmup_requests(max_images_per_prompt=2, sizes=sizes)[0])
    runs = warmup_runs(runner, spec)
    return _warmup_jobs(runner, spec, *runs[0])[0] if runs else None


def recompile_limit(spec: WorkerSpec, transformers: int, split: bool) -> int | None:
    """Room for every compiled variant of a block (None: dynamo's default suffices). Each adapter set is one
    more variant (guards on peft's state), each of them up to four times where text is split (a pair's Ulysses
    on with and without the padding mask, and off; a batch of one specialised apart from n > 1); a fast copy's
    quantized blocks are variants of the same block code too; and every variant counts once per GPU a split
    transformer's blocks sit on (the blocks share one code object, and its guards hold each tensor's
    device)."""
    gpus = len(spec.plan.components["transformer"].devices)
    if not (spec.loras or split or gpus > 1):
        return None
    return (8 + 2 * len(spec.loras) + 2 * (transformers - 1)) * (4 if split else 1) * gpus


def warm_up_rewrite(pipe, fallbacks: list[str], compiled: bool) -> float:
    """A short prompt rewrite before any user waits: a worker's first rewrite ran 1.6-2.3x slower a token than
    its third (2026-11-27, H200: 58.7 against 25.5 ms, 160 tokens), the kernels and the GPU's matrix routines
    loading on first use. One picture at the rewrite's view size, 8 tokens; and, for a family that makes
    pictures from the prompt alone, one without a picture (the same captured decoding step: decode_graphs).
    On a resident encoder its decoding step is captured here as a CUDA graph (the log says how many).

    COMPILE=off: rewrites decode eagerly too, nothing is captured at start-up (eager, a Qwen-Image-2.1 rewrite
    wrote 100 ms a token on an H200)."""
    family = BY_PIPELINE.get(type(pipe).__name__)
    encoder = pipe.text_encoder
    if not compiled:
        enhance.no_static_cache(encoder)
    started = time.perf_counter()

    def once() -> None:
        picture = Image.new("RGB", (1024, 1024), (120, 130, 140))
        for pictures in ([picture], []) if family is not None and family.generates else ([picture],):
            enhance.rewrite(pipe, pictures, "warm up", 8, threading.Event())

    with enhance.on_its_own_gpu(encoder):  # the encoder as a rewrite sees it
        static = enhance.decodes_with_graphs(encoder)
    try:
        once()
        graphs = decode_graphs.installed(encoder)
        if static and graphs is not None:
            log.info("prompt rewriting: %d decoding step(s) captured as CUDA graphs, %d layout(s) left eager",
                     graphs.captures, len(graphs.eager))
            if graphs.eager:  # the rewrites still work, a token at a time: /health and the panel say so
                fallbacks.append(f"captured rewrite decoding failed → eager: {graphs.failure}")
    except Exception as exc:  # noqa: BLE001 - a warm-up
        # a captured decoding falls back, an eager one just says so
        if not static:
            log.warning("the prompt rewrite warm-up failed: %s", cause(exc))
            return round(time.perf_counter() - started, 2)
        enhance.no_static_cache(encoder)
        log.warning("prompt rewrites' captured decoding failed → eager decoding: %s", cause(exc))
        fallbacks.append(f"captured rewrite decoding failed → eager: {cause(exc)}")
        try:
            once()
        except Exception as again:  # noqa: BLE001 - the first user rewrite then says what is wrong
            log.warning("the prompt rewrite warm-up failed: %s", cause(again))
    return round(time.perf_counter() - started, 2)


def warm_up(runner, spec: WorkerSpec, say=lambda doing: None) -> list[float]:
    """Compile before any user waits: one short CFG edit per warm-up size. The blocks compile dynamic in the
    sequence lengths from the first size (block_compile.compile_transformer); the second size checks, before
    any user waits, that no guard of the first one specialised a length."""
    runs = warmup_runs(runner, spec)
    seconds = []
    for k, (width, height, name, params) in enumerate(runs, 1):
        say(f"compiling: warm-up {k} of {len(runs)} ({name.rstrip('-') or 'quality'} at {width}x{height})")
        started = time.perf_counter()
        for job in _warmup_jobs(runner, spec, width, height, name, params):
            if runner.takes_part(job):
                runner.run(job, threading.Event())
        seconds.append(round(time.perf_counter() - started, 2))
    return seconds


def warmup_runs(runner, spec: WorkerSpec) -> list[tuple[int, int, str, dict]]:
    """(width, height, name, parameters) of each warm-up run: a CFG edit at every warm-up size, then the
    CFG-off variants. CFG-off jobs are variants of their own: each Lightning LoRA's at the first size (with
    FUSE_LORA, the no-LoRA variant on fused weights); on a pair that splits CFG-off jobs (Ulysses on) the
    first one at every size. With FAST_QUANTIZE the Lightning jobs run on their copies: the quality weights'
    CFG-off variant is warmed too, and on a splitting pair every one of them at every size (each copy is a
    transformer of its own)."""
    runs: list[tuple[int, int, str, dict]] = [(width, height, "", {"true_cfg_scale": 4.0})
                                              for width, height in spec.warmup_sizes]
    split = runner.group is not None and runner.group.splits_cfg_off
    copies = runner.adapters is not None and bool(runner.adapters.copies)
    sizes = spec.warmup_sizes or ((1024, 1024),)
    for k, adapters in enumerate(_cfg_off_adapters(spec, split, copies)):
        for width, height in sizes if split and (k == 0 or copies) else sizes[:1]:
            runs.append((width, height, f"{adapters[0][0] if adapters else 'cfg-off'}-",
                         {"true_cfg_scale": 1.0, "adapters": adapters,
                          "scheduler": "lightning" if adapters else "default"}))
    return runs


def _cfg_off_adapters(spec: WorkerSpec, split: bool, copies: bool) -> list[tuple]:
    """The adapter sets of the CFG-off warm-up runs: each Lightning LoRA's, or none where a splitting pair
    or FAST_QUANTIZE's copies need the no-LoRA CFG-off variant too."""
    offs = [((f.name, 1.0),) for f in spec.loras if f.steps] or ([()] if split else [])
    if copies and () not in offs:
        offs.append(())
    return offs


def _warmup_jobs(runner, spec: WorkerSpec, width: int, height: int, name: str, params: dict) -> list[Job]:
    """One run's jobs: a prompt of every text kind the group pads differently. A text padded to the Ulysses
    degree carries a mask, one not padded none: two variants of the compiled block, each warmed at every size
    (or a user's first prompt of the other kind compiles)."""
    image = Image.new("RGB", (width, height), (120, 130, 140))
    cfg_on = params["true_cfg_scale"] > 1
    multiple = runner.group.text_multiple(cfg_on) if runner.group is not None else 1
    jobs = []
    for i, prompt in enumerate(warmup_prompts(getattr(runner.pipe, "tokenizer", None), multiple)):
        negative = prompt if cfg_on and multiple > 1 else " "
        req = EditRequest(images=(image,), prompt=prompt, request_id=f"warmup-{name}{width}x{height}-{i}",
                          source=WARMUP)
        jobs.append(Job(req, Resolved(steps=2, negative_prompt=negative, seed=0, num_images=1, width=width,
                                      height=height, **params), spec.checkpoint.family))
    return jobs


def warm_up_21(runner, spec: WorkerSpec, say=lambda doing: None) -> list[float]:
    """Qwen-Image-2.1's warm-up (runtime.compile21.warmup_requests): one reference at the first size (the one
    compile: prefix and target lengths are symbolic from it), then no reference, another prompt length and the
    second size (compiles nothing), then two images per prompt (a batch above 1 is a graph of its own); with
    TURBO_MODEL_DIR, a Turbo job at the first size (its blocks run the same compiled code, its weights are
    graph inputs: nothing compiles again, its kernels load; with LoRAs loaded, its two-images run too: the
    types of its layers differ from the model's); each LoRA that runs unfused, alone and with two images
    (`unfused_adapters`)."""
    sizes = spec.warmup_sizes or ((1024, 1024),)
    runs = compile21.warmup_requests(max_images_per_prompt=2, sizes=sizes)
    # a batch above one image is a variant of its own (dynamo specialises a batch of 1): each variant below
    # is warmed with one image and with two
    shapes = (runs[0], *[run for run in runs[1:] if run["num_images_per_prompt"] > 1][:1])
    if spec.turbo is not None:  # TURBO_MODEL_DIR: its blocks compiled too, warmed at the first size
        turbo = dict(num_inference_steps=spec.turbo.steps, scheduler="turbo")
        # with LoRAs loaded the model's Linear layers are peft's and the Turbo's are not: dynamo guards on the
        # type, so the Turbo's blocks are variants of their own, the batch of two as well
        runs += [dict(run, **turbo) for run in (shapes if spec.loras else shapes[:1])]
    # peft's LoRA layers on, with one adapter active: a variant of its own (per adapter where dynamo's guards
    # tell the adapters apart), so each one is warmed
    runs += [dict(run, adapters=adapters) for adapters in unfused_adapters(runner.adapters) for run in shapes]
    seconds = []
    for k, run in enumerate(runs, 1):
        width, height = run["width"], run["height"]
        what = "Turbo, " if run.get("scheduler") == "turbo" else "LoRA, " if run.get("adapters") else ""
        say(f"compiling: warm-up {k} of {len(runs)} ({what}{run['images']} reference(s) at {width}x{height})")
        started = time.perf_counter()
        runner.run(_job_21(spec, k, run), threading.Event())
        seconds.append(round(time.perf_counter() - started, 2))
    return seconds


def _job_21(spec: WorkerSpec, k: int, run: dict) -> Job:
    """Warm-up run `k` of Qwen-Image-2.1 (compile21.warmup_requests' shape) as a job."""
    width, height = run["width"], run["height"]
    images = tuple(Image.new("RGB", (width, height), (120, 130, 140)) for _ in range(run["images"]))
    prompt = " ".join([WARMUP_PROMPT] * max(1, run["words"] // 2))
    req = EditRequest(images=images, prompt=prompt, request_id=f"warmup-21-{k}", source=WARMUP)
    return Job(req, Resolved(steps=run["num_inference_steps"], negative_prompt=" ", seed=0,
                             num_images=run["num_images_per_prompt"], width=width, height=height,
                             true_cfg_scale=1.0, scheduler=run.get("scheduler", "default"),
                             adapters=run.get("adapters", ())),
               spec.checkpoint.family)


WARMUP_PROMPT = "warm up"


def unfused_adapters(adapters) -> list[tuple[tuple[str, float], ...]]:
    """The adapter sets whose jobs run peft's LoRA layers (unfused), for Qwen-Image-2.1's warm-up: each LoRA
    that FUSE_LORA cannot fuse (off, a quantized transformer, no room, a layer it does not fuse), alone (a 2.1
    job has at most one: there is no Lightning LoRA for it, and its Turbo takes none). A LoRA that is fused
    runs the no-LoRA variant. Measured on one H200 (2026-11-29, Qwen-Image-2.1 with QUANTIZE=fp8): the first
    LoRA job after a warm-up without one compiled its variant, 10.6 s of steps where the next takes 0.74."""
    if adapters is None:
        return []
    fusion = adapters.fusion
    return [((name, 1.0),) for name, internal in adapters.adapter_names.items()
            if fusion is None or not fusion.can_fuse(internal)]


def warmup_prompts(tokenizer, multiple: int) -> list[str]:
    """Warm-up prompts whose token counts leave every remainder modulo `multiple` (the Ulysses degree a text
    is padded to): so both the padded (masked) and the unpadded variant are compiled. The prompt sits between
    special tokens in every template, so its count shifts the text's length by the same amount."""
    if multiple <= 1 or tokenizer is None:
        return [WARMUP_PROMPT]
    prompts, remainders = [], set()
    for extra in range(4 * multiple):
        prompt = WARMUP_PROMPT + " up" * extra
        remainder = len(tokenizer(prompt)["input_ids"]) % multiple
        if remainder not in remainders:
            remainders.add(remainder)
            prompts.append(prompt)
        if len(remainders) == multiple:
            break
    return prompts
