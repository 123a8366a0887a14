"""#45 item 1's proof: a parameter added to the declaration (imgedit.protocol.PARAMETERS) and nowhere else reaches
every entry point. A harmless test-only parameter, `note` (text, recorded in the PNG and restored from it), is
declared for this module's server only; then:

- gradio `/edit` and `/batch` publish it and take it, over gradio_client;
- the page has a control for it (under Advanced, named and explained by the declaration);
- REST `/v1/images/edits` and `/v1/jobs` take it as a form field;
- the result PNGs record it (the request carried it through the line and the worker), and the page's
  "Restore the settings saved in this PNG" gives it back;
- the page's "Copy as API call" snippets send it (gradio_client, curl, OpenAI SDK);
- a job's status (GET /v1/jobs/<id>) shows it (declared `status`);
- the History store keeps it: `/history` lists it and the History tab's Re-run puts it back into the form;
- docs/PARAMETERS.md's generator lists it.

And the declaration is the request type (imgedit.protocol.EditRequest): a field added there, with its type and
`declared(...)`, is that parameter, checked and described, with nothing else written.
"""

from __future__ import annotations

import base64
import functools
import io
import pickle
import re
import time
from pathlib import Path
from typing import Annotated

import gradio as gr
import httpx
import pytest
from conftest import make_manager, start_server
from PIL import Image
from pydantic import ConfigDict
from pydantic.dataclasses import dataclass as pydantic_dataclass
from raw_gradio import RawGradio

import imgedit
from imgedit import protocol
from imgedit.config.settings import load_settings
from imgedit.errors import InvalidInput
from imgedit.protocol import EVERYWHERE, EditRequest, Param
from imgedit.protocol import declared as declare
from imgedit.web.identity import COOKIE
from imgedit.web.page.mask_controls import build_mask_controls
from imgedit.web.page.requests import edit_fields
from imgedit.web.page.speed import SPEED_FIELDS, build_speed_controls

NOTE = Param("note", "text", "a test-only note, kept with the result", takes=EVERYWHERE, default="", png=True,
             restore=True, status=True)


@pytest.fixture(scope="module")
def declared():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(protocol.request, "PARAMETERS", (*protocol.PARAMETERS, NOTE))  # where it is read
        yield


@pytest.fixture(scope="module")
def manager(declared, plus_ckpt):
    return make_manager(plus_ckpt)


@pytest.fixture(scope="module")
def server(manager):
    with start_server(manager) as live:
        yield live


def png_bytes(size=(64, 64)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (30, 120, 200)).save(buffer, "PNG")
    return buffer.getvalue()


def note_of(data: bytes) -> str | None:
    with Image.open(io.BytesIO(data)) as image:
        return image.info.get("note")


def test_gradio_edit_publishes_and_takes_the_declared_field(server, tmp_path):
    from gradio_client import Client, handle_file

    from imgedit.engine.outputs import read_settings

    client = Client(server.url, verbose=False)
    published = client.view_api(print_info=False, return_format="dict")["named_endpoints"]["/edit"]["parameters"]
    assert [p["parameter_name"] for p in published][-1] == "note"
    picture = tmp_path / "in.png"
    picture.write_bytes(png_bytes())
    gallery, _seed = client.predict(images=[handle_file(str(picture))], prompt="make it red", num_inference_steps=2,
                                    width=64, height=64, note="kept by gradio", api_name="/edit")
    result = gallery[0]["image"]
    assert note_of(open(result, "rb").read()) == "kept by gradio"
    assert read_settings(result)["note"] == "kept by gradio"  # what Restore gives back to the form

    [stored] = [e for e in client.predict(api_name="/history") if e.get("note") == "kept by gradio"]
    raw = RawGradio(server.url, httpx.Client(timeout=60, cookies={COOKIE: client.cookies[COOKIE]}))
    filled = raw.predict(raw.fn_index(trigger=("history-rerun", "click")), [stored["id"]])
    assert filled.status_code == 200, filled.text
    assert dict(zip(edit_fields(), filled.json()["data"], strict=True))["note"] == "kept by gradio"
    raw.close()

    batch = client.view_api(print_info=False, return_format="dict")["named_endpoints"]["/batch"]["parameters"]
    assert [p["parameter_name"] for p in batch][-1] == "note"
    gallery, report, _zip = client.predict(files=[handle_file(str(picture))], prompt="make it red",
                                           num_inference_steps=2, width=64, height=64, note="kept by a batch",
                                           api_name="/batch")
    assert "1 of 1 done" in report and note_of(open(gallery[0]["image"], "rb").read()) == "kept by a batch"


def test_rest_and_jobs_take_the_declared_field(server):
    files = [("image", ("in.png", png_bytes(), "image/png"))]
    data = {"prompt": "make it red", "num_inference_steps": "2", "size": "64x64", "note": "kept by REST"}
    reply = httpx.post(f"{server.url}/v1/images/edits", files=files, data=data, timeout=120)
    assert reply.status_code == 200, reply.text
    assert note_of(base64.b64decode(reply.json()["data"][0]["b64_json"])) == "kept by REST"

    job = httpx.post(f"{server.url}/v1/jobs", files=files, data={**data, "note": "kept by a job"}, timeout=120)
    assert job.status_code == 202, job.text
    deadline = time.monotonic() + 120
    while (view := httpx.get(f"{server.url}/v1/jobs/{job.json()['id']}", timeout=30).json())["state"] not in (
            "succeeded", "failed", "cancelled") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert view["state"] == "succeeded" and view["note"] == "kept by a job", view  # declared `status`
    stored = httpx.get(f"{server.url}/v1/jobs/{job.json()['id']}/result", timeout=30)
    assert stored.status_code == 200 and note_of(stored.content) == "kept by a job"


def test_the_page_has_a_control_for_it_and_restores_it(server, manager):
    config = httpx.get(f"{server.url}/config", timeout=30).json()
    controls = [c for c in config["components"] if c.get("props", {}).get("elem_id") == "param-note"]
    assert len(controls) == 1 and controls[0]["type"] == "textbox", controls
    assert controls[0]["props"]["label"] == "Note" and NOTE.help in controls[0]["props"]["info"]

    from imgedit.engine.outputs import restorable
    from imgedit.web.page.tools import PageTools

    assert restorable()["note"] is str
    tools = PageTools(manager.settings, manager.family)
    names = ("prompt", "note")
    restored = tools.restore_settings({"prompt": "p", "note": "from the PNG"}, names)
    assert restored[:2] == ("p", "from the PNG")


def test_the_snippets_send_it_and_leave_it_out_at_its_default(declared):
    from imgedit.web.page.snippets import api_values, curl_snippet, gradio_snippet, input_files, openai_snippet

    form = {"prompt": "make it red", "seed": 3, "randomize_seed": False, "note": "kept by a snippet"}
    defaults = {"num_inference_steps": 2, "true_cfg_scale": 4.0}
    values = api_values(form, input_files(1), defaults)
    assert "note='kept by a snippet'," in gradio_snippet("http://h/", values, auth=False)
    assert "-F 'note=kept by a snippet'" in curl_snippet("http://h/", values)
    assert "'note': 'kept by a snippet'" in openai_snippet("http://h/", values)
    assert "note" not in api_values({**form, "note": ""}, input_files(1), defaults)


def test_the_parameter_table_lists_it_and_the_request_carries_it_to_the_worker(declared):
    from test_parameters import render

    assert any(line.startswith("| `note` |") for line in render().splitlines())
    req = EditRequest(images=(), **protocol.request_kwargs({"prompt": "p", "note": "n"}))
    assert req.value("note") == "n" and pickle.loads(pickle.dumps(req)).value("note") == "n"  # as a worker gets it



# A field added to the request type, with its declaration: on a subclass, so that the real type stays as it is
# for the other tests (module level: the annotation is read in this module's namespace).
@pydantic_dataclass(frozen=True, config=ConfigDict(arbitrary_types_allowed=True))
class WithCount(EditRequest):
    count: Annotated[int | None, declare("whole", "a test-only count", png=True, low=0, high=9,
                                         unit="notes", history=True)] = None


def test_a_field_added_to_the_request_type_is_a_declared_parameter_and_nothing_else_is_written(monkeypatch,
                                                                                              tmp_path):
    """... and, read as the declaration, its PNG settings record it and a History entry keeps it (by name,
    without a column) for the re-run."""
    from imgedit.engine.jobs.history import HistoryStore
    from imgedit.engine.outputs import settings_text
    from imgedit.protocol import EditResult, Resolved

    found = protocol.declaration(WithCount)
    assert [p.name for p in found] == [p.name for p in protocol.declaration(EditRequest)] + ["count"]
    count = found[-1]
    assert (count.kind, count.takes, count.default, count.png, count.range_text()) == (
        "whole", EVERYWHERE, None, True, "0 to 9 notes")
    assert WithCount(images=(), prompt="x", count="3").count == 3
    with pytest.raises(InvalidInput, match="count must be a whole number, got 'many'") as refused:
        WithCount(images=(), prompt="x", count="many")
    assert refused.value.field == "count"

    monkeypatch.setattr(protocol.request, "PARAMETERS", found)
    req = WithCount(images=(), prompt="x", count=3)
    ran = Resolved(steps=2, true_cfg_scale=1.0, negative_prompt=" ", seed=1, num_images=1, width=64, height=64)
    assert settings_text(req, ran, "model", (64, 64))["count"] == "3"
    made = EditResult(images=[Image.new("RGB", (64, 64))], seed=1, steps=2, width=64, height=64, seconds=0.1,
                      worker="w", devices=(), request_id=req.request_id)
    store = HistoryStore(tmp_path)
    entry = store.save("o", "job", 0, req, made)
    assert entry.kept()["count"] == 3 and store.get("o", entry.id).kept()["count"] == 3
    store.close()


def test_one_parser_reads_every_edge_alike():
    """#61: values are parsed once, by kind (protocol.Param.parse): the page's events (any JSON) and REST's forms
    (text) give the same request fields, and refuse the same junk with the same words, naming the parameter."""
    from imgedit.web.api.rest_requests import form_fields
    from imgedit.web.page.requests import event_fields

    page = event_fields({"prompt": "p", "num_inference_steps": 4.0, "true_cfg_scale": 2.5, "num_images": "2",
                         "enhance_prompt": True, "randomize_seed": False, "seed": 7})
    rest = form_fields({"prompt": "p", "num_inference_steps": "4", "true_cfg_scale": "2.5", "n": "2",
                        "enhance_prompt": "true", "seed": "7"}, protocol.REST)
    for name in ("prompt", "num_inference_steps", "true_cfg_scale", "num_images", "enhance_prompt", "seed"):
        assert page[name] == rest[name] and type(page[name]) is type(rest[name]), (name, page[name], rest[name])
    for name, junk, words in (("num_inference_steps", "2.5", "must be a whole number, got '2.5'"),
                              ("true_cfg_scale", "nan", "must be a finite number"),
                              ("enhance_prompt", "perhaps", "must be true or false")):
        rest_form = functools.partial(form_fields, entry=protocol.REST)
        for parse, raw in ((event_fields, {name: junk}), (rest_form, {"prompt": "p", name: junk})):
            with pytest.raises(InvalidInput, match=f"{name} {words}") as refused:
                parse(raw)
            assert refused.value.field == name


def test_a_name_the_worker_side_gives_otherwise_is_mapped_by_the_declaration_alone(monkeypatch):
    """One field, one name: where the pipeline's value has a name of its own (Resolved.steps is
    num_inference_steps), the declaration's `resolved` maps it, and every view (the PNG's settings, /health's
    model defaults, History, a job's status) reads it under the declared name. A parameter declared with a worker
    name, here a test-only `threshold` for Resolved.cache_threshold, is written into each PNG with nothing else
    written."""
    from types import SimpleNamespace

    from imgedit.engine.jobs.batch import job_settings
    from imgedit.engine.outputs import settings_text
    from imgedit.protocol import Resolved

    threshold = Param("threshold", "number", "a test-only threshold", png=True, status=True,
                      resolved="cache_threshold")
    monkeypatch.setattr(protocol.request, "PARAMETERS", (*protocol.PARAMETERS, threshold))
    ran = Resolved(steps=7, true_cfg_scale=2.5, negative_prompt=" ", seed=3, num_images=1, width=64, height=64,
                   cache_threshold=0.25)
    req = EditRequest(images=(), **protocol.request_kwargs({"prompt": "p", "num_inference_steps": 9, "threshold": 1}))
    written = settings_text(req, ran, "model", (64, 64))
    assert (written["num_inference_steps"], written["threshold"], written["true_cfg_scale"]) == ("7", "0.25", "2.5")
    assert protocol.as_declared(ran)["num_inference_steps"] == 7 and "steps" not in protocol.as_declared(ran)
    assert protocol.as_declared(SimpleNamespace(steps=5, prompt="x")) == {"prompt": "x", "num_inference_steps": 5}
    shown = job_settings(req)  # as asked for, by the REST names
    assert (shown["num_inference_steps"], shown["n"], shown["threshold"]) == (9, 1, 1)


def test_the_step_count_is_named_by_the_declaration_its_resolver_and_the_worker_only():
    """One value, one name, written in few places: the request's step count (`num_inference_steps`; a job's items
    once said `total_steps`) is named by the declaration (the request field, and the progress the workers and
    jobs report under it: protocol.Progress), by the resolver that range-checks it, and by the worker code that
    hands it to the pipeline. The line, the jobs, the panel, the page and REST read it through those."""
    root = Path(imgedit.__file__).parent
    naming = sorted(path.relative_to(root).as_posix() for path in root.rglob("*.py")
                    if re.search(r"num_inference_steps|total_steps", path.read_text()))
    assert naming == ["engine/validation.py", "protocol/request.py", "protocol/results.py", "runtime/compile21.py",
                      "runtime/runner.py", "runtime/warmup.py"], naming
    done = protocol.Progress(3, 40)
    assert done.view() == {"step": 3, "num_inference_steps": 40} and protocol.Progress.read(done.view()) == done
    assert (done.text(), protocol.Progress(0, 40).text(), protocol.Progress().fraction) == ("step 3/40", "preparing", 0)
    old = {"index": 0, "step": 2, "total_steps": 2}  # an item stored before the count took the field's name
    assert protocol.Progress.upgraded(old) == {"index": 0, "step": 2, "num_inference_steps": 2}


def test_the_pages_own_control_groups_are_declared_not_listed():
    """The Speed/LoRA controls and the mask's are laid out by their own builders, not under Advanced: which
    parameters each group holds is declared (Param.group), and each builder makes a control for exactly those;
    History's fallback for a speed or LoRA no longer offered resets that declared group."""
    assert protocol.group("speed") == SPEED_FIELDS == ("speed", "lora", "lora_scale")
    assert protocol.group("mask") == ("mask", "mask_grow", "mask_feather", "strength", "mask_prompt")
    with gr.Blocks():
        speed = build_speed_controls(load_settings({}))
        _, mask, _ = build_mask_controls()
    assert tuple(speed) == protocol.group("speed") and set(mask) == set(protocol.group("mask"))
