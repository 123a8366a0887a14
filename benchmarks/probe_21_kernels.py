"""Qwen-Image-2.1's denoising step under each attention variant, compiled as the workers compile it
(imgedit.runtime.compile21: the cached steps), on one real-size random-weight transformer.

Variants: diffusers' processor (complex64 RoPE) and imgedit.model.attention21 (RoPE in real arithmetic, which
inductor fuses with the Q/K norm), each on PyTorch's default SDPA choice and on the cuDNN kernel (ATTENTION=cudnn).
Per variant: the later steps' mean (the cached, compiled steps), the first step (the prefill, eager), the call,
and the PSNR against diffusers' processor run eager on the same seed. Every image must be finite.

    python3 benchmarks/probe_21_kernels.py --device cuda --size real --steps 12 --json /tmp/k21.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from probe_21_compile import call, load, model_arguments, psnr, square_side  # noqa: E402

VARIANTS = ("diffusers", "real-rope", "diffusers+cudnn", "real-rope+cudnn")


def use(pipe, variant: str) -> None:
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21AttnProcessor

    from imgedit.model import attention21
    from imgedit.runtime import offload

    transformer = pipe.transformer
    attention21.uninstall(transformer)
    transformer.set_attn_processor(QwenImage21AttnProcessor())
    if variant.startswith("real-rope"):
        attention21.install(transformer)
    if variant.endswith("+cudnn"):
        offload.use_attention(transformer, "cudnn")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(parser)
    parser.add_argument("--repeat", type=int, default=3, help="timed calls per variant and request")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--refs", default="0,1", help="reference counts to time, e.g. 0,1,5")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    side = square_side(args)

    import numpy as np
    import torch

    from imgedit.runtime import compile21

    pipe = load(args)
    reqs = [dict(words=12, images=int(k), width=side, height=side, seed=7 + int(k)) for k in args.refs.split(",")]
    reference = [call(pipe, args, r) for r in reqs]  # diffusers' processor, eager
    compile21.memoize_21_metadata(pipe.transformer)
    results = []
    for variant in args.variants.split(","):
        torch._dynamo.reset()
        compile21.uncompile_21(pipe.transformer)
        use(pipe, variant)
        compile21.compile_21(pipe.transformer)
        t0 = time.perf_counter()
        for r in reqs:
            call(pipe, args, r)  # the warm-up: compiles for this variant
        warm = time.perf_counter() - t0
        for r, ref in zip(reqs, reference, strict=True):
            times = []
            outs = [call(pipe, args, r, times) for _ in range(args.repeat)]
            assert all(np.isfinite(o).all() for o in outs), f"{variant}: a non-finite image"
            row = dict(variant=variant, refs=r["images"], warmup_s=round(warm, 1),
                       step_s=round(min(t[1] for t in times), 4), prefill_s=round(min(t[0] for t in times), 4),
                       call_s=round(min(t[2] for t in times), 3), psnr_vs_eager=round(psnr(outs[0], ref), 2))
            results.append(row)
            print(json.dumps(row), flush=True)
    summary = dict(device=args.device, size=args.size, steps=args.steps, torch=torch.__version__,
                   gpu=torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", rows=results)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
