"""An edit's parameters as declared: `Param` (kind, help, bounds, unit, where each is taken and where it
shows, the name the worker side gives it) and the one parser by kind every edge uses. An EditRequest field
says its declaration with `declared(...)`; `declaration` reads them (imgedit.protocol.request)."""

from __future__ import annotations

import math
import typing
from dataclasses import MISSING, dataclass, fields, replace
from typing import ClassVar

from imgedit.errors import InvalidInput

# A number as it was sent: 1 stays 1 (in messages and settings), 2.5 stays 2.5.
Number = int | float

# ---- an edit's parameters, declared once: EditRequest's fields (imgedit.protocol.request) ----
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
    # OpenAI's own arguments (an SDK keyword), not an extension sent through `extra_body`. A PNG's settings
    # (imgedit.engine.outputs.declared_text) follow `always` and `beside` too.
    always: bool = False
    beside: str | None = None
    unless: str | None = None
    openai: bool = False
    # Where else it shows: `status`: in a job's status (GET /v1/jobs/<id>, by its REST name); `history`: a
    # History entry keeps it and a re-run gives it back (the store's column of that name, or of its `resolved`
    # name; without a column, the entry's `options`), as asked for, or with `kept_as_ran` as the edit ran (the
    # result's value where it has one: the rewritten prompt, the seed drawn, the model's steps), an empty text
    # or its `none_word` (lora's "none": the word a caller may send for no value) as its default.
    status: bool = False
    history: bool = False
    kept_as_ran: bool = False
    none_word: str = ""
    # The page's control under Advanced (imgedit.web.page.controls): `label` (`{low}` and `{high}` filled from
    # the bounds), a slider moving by `slider` (else a number box or the kind's own), `same_row`: beside the
    # parameter before it. A parameter without a label laid out nowhere else gets a control named by its name
    # and explained by its help.
    label: str = ""
    slider: float | None = None
    same_row: bool = False
    # `group`: the page lays it out with its group's own controls, not under Advanced: "speed" (the Speed
    # preset, the LoRA and its strength: a History entry whose speed or LoRA is no longer offered opens with
    # the group's defaults), "mask" (the mask canvas, its sliders and Select by words).
    group: str = ""
    # The name the worker side gives the value the pipeline gets (Resolved's and EditResult's attribute, read
    # by imgedit.runtime) where it is not the parameter's own: the one place the two names meet.
    resolved: str = ""

    @property
    def edit_default(self) -> object:
        return self.default if self.api_default is ... else self.api_default

    @property
    def form_name(self) -> str:
        return self.rest or self.name

    @property
    def worker_name(self) -> str:
        return self.resolved or self.name

    @property
    def request_field(self) -> str | None:
        return self.name if self.field == "" else self.field

    def parse(self, raw, name: str | None = None):
        """A value as a caller sent it, a form's text or any JSON, as this parameter's kind: the one parser
        every edge uses (the page, the gradio API, REST's forms and bodies). Empty (None or "") is absent: the
        default. Anything else not of the kind is refused, named as the caller called it (`name`: REST's `n`).
        A form's text is a number as written ("9" for a `number` is 9.0); a JSON number keeps its value, a
        whole one as an int (gradio's Number sends 4.0 for 4). The bounds are checked when a request is
        resolved."""
        name = name or self.name
        if raw is None or raw == "":
            return self.default
        number = isinstance(raw, (int, float)) and not isinstance(raw, bool)
        shown = repr(raw) if number else repr(str(raw)[:40])
        if self.kind == "text":
            if not isinstance(raw, str):
                raise InvalidInput(f"{name} must be text", name)
            return raw
        if self.kind == "flag":
            if isinstance(raw, bool):
                return raw
            word = raw.strip().lower() if isinstance(raw, str) else None
            if word in ("true", "1", "yes", "on"):
                return True
            if word in ("false", "0", "no", "off"):
                return False
            raise InvalidInput(f"{name} must be true or false, got {shown}", name)
        if self.kind in ("whole", "number"):
            return _parsed_number(raw, name, shown, self.kind == "whole")
        raise TypeError(f"{self.name}: a {self.kind} is read by its edge")  # files, REST's WxH size

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
        if high is None:
            return f"at least {_number(low)} {self.unit}".rstrip()
        if self.low_open:
            text = f"above {_number(low)}, at most {_number(high)}"
        else:
            text = f"{_number(low)} to {_number(high)}"
        return f"{text} {self.unit}".rstrip()


def _parsed_number(raw, name: str, shown: str, whole: bool) -> Number:
    what = "a whole number" if whole else "a number"
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)) or len(str(raw)) > 40:
        raise InvalidInput(f"{name} must be {what}, got {shown}", name)
    number = raw
    if isinstance(raw, str):
        try:
            number = int(raw.strip())  # exact, however many digits
            number = number if whole else float(number)
        except ValueError:
            try:
                number = float(raw)
            except ValueError:
                raise InvalidInput(f"{name} must be {what}, got {shown}", name) from None
    elif isinstance(raw, float) and raw.is_integer():
        number = int(raw)
    if isinstance(number, float) and not math.isfinite(number):  # nan, inf, 1e400: JSON cannot carry them
        raise InvalidInput(f"{name} must be a finite number, got {shown}", name)
    if whole and isinstance(number, float):
        if not number.is_integer():
            raise InvalidInput(f"{name} must be {what}, got {shown}", name)
        number = int(number)
    return number


def _number(value) -> str:
    """A bound as people write it: 20 not 20.0, 4294967295 not 4.29e+09."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


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
