"""Prometheus metrics: counted from the manager's job records, the rest read live at scrape time."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from imgedit.engine.interface import Engine
from imgedit.engine.workers.gpus import GpuMonitor
from imgedit.protocol import JobRecord

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class _Live:
    """Gauges that are read when scraped: queue, workers, GPU memory, last steps/s."""

    def __init__(self, manager: Engine, monitor: GpuMonitor, gradio_queue_size: Callable[[], int],
                 metrics: Metrics):
        self.manager, self.monitor = manager, monitor
        self.gradio_queue_size, self.metrics = gradio_queue_size, metrics

    def collect(self):
        status = self.manager.status()
        queue = GaugeMetricFamily("imgedit_queue_length", "Jobs waiting for a GPU worker (UI, API and REST)")
        queue.add_metric([], status.waiting + self.gradio_queue_size())
        yield queue
        healthy = GaugeMetricFamily("imgedit_workers_healthy", "Workers loaded and in service")
        healthy.add_metric([], status.healthy_workers)
        yield healthy
        total = GaugeMetricFamily("imgedit_workers", "Workers in the placement plan")
        total.add_metric([], len(status.workers))
        yield total
        rate = GaugeMetricFamily("imgedit_steps_per_second",
                                 "Denoising steps per second of the last finished job")
        rate.add_metric([], self.metrics.last_steps_per_second)
        yield rate
        used = GaugeMetricFamily("imgedit_gpu_memory_used_bytes", "GPU memory in use (all processes)",
                                 labels=["gpu"])
        cap = GaugeMetricFamily("imgedit_gpu_memory_total_bytes", "GPU memory in all", labels=["gpu"])
        for g in self.monitor.read():
            used.add_metric([str(g.index)], g.used_mib * 1024**2)
            cap.add_metric([str(g.index)], g.total_mib * 1024**2)
        yield used
        yield cap


class Metrics:
    def __init__(self, manager: Engine, monitor: GpuMonitor,
                 gradio_queue_size: Callable[[], int] = lambda: 0):
        self.registry = CollectorRegistry()
        self.requests = Counter("imgedit_requests", "Edit requests by source and outcome",
                                ["source", "outcome"], registry=self.registry)
        self.job_seconds = Histogram("imgedit_job_seconds", "Seconds from request to result (or error)",
                                     buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600),
                                     registry=self.registry)
        self.rewrites = Counter("imgedit_prompt_rewrites",
                                "Prompt rewrites alone (Enhance, /v1/prompts/enhance) by source and outcome; "
                                "edits with enhance_prompt count as edits",
                                ["source", "outcome"], registry=self.registry)
        self.outlines = Counter("imgedit_mask_outlines",
                                "mask_prompt outlines alone (Select, /select_mask, /v1/masks) by source and "
                                "outcome; edits with mask_prompt count as edits",
                                ["source", "outcome"], registry=self.registry)
        # where a request's time goes (imgedit.runtime.budget, the line, REST's upload and reply): one
        # series a phase, so that sum/count per phase is its mean and the buckets its spread
        self.phases = Histogram("imgedit_request_phase_seconds",
                                "Seconds of each phase of a finished edit: upload (REST: reading and "
                                "decoding the files), queue, prepare (encodes), first_step, later_steps, "
                                "finish (VAE decode, pictures), reply (REST: encoding the images)", ["phase"],
                                buckets=PHASE_BUCKETS, registry=self.registry)
        self.pauses = Counter("imgedit_item_pauses",
                              "Times an item of a job (/v1/jobs, the Batch tab) paused at a step for an edit "
                              "someone waits on (PREEMPT_ITEMS), counted when it ends",
                              registry=self.registry)
        self.compiled = Counter(
            "imgedit_compiled_graphs", "Graphs torch.compile compiled while finished edits ran: after the "
            "warm-up each one is a recompile it did not cover, seconds of that edit (0 is the aim)",
            registry=self.registry)
        self.last_steps_per_second = 0.0
        self.registry.register(_Live(manager, monitor, gradio_queue_size, self))
        manager.listeners.append(self.record)

    def record(self, job: JobRecord) -> None:
        if job.task != "edit":
            self._counter(job.task).labels(job.source, job.outcome).inc()
            return
        self.requests.labels(job.source, job.outcome).inc()
        if job.pauses:
            self.pauses.inc(job.pauses)
        if job.compiled_graphs:
            self.compiled.inc(job.compiled_graphs)
        if job.outcome in ("ok", "cancelled", "out_of_memory", "worker_failed"):
            self.job_seconds.observe(job.seconds)
        # a paused item's phases are its last run's, and its seconds include the pause: left out
        if job.outcome == "ok" and job.seconds > 0 and not job.pauses:
            self.last_steps_per_second = job.steps / job.seconds
            for phase, seconds in job.timings.items():
                self.phases.labels(phase).observe(seconds)

    def observe_phase(self, phase: str, seconds: float) -> None:
        """A phase the edge measures itself (REST's upload and reply)."""
        self.phases.labels(phase).observe(seconds)

    def record_rejected(self, source: str, outcome: str, task: str = "edit") -> None:
        """A request refused before it reached the manager (bad input at the edge)."""
        self._counter(task).labels(source, outcome).inc()

    def _counter(self, task: str) -> Counter:
        """The counter of a task's requests: edits, prompt rewrites alone, outlines alone."""
        return {"enhance": self.rewrites, "outline": self.outlines}.get(task, self.requests)

    def render(self) -> bytes:
        return generate_latest(self.registry)
