"""The typed requests, results and statuses both sides speak: what a user asks for (`EditRequest`),
the exact parameters the pipeline gets (`Resolved`), what comes back (`EditResult`) and what the
manager and its workers report. Below the server and the worker side alike; imports no torch.
"""

from __future__ import annotations

import secrets
import typing
from dataclasses import MISSING, dataclass, field, fields, replace
from enum import Enum
from typing import Annotated, ClassVar

from PIL import Image
from pydantic import ConfigDict, ValidationError, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from imgedit.errors import InvalidInput


def new_request_id() -> str:
    """Unguessable: a REST edit's id fetches its result from /v1/jobs/<id> (for its owner)."""
    return "req_" + secrets.token_urlsafe(12)


# ---- an edit's parameters, declared once: EditRequest's fields (below) ----
# Where a parameter is taken: the page and the gradio `/edit` API ("edit"), OpenAI-style REST
# (/v1/images/edits: "rest"), the jobs API (/v1/jobs: "jobs"), the page's Batch tab and gradio `/batch`
# ("batch": every item of a batch runs with them). REST and the jobs API parse their form fields by the
# declaration (imgedit.web.api.rest_requests.form_fields), `/edit`'s and `/batch`'s parameters and the page's
# controls follow its order (imgedit.web.page.requests), and docs/PARAMETERS.md is generated from it
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

    Each is written once, as an EditRequest field's `declared(...)` (or a caller's switch there); a parameter
    that is not an EditRequest attribute travels in `EditRequest.options` (by name), from every entry point to
    the worker."""

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
    # "Copy as API call" (imgedit.web.page.snippets): `always`: written whatever the form says (the call then
    # repeats the edit), else only when set (not empty, not its default); `beside`: written only beside that
    # parameter (a LoRA's strength beside the LoRA, the mask's settings beside the mask); `unless`: left out
    # of a REST call where that switch is on (the seed where randomize_seed is ticked); `openai`: one of
    # OpenAI's own arguments (an SDK keyword), not an extension sent through `extra_body`.
    always: bool = False
    beside: str | None = None
    unless: str | None = None
    openai: bool = False

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


def declared(kind: str, help: str, **how) -> Param:
    """A request field's declaration, in its type (`Annotated[int | None, declared("whole", ...)]`): the name
    and the default are the field's own."""
    return Param("", kind, help, **how)


def declaration(request_type: type) -> tuple[Param, ...]:
    """The parameters a request type declares, in its fields' order: each field's `declared(...)` named and
    defaulted by the field, and the callers' switches (`ClassVar[Param]`: declared there, never carried)."""
    found = []
    own = {f.name: f for f in fields(request_type)}
    for name, hint in typing.get_type_hints(request_type, include_extras=True).items():
        if typing.get_origin(hint) is ClassVar:
            if isinstance(switch := getattr(request_type, name), Param):
                found.append(replace(switch, name=name))
            continue
        how = next((m for m in getattr(hint, "__metadata__", ()) if isinstance(m, Param)), None)
        if how is not None:
            default = own[name].default
            found.append(replace(how, name=name, default=how.default if default is MISSING else default))
    return tuple(found)


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


@typing.runtime_checkable
class Picture(typing.Protocol):
    """An input image: a PIL image, or one known by its header alone before it is decoded (Gradio's validator
    checks sizes only: imgedit.engine.images.peek_image). Jobs carry decoded PIL images."""

    size: tuple[int, int]


# A number as it was sent: 1 stays 1 (in messages and settings), 2.5 stays 2.5.
Number = int | float
# What a value of the wrong type is told, by pydantic's error type (the edges parse each field by its kind
# first; this is the manager's own API, where a caller may send anything).
_WRONG = {"int_from_float": "must be a whole number", "int_parsing": "must be a whole number",
          "int_type": "must be a whole number", "float_parsing": "must be a number",
          "float_type": "must be a number", "bool_parsing": "must be true or false",
          "bool_type": "must be true or false", "string_type": "must be text"}


@pydantic_dataclass(frozen=True, config=ConfigDict(arbitrary_types_allowed=True))
class EditRequest:
    """One edit as the user asked for it, and the declaration of every parameter a caller sends: each field's
    type, default and `declared(...)` (kind, help, bounds, unit, which entry points take it, PNG and restore,
    its REST name) are the one place it is written; `PARAMETERS` is read from here, in this order (it is
    `/edit`'s API's order). None means "the model's default". Pydantic checks each value's type when a
    request is made; the bounds, which may depend on the settings, are checked when it is resolved
    (imgedit.engine.validation)."""

    images: Annotated[tuple[Picture, ...], declared(
        "file", "the image(s) to edit: 1 for Qwen-Image-Edit, 1-3 for 2509/2511, 0-10 for Qwen-Image-2.1 "
        "(none: an image from the prompt alone)", rest="image", takes=SINGLE, required=True, openai=True)]
    prompt: Annotated[str, declared(
        "text", "what to change, in words (up to 4,000 characters and 1,024 tokens)", default="",
        required=True, png=True, restore=True, always=True, openai=True)]
    negative_prompt: Annotated[str, declared(
        "text", "what to avoid (true CFG)", png=True, restore=True, always=True)] = ""
    seed: Annotated[int | None, declared(
        "whole", "the noise the edit starts from; absent: a random one, returned with the result", png=True,
        restore=True, low=0, high=2**32 - 1, always=True, unless="randomize_seed")] = None
    randomize_seed: ClassVar[Param] = Param(  # a caller's switch: the edges draw the seed where it is on
        "randomize_seed", "flag", "ignore `seed` and draw one", takes=frozenset((EDIT, BATCH)), default=False,
        field=None, always=True)  # False: a seed given is the seed used (#62)
    num_inference_steps: Annotated[int | None, declared(
        "whole", "denoising steps; absent: the model's", png=True, restore=True, low=2, high="max_steps",
        always=True)] = None
    true_cfg_scale: Annotated[Number | None, declared(
        "number", "how strongly the prompt is followed (1 turns CFG off); absent: DEFAULT_TRUE_CFG "
        "(Qwen-Image-2.1: 1)", png=True, restore=True, low=1, high=20, why="1 turns CFG off",
        always=True)] = None
    num_images: Annotated[int, declared(
        "whole", "images per prompt", rest="n", low=1, high="max_images_per_prompt", always=True,
        openai=True)] = 1
    width: Annotated[int | None, declared(
        "whole", "output width; 0 or absent: from the last input's aspect, about 1 megapixel",
        takes=frozenset((EDIT, BATCH)), png=True, restore=True, api_default=0, always=True)] = None
    height: Annotated[int | None, declared(
        "whole", "output height; 0 or absent: as width", takes=frozenset((EDIT, BATCH)), png=True,
        restore=True, api_default=0, always=True)] = None
    size: ClassVar[Param] = Param(  # OpenAI's name for width and height: REST parses it into them
        "size", "size", "`auto` or WIDTHxHEIGHT (OpenAI's name for width and height)",
        takes=frozenset((REST, JOBS)), field=None, openai=True)
    speed: Annotated[str | None, declared(  # None = quality
        "text", "quality, fast (Lightning 8 steps) or fastest (4 steps), where offered", png=True,
        api_default="quality")] = None
    lora: Annotated[str | None, declared(  # None or "none" = no LoRA
        "text", "a configured LoRA's name, or none", png=True, api_default="none")] = None
    lora_scale: Annotated[Number | None, declared(  # None = 1
        "number", "that LoRA's strength; absent: 1", png=True, api_default=1.0, low=0, high=2,
        beside="lora")] = None
    # Masked editing (imgedit.engine.masks): "L", the first image's size, 255 = may change; None = whole image
    mask: Annotated[Image.Image | None, declared(
        "file", "where to edit: white (or OpenAI's transparent) = edit; the first image's size (one mask for "
        "every item of a job)", takes=SINGLE, png=True, openai=True)] = None
    mask_grow: Annotated[int | None, declared(
        "whole", "pixels the mask is grown by; absent: 0", takes=SINGLE, png=True, low=0, high=256,
        unit="pixels", beside="mask")] = None
    mask_feather: Annotated[int | None, declared(  # None = masks.DEFAULT_FEATHER
        "whole", "pixels of soft edge inside the mask; absent: 8", takes=SINGLE, png=True, low=0, high=256,
        unit="pixels", beside="mask")] = None
    strength: Annotated[Number | None, declared(
        "number", "how far the masked area may move from the input; absent: 1", takes=SINGLE, png=True, low=0,
        high=1, low_open=True, why="1 = repaint the masked area from scratch", beside="mask")] = None
    # rewrite the prompt with the model's text encoder first (imgedit.runtime.enhance)
    enhance_prompt: Annotated[bool, declared(
        "flag", "rewrite the prompt with the model's own text encoder first", takes=SINGLE)] = False
    cache: Annotated[str | None, declared(  # None = CACHE
        "text", "step cache for quality edits: none, first-block or taylorseer, where offered", png=True,
        restore=True)] = None
    # not parameters: who and what the request is
    request_id: str = field(default_factory=new_request_id)
    source: str = "ui"  # ui | api | rest: for logs and metrics
    client: str | None = None  # who asked (imgedit.web.identity's owner): for each client's share of the line
    # declared parameters (PARAMETERS) without an attribute of their own, by name: request_kwargs() puts them
    # here
    options: dict = field(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _in_our_words(cls, values, handler):
        """A value of the wrong type: InvalidInput naming the parameter, as every other check says it."""
        try:
            return handler(values)
        except ValidationError as exc:
            errors = exc.errors()
            # a union (a Number) lists one error per member: the last one says what was expected
            error = [e for e in errors if e["loc"][:1] == errors[0]["loc"][:1]][-1]
            name = str(error["loc"][0]) if error["loc"] else "a request value"
            wrong = _WRONG.get(error["type"], "is not valid")
            value = error.get("input")
            shown = repr(value) if isinstance(value, (int, float)) else repr(str(value)[:40])
            raise InvalidInput(f"{name} {wrong}, got {shown}", name if error["loc"] else None) from None

    def value(self, name: str, default=None):
        """A declared parameter's value as asked for: its attribute, or its entry in `options`."""
        if name in self.options:
            return self.options[name]
        return getattr(self, name, default)


# Every declared parameter, read from EditRequest once (tests/test_declared_once.py adds a test-only one).
PARAMETERS: tuple[Param, ...] = declaration(EditRequest)


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
    features: tuple[str, ...] = ()  # the optimisations and modes it installed (imgedit.runtime.features)
    phases: dict[str, float] = field(default_factory=dict)  # seconds of each start-up phase (runtime.phases)
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
    task: str = "edit"  # edit | enhance (rewrite the prompt only: no image is made)
    enhance_tokens: int = 0  # > 0: rewrite the prompt first, with at most this many new tokens
    cache: str = "none"  # none | first-block | taylorseer (imgedit.runtime.step_cache)
    cache_threshold: float = 0.0  # first-block's threshold

    @property
    def image_seeds(self) -> tuple[int, ...]:
        """Each output image's own seed: image i is drawn from seed + i (wrapping at 2**32), so an edit
        asked with that seed and one image repeats exactly image i, and each PNG records its own seed."""
        return tuple((self.seed + i) % 2**32 for i in range(self.num_images))
