"""What a VAE's decode of one image takes over its weights, whole and in tiles: the real-size Qwen-Image VAE
(2509/2511) and Qwen-Image-2.1's (the published config), random weights, bf16.

    python benchmarks/probe_vae_decode.py --side 1024 --vae 21,plus --tiling off,on [--device cpu|cuda]

Why: on the GPU machine's 16 GB plan for 2.1 most jobs ran out of memory in the decode (imgedit.runtime.decode_room
sizes its estimate from these figures). Each run is its own process; on the CPU the peak is the process's peak
resident memory over what it held before the decode, on a GPU torch's peak allocation over the weights. Prints
one line per run and asserts a finite image (random weights: see docs/BENCHMARKS.md on the NaN trap).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG_21 = ROOT / "imgedit" / "model" / "published" / "qwen-image-2.1" / "vae" / "config.json"


def one(vae_name: str, side: int, tiling: bool, device: str) -> dict:
    import torch
    from diffusers import AutoencoderKLQwenImage, AutoencoderKLQwenImage21

    torch.manual_seed(0)
    if vae_name == "21":
        config = json.loads(CONFIG_21.read_text())
        vae, factor, z_dim = AutoencoderKLQwenImage21.from_config(config), 16, config["z_dim"]
    else:
        vae = AutoencoderKLQwenImage()  # its defaults are the released VAE's config
        factor, z_dim = 8, vae.config.z_dim
    vae = vae.to(device=device, dtype=torch.bfloat16).eval()
    if tiling:
        vae.enable_tiling()
    latents = torch.randn(1, z_dim, 1, side // factor, side // factor, generator=torch.Generator().manual_seed(1))
    latents = latents.to(device=device, dtype=torch.bfloat16)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    started = time.perf_counter()
    with torch.inference_mode():
        image = vae.decode(latents).sample
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert torch.isfinite(image).all(), "the decoded image is not finite"
    base = getattr(vae.config, "decoder_base_dim", None) or vae.config.base_dim
    return {"vae": vae_name, "side": side, "tiling": tiling, "device": device, "decoder_base_dim": base,
            "peak_gib": round(peak / 2**30, 2), "seconds": round(time.perf_counter() - started, 1),
            "mib_per_channel_megapixel": round(peak / 2**20 / base / (side * side / 2**20), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", type=int, default=1024)
    parser.add_argument("--vae", default="21,plus")
    parser.add_argument("--tiling", default="off,on")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one run
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.vae, args.side, args.tiling == "on", args.device)))
        return
    for vae_name in args.vae.split(","):
        for tiling in args.tiling.split(","):
            child = subprocess.run([sys.executable, __file__, "--one", "--vae", vae_name, "--tiling", tiling,
                                    "--side", str(args.side), "--device", args.device],
                                   capture_output=True, text=True, check=True)
            print(child.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
