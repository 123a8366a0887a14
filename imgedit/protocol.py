"""The typed requests, results and statuses both sides speak: what a user asks for (`EditRequest`),
the exact parameters the pipeline gets (`Resolved`), what comes back (`EditResult`) and what the
manager and its workers report. Below the server and the worker side alike; imports no torch.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field, fields
from enum import Enum

from PIL import Image


def new_request_id() -> str:
    """Unguessable: a REST edit's id fetches its result from /v1/jobs/<id> (for its owner)."""
    return "req_" + secrets.token_urlsafe(12)


# ---- an edit's parameters, declared once ----
# Where a parameter is taken: the page and the gradio `/edit` API ("edit"), OpenAI-style REST
# (/v1/images/edits: "rest"), the jobs API (/v1/jobs: "jobs"), the page's Batch tab and gradio `/batch`
# ("batch": every item of a batch runs with them). REST and the jobs API parse their form fields from this
# table (imgedit.web.rest_requests.form_fields), `/edit`'s and `/batch`'s parameters and the page's controls
# follow its order (imgedit.web.requests), and docs/PARAMETERS.md is generated from it
# (tests/test_parameters.py).
EDIT, REST, JOBS, BATCH = "edit", "rest", "jobs", "batch"
EVERYWHERE = frozenset((EDIT, REST, JOBS, BATCH))
SINGLE = frozenset((EDIT, REST, JOBS))  # an edit's own: not the Batch tab's (its files, no mask, no rewrite)


@dataclass(frozen=True)
class Param:
    """One parameter as callers send it. `kind`: text, whole, number, flag, size (REST's WxH) or file.
    `field`: the EditRequest field it fills ("" = its own name; None = none: a caller's switch that shapes
    other fields, such as randomize_seed). `rest`: the form field's name over REST and /v1/jobs where
    OpenAI names it otherwise. `png`: recorded in each result PNG's settings under the parameter's name;
    `restore`: the page's "Restore the settings saved in this PNG" puts it back into the form.

    `low`/`high`: the bounds a value must keep (inclusive; `low_open`: above `low`). `high` may name a
    Settings attribute (e.g. "max_steps", shown as MAX_STEPS) where the server's settings set it. The
    checks (imgedit.engine.validation.check_range), the page's sliders and docs/PARAMETERS.md all read them
    here; `unit` follows the range in messages ("0 to 256 pixels"), `why` explains a bound where a user
    would ask.

    A parameter that is not an EditRequest attribute travels in `EditRequest.options` (by name), from every
    entry point to the worker: adding one is its Param here and the worker code that reads it."""

    name: str
    kind: str
    help: str
    takes: frozenset = EVERYWHERE
    default: object = None
    rest: str = ""
    field: str | None = ""
    required: bool = False
    png: bool = False
    restore: bool = False
    api_default: object = ...  # the gradio `/edit` signature's default where it is not `default`
    low: float | None = None
    high: float | str | None = None
    low_open: bool = False
    unit: str = ""
    why: str = ""

    @property
    def edit_default(self) -> object:
        return self.default if self.api_default is ... else self.api_default

    @property
    def form_name(self) -> str:
        return self.rest or self.name

    @property
    def request_field(self) -> str | None:
        return self.name if self.field == "" else self.field

    def bounds(self, settings=None) -> tuple[float | None, float | str | None]:
        """(low, high) with a settings-named `high` read from `settings`; without settings it stays the
        variable's name (MAX_STEPS), as the docs show it."""
        high = self.high
        if isinstance(high, str):
            high = high.upper() if settings is None else getattr(settings, high)
        return self.low, high

    def range_text(self, settings=None) -> str:
        """The bounds in words: "2 to 100", "above 0, at most 1", "0 to 256 pixels"; "" when unbounded."""
        low, high = self.bounds(settings)
        if low is None and high is None:
            return ""
        if self.low_open:
            text = f"above {_number(low)}, at most {_number(high)}"
        else:
            text = f"{_number(low)} to {_number(high)}"
        return f"{text} {self.unit}".rstrip()


def _number(value) -> str:
    """A bound as people write it: 20 not 20.0, 4294967295 not 4.29e+09."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def param(name: str) -> Param:
    """The declared parameter called `name` (the declaration as it is now)."""
    for p in PARAMETERS:
        if p.name == name:
            return p
    raise KeyError(name)


PARAMETERS: tuple[Param, ...] = (
    Param("images", "file", "the image(s) to edit: 1 for Qwen-Image-Edit, 1-3 for 2509/2511, 0-10 for "
          "Qwen-Image-2.1 (none: an image from the prompt alone)", rest="image",
          takes=SINGLE, required=True),
    Param("prompt", "text", "what to change, in words (up to 4,000 characters and 1,024 tokens)", default="",
          required=True, png=True, restore=True),
    Param("negative_prompt", "text", "what to avoid (true CFG)", default="", png=True, restore=True),
    Param("seed", "whole", "the noise the edit starts from; absent: a random one, returned with the result",
          png=True, restore=True, api_default=0, low=0, high=2**32 - 1),
    Param("randomize_seed", "flag", "ignore `seed` and draw one", takes=frozenset((EDIT, BATCH)),
          default=False, field=None, api_default=True),
    Param("num_inference_steps", "whole", "denoising steps; absent: the model's", png=True, restore=True,
          low=2, high="max_steps"),
    Param("true_cfg_scale", "number", "how strongly the prompt is followed (1 turns CFG off); absent: "
          "DEFAULT_TRUE_CFG (Qwen-Image-2.1: 1)", png=True, restore=True,
          low=1, high=20, why="1 turns CFG off"),
    Param("num_images", "whole", "images per prompt", default=1, rest="n",
          low=1, high="max_images_per_prompt"),
    Param("width", "whole", "output width; 0 or absent: from the last input's aspect, about 1 megapixel",
          takes=frozenset((EDIT, BATCH)), png=True, restore=True, api_default=0),
    Param("height", "whole", "output height; 0 or absent: as width", takes=frozenset((EDIT, BATCH)), png=True,
          restore=True, api_default=0),
    Param("size", "size", "`auto` or WIDTHxHEIGHT (OpenAI's name for width and height)",
          takes=frozenset((REST, JOBS)), field=None),
    Param("speed", "text", "quality, fast (Lightning 8 steps) or fastest (4 steps), where offered", png=True,
          api_default="quality"),
    Param("lora", "text", "a configured LoRA's name, or none", png=True, api_default="none"),
    Param("lora_scale", "number", "that LoRA's strength; absent: 1", png=True, api_default=1.0,
          low=0, high=2),
    Param("mask", "file", "where to edit: white (or OpenAI's transparent) = edit; the first image's size "
          "(one mask for every item of a job)", takes=SINGLE, png=True),
    Param("mask_grow", "whole", "pixels the mask is grown by; absent: 0", takes=SINGLE, png=True, low=0,
          high=256, unit="pixels"),
    Param("mask_feather", "whole", "pixels of soft edge inside the mask; absent: 8", takes=SINGLE, png=True,
          low=0, high=256, unit="pixels"),
    Param("strength", "number", "how far the masked area may move from the input; absent: 1", takes=SINGLE,
          png=True, low=0, high=1, low_open=True, why="1 = repaint the masked area from scratch"),
    Param("enhance_prompt", "flag", "rewrite the prompt with the model's own text encoder first",
          takes=SINGLE, default=False),
    Param("cache", "text", "step cache for quality edits: none, first-block or taylorseer, where offered",
          png=True, restore=True),
)


def parameters(entry: str | None = None) -> tuple[Param, ...]:
    """The parameters one entry point takes (all of them: None), in the declaration's order. Read at each
    call: nothing keeps a copy of the declaration from import time."""
    return tuple(p for p in PARAMETERS if entry is None or entry in p.takes)


def request_kwargs(values: dict) -> dict:
    """{EditRequest field or declared parameter name: value} as EditRequest's keyword arguments: a name that
    is not one of its attributes goes into `options`."""
    attributes = {f.name for f in fields(EditRequest)}
    kwargs = {k: v for k, v in values.items() if k in attributes}
    if options := {k: v for k, v in values.items() if k not in attributes}:
        kwargs["options"] = {**kwargs.get("options", {}), **options}
    return kwargs


@dataclass(frozen=True)
class EditRequest:
    """One edit as the user asked for it. None means "the model's default"."""

    images: tuple[Image.Image, ...]
    prompt: str
    negative_prompt: str = ""
    seed: int | None = None
    num_inference_steps: int | None = None
    true_cfg_scale: float | None = None
    num_images: int = 1
    width: int | None = None
    height: int | None = None
    # quality | fast (Lightning 8 steps) | fastest (Lightning 4 steps); None = quality
    speed: str | None = None
    lora: str | None = None  # a configured LoRA's name; None or "none" = no LoRA
    lora_scale: float | None = None  # that LoRA's strength, 0 to 2; None = 1
    # Masked editing (imgedit.engine.masks): "L", the first image's size, 255 = may change; None = whole image
    mask: Image.Image | None = None
    mask_grow: int | None = None  # pixels the mask is grown by; None = 0
    mask_feather: int | None = None  # pixels of soft edge inside the mask; None = masks.DEFAULT_FEATHER
    strength: float | None = None  # (0, 1]: how far from the input the masked area may go; None = 1
    cache: str | None = None  # step cache for a quality edit: none | first-block | taylorseer; None = CACHE
    # rewrite the prompt with the model's text encoder first (imgedit.runtime.enhance)
    enhance_prompt: bool = False
    request_id: str = field(default_factory=new_request_id)
    source: str = "ui"  # ui | api | rest: for logs and metrics
    client: str | None = None  # who asked (imgedit.web.identity's owner): for each client's share of the line
    # declared parameters (PARAMETERS) without an attribute of their own, by name: request_kwargs() puts them
    # here
    options: dict = field(default_factory=dict)

    def value(self, name: str, default=None):
        """A declared parameter's value as asked for: its attribute, or its entry in `options`."""
        if name in self.options:
            return self.options[name]
        return getattr(self, name, default)


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


@dataclass(frozen=True)
class JobRecord:
    """What the manager reports after each job (metrics, logs)."""

    request_id: str
    source: str
    outcome: str  # ok | cancelled | invalid_input | out_of_memory | worker_failed | busy | error
    seconds: float
    steps: int
    worker: str | None
    task: str = "edit"  # edit | enhance (a prompt rewrite alone)


class WorkerState(str, Enum):
    """Where a worker is in its life. Written only by its handle (imgedit.engine.pool: its pump thread as the
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


@dataclass(frozen=True)
class WorkerStatus:
    name: str
    devices: tuple[str, ...]
    placement: dict[str, str]
    state: WorkerState
    job_id: str | None
    step: int
    total_steps: int
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
    job_client: str | None = None  # who asked for the running job (imgedit.web.identity's owner); never shown

    def __post_init__(self):
        object.__setattr__(self, "state", WorkerState(self.state))  # "busy" given as text is the member


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


@dataclass(frozen=True)
class Resolved:
    """The exact parameters the pipeline gets."""

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
    task: str = "edit"  # edit | enhance (rewrite the prompt only: no image is made)
    enhance_tokens: int = 0  # > 0: rewrite the prompt first, with at most this many new tokens
    cache: str = "none"  # none | first-block | taylorseer (imgedit.runtime.step_cache)
    cache_threshold: float = 0.0  # first-block's threshold

    @property
    def image_seeds(self) -> tuple[int, ...]:
        """Each output image's own seed: image i is drawn from seed + i (wrapping at 2**32), so an edit
        asked with that seed and one image repeats exactly image i, and each PNG records its own seed."""
        return tuple((self.seed + i) % 2**32 for i in range(self.num_images))
