"""The start-up check of the configured LoRA files: fetch each (a local file or a hub file), read it
with diffusers' own Qwen LoRA reader (which also converts the non-diffusers key formats) and compare
every key and shape with the transformer built from the checkpoint's config on the meta device.
diffusers only warns about LoRA keys that name no layer, and a LoRA for another model can load
"fine" and change nothing: this check turns that into a start-up error naming the file.

Runs in the inspection subprocess (imgedit.model.inspect), never in the server process.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from imgedit.config.loras import LoraEntry, LoraError, LoraFile

log = logging.getLogger(__name__)


def local_file(entry: LoraEntry) -> Path:
    """The file on disk: a local path, or a hub file fetched into the Hugging Face cache (HF_HOME;
    HF_HUB_OFFLINE=1 uses the cache only)."""
    path = Path(entry.source).expanduser()
    if path.is_file():
        return path
    parts = entry.source.split("/")
    if len(parts) < 3 or path.is_absolute() or entry.source.startswith("."):
        raise LoraError(f"LoRA {entry.name!r}: {entry.source} is not a file (a hub file is written "
                        "owner/repo/file.safetensors)")
    # only a hub file needs the hub client (~0.2 s of the inspection subprocess otherwise)
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download("/".join(parts[:2]), "/".join(parts[2:])))
    except Exception as exc:  # offline, missing, gated: say which LoRA and why
        raise LoraError(f"LoRA {entry.name!r}: could not fetch {entry.source} from the Hugging Face hub or "
                        f"cache ({type(exc).__name__}); check HF_HOME / HF_HUB_OFFLINE / HF_TOKEN") from None


def unreadable(path: Path) -> str | None:
    """Why `path` is no safetensors file, from its header alone (8 bytes giving the length of a JSON
    object, then that object), or None. A file that fails here is refused before torch and diffusers are
    imported: seconds of CPU in the inspection subprocess for a file that was never a LoRA."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if size < 8 or length > size - 8:
                return (f"no safetensors header (its first 8 bytes: {length:,} bytes of header; "
                        f"the file has {size:,})")
            header = json.loads(f.read(length))
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return f"no safetensors header ({type(exc).__name__}: {exc})"
    return None if isinstance(header, dict) else "no safetensors header (not a JSON object)"


def transformer_linears(folder: Path) -> dict[str, tuple[int, int]]:
    """{module name: (in_features, out_features)} for every Linear of the checkpoint's transformer,
    from its config alone (meta device: no weights read)."""
    # here, not at the top: check_all refuses an unreadable file before torch and diffusers load
    import torch
    from accelerate import init_empty_weights  # (as torch)

    from imgedit.model.components import from_config  # diffusers, transformers (as torch)

    with init_empty_weights():
        model = from_config("transformer", folder)
    return {name: (m.in_features, m.out_features) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)}


def read_state_dict(path: Path) -> dict:
    """The LoRA as diffusers sees it (lora_A/lora_B keys, alphas folded in), via diffusers' reader."""
    # here, not at the top: check_all refuses an unreadable file before diffusers loads
    from diffusers.loaders.lora_pipeline import QwenImageLoraLoaderMixin

    return QwenImageLoraLoaderMixin.lora_state_dict(str(path))


def check_state_dict(state_dict: dict, linears: dict[str, tuple[int, int]]) -> tuple[int, int, list[str]]:
    """(rank, layers adapted, problems): every key must be a lora_A/lora_B weight of a Linear of
    this transformer, with matching shapes."""
    problems: list[str] = []
    ranks: set[int] = set()
    layers: set[str] = set()
    for key, tensor in state_dict.items():
        name = key.removeprefix("transformer.")
        match = re.fullmatch(r"(.+)\.lora_([AB])\.weight", name)
        if not match:
            problems.append(f"key {key!r} is not a LoRA weight this server can load")
            continue
        module, which = match.groups()
        if module not in linears:
            problems.append(f"{module} is not a layer of this model's transformer")
            continue
        shape = tuple(tensor.shape)
        features_in, features_out = linears[module]
        if (len(shape) != 2 or (which == "A" and shape[1] != features_in)
                or (which == "B" and shape[0] != features_out)):
            want = f"(rank, {features_in})" if which == "A" else f"({features_out}, rank)"
            problems.append(f"{module} lora_{which} has shape {list(shape)}, this transformer needs {want}")
            continue
        ranks.add(shape[0] if which == "A" else shape[1])
        layers.add(module)
    if not state_dict:
        problems.append("it holds no LoRA weights for the transformer")
    return (max(ranks) if ranks else 0), len(layers), list(dict.fromkeys(problems))


def check_all(configured: tuple[LoraEntry, ...], checkpoint_folder: Path) -> tuple[LoraFile, ...]:
    """Fetch and check every configured LoRA; bad ones stop start-up with one LoraError naming each of them
    (all at once: a user fixing several files learns of every one in one start)."""
    if not configured:
        return ()
    paths = {entry: local_file(entry) for entry in configured}
    unread = {entry: why for entry, path in paths.items() if (why := unreadable(path)) is not None}
    bad = [f"LoRA {entry.name!r} ({paths[entry]}) cannot be read as a LoRA file: {why[:200]}"
           for entry, why in unread.items()]
    readable = [entry for entry in configured if entry not in unread]
    linears = transformer_linears(checkpoint_folder) if readable else {}  # torch: only for a readable file
    files = []
    for entry in readable:
        path = paths[entry]
        try:
            state_dict = read_state_dict(path)
        except Exception as exc:  # not safetensors, truncated, unknown key scheme
            bad.append(f"LoRA {entry.name!r} ({path}) cannot be read as a LoRA file: "
                       f"{type(exc).__name__}: {str(exc)[:200]}")
            continue
        rank, layers, problems = check_state_dict(state_dict, linears)
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            bad.append(f"LoRA {entry.name!r} ({path}) does not fit this model's transformer "
                       f"(a LoRA for another model?): {'; '.join(problems[:3])}{more}")
            continue
        files.append(LoraFile(entry.name, str(path), entry.steps, rank, layers))
        kind = f"Lightning {entry.steps}-step" if entry.steps else "LoRA"
        log.info("LoRA %s: %s, rank %d, %d layers (%s)", entry.name, kind, rank, layers, path)
    if len(bad) == 1:
        raise LoraError(bad[0])
    if bad:
        raise LoraError(f"{len(bad)} LoRA files cannot be used: " + "; ".join(bad))
    return tuple(files)
