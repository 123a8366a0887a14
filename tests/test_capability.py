"""What these workers can run is decided once (`PipelineManager.can_run`), and every edge asks it: an edit over
REST and a job over /v1/jobs refuse the same requests with the same 400, before anything is queued (#61: a
`cache` the compiled workers cannot run, or an `enhance_prompt` where the text encoder is streamed, was taken
by /v1/jobs with 202, then every item failed).

The managers are planned, not started: a refusal comes before the line, so no worker is needed.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import cpu_plan, http, make_manager, picture, start_server
from test_step_cache import picture_bytes

from imgedit.errors import InvalidInput
from imgedit.planning.memory import MemoryMode
from imgedit.protocol import EditRequest

# (what the server is, the request field that asks for what it cannot run, the value, the words of the refusal)
REFUSABLE = {
    "cache on compiled workers": (dict(COMPILE="on"), None, "cache", "taylorseer",
                                  "cache taylorseer is not available on this server: the workers are compiled"),
    "a rewrite with the text encoder streamed": (dict(), MemoryMode(offload_text_encoder=True), "enhance_prompt",
                                                 "true", "prompt rewriting is not available on this server"),
}


@pytest.fixture(scope="module", params=list(REFUSABLE), ids=list(REFUSABLE))
def refusing(request, plus_ckpt):
    env, memory, field, value, words = REFUSABLE[request.param]
    plan = cpu_plan(1)
    if memory is not None:
        plan = replace(plan, workers=tuple(replace(w, memory=memory) for w in plan.workers))
    manager = make_manager(plus_ckpt, plan=plan, load=False, **env).prepare()
    with start_server(manager) as server:
        yield manager, server, field, value, words


def test_the_manager_answers_once_for_a_decoded_edit_and_for_a_template(refusing):
    manager, _, field, value, words = refusing
    asked = {field: value == "true" if field == "enhance_prompt" else value}
    for check, images in ((manager.resolve, (picture(),)), (manager.check, ())):
        with pytest.raises(InvalidInput, match=words) as refused:
            check(EditRequest(images=images, prompt="make it red", **asked))
        assert refused.value.field == field
    assert manager.can_run(manager.check(EditRequest(images=(), prompt="make it red"))) is None  # without it


@pytest.mark.parametrize("route", ["/v1/images/edits", "/v1/jobs"])
def test_rest_and_jobs_refuse_what_the_workers_cannot_run_with_the_same_400(refusing, route):
    manager, server, field, value, words = refusing
    r = http.post(f"{server.url}{route}", timeout=60, data={"prompt": "make it red", field: value},
                  files={"image": ("a.png", picture_bytes(), "image/png")})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error" and words in error["message"]
    assert error["code"] == "invalid_input"
    # the same request without it gets past the check (503: these workers were never started)
    r = http.post(f"{server.url}{route}", timeout=60, data={"prompt": "make it red"},
                  files={"image": ("a.png", picture_bytes(), "image/png")})
    assert r.status_code in (202, 503), r.text
