"""Where a job's time goes inside the worker, per job: the pipeline's preparation (the prompt's rewrite when
asked, its encoding, the inputs' VAE encoding, the latents), the first denoising step (2.1's prefill writes
the prefix cache there), the later steps, and the end (the VAE decode, the pictures, the features' finishing
work).

A per-job part of the runner (imgedit.runtime.runner.Call), entered before the others (their own work in a
job, such as a prefix cache locking CPU memory, is the job's time): it marks the job's start, the first call
of any of the worker's transformers (a forward pre-hook on each, installed once: Turbo's and the fast copies'
included), every step's end (after the step hooks: `Call.step_marks`) and the job's end. On a GPU the marks
are CUDA events on the stream of the latents' GPU, read once the result is on the CPU: the marks never make
the CPU wait for the GPU, so the job runs as fast as without them. The phases (seconds) go back with the
result (`EditResult.timings`); the server adds its own (the queue, the upload, the reply) and sums them in
/metrics (`imgedit_request_phase_seconds`).

On a GPU a job that made PyTorch's allocator free its cache to find room (it waits for the whole GPU to do so:
copies and compute stop overlapping) says so in the log: a memory cap with too little room shows there.

A job during which torch.compile compiled a graph (dynamo's count in this process: a shape, a prompt length
or a variant the warm-up did not cover) says how many in the log, however it ended, and a finished job's count
goes back with its result (`EditResult.compiled_graphs`; /metrics sums it in `imgedit_compiled_graphs_total`).
0 after the warm-up is the aim; the known exception is a first job of two images a prompt on the edit models
(docs/BENCHMARKS.md, Known limits). Counted per process: a group's result carries its first rank's count (the
other ranks log their own), and an item paused for an edit its last run's. A frame past dynamo's recompile
limit runs eagerly without compiling, so it is not counted.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

import torch

from imgedit.model import internals

log = logging.getLogger(__name__)

WARMUP = "warmup"  # the source of the warm-up's own jobs (imgedit.runtime.warmup)


def _waits(cuda: bool) -> tuple[int, int]:
    """(failed allocations retried after freeing the cache, the allocator's syncs of the whole GPU) so far."""
    if not cuda:
        return 0, 0
    try:  # a log line's numbers: never a job's failure. Every visible GPU: a split spans several.
        stats = [torch.cuda.memory_stats(d) for d in range(torch.cuda.device_count())]
    except RuntimeError as exc:
        log.debug("allocator statistics unread: %s", exc)
        return 0, 0
    return (sum(int(s.get("num_alloc_retries", 0)) for s in stats),
            sum(int(s.get("num_sync_all_streams", 0)) for s in stats))


class _Clock:
    def __init__(self, cuda: bool, device: str | None = None):
        self.cuda = cuda
        # the latents' GPU, not the process's current one (cuda:0): `balanced` may put the transformer on
        # cuda:1, where events on cuda:0's idle stream would complete at once and time nothing
        self.device = torch.device(device) if cuda and device is not None else None
        self.marks: dict[str, object] = {}
        self.steps: list[object] = []

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def mark(self, name: str) -> None:
        self.marks.setdefault(name, self.now())

    def step(self) -> None:
        self.steps.append(self.now())

    def between(self, a, b) -> float:
        if not self.cuda:
            return b - a
        return a.elapsed_time(b) / 1000

    def phases(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        start, end = self.marks["start"], self.marks["end"]
        first = self.marks.get("first_call")
        if first is None or not self.steps:  # no denoising step ran (a rewrite alone)
            return {"prepare": self.between(start, end)}
        out = {"prepare": self.between(start, first), "first_step": self.between(first, self.steps[0]),
               "finish": self.between(self.steps[-1], end)}
        if len(self.steps) > 1:
            out["later_steps"] = self.between(self.steps[0], self.steps[-1])
        return {name: round(max(seconds, 0.0), 4) for name, seconds in out.items()}


class TimeBudget:
    def __init__(self, transformers, cuda: bool, device: str | None = None):
        self.cuda = cuda
        self.device = device
        self.clock: _Clock | None = None
        for transformer in transformers:
            transformer.register_forward_pre_hook(self._called)

    def _called(self, module, args) -> None:
        if self.clock is not None:
            self.clock.mark("first_call")

    @contextmanager
    def job(self, call):
        self.clock = clock = _Clock(self.cuda and torch.cuda.is_available(), self.device)
        waits = _waits(clock.cuda)
        graphs = internals.graphs_compiled()
        clock.mark("start")
        call.step_marks.append(clock.step)  # after the step hooks: a step's own work (a mask's blend) is its
        try:
            yield
            clock.mark("end")
            call.timings.update(clock.phases())
            retries, syncs = (now - before for now, before in zip(_waits(clock.cuda), waits, strict=True))
            if retries or syncs:
                log.info("%s: the GPU allocator freed its cache to find room: %d allocation(s) retried, %d "
                         "wait(s) for the whole GPU", call.job.request_id, retries, syncs)
        finally:
            self.clock = None
            _count_compiles(call, internals.graphs_compiled() - graphs)  # however the job ended


def _count_compiles(call, graphs: int) -> None:
    call.compiled_graphs = graphs
    if not graphs:
        return
    # the warm-up is there to compile
    level = logging.DEBUG if call.job.request.source == WARMUP else logging.WARNING
    log.log(level, "%s: torch.compile compiled %d graph(s) during the job (a shape or variant the warm-up "
            "did not cover; its seconds are in this job's time)", call.job.request_id, graphs)
