"""What a worker, a job's item and a job are doing: str enums, so JSON, logs and the records on disk carry
their values."""

from __future__ import annotations

from enum import Enum


class WorkerState(str, Enum):
    """Where a worker is in its life. Written only by its handle (engine.workers.pool: its pump thread as the
    processes report, `claim()`/`release()` for the manager's line); a str, so /health and the panel read the
    value."""

    LOADING = "loading"
    IDLE = "idle"
    BUSY = "busy"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPED = "stopped"

    __str__ = str.__str__  # "idle", in logs and f-strings as in JSON

    @property
    def serving(self) -> bool:
        return self in (WorkerState.IDLE, WorkerState.BUSY)

    @property
    def coming(self) -> bool:
        """Loading or restarting: it will serve (or fail) soon."""
        return self in (WorkerState.LOADING, WorkerState.RESTARTING)

    @property
    def ended(self) -> bool:
        return self in (WorkerState.FAILED, WorkerState.STOPPED)


class ItemState(str, Enum):
    """Where one item of a job (a batch, or a /v1/jobs input set) is. A str: the jobs API, the Batch tab and
    the records on disk (imgedit.engine.jobs.records) read and write the value."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    __str__ = str.__str__

    @property
    def finished(self) -> bool:
        return self not in (ItemState.QUEUED, ItemState.RUNNING)


class JobState(str, Enum):
    """A job's state, made from its items' (imgedit.engine.jobs.records.job_state)."""

    QUEUED = "queued"
    RUNNING = "running"
    CANCELLING = "cancelling"  # asked to stop: waiting items leave the line, a running one stops at a step
    SUCCEEDED = "succeeded"
    PARTIAL = "partial"
    FAILED = "failed"
    CANCELLED = "cancelled"

    __str__ = str.__str__

    @property
    def finished(self) -> bool:
        return self not in (JobState.QUEUED, JobState.RUNNING, JobState.CANCELLING)
