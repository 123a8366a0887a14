"""Benchmark masked editing on this machine's GPU: the same edit with and without a mask.

    python benchmarks/bench_mask.py [--size 1024] [--steps 20] [--repeats 3] [--json out.json]
    python benchmarks/bench_mask.py --tiny          # CPU smoke run on the tiny checkpoint

Through imgedit's PipelineManager and a worker process, as the app runs it (DEVICE_MAP=cuda:0, COMPILE
off, ENCODE_CACHE=0), with the real-size random-weight checkpoint (trained-like init; the worker hook fails the job on
a non-finite transformer output, bench.finite_check). The workload: one 1024x1024 input, a 1024x1024
output, CFG on (4), the mask the left half. Reported per run: wall time, seconds per step (the first
step excluded) and the time up to the end of the first step (the masked edit encodes the input once more
at the output size there); the per-step difference is the blending's cost, the target is <= 2 % of a step.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from bench import one_gpu_parser, one_gpu_settings, reference_image, request, timed, write_results  # noqa: E402
from PIL import Image  # noqa: E402

from imgedit.engine.manager import PipelineManager  # noqa: E402
from imgedit.protocol import new_request_id  # noqa: E402

log = logging.getLogger("bench_mask")


def main() -> None:
    args = one_gpu_parser(__doc__, steps=20, repeats=3).parse_args()
    settings, size, steps = one_gpu_settings(args, tiny_steps=4, MAX_STEPS="200")
    device_map = "cpu" if args.tiny else "cuda:0"
    t0 = time.perf_counter()
    manager = PipelineManager(settings, worker_hook="bench:finite_check").load(timeout=540)
    image = reference_image(size)
    mask = Image.new("L", (size, size), 0)
    mask.paste(255, (0, 0, size // 2, size))
    out: dict = {"device_map": device_map, "size": size, "steps": steps, "cfg": 4.0,
                 "startup_s": round(time.perf_counter() - t0, 1), "plain": [], "masked": []}
    try:
        timed(manager, request(image, 2, (size, size)))  # warm-up (kernels, allocator)
        timed(manager, replace(request(image, 2, (size, size)), mask=mask))
        for k in range(args.repeats):
            out["plain"].append(timed(manager, request(image, steps, (size, size), seed=k)))
            masked_req = replace(request(image, steps, (size, size), seed=k), mask=mask, mask_feather=8)
            clock_start = time.perf_counter()
            result = manager.edit(masked_req)
            kept = np.asarray(result.images[0])[:, size // 2:] == np.asarray(image)[:, size // 2:]
            if not kept.all():
                raise RuntimeError("a pixel outside the mask changed")
            out["masked"].append(timed(manager, replace(masked_req, request_id=new_request_id())))
            log.info("round %d: plain %.3f s/step, masked %.3f s/step (a check run took %.2f s)", k,
                     out["plain"][-1]["s_per_step"], out["masked"][-1]["s_per_step"], time.perf_counter() - clock_start)
    finally:
        manager.close()
    summary = {}
    for kind in ("plain", "masked"):
        summary[kind] = {key: statistics.median(r[key] for r in out[kind])
                         for key in ("wall_s", "s_per_step", "to_first_step_s", "after_last_step_s")}
    summary["blend_cost_per_step_pct"] = round(
        100 * (summary["masked"]["s_per_step"] / summary["plain"]["s_per_step"] - 1), 2)
    write_results(out, summary, args.json)


if __name__ == "__main__":
    main()
