"""The checkpoint's three components as torch modules: their classes, a model built from a config
alone (on the meta device for sizes, on a GPU for benchmarks), the repeated-block container a split
divides, and the trained-like init that keeps random weights' activations finite.
"""

from __future__ import annotations

import json
from pathlib import Path

import diffusers
import torch
import transformers
from transformers import AutoConfig

MODEL_COMPONENTS = ("transformer", "text_encoder", "vae")  # as planning.checkpoint names them


# The classes a served checkpoint's model_index.json may name for its components (imgedit.planning.families).
KNOWN_CLASSES = {
    "transformer": ("QwenImageTransformer2DModel", "QwenImage21Transformer2DModel"),
    "vae": ("AutoencoderKLQwenImage", "AutoencoderKLQwenImage21"),
    "text_encoder": ("Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration"),
}


def model_index(folder: Path) -> dict:
    """The checkpoint's model_index.json: each component's library and class."""
    return json.loads((Path(folder) / "model_index.json").read_text())


def component_classes(folder: Path) -> dict:
    """Each component's class as the checkpoint's model_index.json names it (one of KNOWN_CLASSES)."""
    index = model_index(folder)
    classes = {}
    for name, known in KNOWN_CLASSES.items():
        library, class_name = index[name]
        if class_name not in known:
            raise ValueError(f"{folder}: the {name} is a {class_name}; imgedit loads {' or '.join(known)}")
        classes[name] = getattr(diffusers if library == "diffusers" else transformers, class_name)
    return classes


def from_config(name: str, folder: Path):
    cls = component_classes(folder)[name]
    if name == "text_encoder":
        return cls._from_config(AutoConfig.from_pretrained(Path(folder) / name))
    return cls.from_config(cls.load_config(Path(folder) / name))


def block_container(model: torch.nn.Module) -> str:
    """Dotted path of the model's largest ModuleList: the repeated blocks a split divides."""
    best, best_size = "", -1
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList):
            size = sum(p.numel() for p in module.parameters())
            if size > best_size:
                best, best_size = name, size
    return best


@torch.no_grad()
def trained_like_init(model: torch.nn.Module, seed: int = 0) -> None:
    """Give random weights the scale of trained ones (Linear/Embedding N(0, 0.02), biases 0, norms 1).

    diffusers' default init can drive a whole random pipeline (random text encoder -> transformer ->
    VAE) to inf/NaN activations, and NaN data runs a power-capped GPU faster: benchmarks would be
    flattered. With this init the activations stay finite (benchmarks assert it)."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            module.weight.normal_(0.0, 0.02, generator=generator)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif (isinstance(module, (torch.nn.LayerNorm, torch.nn.GroupNorm))
              or type(module).__name__.endswith("RMSNorm")):
            if getattr(module, "weight", None) is not None:
                module.weight.fill_(1.0)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
