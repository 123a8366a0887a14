"""Does a compiled Qwen-Image-2.1 recompile for new prompt lengths, reference counts and sizes, and does it give
the eager images? imgedit/runtime/compile21.py (compile the cached steps, prefill eager) against the
other families' recipe (compile_repeated_blocks(fullgraph=True, dynamic=True)).

    python benchmarks/probe_21_compile.py                                   # CPU, tiny checkpoint, float32
    python benchmarks/probe_21_compile.py --recipe blocks --requests 6      # the old recipe: one graph a request
    python benchmarks/probe_21_compile.py --device cuda --size real --json $OUT/p21.json   # H200, bf16, 1024²

Per run: the eager images of N requests (seeded mix of prompt lengths, 0-10 condition images of several
aspects, output sizes, 1 or 2 images per prompt, CFG on some), then the recipe installed, its warm-up
(compile21.warmup_requests), and the same N requests again. Printed per request: the graphs dynamo
compiled for it (counters["stats"]["unique_graphs"]) and its recompile messages (TORCH_LOGS=recompiles'
logger), PSNR of the compiled image against the eager one (same seed), the prefill step's and the mean later
step's seconds, eager and compiled. Asserts every image finite. --size real builds the published configs with
trained-like random weights directly on the GPU (imgedit.runtime.weights.random_component), as the benchmarks do.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ASPECTS = ((1, 1), (4, 3), (3, 4), (16, 9), (9, 16))
WORDS = ("make the sky blue add a cat remove the text turn it into a watercolor with soft light and a red roof "
         "keep the face the same put the dog from picture two on the sofa of picture one").split()


def load(args):
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline

    from imgedit.model.demo_checkpoint import build_checkpoint
    from imgedit.model.processor import load_processor

    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    folder = Path(args.checkpoint or f"/tmp/probe21-{args.size}")
    if not (folder / "model_index.json").is_file():
        build_checkpoint(folder, kind="21", seed=0, size=args.size)
    processor = load_processor(folder / "processor", "Qwen3VLProcessor")
    if args.size == "tiny":
        pipe = QwenImage21Pipeline.from_pretrained(str(folder), processor=processor, torch_dtype=dtype)
        pipe.to(args.device)
    else:
        from imgedit.model.components import from_config, trained_like_init

        parts = {}
        for name in ("transformer", "text_encoder", "vae"):  # as imgedit.runtime.weights.random_component
            previous = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            torch.manual_seed(0)
            try:
                with torch.device(args.device):
                    parts[name] = from_config(name, folder)
            finally:
                torch.set_default_dtype(previous)
            trained_like_init(parts[name])
            parts[name].eval().requires_grad_(False)
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler")
        pipe = QwenImage21Pipeline(scheduler=scheduler, processor=processor, **parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def model_arguments(parser, steps: int = 12) -> None:
    """The options the one-transformer 2.1 probes share (probe_21_kernels.py, profile_21_step.py)."""
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", choices=("tiny", "real"), default="tiny")
    parser.add_argument("--checkpoint")
    parser.add_argument("--steps", type=int, default=steps)


def square_side(args) -> int:
    """Sets the 1024² (real) or tiny output and condition sizes on `args`; returns the request's side."""
    real = args.size == "real"
    args.output_resolution = 1024 if real else 384
    args.cond_side = 1024 if real else 96
    return 1024 if real else 64


def requests(args) -> list[dict]:
    """A seeded mix; the first ones cover the extremes (no reference, ten)."""
    rng = random.Random(args.seed)
    sizes = [(int(w), int(h)) for w, h in (s.split("x") for s in args.sizes.split(","))]
    refs = [0, 10, 1, 3] + [rng.randint(0, 10) for _ in range(max(0, args.requests - 4))]
    out = []
    for i, k in enumerate(refs[:args.requests]):
        width, height = rng.choice(sizes)
        out.append(dict(words=rng.randint(1, args.max_words), images=k, width=width, height=height,
                        aspects=[rng.choice(ASPECTS) for _ in range(k)],
                        num_images_per_prompt=2 if args.batch2 and i % 6 == 5 else 1,
                        cfg=args.cfg and i % 5 == 4, seed=1000 + i))
    return out


def call(pipe, args, req: dict, times: list | None = None, callback=None):
    import numpy as np
    import torch
    from PIL import Image

    rng = np.random.default_rng(req["seed"])
    side = args.cond_side
    images = [Image.fromarray(rng.integers(0, 256, (side * a[1] // max(a), side * a[0] // max(a), 3), np.uint8))
              for a in req.get("aspects") or [(1, 1)] * req["images"]] or None
    prompt = " ".join(WORDS[(req["seed"] + j) % len(WORDS)] for j in range(req["words"]))
    stamps = []

    def step_end(pipe_, step, t, kwargs):
        if times is not None:  # step times: each step's end waited for (else the GPU runs ahead, as in a worker)
            if args.device == "cuda":
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())
        return callback(pipe_, step, t, kwargs) if callback else {}

    extra = {"true_cfg_scale": 4.0, "negative_prompt": " "} if req.get("cfg") else {}
    extra.update(req.get("pipe_kwargs", {}))
    n = req.get("num_images_per_prompt", 1)
    if args.device == "cuda":
        torch.cuda.synchronize()
    with torch.inference_mode():
        start = time.perf_counter()
        stamps.append(start)
        out = pipe(prompt=prompt, image=images, width=req["width"], height=req["height"],
                   num_inference_steps=req.get("num_inference_steps", args.steps), num_images_per_prompt=n,
                   output_resolution=args.output_resolution, output_type="np", callback_on_step_end=step_end,
                   generator=[torch.Generator().manual_seed(req["seed"] + j) for j in range(n)], **extra).images
    if times is not None:
        # stamps[0] is the call's start: the first interval includes the text and VAE encoding
        steps = np.diff(stamps)
        times.append((float(steps[0]), float(steps[1:].mean()) if len(steps) > 1 else float("nan"),
                      time.perf_counter() - start))
    return np.asarray(out, dtype=np.float32)


class RecompileLog(logging.Handler):
    """Counts dynamo's 'Recompiling function ...' messages (the `recompiles` artifact's logger)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        text = record.getMessage()
        if "Recompiling function" in text:
            self.messages.append(" ".join(text.split("triggered by the following guard failure(s):")[-1].split())[:300])


def psnr(a, b) -> float:
    import numpy as np

    mse = float(((a - b) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", choices=("tiny", "real"), default="tiny")
    parser.add_argument("--checkpoint", help="a checkpoint folder (default /tmp/probe21-SIZE, built if missing)")
    parser.add_argument("--recipe", choices=("decode", "blocks", "none"), default="decode",
                        help="decode: compile21.compile_21; blocks: compile_repeated_blocks(fullgraph=True, "
                             "dynamic=True) as the other families; none: eager twice")
    parser.add_argument("--memo", action="store_true", help="also compile21.memoize_21_metadata (the rotary "
                        "table and token metadata once per request)")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sizes", help="output sizes WxH,... (default: 64x64,96x64,64x128,128x128 tiny; "
                                        "1024x1024,768x1024,1024x768,1280x720 real)")
    parser.add_argument("--output-resolution", type=int,
                        help="the pipeline's output_resolution: every condition image's area is its square "
                             "(default 384 tiny: the tiny processor's minimum is 256²; 1024 real)")
    parser.add_argument("--cond-side", type=int, default=96, help="side of the random condition images given")
    parser.add_argument("--max-words", type=int, default=60)
    parser.add_argument("--no-batch2", dest="batch2", action="store_false", help="never 2 images per prompt")
    parser.add_argument("--no-cfg", dest="cfg", action="store_false", help="never true CFG")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--min-psnr", type=float, default=38.0)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    real = args.size == "real"
    args.sizes = args.sizes or ("1024x1024,768x1024,1024x768,1280x720" if real else "64x64,96x64,64x128,128x128")
    args.output_resolution = args.output_resolution or (1024 if real else 384)

    import numpy as np
    import torch
    from torch._dynamo.utils import counters

    from imgedit.runtime import compile21

    torch.set_num_threads(args.threads)
    recompiles = RecompileLog()
    torch._logging.set_logs(recompiles=True)
    logging.getLogger("torch._dynamo").addHandler(recompiles)
    t0 = time.perf_counter()
    pipe = load(args)
    print(f"loaded {args.size} on {args.device} in {time.perf_counter() - t0:.1f} s", flush=True)
    reqs = requests(args)

    eager_times: list = []
    call(pipe, args, reqs[1])  # the first call pays for kernels loading and the allocator's growth
    eager = [call(pipe, args, r, eager_times) for r in reqs]
    print(f"eager references made: {time.perf_counter() - t0:.1f} s since loading began", flush=True)

    t0 = time.perf_counter()
    if args.recipe == "decode":
        compile21.compile_21(pipe.transformer)
    elif args.recipe == "blocks":
        pipe.transformer.compile_repeated_blocks(fullgraph=True, dynamic=True)
    if args.memo:
        compile21.memoize_21_metadata(pipe.transformer)
    sides = [s for s in (tuple(map(int, x.split("x"))) for x in args.sizes.split(","))]
    warm = compile21.warmup_requests(max_images_per_prompt=2 if args.batch2 else 1, cfg=False,
                                            sizes=sides[:2])
    for j, w in enumerate(warm):
        g0 = counters["stats"]["unique_graphs"]
        call(pipe, args, dict(w, seed=j))
        print(f"warm-up {j}: {w} -> {counters['stats']['unique_graphs'] - g0} graph(s)", flush=True)
    warm_graphs = counters["stats"]["unique_graphs"]
    warm_recompiles = len(recompiles.messages)
    print(f"warm-up: {time.perf_counter() - t0:.1f} s, {warm_graphs} graph(s), {warm_recompiles} recompile(s)",
          flush=True)

    rows, compiled_times = [], []
    for i, (req, ref) in enumerate(zip(reqs, eager, strict=True)):
        g0, r0 = counters["stats"]["unique_graphs"], len(recompiles.messages)
        out = call(pipe, args, req, compiled_times)
        assert np.isfinite(out).all() and np.isfinite(ref).all(), f"request {i}: non-finite image"
        row = dict(req, aspects=None, graphs=counters["stats"]["unique_graphs"] - g0,
                   recompiles=recompiles.messages[r0:], psnr=round(psnr(out, ref), 2),
                   eager_prefill_s=round(eager_times[i][0], 4), eager_step_s=round(eager_times[i][1], 4),
                   compiled_prefill_s=round(compiled_times[i][0], 4), compiled_step_s=round(compiled_times[i][1], 4),
                   eager_call_s=round(eager_times[i][2], 3), compiled_call_s=round(compiled_times[i][2], 3))
        rows.append(row)
        print(f"req {i:2d}: words {req['words']:3d} refs {req['images']:2d} {req['width']}x{req['height']} "
              f"n={req['num_images_per_prompt']} cfg={int(req['cfg'])} | graphs {row['graphs']} "
              f"recompiles {len(row['recompiles'])} | PSNR {row['psnr']:.1f} dB | step eager "
              f"{row['eager_step_s']:.4f} compiled {row['compiled_step_s']:.4f} s | prefill eager "
              f"{row['eager_prefill_s']:.3f} compiled {row['compiled_prefill_s']:.3f} s", flush=True)
        for m in row["recompiles"]:
            print("    recompile:", m, flush=True)
    total_graphs = sum(r["graphs"] for r in rows)
    total_recompiles = sum(len(r["recompiles"]) for r in rows)
    worst = min(r["psnr"] for r in rows)
    summary = dict(recipe=args.recipe, memo=args.memo, device=args.device, size=args.size, requests=len(rows),
                   steps=args.steps,
                   warmup=warm, warmup_graphs=warm_graphs, warmup_recompiles=warm_recompiles,
                   graphs_after_warmup=total_graphs, recompiles_after_warmup=total_recompiles, min_psnr=worst,
                   step_speedup=round(float(np.nanmean([r["eager_step_s"] for r in rows]))
                                      / float(np.nanmean([r["compiled_step_s"] for r in rows])), 3),
                   torch=torch.__version__)
    print(json.dumps(summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(summary=summary, rows=rows), indent=1))
    clean = total_graphs == 0 and total_recompiles == 0 and worst >= args.min_psnr
    ok = args.recipe != "decode" or clean
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
