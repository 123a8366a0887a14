"""Where a prompt rewrite's time goes in a worker set up as the app sets one up (COMPILE, a LoRA, the encode
cache), against bench_enhance's plain worker: milliseconds per generated token for each setting, and the
torch profiler's top CPU and CUDA operations of one rewrite.

    python benchmarks/probe_enhance.py --settings "COMPILE=off" "COMPILE=auto" [--lora] [--tokens 160]
    python benchmarks/probe_enhance.py --settings "COMPILE=off DECODE=static"   # static KV cache, compiled decode
    python benchmarks/probe_enhance.py --tiny --settings "COMPILE=off"      # CPU smoke run
    python benchmarks/probe_enhance.py --kind 21 --settings "COMPILE=off"   # Qwen-Image-2.1's Qwen3-VL

Each settings string is one worker (loaded, timed, closed) on cuda:0 with the real-size random checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import one_gpu_parser, one_gpu_settings, reference_image  # noqa: E402

from imgedit.config.settings import load_settings  # noqa: E402
from imgedit.engine.manager import PipelineManager  # noqa: E402
from imgedit.protocol import EditRequest  # noqa: E402

log = logging.getLogger("probe_enhance")


def hooks(pipe, spec) -> None:
    """Worker hook: profile every rewrite after the first (IMGEDIT_PROBE_OUT names the folder for the tables)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from imgedit.runtime import enhance

    if os.environ.get("IMGEDIT_PROBE_DECODE") == "static":  # the experiment: a static KV cache, whose decode
        # steps transformers compiles (CUDA graphs: one launch a step instead of ~960 kernels)
        generate = pipe.text_encoder.generate

        def static_generate(*args, **kwargs):
            return generate(*args, cache_implementation="static", **kwargs)

        pipe.text_encoder.generate = static_generate
    plain = enhance.rewrite
    calls = {"n": 0}

    def profiled(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] != 2:
            return plain(*args, **kwargs)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            result = plain(*args, **kwargs)
            torch.cuda.synchronize() if torch.cuda.is_available() else None
        out = Path(os.environ.get("IMGEDIT_PROBE_OUT", tempfile.gettempdir()))
        name = os.environ.get("IMGEDIT_PROBE_NAME", "probe")
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        cuda = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15)
        (out / f"enhance-profile-{name}.txt").write_text(table + "\n\n" + cuda)
        return result

    enhance.rewrite = profiled  # the runner calls enhance.rewrite through the module


def main() -> None:
    parser = one_gpu_parser(__doc__, steps=2, repeats=3)
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--settings", nargs="+", default=["COMPILE=off"])
    parser.add_argument("--lora", action="store_true", help="a random Lightning-shaped LoRA in LORA_DIR")
    parser.add_argument("--out", default=tempfile.gettempdir())
    parser.add_argument("--kind", choices=("plus", "21"), default="plus", help="21: Qwen-Image-2.1 (Qwen3-VL)")
    args = parser.parse_args()
    if args.kind == "21" and args.ckpt == parser.get_default("ckpt"):
        args.ckpt = "/tmp/qwen-image-2.1-real-random"
    base, size, _ = one_gpu_settings(args, tiny_steps=2, kind=args.kind, ENHANCE_MAX_TOKENS=str(args.tokens))
    env = {"QWEN_MODEL_DIR": base.qwen_model_dir, "DEVICE_MAP": "cpu" if args.tiny else "cuda:0",
           "ENHANCE_MAX_TOKENS": str(args.tokens), "LOG_LEVEL": "INFO"}
    if args.lora:
        from imgedit.model.lora_random import random_lora
        from imgedit.model.loras import transformer_linears

        folder = Path(tempfile.mkdtemp(prefix="probe-loras-"))
        random_lora(folder / "Qwen-Image-Edit-Lightning-4steps-V1.0-bf16.safetensors",
                    transformer_linears(Path(base.qwen_model_dir)), rank=4 if args.tiny else 64, std=0.02)
        env["LORA_DIR"] = str(folder)
    image = reference_image(size)
    os.environ["IMGEDIT_PROBE_OUT"] = args.out
    results = []
    for setting in args.settings:
        extra = dict(item.split("=", 1) for item in setting.split())
        os.environ["IMGEDIT_PROBE_DECODE"] = extra.pop("DECODE", "dynamic")  # DECODE=static: the experiment
        os.environ["IMGEDIT_PROBE_NAME"] = "_".join(f"{k}-{v}" for k, v in extra.items()) or "default"
        started = time.perf_counter()
        manager = PipelineManager(load_settings({**env, **extra}), worker_hook="probe_enhance:hooks").load(
            timeout=900)
        ready = time.perf_counter() - started
        try:
            rows = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                result = manager.enhance(EditRequest(images=(image,), prompt="make it winter", source="bench"))
                seconds = time.perf_counter() - t0
                tokens = args.tokens if result.notice and "cut" in result.notice else None
                rows.append({"seconds": round(seconds, 3), "tokens": tokens,
                             "ms_per_token": round(1000 * seconds / tokens, 2) if tokens else None})
                log.info("%s: %s", setting, rows[-1])
            results.append({"settings": setting, "lora": args.lora, "ready_s": round(ready, 1), "runs": rows})
        finally:
            manager.close()
    print(json.dumps(results, indent=1))
    Path(args.out, "probe-enhance.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
