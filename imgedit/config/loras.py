"""The LoRA registry: which LoRA files the server offers (LORA_DIR, LORAS), which of them are
Lightning 4-/8-step LoRAs, the speed presets, and what a checked LoRA file is (`LoraFile`).

Pure: settings parsing uses `entries()`. Reading and checking the files against the transformer is
imgedit/model/loras.py (worker side: diffusers' reader).
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
