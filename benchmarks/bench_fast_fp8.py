"""Probe: fast mode on fp8 weights with the Lightning LoRA fused in bf16 first (#24 item 1's lossy route).

    python benchmarks/bench_fast_fp8.py [--size 1024] [--repeats 3] [--rows bf16,fp8] [--json out.json]
    python benchmarks/bench_fast_fp8.py --tiny      # CPU smoke run (int8 instead of fp8, eager)

The app has no such worker variant yet; this measures what one would give. Each row is one worker process
started by imgedit's PipelineManager on cuda:0 (COMPILE=on, FUSE_LORA=off, ENCODE_CACHE=0), with the
real-size random checkpoint (trained-like init; bench.finite_check fails a job whose transformer output is
not finite). Its worker hook, before the worker compiles and warms up, loads a random LoRA of the published
Lightning shape (rank 64, imgedit.model.lora_random), fuses it into the bf16 weights (diffusers' fuse_lora),
drops the LoRA layers, and for the fp8 row then quantizes every Linear of the transformer (torchao fp8,
dynamic per-row activations and weights: QUANTIZE=fp8 with QUANTIZE_SKIP empty). The jobs are `fastest`'s
work: 4 steps, CFG off, a 1024x1024 input and output, through manager.edit.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import finite_check, reference_image, write_results  # noqa: E402

from imgedit.config.settings import load_settings  # noqa: E402
from imgedit.engine.manager import PipelineManager  # noqa: E402
from imgedit.model.demo_checkpoint import build_checkpoint  # noqa: E402
from imgedit.model.lora_random import LIGHTNING_RANK, random_lora  # noqa: E402
from imgedit.model.loras import transformer_linears  # noqa: E402
from imgedit.protocol import EditRequest  # noqa: E402

log = logging.getLogger("bench_fast_fp8")
LORA = "BENCH_FP8_LORA"  # the LoRA file the worker hook fuses
WEIGHTS = "BENCH_FP8_WEIGHTS"  # bf16 | fp8 | int8 (the CPU smoke run)


def hook(pipe, spec) -> None:
    """Worker hook (before compile and warm-up): fuse the LoRA for good, then quantize the transformer."""
    import torch

    from imgedit.runtime.offload import quantize_module

    finite_check(pipe, spec)
    started = time.perf_counter()
    probe = pipe.transformer.transformer_blocks[0].attn.to_q
    before = probe.weight.detach().clone()
    pipe.load_lora_weights(os.environ[LORA], adapter_name="lightning")
    pipe.fuse_lora(components=["transformer"], adapter_names=["lightning"], lora_scale=1.0)
    pipe.unload_lora_weights()  # the LoRA layers go; the fused weights stay
    fused = time.perf_counter() - started
    after = pipe.transformer.transformer_blocks[0].attn.to_q.weight
    if torch.equal(after, before) or hasattr(pipe.transformer, "peft_config"):
        raise RuntimeError("the LoRA was not fused into the weights, or its layers are still there")
    mode = os.environ[WEIGHTS]
    changed = quantize_module(pipe.transformer, mode) if mode != "bf16" else 0
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    logging.getLogger("bench_fast_fp8").info(
        "fused the LoRA in %.1fs; %s: %d Linear layers quantized in %.1fs", fused, mode, changed,
        time.perf_counter() - started - fused)


def row(args, ckpt: Path, lora: Path, weights: str) -> dict:
    os.environ[LORA], os.environ[WEIGHTS] = str(lora), weights  # the worker inherits them
    settings = load_settings({
        "QWEN_MODEL_DIR": str(ckpt), "DEVICE_MAP": "cpu" if args.tiny else "cuda:0",
        "COMPILE": "off" if args.tiny else "on", "FUSE_LORA": "off", "ENCODE_CACHE": "0", "LOG_LEVEL": "INFO"})
    size = 64 if args.tiny else args.size
    t0 = time.perf_counter()
    manager = PipelineManager(settings, worker_hook="bench_fast_fp8:hook",
                              warmup_sizes=((size, size),)).load(timeout=900)
    startup = round(time.perf_counter() - t0, 1)
    image = reference_image(size)
    runs = []
    try:
        for k in range(args.repeats + 1):  # the first one warms the CFG-off variant
            steps: list[float] = []
            req = EditRequest(images=(image,), prompt="make the sky a warm sunset", seed=k, num_inference_steps=4,
                              true_cfg_scale=1.0, width=size, height=size, source="bench")
            started = time.perf_counter()
            result = manager.edit(req, on_step=lambda step, total, seen=steps: seen.append(time.perf_counter()))
            wall = time.perf_counter() - started
            if k:
                per_step = (steps[-1] - steps[0]) / (len(steps) - 1) if len(steps) > 1 else None
                runs.append({"wall_s": round(wall, 3), "worker_s": round(result.seconds, 3),
                             "s_per_step": round(per_step, 4) if per_step else None})
                log.info("%s run %d: %s", weights, k, runs[-1])
        info = manager.workers[0].info
    finally:
        manager.close()
    return {"weights": weights, "startup_s": startup, "runs": runs,
            "wall_s": statistics.median(r["wall_s"] for r in runs),
            "s_per_step": statistics.median(r["s_per_step"] for r in runs if r["s_per_step"]),
            "memory_allocated_gib": info.get("memory_allocated_gib"), "compile_seconds": info.get("compile_seconds")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", default="/tmp/qwen-image-edit-real-random")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", default="bf16,fp8")
    parser.add_argument("--json", default="")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    folder = Path(tempfile.mkdtemp())
    if args.tiny:
        ckpt = build_checkpoint(folder / "tiny", kind="plus")
    else:
        ckpt = Path(args.ckpt)
        if not (ckpt / "model_index.json").is_file():
            build_checkpoint(ckpt, kind="plus", size="real")
    lora = folder / "lightning-4steps.safetensors"
    random_lora(lora, transformer_linears(ckpt), rank=LIGHTNING_RANK if not args.tiny else 4, std=0.02, seed=1)
    rows = [r.strip() for r in args.rows.split(",")]
    if args.tiny:
        rows = ["int8" if r == "fp8" else r for r in rows]
    versions = {name: metadata.version(name) for name in ("torch", "diffusers", "torchao", "peft")}
    out = {"size": 64 if args.tiny else args.size, "steps": 4, "cfg": 1.0, "date": time.strftime("%Y-%m-%d"),
           "command": " ".join(sys.argv), "versions": versions,
           "rows": [row(args, ckpt, lora, weights) for weights in rows]}
    write_results(out, {r["weights"]: {k: r[k] for k in ("wall_s", "s_per_step", "startup_s", "memory_allocated_gib")}
                        for r in out["rows"]}, args.json)


if __name__ == "__main__":
    main()
