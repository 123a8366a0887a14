"""imgedit: `python app.py` serves the UI, the gradio API and REST on one port.

`python app.py --demo` builds (once, cached) and serves the tiny random-weight demo checkpoint.
This process is the server: it never imports torch and never holds a CUDA context; the worker
processes it starts own the GPUs (imgedit/engine/workers/pool.py, imgedit/runtime/worker.py).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import signal
import sqlite3
import sys
from dataclasses import replace

SET_UP = "python3 -m venv .venv && .venv/bin/pip install -r requirements.txt"
try:
    from dotenv import find_dotenv

    from imgedit.config.parsers import DeviceMap
    from imgedit.config.settings import load_env_file, load_settings, writable_folder
    from imgedit.engine.workers.gpus import discover_gpus
    from imgedit.errors import ImgEditError, SettingsError
    from imgedit.planning.families import FAMILIES
    from imgedit.web import logs
    from imgedit.web.starting import StartingServer
except ModuleNotFoundError as missing:  # a Python outside the project's environment: one line, no traceback
    print(f"imgedit: the package {missing.name!r} is missing: run .venv/bin/python app.py (the README's "
          f"set-up makes .venv: {SET_UP})", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Edit images with the Qwen image-edit models.",
        epilog="Everything else is set by environment variables or a .env file (model, GPUs, port, limits, "
               "auth): .env.example lists every one with its default, and docs/configuration.md explains "
               "them.")
    parser.add_argument("--demo", action="store_true",
                        help="serve a tiny random-weight model on the CPU (no download; outputs are noise)")
    parser.add_argument("--host", help="the address to listen on (sets GRADIO_SERVER_NAME; default "
                        "127.0.0.1, this machine only; 0.0.0.0 opens it to the network)")
    parser.add_argument("--port", type=int,
                        help="the port to serve on (sets GRADIO_SERVER_PORT; default 7860)")
    parser.add_argument("--env-file", help="the .env file to read (default: .env in this folder or above "
                        "it); a line it cannot parse, or a name one typo away from a setting's, stops "
                        "start-up")
    args = parser.parse_args(argv)
    try:
        # .env fills in what the environment does not set; a line it cannot read stops start-up here
        load_env_file(args.env_file or find_dotenv())
        if args.host is not None:
            os.environ["GRADIO_SERVER_NAME"] = args.host
        if args.port is not None:
            os.environ["GRADIO_SERVER_PORT"] = str(args.port)
        settings = load_settings()
        writable_folder("OUTPUT_DIR", settings.output_dir)
        _history_readable(settings.output_dir)
        writable_folder("COMPILE_CACHE_DIR", settings.compile_cache_dir)  # the workers' compiler writes there
        if os.environ.get("GRADIO_TEMP_DIR"):  # Gradio's uploads and cached results
            writable_folder("GRADIO_TEMP_DIR", os.environ["GRADIO_TEMP_DIR"])
    except SettingsError as exc:
        print(f"imgedit: {exc.message}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level)  # repeated lines summed up (a flood of refusals wrote 76 MB in 75 s)
    log = logging.getLogger("imgedit")
    # The port is bound now and answered from the first second: /health and the page say what the server
    # is doing while it inspects the checkpoint and starts the workers (a minute on a slow first start).
    try:
        starting = StartingServer(settings.gradio_server_name, settings.gradio_server_port,
                                  "inspecting the checkpoint and the LoRA files")
    except OSError as exc:
        if exc.errno == errno.EADDRNOTAVAIL:  # bind() to an address no interface of this machine has
            log.error("%s is not an address of this machine: use 127.0.0.1 (this machine only), 0.0.0.0 "
                      "(every network) or one of its own addresses (--host or GRADIO_SERVER_NAME)",
                      settings.gradio_server_name)
            return 2
        log.error("port %d is in use on %s (%s): stop what serves there, or choose another port with "
                  "--port or GRADIO_SERVER_PORT", settings.gradio_server_port, settings.gradio_server_name,
                  exc.strerror or exc)
        return 2
    try:
        return _start(args, settings, starting, log)
    finally:
        starting.close()  # the port, where the real server never took it over


def _start(args, settings, starting, log) -> int:
    if settings.torch_dtype == "float16":
        log.warning("TORCH_DTYPE=float16: Qwen-Image-Edit is known to give NaN/black images in fp16; "
                    "use bfloat16")

    # Imported here, after load_dotenv() and --host/--port: these modules read the environment when
    # imported (engine.inspection's IMGEDIT_SIZES_CACHE, gradio's GRADIO_* settings), and gradio's
    # import (2.5 s of CPU) comes after the port is answered, the settings are known to be good and the
    # worker processes have started (below: standby processes import torch from before the inspection,
    # 12-15 s on 2x H200). The server process never imports torch nor touches CUDA (GPUs are read
    # through NVML); the worker processes own the GPUs.
    from imgedit.engine.workers.standby import StandbyPool

    no_model_chosen = not settings.qwen_model_dir and "QWEN_MODEL" not in os.environ
    gpus = [] if args.demo or settings.demo or settings.workers == "ray" else discover_gpus()
    device_map = settings.device_map  # modes that name GPUs (balanced/auto plan for what there is)
    wants_gpus = device_map.mode in ("cuda", "cfg-parallel", "ulysses", "replicas") or (
        device_map.mode == "manual" and "cuda" in str(device_map.manual))
    if wants_gpus and not gpus and not args.demo and not settings.demo and settings.workers != "ray":
        log.error("DEVICE_MAP=%s needs GPUs and none is visible here (NVML found none): use DEVICE_MAP=cpu, "
                  "or `python app.py --demo` for the demo model", os.environ.get("DEVICE_MAP", ""))
        return 2
    if args.demo or (not settings.demo and no_model_chosen and not gpus):
        if not args.demo:
            log.warning("no GPU and no QWEN_MODEL/QWEN_MODEL_DIR set: serving the demo model "
                        "(outputs are noise)")
        # A few steps (unless DEFAULT_STEPS says otherwise): the random demo model makes noise either way.
        settings = replace(settings, demo=True, device_map=DeviceMap("cpu"),
                           default_steps=settings.default_steps or 4)
    # uvicorn handles SIGTERM/SIGINT itself, then re-raises the signal once it has stopped serving: turn that,
    # and a signal during start-up, into a normal exit so the standby and worker processes are stopped below.
    for stop_signal in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop_signal, _exit_quietly)
    # The worker processes start now, before the plan is known: they import torch and the libraries while
    # the checkpoint is inspected, then each is given a rank (engine.workers.standby).
    standbys = StandbyPool.for_settings(settings, len(gpus))
    try:
        return _serve(settings, starting, log, standbys)
    finally:
        standbys.close()  # those no rank took, however start-up ended


def _serve(settings, starting, log, standbys) -> int:
    from imgedit.engine import heap
    from imgedit.engine.manager import PipelineManager  # after the environment is set (_start)
    from imgedit.engine.workers.inspection import (  # reads IMGEDIT_SIZES_CACHE (_start)
        ensure_demo_checkpoint,
        inspection_start,
    )

    manager = PipelineManager(settings, standbys=standbys)
    try:
        if settings.demo:
            starting.say("building the demo checkpoint")
            skip = settings.quantize_skip
            skip = FAMILIES[settings.demo_kind].quantize_skip if skip is None else skip  # QUANTIZE_SKIP=auto
            # in a subprocess (torch), or a fork of the workers' forkserver
            start = inspection_start(settings)
            ensure_demo_checkpoint(settings.model_source, skip, settings.demo_kind, start)
        manager.prepare()  # checkpoint and placement plan: the page needs the model family and workers
    except ImgEditError as exc:
        log.error("%s", exc.message)
        return 2
    starting.say("starting the worker processes")
    heap.map_large_blocks()  # this process's freed pixels go back to the system (engine/heap.py)
    manager.start()  # worker processes load the weights; /health says 503 until they are ready
    standbys.close()  # every worker has its processes: the standbys left are stopped
    try:
        starting.say("building the page")
        from imgedit.web.app import build_app, serve  # gradio: after the workers' start (above)

        app = build_app(settings, manager)
        serve(app, settings, starting.handover())  # returns on SIGTERM / Ctrl-C
    finally:
        log.info("stopping the worker processes")
        manager.close()
    return 0


def _history_readable(output_dir: str) -> None:
    """The History's index (engine.jobs.history), if there is one, is a database: a damaged one ended in a
    raw traceback after the workers had started."""
    path = os.path.join(os.path.expanduser(output_dir), "history.sqlite3")
    if not os.path.exists(path):
        return
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            db.execute("PRAGMA schema_version").fetchone()
    except sqlite3.DatabaseError as exc:
        raise SettingsError(f"Bad configuration:\n  the History's database {path} (in OUTPUT_DIR) cannot be "
                            f"opened: {exc}; move it aside and start again (a new one is made)") from None


def _exit_quietly(signum, frame) -> None:
    raise SystemExit(0)


if __name__ == "__main__":
    sys.exit(main())
