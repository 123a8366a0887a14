"""Qwen-Image-2.1-Turbo (TURBO_MODEL_DIR): the 8-step distilled checkpoint that speed=fast and fastest run on
a Qwen-Image-2.1 server. Which folder, whether it fits the served model, and what it costs the plan.

Torch-free: the server checks the folder at start-up and reads its step count for requests; the worker loads
its transformer and scheduler (imgedit.runtime.turbo). The Turbo transformer is a second transformer of the
model's shape, kept beside the quality one on the same device(s): the planner counts it as the transformer
twice (`with_turbo`), so a split balances both and a plan that cannot hold both is refused with the planner's
reason. QUANTIZE applies to both transformers alike (the worker loads the Turbo's as it loads the model's);
the memory modes that stream or cap (MAX_MEMORY, OFFLOAD) are not planned for it: they are refused with it.
"""

from __future__ import annotations

import functools
import itertools
import json
from dataclasses import dataclass, replace
from pathlib import Path

from imgedit.errors import PlacementError
from imgedit.planning.checkpoint import Checkpoint
from imgedit.planning.families import FAMILIES

SETTING = "TURBO_MODEL_DIR"
PIPELINE = FAMILIES["21"].pipeline_class
# What must match between the served transformer's config and the Turbo's: the Turbo's weights go in the
# same module shapes (and the same block split, block for block).
SHAPE = ("_class_name", "attention_head_dim", "axes_dims_rope", "context_in_dim", "in_channels",
         "num_attention_heads", "num_layers", "out_channels", "patch_size", "mlp_ratio", "causal_condition")


@dataclass(frozen=True)
class TurboCheckpoint:
    """A checked Qwen-Image-2.1-Turbo folder: its transformer and scheduler, and the sigmas its
    model_index.json carries (`sample_sigmas`: the schedule it was distilled for, one sigma a step)."""

    folder: Path
    sigmas: tuple[float, ...]
    random_weights: bool = False  # a benchmark checkpoint: configs only (imgedit.runtime.weights)

    @property
    def steps(self) -> int:
        return len(self.sigmas)

    @property
    def describe(self) -> str:
        """What /health and the panel say (the folder's name, never its path)."""
        return f"Qwen-Image-2.1-Turbo, {self.steps} steps ({self.folder.name})"

    @property
    def checkpoint(self) -> Checkpoint:
        """The folder as a checkpoint, for the worker's loader."""
        return Checkpoint(self.folder, PIPELINE, self.random_weights)


def _refuse(source: str, why: str) -> PlacementError:
    return PlacementError(f"{SETTING}={source} cannot be used: {why}")


def _json(path: Path, source: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise _refuse(source, f"its {path.parent.name}/{path.name} cannot be read "
                              f"({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise _refuse(source, f"its {path.name} is not a JSON object")
    return data


@functools.lru_cache(maxsize=4)
def open_turbo(source: str) -> TurboCheckpoint:
    """Check a Turbo folder (a local diffusers folder of QwenImage21Pipeline with `sample_sigmas`, a
    transformer and a scheduler) and read its schedule. Raises PlacementError naming TURBO_MODEL_DIR."""
    folder = Path(source).expanduser()
    if not folder.is_dir():
        raise _refuse(source, "no such folder (give a local Qwen-Image-2.1-Turbo diffusers folder)")
    if not (folder / "model_index.json").is_file():
        raise _refuse(source, "it has no model_index.json: is it a diffusers checkpoint folder?")
    index = _json(folder / "model_index.json", source)
    if index.get("_class_name") != PIPELINE:
        raise _refuse(source, f"it holds a {index.get('_class_name')}, not a Qwen-Image-2.1 ({PIPELINE}) "
                              "checkpoint")
    sigmas = index.get("sample_sigmas")
    if not (isinstance(sigmas, list) and len(sigmas) >= 2
            and all(isinstance(s, (int, float)) and not isinstance(s, bool) and 0 < s <= 1 for s in sigmas)
            and all(a > b for a, b in itertools.pairwise(sigmas))):
        raise _refuse(source, "its model_index.json has no sample_sigmas (a decreasing list of sigmas in "
                              "(0, 1], one a step): is it the Turbo checkpoint, not Qwen-Image-2.1 itself?")
    for part in ("transformer/config.json", "scheduler/scheduler_config.json"):
        if not (folder / part).is_file():
            raise _refuse(source, f"it has no {part}")
    random_weights = bool(index.get("imgedit_demo", {}).get("random_weights"))
    return TurboCheckpoint(folder, tuple(float(s) for s in sigmas), random_weights)


def check_turbo(source: str, served: Checkpoint) -> TurboCheckpoint:
    """The Turbo folder for the served checkpoint: Qwen-Image-2.1 only, and a transformer of its shape."""
    if served.family != "21":
        raise PlacementError(f"{SETTING} is for Qwen-Image-2.1 (its Turbo checkpoint), but the served model "
                             f"is {FAMILIES[served.family].model}: unset {SETTING} or serve Qwen-Image-2.1")
    turbo = open_turbo(source)
    ours = _json(served.folder / "transformer" / "config.json", str(served.folder))
    theirs = _json(turbo.folder / "transformer" / "config.json", source)
    differs = [key for key in SHAPE if ours.get(key) != theirs.get(key)]
    if differs:
        raise _refuse(source, f"its transformer is not Qwen-Image-2.1's shape ({differs[0]} "
                              f"{theirs.get(differs[0])!r}, the served model's {ours.get(differs[0])!r})")
    return turbo


def memory_refusal(max_memory, offload) -> str | None:
    """Why TURBO_MODEL_DIR cannot run with these memory settings, or None. `offload` None: auto (planned
    without streaming, and refused by the planner's message when the model does not fit). QUANTIZE is not
    refused: the Turbo transformer is quantized as the model's is."""
    asked = [name for name, on in (("MAX_MEMORY", bool(max_memory)), ("OFFLOAD", bool(offload))) if on]
    if not asked:
        return None
    settings = "/".join(asked)
    return (f"{SETTING} keeps a second transformer of the model's size (about 14 GB in bf16 for "
            f"Qwen-Image-2.1, 7 GB with QUANTIZE=fp8) on the worker's GPU(s), and the plans of {settings} "
            f"are not built to cap or stream it: unset {settings} (a GPU that holds both transformers, the "
            f"text encoder and the VAE: about 50 GB, or about 36 GB with QUANTIZE=fp8) or unset {SETTING}")


def with_turbo(sizes: list) -> list:
    """Component sizes (imgedit.planning.memory.ComponentSizes) with the Turbo transformer counted: the
    transformer twice, head and each block, so a block of the Turbo sits with the same block of the model."""
    def twice(part):
        return replace(part, linear=2 * part.linear, kept=2 * part.kept, other=2 * part.other)

    return [replace(s, head=twice(s.head), blocks=tuple(twice(b) for b in s.blocks))
            if s.name == "transformer" else s for s in sizes]
