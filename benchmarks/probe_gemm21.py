"""Qwen-Image-2.1's GEMMs at its shapes, on each way PyTorch can run them: does a 2.1 step leave GEMM speed on
the table? (benchmarks/profile_21_step.py: the compiled later step's GEMMs ran at 722 TFLOP/s on 4,096 rows, the
eager capped step's at 794 on 4,136 rows, on other cuBLAS kernels.)

Per block, 2.1 runs seven bf16 GEMMs without bias (diffusers 0.42.1, QwenImage21TransformerBlock): to_q, to_k,
to_v, to_out (4096 -> 4096) and the MLP's proj and gate_layer (4096 -> 12288) and out (12288 -> 4096). Timed per
row count M (the target's tokens; more with text and references in the first step, twice with n=2):

- `cublas`: F.linear as eager runs it (PyTorch's default BLAS choice);
- `cublaslt`: torch.backends.cuda.preferred_blas_library("cublaslt");
- `fused`: Q, K and V as one 4096 -> 12288 GEMM and proj + gate as one 4096 -> 24576 (weights concatenated once);
- `inductor`: torch.compile(mode="max-autotune-no-cudagraphs") of the block's seven GEMMs (Triton templates
  against cuBLAS, the fastest kept);
- `tunableop` (with --tunableop): PyTorch's TunableOp tries every cuBLASLt algorithm per shape (tuning is not
  timed).

Printed per row count and way: ms for one block's seven GEMMs, TFLOP/s, and the 32-block x 40-step total it
implies. Outputs must be finite and match `cublas` to bf16 rounding.

    python3 benchmarks/probe_gemm21.py --json /tmp/res/gemm21.json                 # the GPU machine, ~2 min
    python3 benchmarks/probe_gemm21.py --device cpu --width 64 --rows 32 --repeat 2  # it runs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def weights(width: int, mult: int, device, dtype):
    g = torch.Generator(device="cpu").manual_seed(0)

    def w(out_f, in_f):
        return (torch.randn(out_f, in_f, generator=g) * 0.02).to(device, dtype)

    return dict(q=w(width, width), k=w(width, width), v=w(width, width), o=w(width, width),
                proj=w(width * mult, width), gate=w(width * mult, width), out=w(width, width * mult))


def seven(x, w):
    """The block's GEMMs in its order (the activations in between are not the point: the output of each feeds
    the next of the right width)."""
    q, k, v = F.linear(x, w["q"]), F.linear(x, w["k"]), F.linear(x, w["v"])
    o = F.linear(q + k + v, w["o"])
    h = F.linear(o, w["proj"]) * F.linear(o, w["gate"])
    return F.linear(h, w["out"])


def seven_fused(x, w, fused):
    width = w["q"].shape[0]
    q, k, v = F.linear(x, fused["qkv"]).split(width, dim=-1)
    o = F.linear(q + k + v, w["o"])
    p, g = F.linear(o, fused["pg"]).chunk(2, dim=-1)
    return F.linear(p * g, w["out"])


def timed(fn, x, repeat: int, cuda: bool) -> tuple[float, torch.Tensor]:
    out = fn(x)
    for _ in range(2):
        out = fn(x)
    if cuda:
        torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(x)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            out = fn(x)
            best = min(best, time.perf_counter() - t0)
    return best, out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--mult", type=int, default=3)
    parser.add_argument("--rows", default="4096,4136,8192,8256,24640", help="row counts M to time")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--ways", default="cublas,cublaslt,fused,inductor")
    parser.add_argument("--tunableop", action="store_true", help="also time with PyTorch's TunableOp")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    w = weights(args.width, args.mult, args.device, dtype)
    fused = dict(qkv=torch.cat([w["q"], w["k"], w["v"]]), pg=torch.cat([w["proj"], w["gate"]]))
    flops_per_row = 2 * args.width * args.width * (4 + 3 * args.mult)
    ways = {
        "cublas": lambda x: seven(x, w),
        "fused": lambda x: seven_fused(x, w, fused),
        "inductor": torch.compile(lambda x: seven(x, w), mode="max-autotune-no-cudagraphs", dynamic=False),
    }
    names = args.ways.split(",") + (["tunableop"] if args.tunableop else [])
    if not cuda:  # cuBLASLt and TunableOp are CUDA's
        names = [n for n in names if n not in ("cublaslt", "tunableop")]
    rows = []
    for m in (int(r) for r in args.rows.split(",")):
        x = (torch.randn(m, args.width, generator=torch.Generator().manual_seed(m)) * 0.5).to(args.device, dtype)
        reference = None
        for name in names:
            if name == "cublaslt":
                torch.backends.cuda.preferred_blas_library("cublaslt")
                seconds, out = timed(ways["cublas"], x, args.repeat, cuda)
                torch.backends.cuda.preferred_blas_library("default")
            elif name == "tunableop":
                torch.cuda.tunable.enable(True)
                torch.cuda.tunable.tuning_enable(True)
                ways["cublas"](x)  # tunes each new shape (not timed)
                torch.cuda.tunable.tuning_enable(False)
                seconds, out = timed(ways["cublas"], x, args.repeat, cuda)
                torch.cuda.tunable.enable(False)
            else:
                seconds, out = timed(ways[name], x, args.repeat, cuda)
            assert torch.isfinite(out).all(), f"{name} at M={m}: non-finite output"
            if reference is None:
                reference = out.float()
            error = float((out.float() - reference).abs().max() / reference.abs().max().clamp_min(1e-12))
            row = dict(rows=m, way=name, block_ms=round(seconds * 1e3, 3),
                       tflops=round(flops_per_row * m / seconds / 1e12, 1),
                       request_s=round(seconds * 32 * 40, 3), rel_error=round(error, 5))
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = dict(device=args.device, torch=torch.__version__, width=args.width, mult=args.mult,
                   gpu=torch.cuda.get_device_name(0) if cuda else "cpu", rows=rows)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
