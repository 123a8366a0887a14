"""What a prompt length the process has not seen costs in Qwen-Image-2.1's first step (the prefill), call by call.

On the 16 GB plan (eager, streamed) a text to image with a prompt of a new length once took 1.1-1.4 s in its
first step against 0.19 s for a prompt seen before, a new text of a seen length 0.19 s, and another new
(longer) length 0.28 s (2x H200, 2026-11-30, `acceptance.py --rows 21-16gb`). The prefill's calls that depend
on the prompt's length L are its attention (the text segment, causal over its own L keys; the target's 4096
queries over all L + 4096 keys, with the prompt's key mask) and its projections' GEMMs at L + 4096 rows. This
probe makes them in a fresh process for L = --lengths in order (the first absorbs the process's own first
calls), as diffusers' native backend calls SDPA (made (batch, tokens, heads, dim), transposed), and times
each call's first run against its second (synchronised, milliseconds), per SDPA backend: PyTorch's choice,
then each backend forced alone. The kernels PyTorch runs for the first length are named by the profiler.
The text segment is also timed as SDPA's causal flag without a mask (what its triangle is when the text
starts the sequence and no prompt key is padded), with the largest difference between the two outputs.
Every output must be finite.

    python3 benchmarks/probe_first_call.py --json /tmp/first-call.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time

HEADS, HEAD_DIM, TARGET, FEED = 32, 128, 4096, 12288


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="200," + ",".join(str(n) for n in range(4, 161)))
    parser.add_argument("--backends", default="default,efficient,cudnn,math")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = torch.device(args.device)
    forced = {"efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
              "math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION}
    lengths = [int(x) for x in args.lengths.split(",")]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def twice(fn) -> tuple[float, float, bool]:
        """(first call ms, second call ms, finite)."""
        times, out = [], None
        for _ in range(2):
            sync()
            start = time.perf_counter()
            out = fn()
            sync()
            times.append(round((time.perf_counter() - start) * 1000, 2))
        return times[0], times[1], bool(torch.isfinite(out).all())

    def attention(q, k, v, mask, causal=False):
        # diffusers' native backend: (B, S, H, D) in, transposed for SDPA, transposed back
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=mask, is_causal=causal).transpose(1, 2)

    def make(rows):
        return torch.randn(1, rows, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)

    weight = torch.randn(HEADS * HEAD_DIM, FEED, device=device, dtype=torch.bfloat16) * 0.02

    def calls(length: int) -> dict:
        """The prefill's calls that depend on the prompt's length, each a (function, arguments)."""
        causal = torch.tril(torch.ones(length, length, dtype=torch.bool, device=device))[None, None]
        valid = torch.ones(1, 1, 1, length + TARGET, dtype=torch.bool, device=device)
        target = (make(TARGET), make(length + TARGET), make(length + TARGET))
        x = torch.randn(1, length + TARGET, HEADS * HEAD_DIM, device=device, dtype=torch.bfloat16)
        text = (make(length), make(length), make(length))
        return {"text": (attention, (*text, causal)),
                "text_causal": (attention, (*text, None, True)),
                "target_masked": (attention, (*target, valid)),
                "target": (attention, (*target, None)),
                "gemm": (torch.matmul, (x, weight))}

    rows_out = []
    for backend in args.backends.split(","):
        context = sdpa_kernel([forced[backend]]) if backend in forced else contextlib.nullcontext()
        with context, torch.inference_mode():
            for length in lengths:
                row = {"backend": backend, "length": length}
                made = calls(length)
                for name, (fn, fn_args) in made.items():
                    try:
                        row[name] = twice(functools.partial(fn, *fn_args))
                    except RuntimeError as exc:  # a forced backend that does not take this call
                        row[name] = str(exc).splitlines()[0][:120]
                try:  # the causal flag against the triangle it stands for: the same output
                    masked, flagged = (fn(*fn_args) for fn, fn_args in (made["text"], made["text_causal"]))
                    row["causal_vs_mask_max_diff"] = float((masked.float() - flagged.float()).abs().max())
                except RuntimeError:  # flash takes no mask
                    pass
                rows_out.append(row)
                print(json.dumps(row), flush=True)

    kernels = {}
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        for name, (fn, fn_args) in calls(lengths[0]).items():
            if name == "gemm":
                continue
            with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn(*fn_args)
                sync()
            kernels[name] = sorted({e.name[:100] for e in prof.events() if e.device_type.name == "CUDA"})
        print(json.dumps(kernels, indent=1))
    finite = all(isinstance(v, list | tuple) and v[2] for r in rows_out for k, v in r.items()
                 if isinstance(v, list | tuple))
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "command": " ".join(sys.argv),
              "torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
              else "cpu", "rows": rows_out, "kernels": kernels, "finite": finite}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print("all outputs finite" if finite else "NON-FINITE OUTPUT")
    return 0 if finite else 1


if __name__ == "__main__":
    sys.exit(main())
