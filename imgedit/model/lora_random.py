"""Random LoRA files of the published Lightning shape, for tests (tiny) and benchmarks (real size).

lightx2v's Qwen-Image(-Edit) Lightning V1.0 files adapt 12 Linear layers in each of the 60 transformer
blocks (the 8 attention projections and the 2 x 2 MLP layers; not the modulation layers) at rank 64, in
the kohya-style `<module>.lora_down.weight` / `.lora_up.weight` / `.alpha` layout that diffusers'
`_convert_non_diffusers_qwen_lora_to_diffusers` reads. Rank and targets are inferred from the published
bf16 file size (810 MiB = 60 blocks x 64 x (8 x 2 x 3072 + 2 x 2 x (3072 + 12288)) x 2 bytes); check it
against a real file's header when one is at hand. `style="diffusers"` writes the same tensors as diffusers
saves them (`transformer.<module>.lora_A.weight` / `lora_B.weight`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from imgedit.model import quiet_known_noise
from imgedit.model.loras import transformer_linears

log = logging.getLogger(__name__)

LIGHTNING_RANK = 64
LIGHTNING_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                     "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
                     "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")


def lightning_modules(linears: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """The Lightning targets among a transformer's Linear layers, in block order."""
    return {name: shape for name, shape in linears.items()
            if name.startswith("transformer_blocks.") and name.split(".", 2)[2] in LIGHTNING_TARGETS}


def random_lora(path: Path, linears: dict[str, tuple[int, int]], rank: int = LIGHTNING_RANK,
                std: float = 0.02, seed: int = 0, style: str = "lightning",
                dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> Path:
    """Write a random LoRA for the Lightning targets of `linears` (imgedit.config.loras.transformer_linears).
    Both factors are N(0, std), alpha = rank (scale 1): with std 0.02, as trained-like base weights,
    the update B @ A has entries ~ std^2 * sqrt(rank) and activations stay finite."""
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for module, (features_in, features_out) in lightning_modules(linears).items():
        down = torch.randn(rank, features_in, generator=generator, device=device).mul_(std).to(dtype)
        up = torch.randn(features_out, rank, generator=generator, device=device).mul_(std).to(dtype)
        if style == "lightning":
            tensors[f"{module}.lora_down.weight"] = down.cpu()
            tensors[f"{module}.lora_up.weight"] = up.cpu()
            tensors[f"{module}.alpha"] = torch.tensor(float(rank), dtype=dtype)
        elif style == "diffusers":
            tensors[f"transformer.{module}.lora_A.weight"] = down.cpu()
            tensors[f"transformer.{module}.lora_B.weight"] = up.cpu()
        else:
            raise ValueError(f"style must be lightning or diffusers, not {style!r}")
    if not tensors:
        raise ValueError("the transformer has none of the Lightning target layers")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path


def main(argv: list[str] | None = None) -> int:
    """`python -m imgedit.model.lora_random CHECKPOINT OUT.safetensors`: a random LoRA for that checkpoint's
    transformer, e.g. the demo's, to try the LoRA menu and fast mode without a download."""
    quiet_known_noise()  # torchao's and diffusers' import-time notes are no news to the user
    parser = argparse.ArgumentParser(description="Write a random LoRA for a checkpoint's transformer "
                                     "(to try the LoRA menu and fast mode without a download).")
    parser.add_argument("checkpoint", type=Path,
                        help="the diffusers checkpoint folder (e.g. ~/.cache/imgedit/demo)")
    parser.add_argument("out", type=Path, help="the .safetensors file to write (put it in LORA_DIR)")
    parser.add_argument("--rank", type=int, default=4, help="LoRA rank (Lightning's is 64; 4 suits the demo)")
    parser.add_argument("--std", type=float, default=0.2, help="spread of both factors (0.2 visibly changes "
                        "the demo's output; 0.02 for real-size weights)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--style", choices=("lightning", "diffusers"), default="lightning",
                        help="kohya-style keys as the published Lightning files, or diffusers' own")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    folder = args.checkpoint.expanduser()
    if not (folder / "transformer" / "config.json").is_file():  # a raw FileNotFoundError said nothing useful
        print(f"lora_random: {folder} holds no checkpoint (no transformer/config.json); the demo's is "
              "written by the first `python app.py --demo`, or `python -m imgedit.model.demo_checkpoint "
              f"{args.checkpoint}`", file=sys.stderr)
        return 2
    linears = transformer_linears(folder)
    path = random_lora(args.out, linears, rank=args.rank, std=args.std, seed=args.seed, style=args.style)
    log.info("wrote %s (%d layers, rank %d)", path, len(lightning_modules(linears)), args.rank)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
