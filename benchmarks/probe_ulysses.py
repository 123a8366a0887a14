"""Probe: Ulysses sequence parallelism with the text padded to the degree (imgedit.runtime.ulysses).

    python benchmarks/probe_ulysses.py [--gpus 2] [--steps 3] [--json out.json] [--no-compile]

On N GPUs of one machine (one process each, NCCL), with the real-size transformer (random,
trained-like weights) at 1024^2 edit shapes (8,192 image tokens: output + one reference image):

1. one GPU (rank 0, before parallelism): the prediction for an odd text length (243 tokens), unpadded
   and padded-with-mask (equality of the padding itself), and eager s/step (cond + uncond forwards)
   at 244 tokens without a mask and at 243 padded with a mask (what the mask costs on one GPU);
2. Ulysses-N (imgedit.runtime.ulysses.enable_ulysses): the padded 243-token prediction against the
   one-GPU unpadded one (cosine, max error), and s/step eager and compiled
   (`compile_repeated_blocks(fullgraph=True)`) with a mask (243 -> 244) and without (244).

Every output is checked finite (NaN data runs a power-capped GPU faster).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

IMAGE_TOKENS = 4096  # 1024^2 / (8 * 2)^2 per image


def build(device):
    from diffusers import QwenImageTransformer2DModel

    from imgedit.model.components import trained_like_init
    from imgedit.model.demo_checkpoint import _configs

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = QwenImageTransformer2DModel(**_configs("full")["transformer"])
    finally:
        torch.set_default_dtype(previous)
    trained_like_init(model)
    return model.eval()


def inputs(device, text_len: int, pad_to: int | None = None):
    from imgedit.runtime.ulysses import pad_text

    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, 2 * IMAGE_TOKENS, 64, generator=g)
    text = torch.randn(1, 244, 3584, generator=g)[:, :text_len]
    kw = dict(hidden_states=hidden.to(device, torch.bfloat16), encoder_hidden_states=text.to(device, torch.bfloat16),
              encoder_hidden_states_mask=None, timestep=torch.tensor([0.5], device=device, dtype=torch.bfloat16),
              img_shapes=[[(1, 64, 64), (1, 64, 64)]], return_dict=False)
    if pad_to:
        padded = pad_text(kw["encoder_hidden_states"], None, pad_to)
        kw["encoder_hidden_states"], kw["encoder_hidden_states_mask"] = padded
    return kw


def forward(model, kw):
    out = model(**kw)[0]
    if not torch.isfinite(out).all():
        raise SystemExit("non-finite transformer output: the timing would be flattered")
    return out


def per_step(model, kw, steps: int) -> float:
    forward(model, kw)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        forward(model, kw)  # cond
        forward(model, kw)  # uncond (same shapes)
    torch.cuda.synchronize()
    return round((time.perf_counter() - t0) / steps, 4)


def compare(out, ref) -> dict:
    a, b = out.float().flatten(), ref.float().flatten()
    return {"cosine": round(torch.nn.functional.cosine_similarity(a, b, dim=0).item(), 6),
            "max_abs_err": round((a - b).abs().max().item(), 5), "ref_max_abs": round(b.abs().max().item(), 4)}


def rank_main(rank: int, world: int, args, port: int) -> None:
    from imgedit.runtime.ulysses import Layout, enable_ulysses

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=device)
    torch.set_grad_enabled(False)
    model = build(device)
    result: dict = {"gpus": world, "device": torch.cuda.get_device_name(device), "torch": torch.__version__}
    with torch.inference_mode():
        if rank == 0:
            ref = forward(model, inputs(device, 243))
            result["one_gpu_padding_vs_unpadded"] = compare(forward(model, inputs(device, 243, pad_to=world)), ref)
            result["one_gpu_eager_s_per_step_244_nomask"] = per_step(model, inputs(device, 244), args.steps)
            masked = inputs(device, 243, pad_to=world)
            result["one_gpu_eager_s_per_step_243_masked"] = per_step(model, masked, args.steps)
        dist.barrier()
        enable_ulysses(model, Layout(1, world, rank), "cuda")
        # The installed forward pads the text itself: pass the raw 243 tokens, as the pipeline does.
        out = forward(model, inputs(device, 243))
        if rank == 0:
            result["ulysses_vs_one_gpu"] = compare(out, ref)
        result["ulysses_eager_s_per_step_243_masked"] = per_step(model, inputs(device, 243), args.steps)
        result["ulysses_eager_s_per_step_244_nomask"] = per_step(model, inputs(device, 244), args.steps)
        if args.compile:
            t0 = time.perf_counter()
            model.compile_repeated_blocks(fullgraph=True)
            forward(model, inputs(device, 243))
            forward(model, inputs(device, 244))
            torch.cuda.synchronize()
            result["compile_s"] = round(time.perf_counter() - t0, 1)
            result["ulysses_compiled_s_per_step_243_masked"] = per_step(model, inputs(device, 243), args.steps)
            result["ulysses_compiled_s_per_step_244_nomask"] = per_step(model, inputs(device, 244), args.steps)
            out_c = forward(model, inputs(device, 243))
            if rank == 0:
                result["ulysses_compiled_vs_one_gpu"] = compare(out_c, ref)
        result["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    dist.barrier()
    if rank == 0:
        print(json.dumps(result, indent=1), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    args = parser.parse_args()
    from imgedit.engine.workers.pool import free_port

    port = free_port()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/inductor-probe")
    torch.multiprocessing.spawn(rank_main, args=(args.gpus, args, port), nprocs=args.gpus)


if __name__ == "__main__":
    main()
