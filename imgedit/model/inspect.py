"""What the planner needs to know of a checkpoint, measured on the worker side: the parameters of
every component and of each repeated block (from the configs alone, on the meta device: no weights
read), and the configured LoRA files checked against the transformer.

The server never imports this (it would pull in torch): it runs
`python -m imgedit.model.inspect` with a JSON request on stdin and reads a JSON answer on stdout
(imgedit.engine.workers.inspection). Answers are plain JSON, no classes of the server side.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from imgedit.config.loras import LoraEntry
from imgedit.config.parsers import QUANTIZABLE, is_skipped
from imgedit.errors import ImgEditError
from imgedit.model.demo_checkpoint import ensure_checkpoint
from imgedit.model.loras import check_all


def layer_sizes(folder: Path, skip: tuple[str, ...] = ()) -> list[dict]:
    """Count every component's parameters from its config alone (meta device, no weights):
    per part (the head, each repeated block) the Linear weights QUANTIZE converts (`linear`), those
    QUANTIZE_SKIP keeps (`kept`) and every other parameter (`other`)."""
    # here, not at the top: with the sizes cached (imgedit.engine.workers.inspection) this subprocess measures
    # nothing, and loads torch and diffusers only for a LoRA check or a demo build (seconds of CPU)
    import torch
    from accelerate import init_empty_weights  # (as torch)

    from imgedit.model.components import MODEL_COMPONENTS, block_container, from_config  # (as torch)

    out = []
    for name in MODEL_COMPONENTS:
        with init_empty_weights():
            model = from_config(name, folder)
        container = block_container(model) if name != "vae" else None
        heads: dict[str, int] = {"linear": 0, "kept": 0, "other": 0}
        blocks: list[dict[str, int]] = []
        if container:
            blocks = [{"linear": 0, "kept": 0, "other": 0} for _ in model.get_submodule(container)]
        largest = 0
        for fqn, module in model.named_modules():
            own = list(module.parameters(recurse=False))
            if not own:
                continue
            if not list(module.children()):  # a leaf: what leaf-level streaming moves at once
                largest = max(largest, sum(p.numel() for p in own))
            where = heads
            if container and fqn.startswith(container + "."):
                where = blocks[int(fqn[len(container) + 1:].split(".")[0])]
            for pname, p in module.named_parameters(recurse=False):
                if isinstance(module, torch.nn.Linear) and pname == "weight" and name in QUANTIZABLE:
                    where["kept" if is_skipped(fqn, skip) else "linear"] += p.numel()
                else:
                    where["other"] += p.numel()
        out.append({"name": name, "head": heads, "blocks": blocks, "largest_leaf": largest})
    return out


def inspect(request: dict) -> dict:
    """{"folder", "skip", "loras": [[name, source, steps], ...], "sizes": bool, "build_demo": bool, "kind"}
    -> {"sizes", "loras"} or {"error": {"kind", "message"}} for an ImgEditError (a bad LoRA file names
    itself). `build_demo`: first write the tiny demo checkpoint into the folder if it is not there."""
    folder = Path(request["folder"])
    if request.get("build_demo"):
        ensure_checkpoint(folder, kind=request.get("kind", "plus"))
    try:
        sizes = layer_sizes(folder, tuple(request.get("skip", ()))) if request.get("sizes", True) else None
        entries = tuple(LoraEntry(n, s, steps) for n, s, steps in request.get("loras", ()))
        loras = [f.__dict__ for f in check_all(entries, folder)]
    except ImgEditError as exc:
        return {"error": {"kind": exc.kind, "message": exc.message}}
    return {"sizes": sizes, "loras": loras}


def main() -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    answer = inspect(json.loads(sys.stdin.read()))
    sys.stdout.write(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
