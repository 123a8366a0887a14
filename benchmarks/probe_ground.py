"""Probe: mask_prompt's outline call alone on one GPU (imgedit.runtime.grounding.outline), with a real-size
random-weight Qwen2.5-VL-7B text encoder built directly on the GPU (no checkpoint on disk, no server).

    python benchmarks/probe_ground.py [--size 1024] [--repeats 3] [--full] [--tiny]

Random weights write no box: every call is a refusal, given up after boxes.BOX_WITHIN (48) tokens without
a box begun (what a user waits for "nothing found"); with --full after the outline's token limit
(engine.validation.OUTLINE_MAX_TOKENS, 256: as long as a trained model's longest answer). Timed: the first
call (on the GPU: the static cache's decoding step compiled, as a compiled worker's start-up warm-up does for
rewrites), then --repeats calls with the compiled step, then --repeats eager (a COMPILE=off worker's). The
app-level measurement, through app.py's REST, is benchmarks/bench_ground.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=1024, help="the input's side")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="the tiny encoder on the CPU (a smoke run)")
    parser.add_argument("--full", action="store_true", help="every outline to the 256-token limit")
    args = parser.parse_args()
    import numpy as np
    import torch
    from PIL import Image
    from transformers import Qwen2_5_VLForConditionalGeneration

    from imgedit.errors import InvalidInput
    from imgedit.model import boxes
    from imgedit.model.demo_checkpoint import _processor, build_tokenizer, text_encoder_config
    from imgedit.runtime import enhance, grounding

    if args.full:
        boxes.BOX_WITHIN = 10**9  # never given up early
    tokens = 256 if args.full else boxes.BOX_WITHIN
    device = "cpu" if args.tiny else "cuda"
    torch.set_default_dtype(torch.float32 if args.tiny else torch.bfloat16)
    t0 = time.perf_counter()
    with torch.device(device):
        torch.manual_seed(0)
        encoder = Qwen2_5_VLForConditionalGeneration(text_encoder_config("tiny" if args.tiny else "real")).eval()
    built = time.perf_counter() - t0
    pipe = SimpleNamespace(text_encoder=encoder, processor=_processor(build_tokenizer()),
                           _execution_device=torch.device(device))
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (args.size, args.size, 3), dtype=np.uint8))

    def outline() -> float:
        started = time.perf_counter()
        try:
            grounding.outline(pipe, image, "the red car", 256, threading.Event())
        except InvalidInput:
            pass
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    report = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "size": args.size,
              "tokens": tokens,
              "build_s": round(built, 1), "static": enhance.decodes_with_graphs(encoder)}
    report["first_s"] = round(outline(), 3)
    report["compiled_s"] = [round(outline(), 3) for _ in range(args.repeats)]
    enhance.no_static_cache(encoder)
    report["eager_s"] = [round(outline(), 3) for _ in range(args.repeats)]
    for key in ("compiled_s", "eager_s"):
        report[key.replace("_s", "_ms_per_token")] = round(1000 * statistics.median(report[key]) / tokens, 2)
    if device == "cuda":
        report["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
