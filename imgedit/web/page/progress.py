"""What the page's progress bar says about one edit: waiting in line, preparing, denoising (with time left).

The manager reports a place in line (`on_wait`) and finished steps (`on_step`); the time between a
worker taking the job and its first step (encoding the prompt and images) is read from the workers'
status, where the job's id appears as soon as a worker holds it.
"""

from __future__ import annotations

import time


def _duration(seconds: float) -> str:
    seconds = max(1, round(seconds))
    return f"{seconds} s" if seconds < 90 else f"{seconds // 60} min {seconds % 60:02d} s"


class EditProgress:
    """Collects the manager's callbacks (from its threads) and renders one progress update."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.ahead: int | None = None
        self.step = 0
        self.total = 0
        self.first_step_at: float | None = None
        self.last_step_at: float | None = None

    def on_wait(self, ahead: int) -> None:
        self.ahead = ahead

    def on_step(self, step: int, total: int) -> None:
        now = time.monotonic()
        if self.first_step_at is None:
            self.first_step_at = now
        self.step, self.total, self.last_step_at = step, total, now

    def seconds_left(self) -> float | None:
        """From the pace since the first step (the first one also carries warm-up, so it is the origin)."""
        if self.step < 2 or self.first_step_at is None or self.last_step_at is None:
            return None
        per_step = (self.last_step_at - self.first_step_at) / (self.step - 1)
        return per_step * (self.total - self.step)

    def render(self, status) -> tuple[tuple[int, int] | float, str]:
        """(progress value, description) for gr.Progress, from the callbacks and the manager's status."""
        if self.step:
            if self.step >= self.total:
                return (self.step, self.total), "decoding the result"
            left = self.seconds_left()
            eta = f", about {_duration(left)} left" if left is not None else ""
            return (self.step, self.total), f"denoising{eta}"
        held = any(w.job_id == self.request_id for w in status.workers)
        if held:
            return 0.0, "preparing: encoding the prompt and images"
        if self.ahead:
            return 0.0, f"waiting in line: {self.ahead} job(s) ahead of yours"
        return 0.0, "starting"
