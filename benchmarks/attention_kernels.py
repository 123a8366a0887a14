"""Qwen-Image-2.1's attention shapes on each kernel the card has: PyTorch's SDPA flash (FlashAttention-2), cuDNN,
memory-efficient, and FlashAttention-4 (the `flash-attn-4` package's CuTe kernels, which PyTorch puts behind its
flash SDPA op with `torch.nn.attention.activate_flash_attention_impl("FA4")`).

Shapes (32 heads of 128, bf16, one image at 1024² = 4096 target tokens): the cached later steps attend 4096
queries to the prompt, the references and the target (k = 4096 * (1 + refs) + prompt); the first step (prefill)
attends every token to every token it may see (timed as q = k, an upper bound). Per kernel and shape: the mean of
the timed calls, TFLOP/s, and the largest difference from the FA2 output (every output must be finite).

    python3 benchmarks/attention_kernels.py --refs 0,1,5,10 --json /tmp/attn.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

HEADS, HEAD_DIM, TARGET, PROMPT = 32, 128, 4096, 64


def timed(fn, repeat: int, *tensors) -> float:
    import torch

    fn(*tensors)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn(*tensors)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--refs", default="0,1,5,10")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--prefill", action="store_true", help="also time q = k (the first step's upper bound)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, activate_flash_attention_impl, restore_flash_attention_impl, sdpa_kernel

    kernels = {"fa2": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION, "fa4": SDPBackend.FLASH_ATTENTION}
    try:
        import flash_attn.cute.interface  # noqa: F401
    except ImportError as exc:
        print(f"fa4: not installed ({exc})")
        kernels.pop("fa4")
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    shapes = []
    for refs in (int(r) for r in args.refs.split(",")):
        keys = TARGET * (1 + refs) + PROMPT
        shapes.append((f"refs{refs}-cached", TARGET, keys))
        if args.prefill:
            shapes.append((f"refs{refs}-prefill", keys, keys))
    rows = []
    gen = torch.Generator("cuda").manual_seed(0)
    for name, nq, nk in shapes:
        q = torch.randn(1, HEADS, nq, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(1, HEADS, nk, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(1, HEADS, nk, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        flops = 4 * HEADS * nq * nk * HEAD_DIM
        reference = None
        for kernel, backend in kernels.items():
            if kernel == "fa4":
                activate_flash_attention_impl("FA4")
            try:
                with sdpa_kernel(backend):
                    out = F.scaled_dot_product_attention(q, k, v)
                    seconds = timed(F.scaled_dot_product_attention, args.repeat, q, k, v)
            except RuntimeError as exc:
                print(f"{name} {kernel}: refused ({str(exc).splitlines()[0][:160]})", flush=True)
                continue
            finally:
                if kernel == "fa4":
                    restore_flash_attention_impl()
            finite = bool(torch.isfinite(out).all())
            reference = out if reference is None else reference
            row = dict(shape=name, q=nq, k=nk, kernel=kernel, ms=round(seconds * 1e3, 3),
                       tflops=round(flops / seconds / 1e12, 1), finite=finite,
                       max_diff_vs_fa2=round(float((out.float() - reference.float()).abs().max()), 5))
            rows.append(row)
            print(json.dumps(row), flush=True)
            assert finite, f"{kernel} gave a non-finite output at {name}"
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(torch=torch.__version__, card=torch.cuda.get_device_name(), rows=rows), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
