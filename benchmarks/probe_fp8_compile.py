"""Where the time of compiling one fp8 transformer block goes: one real-size Qwen-Image block, bf16 or fp8
(torchao, as FAST_QUANTIZE quantizes), compiled as the workers compile it (block_compile.compile_transformer's
options), called once at a 1024² edit's sequence lengths.

    python benchmarks/probe_fp8_compile.py --modes none,fp8 --gemms default --tuning off,torchao [--json out.json]
    python benchmarks/probe_fp8_compile.py --device cpu --backend aot_eager      # the tracing alone, on a CPU

Why: on a 2× H200 host each compile of the fp8 copy's block variant took ~3 minutes through the app, against
~1 minute for a bf16 variant (docs/gpu-runs/2026-11-27-2xh200.md, code at ca0f05b), with inductor's GEMMs kept
on cuBLAS. On the CPU the fp8 block traces in 7 s (3.5 s bf16) and inductor's CPU code takes 15 s either way,
so the minutes are in the GPU code generation. For each run: the compile's wall time and torch's own breakdown
(`torch._dynamo.utils.compile_times`), the inductor counters (kernels generated, autotuned GEMMs), the second
call's time, and that the output is finite.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

IMAGE_TOKENS = 2 * 4096  # the edited image and one reference at 1024²
TEXT_TOKENS = 212


def one(mode: str, gemms: str, device: str, backend: str, tuning: str) -> dict:
    """One compile in this process (each run in a fresh process: nothing cached in memory)."""
    import torch
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope, QwenImageTransformerBlock
    from torch._dynamo.utils import compile_times, counters

    from imgedit.runtime.offload import quantize_module

    if device != "cuda":  # torchao refuses fp8 without an fp8 GPU; on the CPU only the tracing is probed
        import torchao.quantization.quant_api as quant_api

        quant_api._check_hardware_support = lambda *a, **k: None
    torch.manual_seed(0)
    block = QwenImageTransformerBlock(dim=3072, num_attention_heads=24, attention_head_dim=128)
    block = block.to(device, torch.bfloat16).eval().requires_grad_(False)
    for p in block.parameters():
        p.data.normal_(0, 0.02)
    quantized = quantize_module(block, mode) if mode != "none" else 0
    if tuning == "torchao":  # what torchao's quantize_ set for the whole process before the app turned it off
        import torchao.quantization.utils

        torchao.quantization.utils.recommended_inductor_config_setter()
    x = torch.randn(1, IMAGE_TOKENS, 3072, device=device, dtype=torch.bfloat16)
    text = torch.randn(1, TEXT_TOKENS, 3072, device=device, dtype=torch.bfloat16)
    temb = torch.randn(1, 3072, device=device, dtype=torch.bfloat16)
    rope = QwenEmbedRope(theta=10000, axes_dim=[16, 56, 56], scale_rope=True)
    freqs = rope([[(1, 64, 64), (1, 64, 64)]], device=device, max_txt_seq_len=TEXT_TOKENS)  # a batch of one edit
    options: dict = {"fullgraph": True, "dynamic": True, "backend": backend}
    if backend == "inductor" and gemms == "aten":
        options["options"] = {"max_autotune_gemm_backends": "ATEN"}
    compiled = torch.compile(block, **options)

    def call() -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.no_grad():
            out = compiled(hidden_states=x, encoder_hidden_states=text, encoder_hidden_states_mask=None,
                           temb=temb, image_rotary_emb=freqs)
        if device == "cuda":
            torch.cuda.synchronize()
        call.finite = all(bool(torch.isfinite(t).all()) for t in out)
        return time.perf_counter() - started

    first = call()
    second = call()
    steady = sorted(call() for _ in range(20))[10]  # the median of 20 calls: the compiled block's speed
    names, values = compile_times(repr="csv", aggregate=True)
    breakdown = {name: round(float(value), 2) for name, value in zip(names, values, strict=True)}
    return {"mode": mode, "gemms": gemms, "tuning": tuning, "backend": backend, "device": device,
            "quantized_linears": quantized, "compile_s": round(first, 1), "second_call_s": round(second, 3),
            "block_ms": round(steady * 1000, 3), "finite": call.finite,
            "breakdown_s": {k: v for k, v in breakdown.items() if v >= 0.5},
            "counters": {k: dict(v) for k, v in counters.items() if k in ("inductor", "aten_mm_info")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="none,fp8")
    ap.add_argument("--gemms", default="aten,default", help="aten: max_autotune_gemm_backends=ATEN (the app's "
                    "default mode); default: inductor's own choice (autotunes _scaled_mm)")
    ap.add_argument("--tuning", default="off", help="off (the app's) or torchao,off: torchao's recommended inductor "
                    "settings (coordinate-descent tuning) as quantize_ set them by default")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--json")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        mode, gemms, tuning = args.one.split(":")
        print(json.dumps(one(mode, gemms, args.device, args.backend, tuning)))
        return
    runs = []
    for mode, gemms, tuning in itertools.product(args.modes.split(","), args.gemms.split(","), args.tuning.split(",")):
        with tempfile.TemporaryDirectory() as cache:  # inductor's on-disk caches: each run compiles from scratch
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": f"{cache}/triton"}
            command = [sys.executable, __file__, "--one", f"{mode}:{gemms}:{tuning}", "--device", args.device,
                       "--backend", args.backend]
            proc = subprocess.run(command, capture_output=True, text=True, env=env)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        run = json.loads(lines[-1]) if lines else {"mode": mode, "gemms": gemms, "error": proc.stderr[-2000:]}
        print(json.dumps(run), flush=True)
        runs.append(run)
        assert run.get("finite", False), f"not finite or failed: {run}"
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
                                               "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
