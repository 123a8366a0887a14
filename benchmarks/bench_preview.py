"""Benchmark the live preview on this machine's GPU: the same edit watched (a preview every few steps) and not.

    python benchmarks/bench_preview.py [--size 1024] [--steps 40] [--repeats 3] [--json out.json]
    python benchmarks/bench_preview.py --tiny          # CPU smoke run on the tiny checkpoint

Through imgedit's PipelineManager and a worker process, as the app runs it (DEVICE_MAP=cuda:0, COMPILE off,
ENCODE_CACHE=0), with the real-size random-weight checkpoint. The workload: one input, a size x size output,
CFG on (4); the watched run asks for the preview (EditRequest.watch) and counts the previews that reached the
server and their bytes. The first watched job fits the latent -> RGB map on the worker's VAE (once): it runs in
the warm-up. Reported: wall time and seconds per step (the first step excluded) each way; the per-step
difference is the preview's cost, the target is <= 1 % of a step.
"""

from __future__ import annotations

import logging
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import one_gpu_parser, one_gpu_settings, reference_image, request, timed, write_results  # noqa: E402

from imgedit.engine.manager import PipelineManager  # noqa: E402

log = logging.getLogger("bench_preview")


def watched(manager, req) -> dict:
    """`timed` for a watched job, with the previews the server received (read from the worker's handle at each
    step)."""
    seen: list[bytes] = []
    worker = manager.workers[0]

    def look() -> None:
        while not done:
            if worker.preview is not None and (not seen or worker.preview is not seen[-1]):
                seen.append(worker.preview)
            time.sleep(0.005)

    done = False
    looker = threading.Thread(target=look, daemon=True)
    looker.start()
    try:
        result = timed(manager, replace(req, watch=True))
    finally:
        done = True
        looker.join()
    return {**result, "previews": len(seen), "preview_bytes": max((len(p) for p in seen), default=0)}


def main() -> None:
    args = one_gpu_parser(__doc__, steps=40, repeats=3).parse_args()
    settings, size, steps = one_gpu_settings(args, tiny_steps=8, MAX_STEPS="200")
    t0 = time.perf_counter()
    manager = PipelineManager(settings, worker_hook="bench:finite_check").load(timeout=540)
    image = reference_image(size)
    out: dict = {"size": size, "steps": steps, "cfg": 4.0, "startup_s": round(time.perf_counter() - t0, 1),
                 "plain": [], "watched": []}
    try:
        timed(manager, request(image, 2, (size, size)))  # warm-up (kernels, allocator)
        fit_start = time.perf_counter()
        watched(manager, request(image, 2, (size, size)))  # warm-up, and the map's fit (once per worker)
        out["first_watched_s"] = round(time.perf_counter() - fit_start, 3)
        for k in range(args.repeats):
            out["plain"].append(timed(manager, request(image, steps, (size, size), seed=k)))
            out["watched"].append(watched(manager, request(image, steps, (size, size), seed=k)))
            log.info("round %d: plain %.4f s/step, watched %.4f s/step (%d previews)", k,
                     out["plain"][-1]["s_per_step"], out["watched"][-1]["s_per_step"],
                     out["watched"][-1]["previews"])
    finally:
        manager.close()
    summary = {kind: {key: statistics.median(r[key] for r in out[kind]) for key in ("wall_s", "s_per_step")}
               for kind in ("plain", "watched")}
    summary["preview_cost_per_step_pct"] = round(
        100 * (summary["watched"]["s_per_step"] / summary["plain"]["s_per_step"] - 1), 2)
    summary["previews_per_job"] = statistics.median(r["previews"] for r in out["watched"])
    summary["preview_bytes"] = max(r["preview_bytes"] for r in out["watched"])
    write_results(out, summary, args.json)


if __name__ == "__main__":
    main()
