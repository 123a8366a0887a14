"""Files the page hands to Gradio to serve (History's results and inputs, the snippets' inputs): copies in a
temp folder of this process. Gradio copies a returned file into its own cache and serves it from there,
so OUTPUT_DIR and the uploads stay private; the copies are swept after EXPORT_KEEP_S, and all at exit.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
import time
import unicodedata
import zipfile
from pathlib import Path

from imgedit.engine.outputs import read_settings

EXPORT_KEEP_S = 120.0  # Gradio has copied a returned file into its own cache long before this
_EXPORTS = Path(tempfile.gettempdir()) / f"imgedit-exports-{os.getpid()}"


def sweep_exports(now: float | None = None) -> None:
    """Remove the copies earlier events handed to Gradio (they once stayed forever, one folder a click)."""
    now = time.time() if now is None else now
    for folder in _EXPORTS.glob("export-*"):
        try:
            if now - folder.stat().st_mtime > EXPORT_KEEP_S:
                shutil.rmtree(folder, ignore_errors=True)
        except FileNotFoundError:
            continue


def export_copy(paths: list[Path], name: str) -> str:
    """A copy (or a zip) in a temp folder: Gradio copies it into its cache and serves it from there;
    OUTPUT_DIR stays private. The copies are swept after EXPORT_KEEP_S, and all at exit."""
    sweep_exports()
    if not _EXPORTS.exists():
        _EXPORTS.mkdir(mode=0o700, exist_ok=True)
        atexit.register(shutil.rmtree, _EXPORTS, True)
    folder = Path(tempfile.mkdtemp(prefix="export-", dir=_EXPORTS))
    if len(paths) == 1:
        target = folder / f"{name}.png"
        shutil.copyfile(paths[0], target)
        return str(target)
    target = folder / f"{name}.zip"
    with zipfile.ZipFile(target, "w") as archive:
        for k, path in enumerate(paths, 1):
            archive.write(path, f"{name}-{k}.png")
    return str(target)


def download_name(prompt: str | None, seed) -> str:
    """A result's file name from its prompt and seed: "make-the-sky-a-warm-sunset-seed77" (ASCII letters
    and digits of the prompt's first words, at most 48 characters; "imgedit-edit" without a prompt)."""
    text = unicodedata.normalize("NFKD", prompt or "").encode("ascii", "ignore").decode().lower()
    slug = ""
    for word in re.findall(r"[a-z0-9]+", text):
        if len(slug) + len(word) + 1 > 48:
            break
        slug = f"{slug}-{word}" if slug else word
    slug = slug or "imgedit-edit"
    return f"{slug}-seed{seed}" if seed is not None and str(seed).isdigit() else slug


def download_copy(path: str) -> str:
    """A result PNG to download, named from the prompt and seed in its text chunks (it was "image.png")."""
    stored = read_settings(path)
    return export_copy([Path(path)], download_name(stored.get("prompt"), stored.get("seed")))
