"""Benchmark ENCODE_CACHE on this machine's GPU: a new input image vs the same image edited again.

    python benchmarks/bench_encode.py [--size 1024] [--steps 4] [--repeats 3] [--json out.json]
    python benchmarks/bench_encode.py --tiny          # CPU smoke run on the tiny checkpoint

Through imgedit's PipelineManager and a worker process, as the app runs it (DEVICE_MAP=cuda:0, COMPILE
off, ENCODE_CACHE=8), with the real-size random-weight checkpoint (trained-like init; the worker hook
fails the job on a non-finite transformer output, bench.finite_check). The workload is a fast edit's
shape: 4 steps, CFG off, one 1024x1024 input, a 1024x1024 output. Each round edits a picture the worker
has never seen (the VAE encodes it at about 1 MP and the 7B text encoder reads the prompt with it), then
the same picture with another seed (both encodings come from the memo). Reported: wall time, time to the
end of the first step (encodings + one step) and seconds per step, for both; their difference is what a
repeated input saves.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import reference_image, request, timed  # noqa: E402
from PIL import ImageChops  # noqa: E402

from imgedit.config.settings import load_settings  # noqa: E402
from imgedit.engine.manager import PipelineManager  # noqa: E402
from imgedit.model.demo_checkpoint import build_checkpoint  # noqa: E402

log = logging.getLogger("bench_encode")


def picture(base, k: int):
    """The k-th never-seen input: the reference picture rolled by a few pixels (other pixels, same content)."""
    return ImageChops.offset(base, 7 * k, 3 * k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", default="/tmp/qwen-image-edit-real-random")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, 64x64 output")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.tiny:
        ckpt = build_checkpoint(Path(tempfile.mkdtemp()) / "tiny", kind="plus")
        device_map, size = "cpu", 64
    else:
        ckpt = Path(args.ckpt)
        if not (ckpt / "model_index.json").is_file():
            build_checkpoint(ckpt, kind="plus", size="real")
        device_map, size = "cuda:0", args.size
    settings = load_settings({"QWEN_MODEL_DIR": str(ckpt), "DEVICE_MAP": device_map, "COMPILE": "off",
                              "ENCODE_CACHE": "8", "LOG_LEVEL": "INFO", "MAX_STEPS": "200"})
    t0 = time.perf_counter()
    manager = PipelineManager(settings, worker_hook="bench:finite_check").load(timeout=540)
    out: dict = {"device_map": device_map, "size": size, "steps": args.steps, "cfg": 1.0,
                 "startup_s": round(time.perf_counter() - t0, 1), "rounds": []}
    base = reference_image(1024 if not args.tiny else 128)
    try:
        timed(manager, request(picture(base, 99), 2, (size, size), cfg=1.0))  # warm-up (kernels, allocator)
        for k in range(args.repeats):
            image = picture(base, k + 1)
            new = timed(manager, request(image, args.steps, (size, size), seed=k, cfg=1.0))
            again = timed(manager, request(image, args.steps, (size, size), seed=100 + k, cfg=1.0))
            out["rounds"].append({"new_input": new, "same_input": again})
            log.info("round %d: new input %.3f s (first step ends at %.3f s), same input %.3f s (%.3f s)", k,
                     new["wall_s"], new["to_first_step_s"], again["wall_s"], again["to_first_step_s"])
    finally:
        manager.close()
    walls_new = [r["new_input"]["wall_s"] for r in out["rounds"]]
    walls_same = [r["same_input"]["wall_s"] for r in out["rounds"]]
    first_new = [r["new_input"]["to_first_step_s"] for r in out["rounds"]]
    first_same = [r["same_input"]["to_first_step_s"] for r in out["rounds"]]
    out["summary"] = {"new_input_wall_s": statistics.median(walls_new),
                      "same_input_wall_s": statistics.median(walls_same),
                      "saved_s": round(statistics.median(walls_new) - statistics.median(walls_same), 3),
                      "new_input_to_first_step_s": statistics.median(first_new),
                      "same_input_to_first_step_s": statistics.median(first_same)}
    print(json.dumps(out["summary"], indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
