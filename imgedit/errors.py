"""Errors that may reach a user: each carries a safe message and a kind the edges map to a status."""

from __future__ import annotations


class ImgEditError(Exception):
    """Base class: `message` is safe to show to a user; `kind` picks the HTTP status at the edges."""

    kind = "internal"

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field  # the request parameter at fault, when there is one


class SettingsError(ImgEditError):
    kind = "settings"


class PlacementError(ImgEditError):
    kind = "placement"


class InvalidInput(ImgEditError):
    kind = "invalid_input"


class InputTooLarge(InvalidInput):
    kind = "too_large"


class QueueFull(ImgEditError):
    kind = "busy"


class Cancelled(ImgEditError):
    kind = "cancelled"


class OutOfGpuMemory(ImgEditError):
    kind = "out_of_memory"


class WorkerFailed(ImgEditError):
    kind = "worker_failed"


class NotReady(ImgEditError):
    kind = "not_ready"


def user_text(exc: BaseException) -> str:
    """Our own errors carry user-safe text; others are named by type only (details go to the log)."""
    return exc.message if isinstance(exc, ImgEditError) else f"{type(exc).__name__} (see the server log)"
