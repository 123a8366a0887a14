"""Pausing an item of a job at a step's end, to go on later from that step (a per-job part of the runner).

An edit someone waits on that finds every worker busy asks one running item of a job (/v1/jobs, the Batch tab)
to pause (imgedit.engine.line): the item stops at its next step's end and hands back the latents after that
step (`Resume`); the edit takes the worker; the item, resubmitted before the items not yet started, runs the
pipeline again from there: the latents as they were, and the schedule's remaining sigmas. The schedule's shift
is a function of each sigma alone (and of the last one, which a tail keeps), and a flow-matching Euler step
draws no noise, so the item ends with the image it would have made without the pause: the same pixels on the
edit models, whose steps are all alike. On Qwen-Image-2.1 the resumed call's first step is a prefill, which
computes the prompt's and references' keys with the target's (the unpaused step reads them from the prefix
cache) and, on a compiled worker, runs eager (imgedit.runtime.compile21): the image is the same within
rounding (the same pixels eager on the CPU; a 1-level difference, 95 dB, compiled, on the tiny checkpoint,
2026-11-30).

A job pauses only where nothing else carries state from step to step or from rank to rank: not a masked edit
(its blend counts steps from the start), not a step cache, not a prompt rewrite or mask_prompt outline (both
would run again), not a Turbo job (its own schedule), not a job the ranks of a group run together (the server
asks only items on a worker of one process), and only with a flow-matching Euler schedule whose sigmas a tail
can continue (imgedit.runtime.messages.may_pause is the part the server checks too). Any other job runs on as
if not asked.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from imgedit.runtime.messages import Job, Resume, may_pause

# scheduler options under which a tail of the sigmas does not give the tail of the schedule
_WHOLE_SCHEDULE = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "stochastic_sampling",
                   "invert_sigmas")


class JobPaused(Exception):
    """Raised from a step's end to stop a job that was asked to pause; carries where it stopped."""

    def __init__(self, resume: Resume):
        super().__init__(f"paused after step {resume.step}")
        self.resume = resume


def pausable(pipe, job: Job, together) -> bool:
    """Whether this job can pause and go on later with the image it makes unpaused (module docstring)."""
    if not may_pause(job) or together is not None or getattr(pipe.config, "sample_sigmas", None) is not None:
        return False
    scheduler = pipe.scheduler
    return isinstance(scheduler, FlowMatchEulerDiscreteScheduler) and not any(
        scheduler.config.get(option) for option in _WHOLE_SCHEDULE)


def resume_of(step: int, latents: torch.Tensor) -> Resume:
    """The state after `step` steps: the latents as bytes, in their own dtype."""
    latents = latents.detach().to("cpu").contiguous()
    data = latents.view(torch.uint8).numpy().tobytes() if latents.numel() else b""
    return Resume(step, data, tuple(latents.shape), str(latents.dtype).removeprefix("torch."))


def latents_of(resume: Resume) -> torch.Tensor:
    dtype = getattr(torch, resume.dtype)
    raw = torch.frombuffer(bytearray(resume.latents), dtype=torch.uint8)
    return raw.view(dtype).reshape(resume.shape)


def remaining_sigmas(steps: int, done: int) -> list[float]:
    """The sigmas the pipelines sample `steps` steps with (before the scheduler's shift), from step `done`
    on."""
    return [float(s) for s in np.linspace(1.0, 1 / steps, steps)[done:]]


class Pausing:
    """The runner's per-job part: a resumed job's latents and remaining schedule; a pausable job's check at
    every step's end (entered last, so the latents it keeps are those every other part handed back)."""

    def __init__(self, pipe):
        self.pipe = pipe

    @contextmanager
    def job(self, call):
        job = call.job
        if job.resume is not None:  # call.offset is set already (the runner's _new_call)
            call.kwargs["latents"] = latents_of(job.resume)
            call.kwargs["sigmas"] = remaining_sigmas(job.params.steps, job.resume.step)
        if call.pause is not None and pausable(self.pipe, job, call.together):
            if "latents" not in call.tensor_inputs:
                call.tensor_inputs.append("latents")

            def check(step: int, tensors: dict) -> None:
                if call.pause.is_set() and call.reached < job.params.steps:
                    raise JobPaused(resume_of(call.reached, tensors["latents"]))

            call.step_hooks.append(check)
        yield
