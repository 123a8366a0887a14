"""The LoRA registry: which LoRA files the server offers (LORA_DIR, LORAS), which of them are
Lightning 4-/8-step LoRAs, and the start-up check that each one fits the loaded transformer.

Torch-free at import. `entries()` is pure (settings parsing uses it); `check_all()` reads the files
(diffusers' own Qwen LoRA reader, which also converts the non-diffusers key formats) and compares
every key and shape with the transformer built from the checkpoint's config on the meta device.
diffusers only warns about LoRA keys that name no layer, and a LoRA for another model can load
"fine" and change nothing: this check turns that into a start-up error naming the file.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

from imgedit.errors import ImgEditError

log = logging.getLogger(__name__)

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# lightx2v's published files: Qwen-Image-Edit-2509-Lightning-4steps-V1.0-bf16.safetensors, -8steps-, ...
LIGHTNING_FILE = re.compile(r"lightning.*?(\d+)[-_ ]?steps?", re.IGNORECASE)
LIGHTNING_STEPS = (4, 8)
SPEEDS = {"quality": None, "fast": 8, "fastest": 4}  # speed -> Lightning steps
MAX_LORA_SCALE = 2.0
# The published Lightning recipe (ModelTC/Qwen-Image-Lightning generate_with_diffusers.py: "we use
# shift=3 in distillation"): FlowMatchEuler with a constant shift of 3 applied exponentially, and no
# shift_terminal (the Qwen checkpoints' own scheduler config has 0.02, base 0.5 / max 0.9).
LIGHTNING_SCHEDULER = {"base_shift": math.log(3), "max_shift": math.log(3), "shift": 1.0,
                       "time_shift_type": "exponential", "use_dynamic_shifting": True, "shift_terminal": None}


class LoraError(ImgEditError):
    kind = "settings"


@dataclass(frozen=True)
class LoraEntry:
    """One configured LoRA: its request name, where it comes from, and its Lightning step count."""

    name: str
    source: str  # a local file, or a hub file as owner/repo/path/in/repo.safetensors
    steps: int | None = None  # 4 or 8 for a Lightning LoRA


@dataclass(frozen=True)
class LoraFile:
    """A LoRA that passed the start-up check: what every worker loads."""

    name: str
    path: str
    steps: int | None
    rank: int
    layers: int  # transformer Linear layers it adapts

    def describe(self) -> dict:
        return {"name": self.name, "lightning_steps": self.steps, "rank": self.rank, "layers": self.layers,
                "file": Path(self.path).name}


def parse_loras(raw: str) -> tuple[tuple[str, str], ...]:
    """LORAS: `name=path-or-hub-file` pairs separated by commas."""
    pairs = []
    for part in raw.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, source = part.partition("=")
        name, source = name.strip(), source.strip()
        if not sep or not NAME.match(name) or not source:
            raise ValueError("comma-separated name=path pairs such as "
                             "lightning8=/loras/Qwen-Image-Edit-2509-Lightning-8steps-V1.0-bf16.safetensors "
                             "(names: letters, digits, . _ -)")
        pairs.append((name, source))
    return tuple(pairs)


def lightning_steps(source: str) -> int | None:
    match = LIGHTNING_FILE.search(Path(source).name)
    steps = int(match.group(1)) if match else None
    return steps if steps in LIGHTNING_STEPS else None


def entries(lora_dir: str | None, loras: tuple[tuple[str, str], ...], fast4: str | None,
            fast8: str | None) -> tuple[LoraEntry, ...]:
    """Every configured LoRA, LORA_DIR's files (named by their stem) then LORAS. A Lightning LoRA is the
    one FAST_LORA_4STEP / FAST_LORA_8STEP names, or else the one whose file name says
    `Lightning...4steps` / `...8steps`. Raises ValueError naming the setting at fault."""
    found: dict[str, str] = {}
    if lora_dir:
        folder = Path(lora_dir).expanduser()
        if not folder.is_dir():
            raise ValueError(f"LORA_DIR={lora_dir!r} is not a folder")
        for file in sorted(folder.glob("*.safetensors")):
            name = re.sub(r"[^A-Za-z0-9._-]", "_", file.stem)[:64]
            found[name] = str(file)
    for name, source in loras:
        if name in found:
            raise ValueError(f"LORAS names {name!r} twice (or also a LORA_DIR file of that name)")
        found[name] = source
    explicit = {4: fast4, 8: fast8}
    for steps, name in explicit.items():
        if name and name not in found:
            known = ", ".join(found) or "none"
            raise ValueError(f"FAST_LORA_{steps}STEP={name!r} names no configured LoRA (configured: {known})")
    chosen: dict[str, int] = {}
    for steps in LIGHTNING_STEPS:
        if explicit[steps]:
            chosen[explicit[steps]] = steps
        else:
            by_name = [n for n, s in found.items() if lightning_steps(s) == steps and n not in chosen]
            if by_name:
                chosen[by_name[0]] = steps
    return tuple(LoraEntry(name, source, chosen.get(name)) for name, source in found.items())


def lightning_for(entries_: tuple[LoraEntry, ...], steps: int) -> LoraEntry | None:
    return next((e for e in entries_ if e.steps == steps), None)


# ---- start-up: fetch and check the files against the transformer ----

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
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download("/".join(parts[:2]), "/".join(parts[2:])))
    except Exception as exc:  # offline, missing, gated: say which LoRA and why
        raise LoraError(f"LoRA {entry.name!r}: could not fetch {entry.source} from the Hugging Face hub or "
                        f"cache ({type(exc).__name__}); check HF_HOME / HF_HUB_OFFLINE / HF_TOKEN") from None


def transformer_linears(folder: Path) -> dict[str, tuple[int, int]]:
    """{module name: (in_features, out_features)} for every Linear of the checkpoint's transformer,
    from its config alone (meta device: no weights read)."""
    import torch
    from accelerate import init_empty_weights
    from diffusers import QwenImageTransformer2DModel

    with init_empty_weights():
        model = QwenImageTransformer2DModel.from_config(QwenImageTransformer2DModel.load_config(folder / "transformer"))
    return {name: (m.in_features, m.out_features) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)}


def read_state_dict(path: Path) -> dict:
    """The LoRA as diffusers sees it (lora_A/lora_B keys, alphas folded in), via diffusers' reader."""
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
        if len(shape) != 2 or (which == "A" and shape[1] != features_in) or (which == "B" and shape[0] != features_out):
            want = f"(rank, {features_in})" if which == "A" else f"({features_out}, rank)"
            problems.append(f"{module} lora_{which} has shape {list(shape)}, this transformer needs {want}")
            continue
        ranks.add(shape[0] if which == "A" else shape[1])
        layers.add(module)
    if not state_dict:
        problems.append("it holds no LoRA weights for the transformer")
    return (max(ranks) if ranks else 0), len(layers), list(dict.fromkeys(problems))


def check_all(configured: tuple[LoraEntry, ...], checkpoint_folder: Path) -> tuple[LoraFile, ...]:
    """Fetch and check every configured LoRA; the first bad one stops start-up with a LoraError naming it."""
    if not configured:
        return ()
    linears = transformer_linears(checkpoint_folder)
    files = []
    for entry in configured:
        path = local_file(entry)
        try:
            state_dict = read_state_dict(path)
        except Exception as exc:  # not safetensors, truncated, unknown key scheme
            raise LoraError(f"LoRA {entry.name!r} ({path}) cannot be read as a LoRA file: "
                            f"{type(exc).__name__}: {str(exc)[:200]}") from None
        rank, layers, problems = check_state_dict(state_dict, linears)
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise LoraError(f"LoRA {entry.name!r} ({path}) does not fit this model's transformer "
                            f"(a LoRA for another model?): {'; '.join(problems[:3])}{more}")
        files.append(LoraFile(entry.name, str(path), entry.steps, rank, layers))
        kind = f"Lightning {entry.steps}-step" if entry.steps else "LoRA"
        log.info("LoRA %s: %s, rank %d, %d layers (%s)", entry.name, kind, rank, layers, path)
    return tuple(files)
