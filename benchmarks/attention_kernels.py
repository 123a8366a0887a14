"""Qwen-Image-2.1's attention shapes on each kernel the card has: PyTorch's default choice, SDPA flash (FA2), cuDNN,
memory-efficient, and FlashAttention-4 (the `flash-attn-4` package's CuTe kernels, called as `flash_attn_func` on
(batch, tokens, heads, dim) tensors: PyTorch 2.11's `activate_flash_attention_impl("FA4")` expects an older
`_flash_attn_fwd` that returned two values, and 4.0.0b36's returns more).

Shapes (32 heads of 128, bf16, one image at 1024² = 4096 target tokens): the cached later steps attend 4096
queries to the prompt, the references and the target (k = 4096 * (1 + refs) + prompt); the first step (prefill)
attends every token to every token it may see (timed as q = k, an upper bound). The tensors are laid out as
diffusers hands them to SDPA: made (batch, tokens, heads, dim) and transposed. Per kernel and shape: the mean of
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
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend):
        def attend(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v)
        return attend

    def native(q, k, v):  # what ATTENTION=native runs: PyTorch's own choice
        return F.scaled_dot_product_attention(q, k, v)

    kernels = {"fa2": sdpa(SDPBackend.FLASH_ATTENTION), "native": native, "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
               "efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION)}
    try:
        from flash_attn.cute import flash_attn_func

        def fa4(q, k, v):
            out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)
        kernels["fa4"] = fa4
    except ImportError as exc:
        print(f"fa4: not installed ({exc})")
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
        q = torch.randn(1, nq, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
        k = torch.randn(1, nk, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
        v = torch.randn(1, nk, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
        flops = 4 * HEADS * nq * nk * HEAD_DIM
        reference = None
        for kernel, attend in kernels.items():
            try:
                out = attend(q, k, v)
                seconds = timed(attend, args.repeat, q, k, v)
            except Exception as exc:  # a kernel that refuses this shape (or fails to build) is a row, not the end
                print(f"{name} {kernel}: refused ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})",
                      flush=True)
                continue
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
