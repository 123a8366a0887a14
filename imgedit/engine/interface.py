"""What the web layer may ask of the engine (`Engine`): the model family, checks, jobs through the line,
status, the SIGTERM drain. `engine.manager.PipelineManager` implements it; the web is handed an `Engine`
and uses nothing else of the manager.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

from imgedit.engine.prompt_tokens import PromptTokens
from imgedit.errors import InvalidInput
from imgedit.protocol import EditRequest, EditResult, JobRecord, ManagerStatus, Resolved

StepCallback = Callable[[int, int], None]  # (step, total)
WaitCallback = Callable[[int], None]  # jobs ahead of this one (running ones included)


class Engine(ABC):
    """The line in front of the workers, as the server's edges see it."""

    prompt_tokens: PromptTokens  # the checkpoint's tokenizer: the page counts a prompt as the checks do
    # called after every job (metrics, logs)
    listeners: list[Callable[[JobRecord], None]]

    @property
    @abstractmethod
    def family(self) -> str:
        """The checkpoint's model family (imgedit.planning.families)."""

    @abstractmethod
    def status(self) -> ManagerStatus: ...

    # ---- checks: every edge's, before a job waits ----
    @abstractmethod
    def resolve(self, req: EditRequest) -> Resolved:
        """A decoded edit's exact parameters, or InvalidInput naming the field (`can_run` included)."""

    @abstractmethod
    def check(self, req: EditRequest) -> Resolved:
        """`resolve` for a request whose images are not decoded or not there yet (a job's template)."""

    @abstractmethod
    def can_run(self, params: Resolved) -> InvalidInput | None:
        """Whether these workers can run a job with these parameters: the refusal, or None."""

    @abstractmethod
    def cache_refusal(self) -> str | None:
        """Why these workers cannot run a step cache, or None (the page then hides its control)."""

    # ---- jobs through the line ----
    @abstractmethod
    async def run(self, req: EditRequest, on_step: StepCallback | None = None,
                  on_wait: WaitCallback | None = None, cancel: threading.Event | None = None,
                  params: Resolved | None = None) -> EditResult:
        """An edit: waits in line for a worker, runs there; `params` as `resolve` made them at the edge."""

    @abstractmethod
    async def run_enhance(self, req: EditRequest, on_wait: WaitCallback | None = None,
                          cancel: threading.Event | None = None) -> EditResult:
        """A prompt rewrite alone, through the same line."""

    @abstractmethod
    async def run_outline(self, req: EditRequest, on_wait: WaitCallback | None = None,
                          cancel: threading.Event | None = None) -> EditResult:
        """mask_prompt's outline alone (its `mask` and `boxes`), through the same line."""

    def preview(self, request_id: str) -> bytes | None:
        """A watched job's newest live preview while it runs (a small JPEG; EditRequest.watch), else None."""
        return None

    # ---- the SIGTERM drain (imgedit.engine.shutdown.Shutdown) ----
    @abstractmethod
    def stop_accepting(self, message: str) -> None:
        """From now on a job is refused (ShuttingDown); every job still waiting fails at once with `message`;
        jobs on a worker go on."""

    @abstractmethod
    def wait_idle(self, timeout: float) -> bool:
        """Wait until no job is in flight (True) or `timeout` seconds passed (False)."""

    @abstractmethod
    def cancel_running(self, message: str) -> None:
        """Stop the jobs still running at their next step; their callers get ShuttingDown(message)."""

    @abstractmethod
    def close(self) -> None:
        """Stop and join every worker process (no orphans); idempotent."""
