"""#45 item 1: an edit's parameters are declared once (imgedit.protocol.EditRequest's fields, read as
PARAMETERS) and the entry points follow the declaration: REST and /v1/jobs parse their form fields from it,
`/edit`'s parameters come in its order, each result PNG records the parameters declared `png`, and
docs/PARAMETERS.md is generated from it.

    python tests/test_parameters.py     # rewrites docs/PARAMETERS.md from the declaration
"""

from __future__ import annotations

import dataclasses
import io
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from imgedit.protocol import BATCH, EDIT, JOBS, PARAMETERS, REST, EditRequest, Resolved, parameters  # noqa: E402

DOC = ROOT / "docs" / "PARAMETERS.md"
WHERE = {EDIT: "page, gradio `/edit`", REST: "`/v1/images/edits`", JOBS: "`/v1/jobs`", BATCH: "Batch tab, `/batch`"}
# A valid value for every declared form field over REST and /v1/jobs (64x64 pictures, the tiny model)
VALID = {"prompt": "make it red", "negative_prompt": "blurry", "seed": "7", "num_inference_steps": "2",
         "true_cfg_scale": "3.5", "n": "1", "size": "64x64", "speed": "quality", "lora": "none", "lora_scale": "1",
         "mask_grow": "2", "mask_feather": "3", "strength": "0.9", "enhance_prompt": "false", "cache": "none",
         "expand": "0", "mask_prompt": ""}
# a bad value of each kind (nan: #47 item 7's siblings: every number field of both routes names itself)
INVALID = {"whole": "1.5x", "number": "nan", "flag": "perhaps", "size": "big", "text": None}


def render() -> str:
    lines = ["# An edit's parameters", "",
             "Generated from `imgedit/protocol/request.py` (`EditRequest`'s fields, read as `PARAMETERS`) by",
             "`python tests/test_parameters.py`; a test fails when this file and the declaration differ. Names are",
             "the gradio `/edit` API's; REST and `/v1/jobs` take",
             "the form field named in the second column. PNG: recorded in each result PNG's settings; restored:",
             "the page's \"Restore the settings saved in this PNG\" puts it back into the form.", "",
             "| parameter | REST / jobs form field | kind | where | default | range | PNG | what it does |",
             "|---|---|---|---|---|---|---|---|"]
    for p in parameters():  # the declaration as it is now (a test may add to it)
        rest = f"`{p.form_name}`" if p.takes & {REST, JOBS} else "—"
        where = ", ".join(WHERE[e] for e in (EDIT, REST, JOBS, BATCH) if e in p.takes)
        default = "required" if p.required else "—" if p.default in (None, "") else f"`{p.default}`"
        bounds = p.range_text() or "—"
        png = "restored" if p.restore else "recorded" if p.png else "—"
        lines.append(f"| `{p.name}` | {rest} | {p.kind} | {where} | {default} | {bounds} | {png} | {p.help} |")
    return "\n".join(lines) + "\n"


def test_the_parameters_page_is_the_declaration():
    assert DOC.read_text() == render(), "docs/PARAMETERS.md is out of date: run `python tests/test_parameters.py`"


def test_every_declared_field_is_a_request_field_and_each_name_is_one_parameter():
    fields = {f.name for f in dataclasses.fields(EditRequest)}
    assert {p.request_field for p in PARAMETERS if p.request_field} <= fields
    for entry in (EDIT, REST, JOBS):
        names = [p.form_name if entry != EDIT else p.name for p in parameters(entry)]
        assert len(names) == len(set(names)), entry


def test_each_png_records_every_parameter_declared_png():
    from imgedit.engine.outputs import settings_text

    mask = Image.new("L", (64, 64), 255)
    req = EditRequest(images=(Image.new("RGB", (64, 64)),), prompt="p", negative_prompt="n", speed="quality",
                      mask=mask, lora="x", lora_scale=0.5, cache="first-block", expand="8", mask_prompt="a door")
    params = Resolved(steps=2, true_cfg_scale=4.0, negative_prompt="n", seed=1, num_images=1, width=64, height=64,
                      adapters=(("x", 0.5),), mask_grow=1, mask_feather=2, strength=0.5, cache="first-block",
                      cache_threshold=0.1)
    written = settings_text(req, params, "model", (64, 64))
    assert {p.name for p in PARAMETERS if p.png} <= set(written), written


def test_a_png_records_the_loras_and_step_cache_the_job_ran_with_not_the_words_asked():
    """The declared text parameters are written as asked for (`speed`, `expand`, ...), but a job's LoRAs and step
    cache as it ran them (Resolved): a Lightning job that asked for cache none ran none and says nothing of a
    cache; a speed preset's LoRA is named; a quality job left to the server's CACHE records the one it ran."""
    from imgedit.engine.outputs import settings_text

    ran = {"true_cfg_scale": 1.0, "negative_prompt": " ", "seed": 1, "num_images": 1, "width": 64, "height": 64}
    fast = EditRequest(images=(), prompt="p", speed="fast", cache="none", lora="none", lora_scale=0.5)
    lightning = Resolved(steps=8, **ran, adapters=(("Lightning-8steps", 1.0),), scheduler="lightning")
    written = settings_text(fast, lightning, "model", (64, 64))
    assert "cache" not in written and (written["speed"], written["lora"], written["lora_scale"]) == (
        "fast", "Lightning-8steps", "1"), written
    quality = Resolved(steps=2, **ran, cache="first-block", cache_threshold=0.08)
    written = settings_text(EditRequest(images=(), prompt="p", lora_scale=0.5), quality, "model", (64, 64))
    assert (written["cache"], written["lora"], "lora_scale" in written, "speed" in written) == (
        "first-block:0.08", "none", False, False), written


def test_the_edit_api_publishes_the_declared_names_and_defaults(live_server):
    """Gradio reads `/edit`'s parameters from the function's signature, which edit_signature makes from the
    declaration: names, order, which are required and each default, as gradio_client sees them."""
    from gradio_client import Client

    published = Client(live_server.url, verbose=False).view_api(print_info=False, return_format="dict")
    shown = [(p["parameter_name"], p["parameter_has_default"], p.get("parameter_default"))
             for p in published["named_endpoints"]["/edit"]["parameters"]]
    assert shown == [(p.name, not p.required, None if p.required else p.edit_default) for p in parameters(EDIT)]
    assert shown[:5] == [("images", False, None), ("prompt", False, None), ("negative_prompt", True, ""),
                         ("seed", True, None), ("randomize_seed", True, False)]


def png(size=(64, 64), mode="RGB", color=(30, 120, 200)) -> bytes:
    """A picture, or (mode L) a mask whose left half is white: edit there."""
    image = Image.new(mode, size, color if mode == "RGB" else 0)
    if mode == "L":
        image.paste(255, (0, 0, size[0] // 2, size[1]))
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def test_rest_and_jobs_take_every_declared_field_and_name_a_bad_one(live_server):
    files = [("image", ("in.png", png(), "image/png")), ("mask", ("mask.png", png(mode="L"), "image/png"))]
    for entry, path in ((REST, "/v1/images/edits"), (JOBS, "/v1/jobs")):
        declared = {p.form_name for p in parameters(entry) if p.kind != "file"}
        assert declared <= set(VALID), declared - set(VALID)  # every declared field is sent below
        r = httpx.post(f"{live_server.url}{path}", files=files, data={k: VALID[k] for k in declared}, timeout=120)
        assert r.status_code in (200, 202), (entry, r.text)
        if entry == JOBS:
            deadline = time.monotonic() + 120
            while (view := httpx.get(f"{live_server.url}/v1/jobs/{r.json()['id']}", timeout=30).json())[
                    "state"] not in ("succeeded", "failed", "cancelled") and time.monotonic() < deadline:
                time.sleep(0.2)
            assert view["state"] == "succeeded", view
        for p in parameters(entry):
            if p.kind == "file" or INVALID[p.kind] is None:
                continue
            bad = httpx.post(f"{live_server.url}{path}", files=files, timeout=60,
                             data={**{k: VALID[k] for k in declared}, p.form_name: INVALID[p.kind]})
            assert bad.status_code == 400, (entry, p.name, bad.text)
            error = bad.json()["error"]
            if p.kind != "size":
                assert error["param"] == p.form_name and p.form_name in error["message"], (entry, p.name, error)


def outside(p, settings) -> list:
    """A value just outside each of a declared parameter's bounds, as a form sends it."""
    low, high = p.bounds(settings)
    step = 1 if p.kind == "whole" else 0.5
    return [str(low if p.low_open else low - step), str(high + step)]


def test_rest_and_jobs_refuse_a_value_outside_each_declared_bound(live_server, server_manager):
    """The bounds are the declaration's (Param.low/high): each edge refuses a value just past either bound,
    naming the parameter and the declared range (the server's MAX_STEPS and MAX_IMAGES_PER_PROMPT filled in)."""
    settings = server_manager.settings
    files = [("image", ("in.png", png(), "image/png")), ("mask", ("mask.png", png(mode="L"), "image/png"))]
    bounded = [p for p in parameters(REST) if p.high is not None]
    assert {p.name for p in bounded} >= {"seed", "num_inference_steps", "true_cfg_scale", "num_images",
                                         "lora_scale", "mask_grow", "mask_feather", "strength"}
    for entry, path in ((REST, "/v1/images/edits"), (JOBS, "/v1/jobs")):
        for p in bounded:
            for value in outside(p, settings):
                data = {"prompt": "make it red", "num_inference_steps": "2", p.form_name: value}
                r = httpx.post(f"{live_server.url}{path}", files=files, data=data, timeout=60)
                error = r.json()["error"]
                assert r.status_code == 400 and error["param"] == p.form_name, (entry, p.name, value, r.text)
                assert f"out of range: {p.range_text(settings)}" in error["message"], (p.name, error)


def test_each_bound_is_inclusive_and_a_bound_changed_in_the_declaration_is_the_one_checked(server_manager,
                                                                                         monkeypatch):
    """Through validation.resolve, the check every edge runs: a value at either declared bound passes (a low
    declared open refuses the bound itself); then every bound is moved in the declaration alone, and resolve
    refuses the old bounds: no copy of a bound is left elsewhere."""
    from imgedit import protocol
    from imgedit.engine.validation import resolve
    from imgedit.errors import InvalidInput

    settings, family = server_manager.settings, server_manager.family
    image, mask = Image.new("RGB", (64, 64)), Image.new("L", (64, 64), 255)
    image_size = (64, 64)

    def resolved(name, value):
        req = EditRequest(images=(image,), prompt="make it red", mask=mask, **{p.request_field: value
                          for p in parameters() if p.name == name})
        return resolve(req, settings, family, last_image_size=image_size, n_images=1)

    bounded = [p for p in parameters() if p.high is not None]
    for p in bounded:
        low, high = p.bounds(settings)
        if not p.low_open:
            resolved(p.name, low)
        resolved(p.name, high)
    declared = protocol.request.PARAMETERS
    for p in bounded:  # one parameter's bounds narrowed at a time: the others keep their defaults valid
        low, high = p.bounds(settings)
        narrowed = dataclasses.replace(p, low=low + 1, high=high - 1, low_open=False)
        monkeypatch.setattr(protocol.request, "PARAMETERS", tuple(narrowed if q is p else q for q in declared))
        for value in ((high,) if p.low_open else (low, high)):
            with pytest.raises(InvalidInput, match=f"{p.name} {value} is out of range"):
                resolved(p.name, value)

def test_a_range_check_names_the_bound_and_refuses_nan():
    from imgedit.engine.validation import check_range
    from imgedit.errors import InvalidInput

    check_range("num_images", 3, SimpleNamespace(max_images_per_prompt=4))
    with pytest.raises(InvalidInput, match="num_images 5 is out of range: 1 to 4"):
        check_range("num_images", 5, SimpleNamespace(max_images_per_prompt=4))
    with pytest.raises(InvalidInput, match="strength 0 is out of range: above 0, at most 1"):
        check_range("strength", 0)
    with pytest.raises(InvalidInput, match="out of range"):
        check_range("lora_scale", float("nan"))
    for sent in ("1", True, None):  # a caller of the manager's own API may send anything
        with pytest.raises(InvalidInput, match="true_cfg_scale must be a number"):
            check_range("true_cfg_scale", sent)


if __name__ == "__main__":
    DOC.write_text(render())
    print(f"wrote {DOC}")


def test_the_declaration_is_the_request_type():
    """#61 item 1: each parameter is written once, as an EditRequest field (its type, default and `declared`:
    kind, help, bounds, unit, where it is taken); PARAMETERS is read from the fields, in their order, and a value
    of the wrong type is refused when a request is made, naming the parameter."""
    import typing

    from imgedit.errors import InvalidInput
    from imgedit.protocol import Param

    hints = typing.get_type_hints(EditRequest, include_extras=True)
    declared = [name for name, hint in hints.items()
                if any(isinstance(m, Param) for m in getattr(hint, "__metadata__", ()))
                or typing.get_origin(hint) is typing.ClassVar]
    assert declared == [p.name for p in PARAMETERS]  # nothing declares a parameter anywhere else
    steps = next(p for p in PARAMETERS if p.name == "num_inference_steps")
    assert (steps.kind, steps.low, steps.high, steps.default) == ("whole", 2, "max_steps", None)
    for field, value, words in (("num_inference_steps", 2.5, "must be a whole number, got 2.5"),
                                ("lora_scale", "many", "must be a number, got 'many'"),
                                ("enhance_prompt", "perhaps", "must be true or false"),
                                ("prompt", None, "must be text")):
        with pytest.raises(InvalidInput, match=f"{field} {words}") as refused:
            EditRequest(images=(), **{"prompt": "x", field: value})
        assert refused.value.field == field
    assert EditRequest(images=[], prompt="x", num_inference_steps=3.0).num_inference_steps == 3  # lax, exact
