"""Benchmark the step caches (CACHE / `cache`) on this machine's GPU: time per image and fidelity to the uncached edit.

    python benchmarks/bench_cache.py [--size 1024] [--steps 40] [--repeats 2] [--json out.json]
    python benchmarks/bench_cache.py --tiny          # CPU smoke run on the tiny checkpoint
    python benchmarks/bench_cache.py --modes none,taylorseer   # some of the caches (none first: the reference)

Through imgedit's PipelineManager and a worker process, as the app runs it (DEVICE_MAP=cuda:0, COMPILE off,
ENCODE_CACHE=0), with the real-size random-weight checkpoint (trained-like init; the worker hook fails a job on
non-finite transformer outputs, bench.finite_check). The workload: a 1024x1024 quality edit, 40 steps, CFG 4.
For each cache mode the same seeds as the uncached edit: seconds per image and per step, and fidelity against
the uncached result, the cosine similarity of the final latents (saved by the worker hook right before the
VAE decodes) and the PSNR of the images. Random weights make the fidelity an upper bound of what it means
for a trained model (the blocks' outputs of a random model change differently from step to step).
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from bench import (  # noqa: E402
    finite_check,
    one_gpu_parser,
    one_gpu_settings,
    reference_image,
    request,
    timed,
    write_results,
)

from imgedit.engine.manager import PipelineManager  # noqa: E402

log = logging.getLogger("bench_cache")
MODES = ("none", "first-block", "taylorseer")


def hooks(pipe, spec) -> None:
    """Worker hook: bench.finite_check, and the final latents of each edit saved to $BENCH_LATENTS."""
    import torch

    finite_check(pipe, spec)
    target = os.environ["BENCH_LATENTS"]

    def save(module, args):
        torch.save(args[0].detach().float().cpu(), target)

    pipe.vae.decoder.register_forward_pre_hook(save)


def fidelity(latents, reference_latents, image, reference_image_) -> dict:
    import torch

    a, b = latents.flatten(), reference_latents.flatten()
    cosine = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    x = np.asarray(image, dtype=np.float64)
    y = np.asarray(reference_image_, dtype=np.float64)
    mse = float(((x - y) ** 2).mean())
    return {"latent_cosine": round(cosine, 5), "psnr_db": round(10 * math.log10(255**2 / mse), 2) if mse else None}


def main() -> None:
    parser = one_gpu_parser(__doc__, steps=40, repeats=2)
    parser.add_argument("--threshold", default="0.08")
    parser.add_argument("--modes", default=",".join(MODES), help="which caches, none first (the reference)")
    args = parser.parse_args()
    modes = tuple(m.strip() for m in args.modes.split(","))
    if modes[0] != "none" or not set(modes) <= set(MODES):
        parser.error(f"--modes: none first, then any of {', '.join(MODES[1:])}")
    settings, size, steps = one_gpu_settings(args, tiny_steps=12, CACHE_THRESHOLD=args.threshold)
    device_map = "cpu" if args.tiny else "cuda:0"
    latents_file = Path(tempfile.mkdtemp()) / "latents.pt"
    os.environ["BENCH_LATENTS"] = str(latents_file)  # the worker inherits it
    t0 = time.perf_counter()
    manager = PipelineManager(settings, worker_hook="bench_cache:hooks").load(timeout=540)
    image = reference_image(size)
    out: dict = {"device_map": device_map, "size": size, "steps": steps, "cfg": 4.0, "threshold": args.threshold,
                 "startup_s": round(time.perf_counter() - t0, 1), "runs": {m: [] for m in modes}}
    import torch

    reference: dict[int, tuple] = {}
    try:
        timed(manager, request(image, 2, (size, size)))  # warm-up (kernels, allocator)
        for k in range(args.repeats):
            for mode in modes:
                req = request(image, steps, (size, size), seed=k)
                started = time.perf_counter()
                result = manager.edit(replace(req, cache=mode))
                run = {"wall_s": round(time.perf_counter() - started, 3), "worker_s": round(result.seconds, 3)}
                latents = torch.load(latents_file)
                if mode == "none":
                    reference[k] = (latents, result.images[0])
                else:
                    run.update(fidelity(latents, reference[k][0], result.images[0], reference[k][1]))
                out["runs"][mode].append(run)
                log.info("seed %d %s: %s", k, mode, run)
    finally:
        manager.close()
    base = statistics.median(r["wall_s"] for r in out["runs"]["none"])
    summary = {}
    for mode in modes:
        runs = out["runs"][mode]
        wall = statistics.median(r["wall_s"] for r in runs)
        summary[mode] = {"s_per_image": wall, "s_per_step": round(wall / steps, 4), "speedup": round(base / wall, 2)}
        if mode != "none":
            summary[mode]["latent_cosine"] = min(r["latent_cosine"] for r in runs)
            summary[mode]["psnr_db"] = min(r["psnr_db"] for r in runs if r["psnr_db"] is not None) if any(
                r["psnr_db"] is not None for r in runs) else None
    write_results(out, summary, args.json)


if __name__ == "__main__":
    main()
