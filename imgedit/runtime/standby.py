"""A standby process: a worker process started before the plan is known (imgedit.engine.workers.standby).

It prepares what torch reads at import (runtime.worker.prepare_process, less the GPUs), imports what a worker
imports, then waits on its inbox for its assignment: a rank's spec, its GPUs and the server's environment. It
then runs runtime.worker.main over the same pipes, as a process started for that rank would. The imports
(12-15 s on 2x H200) run while the server inspects the checkpoint (3-19 s) instead of after it.

A process that imported torch can still be given its GPUs, as long as nothing initialised the CUDA driver
(`cuda_in_use`): a standby checks that after its imports and again at its assignment, and one that cannot
serve says so (StandbyUnfit) and exits; the server starts a fresh process for the rank instead.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import signal
import sys

from imgedit.model import quiet_known_noise
from imgedit.runtime.messages import Assignment, StandbyUnfit
from imgedit.runtime.worker import main as run_rank
from imgedit.runtime.worker import prepare_process, watch_parent

# What a worker imports before it can place anything (runtime.worker.main and runtime.phases.build_worker)
IMPORTS = ("torch", "diffusers", "transformers", "accelerate", "torchao", "peft",
           "imgedit.runtime.phases", "imgedit.runtime.runner", "imgedit.runtime.worker")
# torch.cuda.is_available() through NVML rather than the driver, for a library that asks at its import
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
CUDA_ERROR_NOT_INITIALIZED = 3


def main(inbox, outbox, cache_dir: str | None, log_level: str, capped: bool) -> None:
    watch_parent(os.getppid())
    # Ctrl-C in a terminal signals the whole process group: the server stops its standbys itself. SIGTERM,
    # the server's stop of a standby it did not use, ends one at once, whatever it is importing; once it is
    # a rank, it ignores SIGTERM as every worker does (runtime.worker.main).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s %(levelname)s standby {os.getpid()}: %(message)s")
    prepare_process(None, cache_dir, capped)
    why = _import_all(log_level) or cuda_in_use()
    assignment = None
    if why is None:
        try:
            message = inbox.recv()
        except (EOFError, OSError):  # the server is stopping its unused standbys
            return
        if not isinstance(message, Assignment):  # Stop
            return
        assignment = message
        why = cuda_in_use()
    if why is not None:  # the server says it in its log
        outbox.send(StandbyUnfit(os.getpid(), why))
        return
    os.environ.clear()
    os.environ.update(assignment.environ)
    logging.root.handlers.clear()  # the rank's own log format (runtime.worker.main)
    run_rank(assignment.spec, inbox, outbox, assignment.visible_devices, assignment.cache_dir,
             assignment.log_level)


def _import_all(log_level: str) -> str | None:
    """Import what a worker imports (None), or say which import failed: a fresh process for the rank then
    reports the failure as a worker does."""
    if log_level != "DEBUG":
        quiet_known_noise()
    server_value = os.environ.get(NVML_CHECK)
    os.environ[NVML_CHECK] = "1"
    try:
        for name in IMPORTS:
            importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - the fresh process's load shows the traceback
        return f"importing {name} failed ({type(exc).__name__}: {exc})"
    finally:
        if server_value is None:
            del os.environ[NVML_CHECK]
        else:
            os.environ[NVML_CHECK] = server_value
    return None


def cuda_in_use() -> str | None:
    """Why this process can no longer be given GPUs, or None while it still can.

    CUDA_VISIBLE_DEVICES is read by the driver once, at cuInit, not at `import torch`, and torch initialises
    CUDA lazily (torch.cuda.device_count() caches nothing before): a process that has imported torch and the
    libraries still takes the GPUs its assignment names, as long as nothing initialised the driver. The
    driver is asked itself, as a library may have called it without torch: before cuInit, cuDeviceGetCount
    answers CUDA_ERROR_NOT_INITIALIZED (3), and 0 after. No libcuda.so.1: no driver, no GPU to get wrong."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        driver = None
    if driver is not None:
        count = ctypes.c_int(0)
        status = driver.cuDeviceGetCount(ctypes.byref(count))
        if status != CUDA_ERROR_NOT_INITIALIZED:
            return f"the CUDA driver was initialised (cuDeviceGetCount returned {status})"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "torch had initialised CUDA"
    return None
