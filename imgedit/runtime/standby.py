"""A standby process: a worker process started before the plan is known (imgedit.engine.workers.standby).

Started with the CUDA_VISIBLE_DEVICES of the rank it may become, it prepares what torch reads at import
(runtime.worker.prepare_process), imports what a worker imports, then waits on its inbox for its assignment: a
rank of exactly those GPUs, its spec and the server's environment. It then runs runtime.worker.main over the
same pipes, as a process started for that rank would. The imports (12-15 s on 2x H200) run while the server
inspects the checkpoint (3-19 s) instead of after it. An import may initialise CUDA (torchao's does, on a GPU
host): harmless, as the GPUs it sees are already the rank's.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal

from imgedit.model import quiet_known_noise
from imgedit.runtime.messages import Assignment, StandbyUnfit
from imgedit.runtime.worker import main as run_rank
from imgedit.runtime.worker import prepare_process, watch_parent

# What a worker imports before it can place anything (runtime.worker.main and runtime.phases.build_worker)
IMPORTS = ("torch", "diffusers", "transformers", "accelerate", "torchao", "peft",
           "imgedit.runtime.phases", "imgedit.runtime.runner", "imgedit.runtime.worker")


def main(inbox, outbox, visible: str | None, cache_dir: str | None, log_level: str, capped: bool) -> None:
    watch_parent(os.getppid())
    # Ctrl-C in a terminal signals the whole process group: the server stops its standbys itself. SIGTERM,
    # the server's stop of a standby it did not use, ends one at once, whatever it is importing; once it is
    # a rank, it ignores SIGTERM as every worker does (runtime.worker.main).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s %(levelname)s standby {os.getpid()}: %(message)s")
    prepare_process(visible, cache_dir, capped)  # as it was started: CUDA_VISIBLE_DEVICES already the rank's
    why = _import_all(log_level)
    if why is not None:  # the server says it in its log; a fresh process for the rank shows the traceback
        outbox.send(StandbyUnfit(os.getpid(), why))
        return
    try:
        assignment = inbox.recv()
    except (EOFError, OSError):  # the server is stopping its unused standbys
        return
    if not isinstance(assignment, Assignment):  # Stop
        return
    os.environ.clear()
    os.environ.update(assignment.environ)
    logging.root.handlers.clear()  # the rank's own log format (runtime.worker.main)
    run_rank(assignment.spec, inbox, outbox, assignment.visible_devices, assignment.cache_dir,
             assignment.log_level)


def _import_all(log_level: str) -> str | None:
    """Import what a worker imports (None), or say which import failed."""
    if log_level != "DEBUG":
        quiet_known_noise()
    for name in IMPORTS:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - the fresh process's load shows the traceback
            return f"importing {name} failed ({type(exc).__name__}: {exc})"
    return None
