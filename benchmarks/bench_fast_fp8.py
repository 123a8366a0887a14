"""Benchmark FAST_QUANTIZE: `fastest` on the bf16 quality weights against its own fp8 copy (the LoRA fused in,
every Linear in fp8), through the app's manager and REST, with the images compared.

    python benchmarks/bench_fast_fp8.py [--size 1024] [--repeats 3] [--rows none,fp8] [--json out.json]
        [--device-map cfg-parallel] [--fast-only] [--env NAME=VALUE ...] [--phases N]
    python benchmarks/bench_fast_fp8.py --tiny      # CPU smoke run (int8 instead of fp8, eager, 64x64)

Each row is one worker started by imgedit's PipelineManager on cuda:0 or --device-map (COMPILE=on, warmed up at the
size, ENCODE_CACHE=0) with a real-size random checkpoint (trained-like init) and one random LoRA of the published
Lightning 4-step shape (rank 64 on the 720 attention and MLP Linear layers; imgedit.model.lora_random) in
LORA_DIR; FAST_QUANTIZE is the row (none: FUSE_LORA=auto fuses the LoRA into the quality weights where its copy
of the adapted weights fits, as on an H200, and runs it unfused where not, as on an 80 GB H100). The worker
hook (bench.finite_check) fails a job whose transformer output (the copy's too) or latents are not finite
(NaN runs faster; the 2026-11-27 run checked the latents only, which the copy's outputs reach), and every
image must have contrast. Jobs: speed=fastest (4 steps, CFG off, a 1024x1024 input and output) through
manager.edit, then through the HTTP server (REST), seeds 1..N after one warm-up job. Fidelity: the fp8 row's
images against the bf16 row's of the same seed, PSNR and the cosine of the centred pixels (random weights and
LoRA: no statement about a trained model's fp8 quality). --phases N: after the timed jobs (which run without
stamps), N more jobs with bench_outside's per-rank timeline (each stamp syncs the GPU), in the same workers.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import StepClock, contrast, reference_image, write_results  # noqa: E402
from bench_fast import PROMPT, rest_fastest  # noqa: E402
from bench_outside import STAMPS, SWITCH, stamped_edit  # noqa: E402

from imgedit.config.settings import load_settings  # noqa: E402
from imgedit.engine.manager import PipelineManager  # noqa: E402
from imgedit.model.demo_checkpoint import build_checkpoint  # noqa: E402
from imgedit.model.lora_random import LIGHTNING_RANK, random_lora  # noqa: E402
from imgedit.model.loras import transformer_linears  # noqa: E402
from imgedit.protocol import EditRequest  # noqa: E402

log = logging.getLogger("bench_fast_fp8")
FOUR = "Bench-Lightning-4steps-V1.0-bf16"


def row(args, ckpt: Path, lora_dir: Path, mode: str) -> tuple[dict, dict[int, np.ndarray]]:
    settings = load_settings({
        "QWEN_MODEL_DIR": str(ckpt), "DEVICE_MAP": "cpu" if args.tiny else args.device_map, "LORA_DIR": str(lora_dir),
        "COMPILE": "off" if args.tiny else "on", "FAST_QUANTIZE": mode, "FUSE_LORA": "auto", "ENCODE_CACHE": "0",
        "LOG_LEVEL": "INFO", "COMPILE_CACHE_DIR": tempfile.mkdtemp()}  # no compile cache from an earlier row
        | dict(item.split("=", 1) for item in args.env))
    size = args.size
    t0 = time.perf_counter()
    STAMPS.mkdir(exist_ok=True)
    SWITCH.unlink(missing_ok=True)  # the timed jobs run without stamps
    manager = PipelineManager(settings, worker_hook="bench_outside:phases" if args.phases else "bench:finite_check",
                              warmup_sizes=() if args.fast_only else ((size, size),)).load(timeout=1500)
    startup = round(time.perf_counter() - t0, 1)
    image = reference_image(size)
    runs, images = [], {}
    try:
        for seed in range(args.repeats + 1):  # seed 0 warms up
            req = EditRequest(images=(image,), prompt=PROMPT, seed=seed, width=size, height=size, speed="fastest",
                              source="bench")
            clock, started = StepClock(), time.perf_counter()
            result = manager.edit(req, on_step=clock)
            wall = time.perf_counter() - started
            if contrast(result.images[0]) < 1.0:
                raise RuntimeError("a flat (black/NaN) image came back")
            if result.weights != (None if mode == "none" else mode):  # the job ran on the weights the row is about
                raise RuntimeError(f"the {mode} row's job ran on {result.weights or 'the bf16 weights'}")
            per_step = clock.per_step
            run = {"wall_s": round(wall, 3), "worker_s": round(result.seconds, 3), "s_per_step": round(per_step, 4),
                   "outside_loop_s": round(wall - per_step * result.steps, 3)}
            if seed:
                runs.append(run)
                images[seed] = np.asarray(result.images[0], dtype=np.float64)
            log.info("%s seed %d: %s", mode, seed, run)
        timelines = [phases_run(manager, image, size, seed) for seed in range(1, args.phases + 1)]
        try:
            rest = rest_fastest(manager, image, size, args.repeats)
        except ModuleNotFoundError as exc:  # the GPU machine may lack the web stack
            rest = {"not_measured": f"{exc.name} is not installed here"}
        info = manager.workers[0].info
    finally:
        manager.close()
    walls = sorted(r["wall_s"] for r in runs)
    return {"fast_quantize": mode, "startup_s": startup, "runs": runs, "wall_s": statistics.median(walls),
            "s_per_step": statistics.median(r["s_per_step"] for r in runs),
            "outside_loop_s": statistics.median(r["outside_loop_s"] for r in runs), "rest": rest,
            "fast_weights": info.get("fast_weights"), "fuse_lora": info.get("fuse_lora"),
            "memory_allocated_gib": info.get("memory_allocated_gib"), "cpu_threads": info.get("cpu_threads"),
            "pixels": info.get("pixels"), "compile_seconds": info.get("compile_seconds")} \
        | ({"timelines": timelines} if timelines else {}), images


def phases_run(manager, image, size: int, seed: int) -> dict:
    """One more fastest job with every rank stamping its phases (bench_outside.phases): where the time goes."""
    SWITCH.touch()
    try:
        run = stamped_edit(manager, EditRequest(images=(image,), prompt=PROMPT, seed=seed, width=size, height=size,
                                                speed="fastest", source="bench"))
    finally:
        SWITCH.unlink(missing_ok=True)
    log.info("phases, seed %d: %s", seed, run)
    return run


def fidelity(a: dict[int, np.ndarray], b: dict[int, np.ndarray]) -> dict:
    """PSNR (dB) and the cosine of the centred pixels, per seed, of the images both rows made."""
    out = {}
    for seed in sorted(set(a) & set(b)):
        x, y = a[seed], b[seed]
        mse = float(np.mean((x - y) ** 2))
        xc, yc = (x - x.mean()).ravel(), (y - y.mean()).ravel()
        out[seed] = {"psnr_db": round(99.0 if mse == 0 else 10 * np.log10(255.0**2 / mse), 2),
                     "cosine": round(float(xc @ yc / (np.linalg.norm(xc) * np.linalg.norm(yc))), 5)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", default="/tmp/qwen-image-edit-real-random")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", default="none,fp8")
    parser.add_argument("--json", default="")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--device-map", default="cuda:0",
                        help="e.g. cfg-parallel: a pair, its ranks split each fast job")
    parser.add_argument("--fast-only", action="store_true",
                        help="no quality (CFG) warm-up, the fast jobs' variants alone (where the quality weights, "
                             "the copy and a CFG forward's buffers do not fit one card together)")
    parser.add_argument("--phases", type=int, default=0, metavar="N",
                        help="N more jobs with a per-rank timeline of their phases (after the timed ones)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="another setting for the workers (repeatable), e.g. WORKER_THREADS=32")
    args = parser.parse_args()
    if bad := [item for item in args.env if "=" not in item]:
        parser.error(f"--env takes NAME=VALUE, got {bad[0]!r}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    folder = Path(tempfile.mkdtemp())
    if args.tiny:
        ckpt, args.size = build_checkpoint(folder / "tiny", kind="plus"), 64
    else:
        ckpt = Path(args.ckpt)
        if not (ckpt / "model_index.json").is_file():
            build_checkpoint(ckpt, kind="plus", size="real")
    lora_dir = folder / "loras"
    lora_dir.mkdir()
    random_lora(lora_dir / f"{FOUR}.safetensors", transformer_linears(ckpt),
                rank=4 if args.tiny else LIGHTNING_RANK, std=0.02, seed=1)
    modes = [m.strip() for m in args.rows.split(",")]
    if args.tiny:
        modes = ["int8" if m == "fp8" else m for m in modes]
    versions = {name: metadata.version(name) for name in ("torch", "diffusers", "torchao", "peft")}
    rows, images = [], {}
    for mode in modes:
        result, images[mode] = row(args, ckpt, lora_dir, mode)
        rows.append(result)
    out = {"size": args.size, "steps": 4, "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
           "versions": versions, "rows": rows}
    if "none" in images and len(images) > 1:
        out["fidelity_vs_bf16"] = {m: fidelity(images[m], images["none"]) for m in images if m != "none"}
    summary = {r["fast_quantize"]: {k: r[k] for k in ("wall_s", "s_per_step", "outside_loop_s", "startup_s",
                                                      "memory_allocated_gib")}
               | {"rest_s": r["rest"].get("median_after_first_s")} for r in rows}
    write_results(out, {"rows": summary, "fidelity": out.get("fidelity_vs_bf16")}, args.json)


if __name__ == "__main__":
    main()
