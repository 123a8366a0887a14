"""The server's view of a checkpoint's sizes and LoRA files, asked of the worker side in a
subprocess (`python -m imgedit.model.inspect`) so that the server process never imports torch.

Sizes depend only on the components' config files and QUANTIZE_SKIP: they are cached on disk
(~/.cache/imgedit/sizes, keyed by a hash of both), so a restart plans without the subprocess.
A local LoRA file that passed the check is remembered there too, keyed by the transformer's config
and the file's path, size and modification time: a restart with unchanged files starts no
subprocess (importing torch and diffusers in it costs seconds of CPU). A file that changed, a hub
file (its local copy is only known after the fetch) and a file that failed are checked again.

With WORKER_START=forkserver the inspection is a fork of the workers' forkserver instead, which has imported
torch and diffusers once for every worker: 0.1-1 s where a fresh interpreter took 5-8 s on a 2-core
machine (the CPU test suite ran twenty of them). Not for a hub LoRA file: the hub client read its settings
(HF_HUB_OFFLINE, HF_HOME, ...) when the forkserver imported it, and a fresh interpreter reads today's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from imgedit.config.loras import LoraEntry, LoraError, LoraFile
from imgedit.config.settings import Settings
from imgedit.engine.workers.processes import start_context
from imgedit.errors import PlacementError
from imgedit.planning.checkpoint import MODEL_COMPONENTS, Checkpoint, open_checkpoint
from imgedit.planning.memory import ComponentSizes, sizes_from_json

log = logging.getLogger(__name__)

CACHE_DIR = Path(os.environ.get("IMGEDIT_SIZES_CACHE", "~/.cache/imgedit/sizes")).expanduser()
TIMEOUT_S = 600  # a hub LoRA may be downloaded


def _key(checkpoint: Checkpoint, skip: tuple[str, ...]) -> str:
    digest = hashlib.sha256(json.dumps(list(skip)).encode())
    for name in MODEL_COMPONENTS:
        config = checkpoint.folder / name / "config.json"
        digest.update(config.read_bytes() if config.is_file() else b"-")
    return digest.hexdigest()[:32]


def inspect_checkpoint(checkpoint: Checkpoint, skip: tuple[str, ...] = (),
                       loras: tuple[LoraEntry, ...] = (), sizes: bool = True, start: str = "spawn",
                       ) -> tuple[list[ComponentSizes] | None, tuple[LoraFile, ...]]:
    """(sizes of every component, the checked LoRA files). Raises LoraError for a bad LoRA and
    PlacementError when the inspection itself fails (the log has its output). `start`: WORKER_START."""
    cached = CACHE_DIR / f"{_key(checkpoint, skip)}.json" if sizes else None
    known = None
    if cached is not None:
        try:
            known = sizes_from_json(_read(cached))
        except (ValueError, KeyError, TypeError):
            known = None
    checked = {e: _checked_before(checkpoint, e) for e in loras}
    unchecked = [e for e in loras if checked[e] is None]
    if (known is not None or not sizes) and not unchecked:
        return known, tuple(checked[e] for e in loras)
    request = {"folder": str(checkpoint.folder), "skip": list(skip), "sizes": sizes and known is None,
               "loras": [[e.name, e.source, e.steps] for e in unchecked]}
    if any(not Path(e.source).expanduser().is_file() for e in unchecked):
        start = "spawn"  # a hub file: the forkserver's hub client read HF_HUB_OFFLINE, HF_HOME at its start
    answer = _run(request, start=start)
    if "error" in answer:
        raise LoraError(answer["error"]["message"])
    for entry, found in zip(unchecked, answer["loras"], strict=True):
        checked[entry] = LoraFile(**found)
        if (key := _lora_key(checkpoint, entry)) is not None:
            _write(CACHE_DIR / f"lora-{key}.json", found)
    if answer["sizes"] is not None:
        known = sizes_from_json(answer["sizes"])
        if cached is not None:
            _write(cached, answer["sizes"])
    return known, tuple(checked[e] for e in loras)


def inspection_start(settings: Settings) -> str:
    """How the inspection starts: a fork of the workers' forkserver where local workers come from one
    (WORKER_START=forkserver), else a fresh interpreter (Ray's workers have no forkserver here)."""
    return settings.worker_start if settings.workers == "local" else "spawn"


def _lora_key(checkpoint: Checkpoint, entry: LoraEntry) -> str | None:
    """The cache key of a local LoRA file as it is now (None for a hub file)."""
    path = Path(entry.source).expanduser()
    if not path.is_file():
        return None
    stat = path.stat()
    config = checkpoint.folder / "transformer" / "config.json"
    digest = hashlib.sha256(config.read_bytes() if config.is_file() else b"-")
    key = [entry.name, entry.steps, str(path.resolve()), stat.st_size, stat.st_mtime_ns]
    digest.update(json.dumps(key).encode())
    return digest.hexdigest()[:32]


def _checked_before(checkpoint: Checkpoint, entry: LoraEntry) -> LoraFile | None:
    key = _lora_key(checkpoint, entry)
    if key is None:
        return None
    try:
        return LoraFile(**_read(CACHE_DIR / f"lora-{key}.json"))
    except (ValueError, KeyError, TypeError):
        return None


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except OSError:
        return None


def _write(path: Path, data) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    except OSError as exc:  # a read-only home: plan without the cache
        log.warning("could not cache the checkpoint's sizes or LoRA checks in %s: %s", CACHE_DIR, exc)


def _run(request: dict, failed: str = "could not read the checkpoint's component configs",
         start: str = "spawn") -> dict:
    """imgedit.model.inspect's answer to `request`, from a fresh interpreter, or with `start` "forkserver"
    from a fork of the workers' forkserver."""
    if start == "forkserver":
        return _forked(request, failed)
    try:
        done = subprocess.run([sys.executable, "-m", "imgedit.model.inspect"], input=json.dumps(request),
                              capture_output=True, text=True, timeout=TIMEOUT_S, check=False, env=_env())
    except subprocess.TimeoutExpired:
        raise PlacementError(f"inspecting the checkpoint took over {TIMEOUT_S}s") from None
    if done.returncode != 0:
        log.error("checkpoint inspection failed (exit %d):\n%s", done.returncode, done.stderr[-4000:])
        raise PlacementError(f"{failed} (see the server log)")
    return json.loads(done.stdout)


def _forked(request: dict, failed: str) -> dict:
    """The inspection in a process forked from the forkserver the workers come from (its traceback, if it
    fails, goes to the server's stderr)."""
    ctx = start_context("forkserver")
    answer_read, answer_write = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_forked_entry, name="imgedit-inspect", daemon=True,
                       args=(dict(os.environ), request, answer_write))
    try:
        try:
            proc.start()
        finally:
            answer_write.close()  # the child's end: closed here, so a dead child reads as end-of-file
        if not answer_read.poll(TIMEOUT_S):
            raise PlacementError(f"inspecting the checkpoint took over {TIMEOUT_S}s")
        return json.loads(answer_read.recv_bytes())  # JSON, as the subprocess answers: no classes unpickled
    except (EOFError, OSError) as exc:  # it died without an answer, or the forkserver could not start
        if proc.pid is not None:
            proc.join(5)
        log.error("checkpoint inspection failed (%s, exit %s); its traceback is above", type(exc).__name__,
                  proc.exitcode if proc.pid is not None else "not started")
        raise PlacementError(f"{failed} (see the server log)") from None
    finally:
        answer_read.close()
        if proc.pid is not None:
            if proc.is_alive():
                proc.kill()
            proc.join()


def _forked_entry(environ: dict[str, str], request: dict, answer) -> None:
    os.environ.clear()
    os.environ.update(environ)  # a fork has the forkserver's environment: the server's as of now
    from imgedit.model.inspect import inspect  # in the child only (torch)

    answer.send_bytes(json.dumps(inspect(request)).encode())


def _env() -> dict[str, str]:
    """The server's environment with this copy of imgedit importable whatever the working directory."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


def ensure_demo_checkpoint(folder: str, skip: tuple[str, ...] = (), kind: str = "plus",
                           start: str = "spawn") -> None:
    """Build the tiny demo checkpoint once, in the inspection subprocess (building it needs torch),
    which measures its sizes on the way: the first demo start imports torch in one process, not two.
    `start`: WORKER_START."""
    if (Path(folder).expanduser() / "model_index.json").is_file():
        return
    log.info("building the demo checkpoint in %s", folder)
    answer = _run({"folder": str(Path(folder).expanduser()), "build_demo": True, "kind": kind,
                   "skip": list(skip), "sizes": True},
                  f"could not build the demo checkpoint in {folder}", start)
    _write(CACHE_DIR / f"{_key(open_checkpoint(folder), skip)}.json", answer["sizes"])
