"""Benchmark prompt enhancement on this machine's GPU: the rewrite's latency and memory, and an edit right after.

    python benchmarks/bench_enhance.py [--size 1024] [--tokens 80] [--steps 8] [--repeats 3] [--json out.json]
    python benchmarks/bench_enhance.py --tiny          # CPU smoke run on the tiny checkpoint

Through imgedit's PipelineManager and a worker process, as the app runs it (DEVICE_MAP=cuda:0, COMPILE off,
ENCODE_CACHE=0), with the real-size random-weight checkpoint (trained-like init). A random text encoder never
ends its answer, so with ENHANCE_MAX_TOKENS=--tokens every rewrite writes exactly that many new tokens (and is
then not used: the notice says it was cut, which the script checks): the latency of a rewrite of that length.
The worker hook fails a job on non-finite next-token scores or transformer outputs (bench.finite_check).

Reported: a rewrite alone (one 1024x1024 input), the GPU memory in use at its peak against idle (NVML, polled
every 10 ms), and an edit (--steps, CFG 4) after an edit against the same edit right after a rewrite.
"""

from __future__ import annotations

import logging
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

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
from imgedit.protocol import EditRequest  # noqa: E402

log = logging.getLogger("bench_enhance")


def hooks(pipe, spec) -> None:
    """Worker hook: bench.finite_check, and the text encoder's next-token scores must be finite."""
    import torch

    finite_check(pipe, spec)

    def after(module, args, output):
        logits = getattr(output, "logits", None)
        if logits is not None and not bool(torch.isfinite(logits[:, -1]).all()):
            raise RuntimeError("non-finite next-token scores: the benchmark would be flattered")

    pipe.text_encoder.register_forward_hook(after)


class PeakMemory:
    """GPU 0's memory in use (NVML), polled every 10 ms while the block runs: the peak, in MiB."""

    def __init__(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle, self._nvml = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml
        except Exception:  # noqa: BLE001 - no NVML (CPU smoke run): no memory figures
            self._nvml = None
        self.peak = 0.0

    def used(self) -> float:
        if self._nvml is None:
            return 0.0
        return self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used / 2**20

    def __enter__(self):
        self.peak, self._stop = self.used(), threading.Event()

        def poll():
            while not self._stop.wait(0.01):
                self.peak = max(self.peak, self.used())

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.used())


def main() -> None:
    parser = one_gpu_parser(__doc__, steps=8, repeats=3)
    parser.add_argument("--tokens", type=int, default=80)
    args = parser.parse_args()
    settings, size, steps = one_gpu_settings(args, tiny_steps=2, ENHANCE_MAX_TOKENS=str(args.tokens))
    device_map = "cpu" if args.tiny else "cuda:0"
    t0 = time.perf_counter()
    manager = PipelineManager(settings, worker_hook="bench_enhance:hooks").load(timeout=540)
    image = reference_image(size)
    memory = PeakMemory()
    out: dict = {"device_map": device_map, "size": size, "tokens": args.tokens, "steps": steps,
                 "startup_s": round(time.perf_counter() - t0, 1), "rewrite_s": [], "edit_after_edit": [],
                 "edit_after_rewrite": []}

    def rewrite() -> float:
        started = time.perf_counter()
        result = manager.enhance(EditRequest(images=(image,), prompt="make it winter", source="bench"))
        seconds = time.perf_counter() - started
        if f"cut at the {args.tokens}-token limit" not in (result.notice or ""):
            raise RuntimeError(f"expected a rewrite of exactly {args.tokens} tokens, got: {result}")
        return round(seconds, 3)

    try:
        timed(manager, request(image, 2, (size, size)))  # warm-up (kernels, allocator)
        rewrite()
        idle = memory.used()
        with memory:
            out["rewrite_s"].append(rewrite())
        out["idle_mib"], out["rewrite_peak_mib"] = round(idle), round(memory.peak)
        with memory:
            timed(manager, request(image, steps, (size, size)))
        out["edit_peak_mib"] = round(memory.peak)
        for k in range(args.repeats):
            timed(manager, request(image, 2, (size, size), seed=k))
            out["edit_after_edit"].append(timed(manager, request(image, steps, (size, size), seed=k)))
            out["rewrite_s"].append(rewrite())
            out["edit_after_rewrite"].append(timed(manager, request(image, steps, (size, size), seed=k)))
            log.info("round %d: rewrite %.3f s; edit after an edit %.3f s, after a rewrite %.3f s", k,
                     out["rewrite_s"][-1], out["edit_after_edit"][-1]["wall_s"],
                     out["edit_after_rewrite"][-1]["wall_s"])
    finally:
        manager.close()
    summary = {"rewrite_s_median": statistics.median(out["rewrite_s"]),
               "s_per_token": round(statistics.median(out["rewrite_s"]) / args.tokens, 4),
               "rewrite_adds_mib": out["rewrite_peak_mib"] - out["idle_mib"],
               "edit_adds_mib": out["edit_peak_mib"] - out["idle_mib"]}
    for kind in ("edit_after_edit", "edit_after_rewrite"):
        summary[kind] = {key: statistics.median(r[key] for r in out[kind]) for key in ("wall_s", "s_per_step")}
    write_results(out, summary, args.json)


if __name__ == "__main__":
    main()
