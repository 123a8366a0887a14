"""What crosses the process boundary between the server and its worker processes: small typed,
picklable messages. Torch-free: the server imports this without touching a GPU.

server -> every rank of a worker (its own inbox pipe): WorkerSpec at spawn, then Job, Cancel, Pause, Stop.
rank -> server (its own outbox pipe): Ready / LoadFailed once, then Step, Done, Failed or Paused per job.
Only rank 0 reports steps and results; any rank may report a failure.
server -> a standby process (started before the plan was known): Assignment, which makes it a rank, or
Stop; a standby -> server: StandbyUnfit when it cannot serve (then it exits).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

from imgedit.config.loras import LoraFile
from imgedit.planning.checkpoint import Checkpoint
from imgedit.planning.plan import WorkerPlan
from imgedit.planning.turbo import TurboCheckpoint
from imgedit.protocol import EditRequest, EditResult, Resolved


class Channel:
    """One direction of a multiprocessing Pipe. `put` pickles and writes in the calling thread: with
    multiprocessing.Queue a feeder thread does it, and a worker that goes straight on to heavy Python
    work (gc after a job, kernel launches) starves that thread of the GIL and delays its messages
    (measured: ~0.45 s per result on the GPU machine). A lock serialises senders in several threads."""

    def __init__(self, conn):
        self.conn = conn
        self._lock = threading.Lock()

    def put(self, message) -> None:
        with self._lock:
            self.conn.send(message)

    def get(self, timeout: float | None = None):
        if timeout is not None and not self.conn.poll(timeout):
            raise queue.Empty
        return self.conn.recv()

    def close(self) -> None:
        self.conn.close()


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank process needs to load and serve: its plan with devices numbered as the
    process sees them (CUDA_VISIBLE_DEVICES holds only its GPUs)."""

    name: str
    rank: int
    world: int
    parallel: str  # none | cfg | ulysses (imgedit.runtime.group)
    plan: WorkerPlan
    checkpoint: Checkpoint
    dtype: str
    compile: bool
    master_port: int = 0
    hook: str | None = None  # "module:function" called with (pipe, spec) after loading (tests inject faults)
    auto_cleanup: bool = True
    warmup_sizes: tuple[tuple[int, int], ...] = ()
    devices: tuple[str, ...] = ()  # the worker's GPUs as the server numbers them (for messages and results)
    memory_caps: tuple[int, ...] = ()  # MAX_MEMORY for each GPU this rank sees (cuda:0, cuda:1, ...), bytes
    # ranks splitting each forward's sequence (the half of a cfg group, or all of a ulysses one)
    ulysses: int = 1
    pair_ulysses: bool = False  # PAIR_ULYSSES: a CFG pair splits CFG-off jobs' sequences over both ranks
    encode_cache: int = 0  # ENCODE_CACHE: input encodings this rank keeps (imgedit.runtime.encode_cache)
    attention: str = "native"  # ATTENTION (imgedit.runtime.offload.ATTENTION_BACKENDS)
    compile_mode: str = "default"  # COMPILE_MODE, when `compile`
    # checked at start-up (imgedit.config.loras.check_all); every rank loads them all
    loras: tuple[LoraFile, ...] = ()
    fuse_lora: str = "off"  # FUSE_LORA as this plan allows it: auto | off (imgedit.runtime.fusion)
    activation_reserve: int = 0  # ACTIVATION_RESERVE: what a fused LoRA's copy of the weights must leave free
    fast_quantize: str = "none"  # FAST_QUANTIZE: Lightning LoRAs' quantized copies (runtime.fast_weights)
    fast_steps: tuple[int, ...] = (4, 8)  # FAST_QUANTIZE_SPEEDS as Lightning step counts
    cpu_threads: int = 0  # WORKER_THREADS (planning.modes.worker_threads); 0 = PyTorch's default
    copy_threads: int = 0  # while the streamed weights are copied (planning.modes.copy_threads); 0 = as above
    turbo: TurboCheckpoint | None = None  # TURBO_MODEL_DIR, checked: speed=fast/fastest's transformer


@dataclass(frozen=True)
class Assignment:
    """A standby process made a rank (imgedit.runtime.standby): what a process started for the rank is
    given (engine.workers.processes), the server's environment as of now included."""

    environ: dict[str, str]
    spec: WorkerSpec
    visible_devices: str | None  # the rank's CUDA_VISIBLE_DEVICES
    cache_dir: str | None  # COMPILE_CACHE_DIR
    log_level: str


@dataclass(frozen=True)
class StandbyUnfit:
    """A standby process that cannot serve (an import failed): it exits, and its rank, if it was given one,
    starts in a fresh process."""

    pid: int
    reason: str


@dataclass(frozen=True)
class Resume:
    """Where a paused job stopped (imgedit.runtime.pause): the steps done and the latents after the last of
    them, as bytes (the server never holds a tensor), to go on from there on any worker of the model."""

    step: int
    latents: bytes
    shape: tuple[int, ...]
    dtype: str  # torch's name without "torch.", e.g. "bfloat16"


@dataclass(frozen=True)
class Job:
    request: EditRequest
    params: Resolved
    family: str
    resume: Resume | None = None  # a paused job's state: the pipeline goes on from its step

    @property
    def request_id(self) -> str:
        return self.request.request_id


def may_pause(job: Job) -> bool:
    """Whether the job itself lets it pause and go on later (imgedit.runtime.pause): an item of a job, an
    image edit, with nothing that counts its steps from the start (a mask's blend, a step cache), nothing run
    before the steps that would run again (a rewrite, a mask_prompt outline) and not Turbo's own schedule. The
    server asks only such items; the worker also checks its schedule and that one rank runs the job alone."""
    req, params = job.request, job.params
    return (req.background and params.task == "edit" and req.mask is None and params.cache == "none"
            and not params.enhance_tokens and not params.outline_tokens and params.scheduler != "turbo")


@dataclass(frozen=True)
class Cancel:
    request_id: str


@dataclass(frozen=True)
class Pause:
    """Stop this job at its next step's end, if it can go on later (runtime.pause.pausable), and send Paused;
    a job that cannot pause runs on."""

    request_id: str


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Ready:
    rank: int
    pid: int
    seconds: float
    report: StartupReport = field(default_factory=lambda: StartupReport())  # modes, sizes, warm-up times


@dataclass(slots=True)
class StartupReport:
    """What a rank reports once it has loaded (in `Ready`): the modes it runs, what it holds, what it took.
    Filled as the rank loads (runtime.worker, runtime.warmup); slots: a misspelt field is an error where it is
    written, not a key nobody reads."""

    compiled: bool = False  # COMPILE: its transformer(s) compiled and warmed up
    batch_cfg: bool = False  # BATCH_CFG: both CFG branches in one forward
    pair_ulysses: bool = False  # a CFG pair that splits CFG-off jobs' sequences (PAIR_ULYSSES)
    load_seconds: float = 0.0  # loading the weights, before any LoRA, copy or warm-up
    loras: list[str] = field(default_factory=list)  # the LoRAs loaded, by name
    # per component: dtype, quantization, where, bytes per device
    components: dict = field(default_factory=dict)
    fuse_lora: str = "off"  # FUSE_LORA as it runs
    fast_weights: str = "none"  # FAST_QUANTIZE's copies
    turbo: str = ""  # TURBO_MODEL_DIR's transformer, loaded beside the model's (planning.turbo.describe)
    # MiB per GPU after loading (this rank's numbering)
    weights_mib: dict[str, float] = field(default_factory=dict)
    encode_cache: int = 0  # ENCODE_CACHE entries
    cpu_threads: int = 0  # torch's threads in this rank
    pixels: str = "cpu"  # where the pictures' arithmetic runs (runtime.pixels)
    # optimisations that failed to build, and what runs instead
    fallbacks: list[str] = field(default_factory=list)
    # what a job gives up where MAX_MEMORY leaves it no room
    under_cap: list[str] = field(default_factory=list)
    attention: str = "native"  # the attention kernel as the processors have it
    warmup_seconds: list[float] = field(default_factory=list)  # each compile warm-up
    compile_seconds: float | None = None  # compiling and warming up, in all
    rewrite_warmup_seconds: float | None = None  # the prompt rewrite's warm-up
    first_job_seconds: float | None = None  # an uncompiled worker's warm-up job (features.FirstJob)
    phases: dict[str, float] = field(default_factory=dict)  # seconds of each start-up phase (runtime.phases)
    features: list[str] = field(default_factory=list)  # the features installed (runtime.features)
    memory_allocated_gib: float | None = None  # torch's allocations on this rank's first GPU after start-up
    memory_reserved_gib: float | None = None


@dataclass(frozen=True)
class Loading:
    """What a loading rank is doing now ("compiling: warm-up 2 of 5 (...)"), for /health and the page."""

    rank: int
    doing: str
    elapsed: float


@dataclass(frozen=True)
class LoadFailed:
    rank: int
    message: str


@dataclass(frozen=True)
class Step:
    request_id: str
    step: int
    total: int
    preview: bytes | None = None  # a watched job's newest preview, a small JPEG (imgedit.runtime.preview)


@dataclass(frozen=True)
class Done:
    request_id: str
    result: EditResult


@dataclass(frozen=True)
class Paused:
    """A job stopped at a step's end because Pause asked it to: resubmitted with `resume`, it ends as it
    would have without the pause (imgedit.runtime.pause says where only within rounding)."""

    request_id: str
    resume: Resume


@dataclass(frozen=True)
class Failed:
    """A job that ended without a result. `kind` is an ImgEditError kind; `message` is user-safe.
    `fatal`: the rank exits after sending this (the pool restarts the worker)."""

    request_id: str
    kind: str
    message: str
    rank: int = 0
    fatal: bool = False
    field: str | None = None  # the request parameter at fault (an InvalidInput's), when there is one
