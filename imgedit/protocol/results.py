"""What a request becomes and what comes back: the exact parameters the pipeline gets (`Resolved`), the
result (`EditResult`), the manager's record of a job, and the status the manager and its workers report."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from PIL import Image

from imgedit.protocol.states import WorkerState


@dataclass(frozen=True)
class EditResult:
    images: list[Image.Image]
    seed: int
    steps: int
    width: int
    height: int
    seconds: float
    worker: str
    devices: tuple[str, ...]
    request_id: str
    prompt: str | None = None  # the rewritten prompt the edit used (enhance_prompt); None: the user's own
    notice: str | None = None  # why an asked-for rewrite was not used (the user's prompt was)
    # the lossy copy a fast job ran on (FAST_QUANTIZE: fp8 | int8); None: the model's own
    weights: str | None = None
    # seconds of each phase in the worker (imgedit.runtime.budget): prepare, first_step, later_steps, finish
    timings: dict = field(default_factory=dict)
    # mask_prompt's outline (imgedit.runtime.grounding): the mask it made ("L", the first image's size) and
    # its boxes (x1, y1, x2, y2 in the first image's pixels); an outline alone returns only these
    mask: Image.Image | None = None
    boxes: tuple[tuple[int, int, int, int], ...] = ()
    # graphs torch.compile compiled while the job ran (imgedit.runtime.budget): after the warm-up each one is
    # a recompile the warm-up did not cover, seconds of this job; 0 is the aim
    compiled_graphs: int = 0

    @property
    def num_images(self) -> int:
        """The images made (the request's `num_images` as the edit ran: History keeps this one)."""
        return len(self.images)


@dataclass(frozen=True)
class JobRecord:
    """What the manager reports after each job (metrics, logs)."""

    request_id: str
    source: str
    outcome: str  # ok | cancelled | invalid_input | out_of_memory | worker_failed | busy | error
    seconds: float
    steps: int
    worker: str | None
    task: str = "edit"  # edit | enhance (a prompt rewrite alone) | outline (a mask_prompt's mask alone)
    # seconds of each phase: the queue, and the worker's (EditResult.timings); /metrics sums them
    timings: dict = field(default_factory=dict)
    pauses: int = 0  # an item of a job: the times it paused for an edit someone waits on (PREEMPT_ITEMS)
    compiled_graphs: int = 0  # graphs torch.compile compiled while it ran (EditResult.compiled_graphs)


@dataclass(frozen=True)
class Progress:
    """How far a running job is: `step` of its `steps` (0 of N before its first step; 0 of 0 while queued or
    idle). Shown under the request field's name, as the job asked for it: `view()` is the one place that names
    it for /health's workers and /v1/jobs' items, `read()` reads it back, `text()` is how the page and the
    logs say it."""

    step: int = 0
    steps: int = 0

    def view(self) -> dict[str, int]:
        return {"step": self.step, "num_inference_steps": self.steps}

    @classmethod
    def read(cls, view: Mapping) -> Progress:
        """From a view (a worker's status as /health gives it, a job's item as stored); an item stored before
        the count took the request field's name carries it as `total_steps`."""
        steps = view.get("num_inference_steps", view.get("total_steps"))
        return cls(int(view.get("step") or 0), int(steps or 0))

    @classmethod
    def upgraded(cls, view: dict) -> dict:
        """A stored view with today's keys (`total_steps` read back under the request field's name)."""
        return {**{k: v for k, v in view.items() if k != "total_steps"}, **cls.read(view).view()}

    @property
    def fraction(self) -> float:
        return min(self.step, self.steps) / max(1, self.steps)

    def text(self, before: str = "preparing") -> str:
        """"step 3/40", or `before` until the first step."""
        return f"step {min(self.step, self.steps)}/{self.steps}" if self.step else before


@dataclass(frozen=True)
class WorkerStatus:
    name: str
    devices: tuple[str, ...]
    placement: dict[str, str]
    state: WorkerState
    job_id: str | None
    step: int  # the running job's Progress (0 of 0 when idle): its view's two keys
    num_inference_steps: int
    jobs_done: int
    error: str | None
    parallel: str = "none"  # none | cfg | ulysses
    ranks: int = 1
    pids: tuple[int, ...] = ()
    restarts: int = 0
    compiled: bool = False
    encode_cache: int = 0  # ENCODE_CACHE as the worker installed it (0 = off; imgedit.runtime.encode_cache)
    attention: str = ""  # the attention kernel the worker's transformer runs (read back after loading)
    detail: str | None = None  # what a loading worker is doing (loading weights, compiling, ...)
    node: str | None = None  # WORKERS=ray: the id of the Ray node its actors run on
    # per component: dtype, quantization, location (imgedit.runtime.offload.describe)
    components: dict | None = None
    # per GPU, measured by its ranks after loading
    weights_mib: dict[str, float] = field(default_factory=dict)
    fast_weights: str = ""  # FAST_QUANTIZE as the worker built it: none, or the mode and its copies
    turbo: str = ""  # TURBO_MODEL_DIR's transformer as the worker loaded it (speed=fast/fastest); "" = none
    cpu_threads: int = 0  # PyTorch's CPU threads in the worker's processes (WORKER_THREADS)
    # optimisations that failed to build and what the worker runs instead ("compile failed → eager: ...")
    fallbacks: tuple[str, ...] = ()
    # what a job gives up where MAX_MEMORY leaves no room (imgedit.runtime.worker)
    under_cap: tuple[str, ...] = ()
    features: tuple[str, ...] = ()  # the optimisations and modes it installed (imgedit.runtime.features)
    phases: dict[str, float] = field(default_factory=dict)  # seconds of each start-up phase (runtime.phases)
    job_client: str | None = None  # who asked for the running job (imgedit.web.identity's owner); never shown

    def __post_init__(self):
        object.__setattr__(self, "state", WorkerState(self.state))  # "busy" given as text is the member

    @property
    def progress(self) -> Progress:
        return Progress(self.step, self.num_inference_steps)


@dataclass(frozen=True)
class ManagerStatus:
    ready: bool
    model: str
    family: str
    mode: str
    reason: str
    waiting: int
    workers: tuple[WorkerStatus, ...]
    error: str | None = None
    loras: tuple[dict, ...] = ()  # the LoRAs every worker loaded: name, lightning_steps, rank, layers, file
    weights_mib: dict[str, float] = field(default_factory=dict)  # per GPU, as planned (the placement's sizes)
    cache: str = "none"  # CACHE: the step cache quality edits get unless they ask otherwise
    attention: str = "native"  # ATTENTION: the transformer's attention kernel
    compile_mode: str = "off"  # COMPILE_MODE of the compiled workers, or off when none is compiled
    fast_quantize: str = "none"  # FAST_QUANTIZE: fast jobs on a quantized copy per Lightning LoRA
    # the model family's defaults and what it takes (engine.manager.defaults): steps, CFG, images, text to
    # image
    defaults: dict = field(default_factory=dict)

    @property
    def healthy_workers(self) -> int:
        return sum(w.state.serving for w in self.workers)


@dataclass(frozen=True, kw_only=True)
class Resolved:
    """The exact parameters the pipeline gets (by name: twelve of them read alike in a row of values)."""

    steps: int
    true_cfg_scale: float
    negative_prompt: str
    seed: int
    num_images: int
    width: int | None
    height: int | None
    adapters: tuple[tuple[str, float], ...] = ()  # (LoRA name, strength) active for this job
    # default | lightning (imgedit.config.loras.LIGHTNING_SCHEDULER) | turbo (TURBO_MODEL_DIR's transformer
    # and schedule: imgedit.runtime.turbo)
    scheduler: str = "default"
    # With a mask: the model runs at width x height, the result is the first image's size
    mask_grow: int = 0
    mask_feather: int = 0
    strength: float = 1.0
    # edit | enhance (rewrite the prompt only: no image is made) | outline (mask_prompt's mask only)
    task: str = "edit"
    enhance_tokens: int = 0  # > 0: rewrite the prompt first, with at most this many new tokens
    outline_tokens: int = 0  # > 0: outline mask_prompt as the mask first, with at most this many new tokens
    cache: str = "none"  # none | first-block | taylorseer (imgedit.runtime.step_cache)
    cache_threshold: float = 0.0  # first-block's threshold

    @property
    def image_seeds(self) -> tuple[int, ...]:
        """Each output image's own seed: image i is drawn from seed + i (wrapping at 2**32), so an edit
        asked with that seed and one image repeats exactly image i, and each PNG records its own seed."""
        return tuple((self.seed + i) % 2**32 for i in range(self.num_images))
