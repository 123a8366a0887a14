"""What anyone who reaches the port may see of the server's state (`/health`, `/gpu_status`, the
panel) and what only key holders may (`/v1/status`).

The open views keep readiness, counts, GPU readings, each worker's state and progress; they leave
out what would let a stranger reach other people's work or learn the host: job ids (a REST edit's
id fetches its result), process ids, the checkpoint's path, LoRA file names.
"""

from __future__ import annotations

from dataclasses import replace

from imgedit.config.settings import public_model_name
from imgedit.engine.workers.gpus import GpuMonitor, snapshot
from imgedit.protocol import ManagerStatus

RUNNING = "a job"  # what an open view says instead of a job's id


def _hide_path(text: str | None, model: str) -> str | None:
    return text.replace(model, public_model_name(model)) if text and model else text


def open_snapshot(monitor: GpuMonitor, status: ManagerStatus, history: bool = False) -> dict:
    """The panel's data for anyone: `snapshot` of a status with the ids, paths and files left out."""
    workers = tuple(replace(w, job_id=RUNNING if w.job_id else None, error=_hide_path(w.error, status.model),
                            detail=_hide_path(w.detail, status.model), job_client=None)
                    for w in status.workers)
    shown = replace(status, model=public_model_name(status.model), workers=workers,
                    error=_hide_path(status.error, status.model),
                    loras=tuple({k: v for k, v in lora.items() if k != "file"} for lora in status.loras))
    data = snapshot(monitor, shown, history=history)  # the pids are still there: NVML's readings need them
    for worker in data["workers"]:
        worker.pop("pids", None)
        worker.pop("job_client", None)
    data.update(model=shown.model, family=status.family, error=shown.error)
    return data


def full_snapshot(monitor: GpuMonitor, status: ManagerStatus, caller: str | None) -> dict:
    """For key holders (`/v1/status`): the checkpoint, LoRA files, and the id of a running job when the caller
    asked for it (another owner's shows as "a job"). The worker processes' ids only for the operator: the
    holder of API_KEY, or anyone on a server without keys (imgedit.web.identity: owners "token:..."), never
    for the owners API_KEYS names ("key:...", or "user:..." for a key named as a login)."""
    workers = tuple(replace(w, job_id=w.job_id if w.job_client == caller else (RUNNING if w.job_id else None),
                            job_client=None) for w in status.workers)
    data = snapshot(monitor, replace(status, workers=workers))
    for worker in data["workers"]:
        worker.pop("job_client", None)
        if not (caller or "").startswith("token:"):
            worker.pop("pids", None)
    data.update(model=status.model, family=status.family, error=status.error)
    return data
