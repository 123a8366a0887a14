"""Benchmark fast mode: Lightning-shaped LoRAs at 4 and 8 steps, CFG off, through the app's own path.

    python benchmarks/bench_fast.py [--sections eager,compiled] [--size 1024] [--json out.json]
    python benchmarks/bench_fast.py --tiny          # CPU smoke run of every section on the tiny model
    python benchmarks/bench_fast.py --sections compiled --env FUSE_LORA=off   # any setting, e.g. A/B runs
    python benchmarks/bench_fast.py --sections compiled --phases   # + where a 4-step edit's time goes

Every job goes through imgedit's PipelineManager and a worker process, as in the app, on one GPU
(DEVICE_MAP=cuda:0; --device-map for another, e.g. cfg-parallel), with a real-size random-weight
checkpoint (trained-like init) and two random LoRAs of the published Lightning shape (rank 64 on the
12 attention and MLP Linear layers of each of the 60 blocks; imgedit.model.lora_random), registered through
LORA_DIR by their Lightning file names. The worker hook checks that every transformer output is finite
(bench.finite_check): NaN runs faster.

Sections (each loads the model once; --sections picks them):
  eager     COMPILE=off: 4-step and 8-step edits end to end (speed=fastest / fast), per-step time
            with no LoRA vs one LoRA as the app runs it (fused with FUSE_LORA=auto, the default; unfused
            with FUSE_LORA=off, and then also fused by pipe.fuse_lora, bench-only: a prompt marker makes
            the worker fuse before denoising),
            the cost of switching LoRA between jobs vs a 40-step quality edit, and that 40-step edit.
  compiled  COMPILE=on (regional compile, warmed up at start-up, Lightning variants included): the
            same edits, switching, the 40-step quality edit, and a 4-step edit through the HTTP
            server (REST), which is what the <= 2 s target is about.

--phases: the 4-step edits also report where their time goes inside the pipeline call (prompt encoding,
VAE encode, the denoising loop, VAE decode, postprocess), the GPU synchronized at every boundary, so each
phase is timed alone (overlap between them is lost: the phases add up to a little more than the call).
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import StepClock, contrast, finite_check, reference_image, rest_edit, served  # noqa: E402

from imgedit.config.settings import load_settings  # noqa: E402
from imgedit.engine.manager import PipelineManager  # noqa: E402
from imgedit.model.demo_checkpoint import build_checkpoint  # noqa: E402
from imgedit.model.lora_random import LIGHTNING_RANK, random_lora  # noqa: E402
from imgedit.model.loras import transformer_linears  # noqa: E402
from imgedit.protocol import EditRequest  # noqa: E402

log = logging.getLogger("bench_fast")
FOUR = "Bench-Lightning-4steps-V1.0-bf16"
EIGHT = "Bench-Lightning-8steps-V1.0-bf16"
STYLE = "bench-style"
FUSE_MARK = "[fused]"
PHASES = "IMGEDIT_BENCH_PHASES"  # the file the workers' --phases records go to


def hook(pipe, spec) -> None:
    """Worker hook: the finite check, plus fusing for the fused-adapter measurement. A prompt with
    FUSE_MARK fuses the job's (already active) adapters into the weights before denoising; the next
    job without it unfuses them first. The app fuses by itself only with FUSE_LORA (imgedit.runtime.fusion)."""
    finite_check(pipe, spec)
    encode = pipe.encode_prompt
    state = {"fused": False, "locked": False}

    def encode_prompt(*args, **kwargs):
        prompt = kwargs.get("prompt", args[0] if args else "")
        if isinstance(prompt, str) and not state["locked"]:  # the prompt is encoded before the negative one
            state["locked"] = True
            if FUSE_MARK in prompt and not state["fused"]:
                pipe.fuse_lora(components=["transformer"], adapter_names=pipe.get_active_adapters())
                state["fused"] = True
            elif FUSE_MARK not in prompt and state["fused"]:
                pipe.unfuse_lora(components=["transformer"])
                state["fused"] = False
        return encode(*args, **kwargs)

    def release(module, args):  # one pipeline call = one prompt decision
        state["locked"] = False

    pipe.encode_prompt = encode_prompt
    pipe.vae.decoder.register_forward_pre_hook(release)
    if PHASES in os.environ:
        phases(pipe, os.environ[PHASES])


def phases(pipe, path: str) -> None:
    """Worker hook part for --phases: seconds in each phase of every pipeline call, one JSON line per call."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    record: dict = {}

    def timed(name, function):
        def wrapper(*args, **kwargs):
            sync()
            t0 = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                sync()
                record[name] = record.get(name, 0.0) + time.perf_counter() - t0
        return wrapper

    pipe.encode_prompt = timed("encode_prompt", pipe.encode_prompt)
    pipe._encode_vae_image = timed("vae_encode", pipe._encode_vae_image)
    pipe.vae.decode = timed("vae_decode", pipe.vae.decode)
    pipe.image_processor.postprocess = timed("postprocess", pipe.image_processor.postprocess)

    def loop_starts(module, args):
        if "loop_start" not in record:
            sync()
            record["loop_start"] = time.perf_counter()

    pipe.transformer.register_forward_pre_hook(loop_starts)
    call = type(pipe).__call__

    class Timed(type(pipe)):
        def __call__(self, *args, **kwargs):
            record.clear()
            sync()
            t0 = time.perf_counter()
            out = call(self, *args, **kwargs)
            sync()
            total = time.perf_counter() - t0
            start = record.pop("loop_start", t0) - t0
            done = {k: round(v, 4) for k, v in record.items()}
            done.update(call_s=round(total, 4), before_loop_s=round(start, 4),
                        loop_s=round(total - start - record.get("vae_decode", 0) - record.get("postprocess", 0), 4))
            with open(path, "a") as f:
                f.write(json.dumps(done) + "\n")
            return out

    pipe.__class__ = Timed


PROMPT = "turn the sky into a sunset"  # --prompt: another length (a Ulysses pair pads an odd one and masks it)


def edit(manager, image, size, seed=0, prompt=None, **kw) -> dict:
    prompt = prompt or PROMPT
    req = EditRequest(images=(image,), prompt=prompt, seed=seed, width=size, height=size, source="bench", **kw)
    clock = StepClock()
    t0 = time.perf_counter()
    result = manager.edit(req, on_step=clock)
    wall = time.perf_counter() - t0
    if contrast(result.images[0]) < 1.0:
        raise RuntimeError("a flat (black/NaN) image came back")
    return {"wall_s": round(wall, 3), "worker_s": round(result.seconds, 3), "steps": result.steps,
            "s_per_step": round(clock.per_step, 4), "outside_loop_s": round(wall - clock.per_step * result.steps, 3)}


def best(runs: list[dict]) -> dict:
    """The median run by wall time, with every wall time listed."""
    ordered = sorted(runs, key=lambda r: r["wall_s"])
    return {**ordered[len(ordered) // 2], "walls": [r["wall_s"] for r in runs]}


def make_loras(folder: Path, ckpt: Path, rank: int) -> None:
    linears = transformer_linears(ckpt)
    for seed, name in enumerate((FOUR, EIGHT, STYLE)):
        path = folder / f"{name}.safetensors"
        if not path.is_file():
            t0 = time.perf_counter()
            random_lora(path, linears, rank=rank, std=0.02, seed=seed + 1)
            log.info("wrote %s (%.0f MiB) in %.1fs", path.name, path.stat().st_size / 2**20, time.perf_counter() - t0)


def manager_for(args, ckpt: Path, lora_dir: Path, compile_mode: str) -> tuple[PipelineManager, float]:
    settings = load_settings({
        "QWEN_MODEL_DIR": str(ckpt), "DEVICE_MAP": args.device_map, "COMPILE": compile_mode,
        "COMPILE_CACHE_DIR": args.cache, "LOG_LEVEL": "INFO", "MAX_STEPS": "200", "LORA_DIR": str(lora_dir),
        "ENCODE_CACHE": "0", **dict(pair.split("=", 1) for pair in args.env)})
    t0 = time.perf_counter()
    portrait = tuple(max(64, round(args.size * f / 16) * 16) for f in (0.8125, 1.21875))  # 832x1248 at 1024
    sizes = ((args.size, args.size), portrait)  # the app's two warm-up shapes (imgedit.engine.manager.WARMUP_SIZES)
    manager = PipelineManager(settings, worker_hook="bench_fast:hook", warmup_sizes=sizes).load(timeout=540)
    return manager, round(time.perf_counter() - t0, 1)


def switching(manager, image, size, repeats: int) -> dict:
    """4-step CFG-off jobs with the same adapter every time vs alternating between two adapters of the
    same shape (the 4-step Lightning LoRA, and the style LoRA at 4 steps): equal work per job, so the
    difference per job is what switching LoRA costs. Both sets run once first (a compiled worker
    compiles each adapter set's variant on first use)."""
    def job(i: int, other: bool) -> float:
        kw = dict(lora=STYLE, num_inference_steps=4, true_cfg_scale=1.0) if other else dict(speed="fastest")
        return edit(manager, image, size, seed=i, **kw)["wall_s"]

    job(0, True)
    job(0, False)
    same = [job(i, False) for i in range(repeats)]
    mixed = [job(i, i % 2 == 1) for i in range(2 * repeats)]
    cost = statistics.median(mixed) - statistics.median(same)
    return {"same_lora_walls": same, "alternating_walls": mixed, "switch_cost_s": round(cost, 3)}


def section(name: str, args, ckpt: Path, lora_dir: Path, image) -> dict:
    compile_mode = "on" if name == "compiled" else "off"
    manager, startup = manager_for(args, ckpt, lora_dir, compile_mode)
    out: dict = {"section": name, "compile": compile_mode, "startup_s": startup,
                 "worker_info": {w.name: w.info for w in manager.workers}, "loras": [dict(x) for x in
                                                                                     manager.status().loras]}
    size, reps = args.size, args.repeats
    try:
        if compile_mode == "off":
            edit(manager, image, size, num_inference_steps=2)  # warm-up (compiled workers warm up at start)
            edit(manager, image, size, speed="fastest")
        seen = phase_lines()
        out["fastest_4_step"] = best([edit(manager, image, size, seed=i, speed="fastest") for i in range(reps)])
        if PHASES in os.environ:  # medians over the 4-step edits just timed
            calls = phase_lines()[len(seen):]
            out["fastest_4_step"]["phases"] = {k: statistics.median(c.get(k, 0.0) for c in calls) for k in calls[0]}
        out["fast_8_step"] = best([edit(manager, image, size, seed=i, speed="fast") for i in range(reps)])
        n = args.per_step_steps
        # Per step, CFG off in all three: the base transformer, + the adapter as the app runs it, + fused by hand.
        # what the worker does, not what was asked: FUSE_LORA=auto runs unfused where the copy does not fit
        fuses = not str(manager.workers[0].info.get("fuse_lora", "off")).startswith("off")
        as_run = "fused_app" if fuses else "unfused"
        out["per_step"] = {
            "no_lora": edit(manager, image, size, num_inference_steps=n, true_cfg_scale=1.0)["s_per_step"],
            as_run: edit(manager, image, size, num_inference_steps=n, true_cfg_scale=1.0, lora=EIGHT)["s_per_step"],
        }
        # by hand only eager (fusing flips peft's state: under compile it would recompile mid-run) and only
        # when the app does not fuse already
        if compile_mode == "off" and as_run == "unfused":
            fused = edit(manager, image, size, num_inference_steps=n, true_cfg_scale=1.0, lora=EIGHT,
                         prompt=f"{FUSE_MARK} {PROMPT}")
            out["per_step"]["fused"] = fused["s_per_step"]
            edit(manager, image, size, num_inference_steps=2)  # unfuse again before the next measurement
        base = out["per_step"]["no_lora"]
        out["per_step"][f"{as_run}_overhead"] = round(out["per_step"][as_run] / base - 1, 4)
        if "fused" in out["per_step"]:
            out["per_step"]["fused_overhead"] = round(out["per_step"]["fused"] / base - 1, 4)
        out["switching"] = switching(manager, image, size, max(2, reps))
        out["quality"] = edit(manager, image, size, num_inference_steps=args.quality_steps, negative_prompt=" ")
        out["switching"]["fraction_of_quality_edit"] = round(
            out["switching"]["switch_cost_s"] / out["quality"]["wall_s"], 4)
        if (name == "compiled" or args.tiny) and importlib.util.find_spec("gradio") is None:
            out["rest_fastest"] = "not measured: gradio is not installed here"
        elif name == "compiled" or args.tiny:
            out["rest_fastest"] = rest_fastest(manager, image, size, reps)
    finally:
        manager.close()
    return out


def phase_lines() -> list[dict]:
    """The workers' --phases records so far (one per pipeline call, every rank of a group)."""
    path = Path(os.environ.get(PHASES, "/nonexistent"))
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def rest_fastest(manager, image, size: int, repeats: int) -> dict:
    """A 4-step fast edit through the HTTP server (REST), as a client sees it."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    form = {"prompt": PROMPT, "size": f"{size}x{size}", "seed": "0", "speed": "fastest"}
    with served(manager.settings, manager) as url:
        walls = [rest_edit(url, buf.getvalue(), form) for _ in range(repeats + 1)]
    return {"walls": walls, "median_after_first_s": statistics.median(walls[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="eager,compiled")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, rank-4 LoRAs, 64x64")
    parser.add_argument("--ckpt", default="/tmp/qwen-image-edit-real-random")
    parser.add_argument("--loras", default="/tmp/imgedit-bench-loras")
    parser.add_argument("--cache", default="/tmp/imgedit-compile-cache")
    parser.add_argument("--device-map", default="cuda:0")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--per-step-steps", type=int, default=8)
    parser.add_argument("--quality-steps", type=int, default=40)
    parser.add_argument("--json", default="")
    parser.add_argument("--phases", action="store_true", help="time the phases of each 4-step edit (see above)")
    parser.add_argument("--prompt", default="")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="a setting for the workers (repeatable), e.g. FUSE_LORA=off or DEVICE_MAP=cfg-parallel")
    args = parser.parse_args()
    global PROMPT
    PROMPT = args.prompt or PROMPT
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    rank = LIGHTNING_RANK
    if args.tiny:
        tmp = Path(tempfile.mkdtemp(prefix="bench-fast-"))
        args.ckpt, args.loras, args.device_map, rank = str(tmp / "ckpt"), str(tmp / "loras"), "cpu", 4
        args.size, args.repeats, args.per_step_steps, args.quality_steps = 64, 2, 3, 4
        args.sections = args.sections if args.sections != "eager,compiled" else "eager"
    ckpt, lora_dir = Path(args.ckpt), Path(args.loras)
    if not (ckpt / "model_index.json").is_file():
        build_checkpoint(ckpt, kind="plus", size="tiny" if args.tiny else "real")
    lora_dir.mkdir(parents=True, exist_ok=True)
    make_loras(lora_dir, ckpt, rank)
    image = reference_image(max(args.size, 64))
    if args.phases:  # the worker processes inherit it (spawned after this)
        os.environ[PHASES] = str(Path(tempfile.mkdtemp(prefix="bench-phases-")) / "phases.jsonl")
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
              "lora_rank": rank, "env": args.env, "results": []}
    failed = False
    for name in args.sections.split(","):
        try:
            res = section(name, args, ckpt, lora_dir, image)
        except Exception as exc:
            log.exception("section %s failed", name)
            res, failed = {"section": name, "error": repr(exc)}, True
        report["results"].append(res)
        print(json.dumps(res), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
