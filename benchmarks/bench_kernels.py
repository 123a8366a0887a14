"""Benchmark the attention kernels (ATTENTION) and compile modes (COMPILE, COMPILE_MODE) on this machine's GPU.

    python benchmarks/bench_kernels.py [--rows eager-native,eager-flash,...] [--steps 10] [--repeats 2]
    python benchmarks/bench_kernels.py --tiny --rows eager-native,eager-flash   # CPU smoke run

One worker on cuda:0 through imgedit's PipelineManager, as the app runs it (ENCODE_CACHE=0), with the real-size
random-weight checkpoint (trained-like init; the worker hook fails a job on non-finite transformer outputs,
bench.finite_check). The workload: a 1024x1024 quality edit, CFG 4, bf16, lossless. Each row starts its own
worker: start-up (load, compile and warm-up), seconds per step and per image, the GPU's peak memory (NVML),
and the image's PSNR against the first row's (the kernels sum in other orders; the same seeds).
"""

from __future__ import annotations

import logging
import math
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from bench import (  # noqa: E402
    one_gpu_parser,
    one_gpu_settings,
    peak_sampler,
    reference_image,
    request,
    timed,
    write_results,
)

from imgedit.engine.manager import PipelineManager  # noqa: E402
from imgedit.engine.workers.gpus import GpuMonitor  # noqa: E402

log = logging.getLogger("bench_kernels")
# name -> settings: every route of #24 item 4 (PyTorch's own kernels; nothing is downloaded)
ROWS = {
    "eager-native": {"ATTENTION": "native"},
    "eager-flash": {"ATTENTION": "flash"},
    "eager-cudnn": {"ATTENTION": "cudnn"},
    "eager-efficient": {"ATTENTION": "efficient"},
    "compiled-native": {"COMPILE": "on"},
    "compiled-flash": {"COMPILE": "on", "ATTENTION": "flash"},
    "compiled-cudnn": {"COMPILE": "on", "ATTENTION": "cudnn"},
    "compiled-autotune": {"COMPILE": "on", "COMPILE_MODE": "max-autotune-no-cudagraphs"},
}


def psnr(a, b) -> float | None:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    mse = float(((x - y) ** 2).mean())
    return round(10 * math.log10(255**2 / mse), 2) if mse else None


def run_row(name: str, args, size: int, steps: int, image, monitor) -> tuple[dict, list]:
    settings, _, _ = one_gpu_settings(args, tiny_steps=2, **{"COMPILE": "off", **ROWS[name]})
    peaks: dict = {}
    stop = threading.Event()
    sampler = threading.Thread(target=peak_sampler, args=(monitor, stop, peaks), daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    manager = PipelineManager(settings, worker_hook="bench:finite_check").load(timeout=560)
    row: dict = {"settings": ROWS[name], "startup_s": round(time.perf_counter() - t0, 1),
                 "attention_in_worker": manager.status().workers[0].attention,
                 "compile_mode": manager.status().compile_mode, "runs": []}
    try:
        timed(manager, request(image, 2, (size, size)))  # warm-up (kernels, allocator)
        for k in range(args.repeats):
            req = request(image, steps, (size, size), seed=k)
            run = timed(manager, req)
            row["runs"].append(run)
            log.info("%s seed %d: %s", name, k, run)
        images = [manager.edit(request(image, steps, (size, size), seed=0)).images[0]]  # for the PSNR
    finally:
        manager.close()
        stop.set()
        sampler.join(2)
    row["peak_gib"] = peaks
    row["s_per_step"] = round(statistics.median(r["s_per_step"] for r in row["runs"]), 4)
    row["s_per_image"] = round(statistics.median(r["wall_s"] for r in row["runs"]), 3)
    return row, images


def main() -> None:
    parser = one_gpu_parser(__doc__, steps=10, repeats=2)
    parser.add_argument("--rows", default=",".join(ROWS))
    args = parser.parse_args()
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    _, size, steps = one_gpu_settings(args, tiny_steps=2)
    image = reference_image(size)
    monitor = GpuMonitor()
    out: dict = {"size": size, "steps": steps, "cfg": 4.0, "rows": {}}
    reference = None
    summary = {}
    for name in rows:
        try:
            row, images = run_row(name, args, size, steps, image, monitor)
        except Exception as exc:  # a mode this machine cannot run is a row of its own, not the end of the run
            log.exception("%s failed", name)
            out["rows"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            summary[name] = out["rows"][name]
            continue
        if reference is None:
            reference = images[0]
        row["psnr_vs_first_row_db"] = psnr(images[0], reference)
        out["rows"][name] = row
        summary[name] = {k: row[k] for k in ("s_per_step", "s_per_image", "startup_s", "peak_gib",
                                             "psnr_vs_first_row_db", "attention_in_worker", "compile_mode")}
        write_results(out, summary, args.json)  # after every row: a later row's crash keeps the earlier ones
    write_results(out, summary, args.json)


if __name__ == "__main__":
    main()
