"""Which checkpoint to serve: a local folder or a hub id, and the pipeline class its model_index.json names.

Torch-free, so the server process and the worker messages can name a checkpoint without loading anything;
a hub id is fetched with huggingface_hub (no diffusers).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from imgedit.errors import PlacementError
from imgedit.planning.families import BY_PIPELINE

log = logging.getLogger(__name__)

SUPPORTED_PIPELINES = tuple(BY_PIPELINE)
MODEL_COMPONENTS = ("transformer", "text_encoder", "vae")
# What a diffusers checkpoint of these pipelines holds (the weights as safetensors, no .bin copies).
DOWNLOAD_PATTERNS = ["model_index.json", "*/*.json", "*/*.safetensors", "*/*.txt", "*/*.model", "*/*.jinja"]


@dataclass(frozen=True)
class Checkpoint:
    folder: Path
    pipeline_class: str
    random_weights: bool

    @property
    def family(self) -> str:
        return BY_PIPELINE[self.pipeline_class].key

    @property
    def attention_heads(self) -> int | None:
        """The transformer's attention heads (its config.json), which Ulysses splits; None if unreadable."""
        try:
            config = self.folder / "transformer" / "config.json"
            return int(json.loads(config.read_text())["num_attention_heads"])
        except (OSError, ValueError, KeyError, TypeError):
            return None


def open_checkpoint(source: str) -> Checkpoint:
    """Resolve a local folder or hub id (downloaded to the HF cache) and read model_index.json."""
    folder = Path(source).expanduser()
    if not folder.is_dir():
        # only a hub id needs the hub client (torch-free, ~0.2 s to import): naming a checkpoint loads nothing
        from huggingface_hub import snapshot_download

        log.info("fetching %s into the Hugging Face cache (HF_HOME) ...", source)
        try:
            folder = Path(snapshot_download(source, allow_patterns=DOWNLOAD_PATTERNS))
        except Exception as exc:
            raise PlacementError(
                f"could not find or download {source!r} ({type(exc).__name__}: {str(exc)[:200]}); "
                "set QWEN_MODEL_DIR to a local checkpoint folder, check HF_HOME / HF_HUB_OFFLINE, "
                "or run `python app.py --demo` for the built-in demo model") from exc
    index_file = folder / "model_index.json"
    if not index_file.is_file():
        raise PlacementError(f"{folder} has no model_index.json: is it a diffusers checkpoint folder?")
    index = json.loads(index_file.read_text())
    name = index.get("_class_name")
    if name not in SUPPORTED_PIPELINES:
        raise PlacementError(f"{folder} holds a {name}; imgedit serves {', '.join(SUPPORTED_PIPELINES)}")
    random_weights = bool(index.get("imgedit_demo", {}).get("random_weights"))
    return Checkpoint(folder, name, random_weights)
