"""#64 "Select what to edit by words" (`mask_prompt`): the pipeline's own text encoder boxes a phrase in the first
image and the boxes become the mask; over REST, the openai SDK, gradio_client and the manager.

The tiny checkpoint's random text encoder never writes a box: every plain phrase exercises the real refusal
(a generate call on the real pipeline, its nonsense read, nothing found). The success path is the same call
with the model's answer scripted at the text encoder's output (tests/faults.py: `[answer:TEXT:answer]` in
mask_prompt makes the model write TEXT), so what is tested is generate -> parse -> mask -> masked edit.
"""

from __future__ import annotations

import base64
import io
import time
from dataclasses import replace

import httpx
import numpy as np
import openai
import pytest
from conftest import cpu_plan, make_manager, picture, wait_job
from gradio_client import Client, handle_file
from PIL import Image

from imgedit.errors import InvalidInput
from imgedit.model.boxes import boxes_mask, frame, outline, read_boxes
from imgedit.planning.memory import MemoryMode
from imgedit.protocol import EditRequest

W, H = 64, 64
# What the tiny Qwen2.5-VL-shaped encoder sees of a 64x64 image (enhance.view at its own area, 28-pixel
# cells): 56x56, so its absolute coordinates are scaled by 64/56.
BOX = '```json\n[{"bbox_2d": [7, 14, 28, 42], "label": "the door"}]\n```'
SCRIPTED = f"the door [answer:{BOX}:answer]"
EXPECTED = (8, 16, 32, 48)  # 7*64/56, 14*64/56, 28*64/56, 42*64/56 (outward to whole pixels)


def photo() -> Image.Image:
    return picture(W, H, (40, 140, 90))


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


# ---- the answer, read (pure: imgedit.model.boxes) ------------------------------------------------------------
@pytest.mark.parametrize("answer, expected", [
    # Qwen2.5-VL's usual answer: fenced JSON, a label
    ('```json\n[{"bbox_2d": [10, 20, 30, 40], "label": "car"}]\n```', [(10, 20, 30, 40)]),
    # several boxes, trailing words, a box repeated (kept once)
    ('[{"bbox_2d": [0, 0, 10, 10]}, {"bbox_2d": [50, 50, 60, 70]}, {"bbox_2d": [0, 0, 10, 10]}] Done!',
     [(0, 0, 10, 10), (50, 50, 60, 70)]),
    # corners in the wrong order; floats; single quotes; unfenced single object
    ("{'bbox_2d': [30.6, 40.2, 10.4, 20.9], 'label': 'x'}", [(10, 20, 31, 41)]),
    # out of bounds: clipped to the 100x80 image; one wholly outside is dropped
    ('[{"bbox_2d": [-20, -5, 150, 30]}, {"bbox_2d": [200, 200, 300, 300]}]', [(0, 0, 100, 30)]),
    # degenerate boxes (no width, no height) dropped; a cut answer keeps the boxes it finished
    ('[{"bbox_2d": [5, 5, 5, 40]}, {"bbox_2d": [5, 9, 40, 9]}, {"bbox_2d": [1, 2, 3, 4]}, {"bbox_2d": [7, 8',
     [(1, 2, 3, 4)]),
    # garbage, a point (not a box), three numbers, an empty answer: nothing usable
    ("I cannot see a car here.", None), ('[{"point_2d": [10, 20], "label": "car"}]', None),
    ('{"bbox_2d": [1, 2, 3]}', None), ("", None), ('```json\n[]\n```', None),
])
def test_answers_are_read_leniently_and_only_usable_boxes_count(answer, expected):
    found = outline(answer, (100, 80), (100, 80))
    if expected is None:
        assert found is None
        return
    assert list(found.boxes) == expected
    mask = np.asarray(found.mask)
    assert found.mask.mode == "L" and found.mask.size == (100, 80)
    union = np.zeros((80, 100), bool)
    for x1, y1, x2, y2 in expected:
        union[y1:y2, x1:x2] = True
    assert np.array_equal(mask == 255, union) and set(np.unique(mask)) <= {0, 255}


def test_each_encoder_answers_in_its_own_coordinates():
    # Qwen3-VL (Qwen-Image-2.1): 0-1000 whatever the image; Qwen2.5-VL: the pixels its processor gave it
    assert frame("qwen3_vl", (448, 336)) == (1000, 1000)
    assert frame("qwen2_5_vl", (448, 336)) == (448, 336)
    answer = '{"bbox_2d": [100, 50, 200, 150]}'
    assert outline(answer, frame("qwen3_vl", (448, 336)), (800, 600)).boxes == ((80, 30, 160, 90),)
    # the same numbers from Qwen2.5-VL, which saw a 448x336 view of an 896x672 image: twice as large
    assert outline(answer, frame("qwen2_5_vl", (448, 336)), (896, 672)).boxes == ((200, 100, 400, 300),)
    assert read_boxes("x" * 10_000 + '"bbox_2d":[1,2,3,4]') == [(1.0, 2.0, 3.0, 4.0)]
    many = "".join(f'{{"bbox_2d": [{i}, 0, {i + 1}, 1]}}' for i in range(500))
    assert len(read_boxes(many)) == 64  # a model repeating itself stops counting
    assert np.asarray(boxes_mask([(0, 0, 2, 1), (1, 0, 3, 2)], (4, 3))).tolist() == [
        [255, 255, 255, 0], [0, 255, 255, 0], [0, 0, 0, 0]]


def test_an_answer_with_no_box_begun_is_given_up_at_its_48th_token_and_one_with_a_box_runs_on():
    import torch  # the criterion's input, as generate() gives it

    from imgedit.model.boxes import BOX_WITHIN, NoBoxBegun
    from imgedit.model.demo_checkpoint import build_tokenizer

    tokenizer = build_tokenizer()

    def stops(answer: str) -> list[bool]:
        """The criterion's verdict after each new token of `answer` (as generate() asks, prompt first)."""
        ids, criterion = tokenizer.encode("the prompt " * 5 + answer), NoBoxBegun(tokenizer)
        start = len(tokenizer.encode("the prompt " * 5))
        return [bool(criterion(torch.tensor([ids[:n]]), None)[0]) for n in range(start + 1, len(ids) + 1)]

    nonsense = stops("the sky is blue and " * 30)
    assert len(nonsense) > BOX_WITHIN and not any(nonsense[:BOX_WITHIN - 1]) and all(nonsense[BOX_WITHIN - 1:])
    boxed = stops('```json\n[{"bbox_2d": [1, 2, 3, 4], "label": "sky"}, ' + '{"bbox_2d": [5, 6, 7, 8]}, ' * 10)
    assert len(boxed) > BOX_WITHIN and not any(boxed)


# ---- the manager: the real pipeline's refusal, a scripted answer's mask and edit -----------------------------
def test_random_weights_outline_nothing_and_say_so_and_a_scripted_box_is_the_edits_mask(server_manager):
    manager, records = server_manager, []
    manager.listeners.append(records.append)
    with pytest.raises(InvalidInput) as refused:
        manager.outline(EditRequest(images=(photo(),), prompt="", mask_prompt="the red car"))
    assert refused.value.field == "mask_prompt"
    assert refused.value.message.startswith('mask_prompt "the red car": the model found nothing it could outline')
    request = dict(images=(photo(),), prompt="paint it blue", num_inference_steps=2, seed=5, width=W, height=H)
    with pytest.raises(InvalidInput) as refused_edit:  # inside the edit's own job: no image is made
        manager.edit(EditRequest(**request, mask_prompt="  the red   car "))
    assert refused_edit.value.field == "mask_prompt" and '"the red car"' in refused_edit.value.message
    # both ran on a worker (the real generate call: nonsense, given up with no box begun) and cost nothing else
    assert [(r.task, r.outcome, r.worker is not None) for r in records] == [
        ("outline", "invalid_input", True), ("edit", "invalid_input", True)]
    assert all(w.state.serving and w.restarts == 0 for w in manager.workers)
    manager.listeners.remove(records.append)

    proposed = manager.outline(EditRequest(images=(photo(),), prompt="", mask_prompt=SCRIPTED))
    assert proposed.boxes == (EXPECTED,) and proposed.images == [] and proposed.mask.size == (W, H)
    edited = manager.edit(EditRequest(**request, mask_prompt=SCRIPTED))
    assert edited.boxes == (EXPECTED,) and edited.images[0].size == (W, H)
    # the outlined mask is the edit's: the same as that mask drawn and sent, pixel for pixel and in the PNG
    drawn = manager.edit(EditRequest(**request, mask=proposed.mask))
    assert np.array_equal(np.asarray(edited.images[0]), np.asarray(drawn.images[0]))
    info = edited.images[0].info
    assert info["mask"] == drawn.images[0].info["mask"] and info["mask_prompt"] == SCRIPTED
    outside = np.asarray(boxes_mask([EXPECTED], (W, H))) == 0  # the input's own pixels there, exactly
    assert np.array_equal(np.asarray(edited.images[0])[outside], np.asarray(photo())[outside])


def test_bad_mask_prompts_are_refused_before_anything_waits(server_manager):
    manager, image = server_manager, photo()
    cases = {
        "mask and mask_prompt both choose": dict(mask_prompt="the sky", mask=Image.new("L", (W, H), 255)),
        "expand makes its own mask": dict(mask_prompt="the sky", expand="16"),
        "at most 200": dict(mask_prompt="sky " * 80),
        "control token": dict(mask_prompt="the <|image_pad|> sky"),
    }
    for said, fields in cases.items():
        with pytest.raises(InvalidInput) as refused:
            manager.resolve(EditRequest(images=(image,), prompt="x", **fields))
        assert refused.value.field == "mask_prompt" and said in refused.value.message, refused.value.message
    with pytest.raises(InvalidInput, match="mask_prompt is required"):
        manager.outline(EditRequest(images=(image,), prompt="", mask_prompt="   "))
    # a blank phrase in an edit is no phrase: an ordinary edit
    assert manager.resolve(EditRequest(images=(image,), prompt="x", mask_prompt=" ")).outline_tokens == 0


def test_where_rewrites_are_refused_mask_prompt_is_too_with_the_same_reason(plus_ckpt):
    """A worker whose text encoder is streamed from the CPU (MAX_MEMORY leaving it no room) writes no words:
    `can_run` refuses an outline as it refuses a rewrite, for an edit and for an outline alone (planned, not
    started: the refusal comes before the line)."""
    plan = cpu_plan(1)
    plan = replace(plan, workers=tuple(replace(w, memory=MemoryMode(offload_text_encoder=True))
                                       for w in plan.workers))
    manager = make_manager(plus_ckpt, plan=plan, load=False).prepare()
    for check in (manager.resolve, manager.resolve_outline, manager.check):
        with pytest.raises(InvalidInput) as refused:
            check(EditRequest(images=(photo(),), prompt="x", mask_prompt="the sky"))
        assert refused.value.field == "mask_prompt"
        assert refused.value.message.startswith("mask_prompt is not available on this server: the text encoder "
                                                "is kept on the CPU and streamed"), refused.value.message
    assert manager.resolve(EditRequest(images=(photo(),), prompt="x")).outline_tokens == 0  # an edit still runs


# ---- REST: the openai SDK, /v1/masks, /v1/jobs; gradio_client ------------------------------------------------
def test_rest_and_gradio_select_by_words_or_say_plainly_that_nothing_was_found(live_server):
    client = openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="unused", max_retries=0)
    image = ("in.png", png(photo()), "image/png")
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.edit(image=image, prompt="paint it blue",
                           extra_body={"mask_prompt": "the red car", "num_inference_steps": 2})
    error = refused.value.body
    assert refused.value.status_code == 400 and error["param"] == "mask_prompt"
    assert "found nothing it could outline" in error["message"] and "draw the mask" in error["message"]
    with pytest.raises(openai.BadRequestError) as both:
        client.images.edit(image=image, prompt="x", mask=("m.png", png(boxes_mask([(0, 0, 9, 9)], (W, H))),
                                                          "image/png"), extra_body={"mask_prompt": "the sky"})
    assert both.value.body["param"] == "mask_prompt" and "mask and mask_prompt" in both.value.body["message"]
    # the SDK's edit, selected by words: the reply names the boxes; the picture outside them is the input's
    edited = client.images.edit(image=image, prompt="paint it blue",
                                size=f"{W}x{H}", extra_body={"mask_prompt": SCRIPTED, "num_inference_steps": 2})
    assert edited.model_extra["mask_boxes"] == [list(EXPECTED)]
    result = np.asarray(Image.open(io.BytesIO(base64.b64decode(edited.data[0].b64_json))).convert("RGB"))
    outside = np.asarray(boxes_mask([EXPECTED], (W, H))) == 0
    assert np.array_equal(result[outside], np.asarray(photo())[outside])
    # stored with its words: the edit's status (a REST edit's, read back from the history) names them
    status_url = f"{live_server.url}/v1/jobs/{edited.model_extra['request_id']}"
    deadline = time.monotonic() + 60
    while (view := httpx.get(status_url, headers={"Authorization": "Bearer unused"}, timeout=30)).status_code == 404 \
            and time.monotonic() < deadline:  # stored in the background (b64_json does not wait for it)
        time.sleep(0.1)
    view = view.json()
    assert (view["mask_prompt"], view["items"][0]["num_inference_steps"], view["restored"]) == (SCRIPTED, 2, True)

    # the proposal alone: a mask to adjust and send back as `mask`
    files = {"image": image}
    proposed = httpx.post(f"{live_server.url}/v1/masks", files=files, data={"mask_prompt": SCRIPTED}, timeout=120)
    assert proposed.status_code == 200, proposed.text
    body = proposed.json()
    mask = Image.open(io.BytesIO(base64.b64decode(body["data"][0]["b64_json"])))
    assert body["boxes"] == [list(EXPECTED)] and body["size"] == f"{W}x{H}" and mask.mode == "L"
    assert np.array_equal(np.asarray(mask), np.asarray(boxes_mask([EXPECTED], (W, H))))
    nothing = httpx.post(f"{live_server.url}/v1/masks", files=files, data={"mask_prompt": "the moon"}, timeout=120)
    assert nothing.status_code == 400 and nothing.json()["error"]["param"] == "mask_prompt", nothing.text
    absent = httpx.post(f"{live_server.url}/v1/masks", files=files, timeout=30)
    assert absent.status_code == 400 and "mask_prompt is required" in absent.json()["error"]["message"]
    counted = httpx.get(f"{live_server.url}/metrics", timeout=30).text  # outlines alone apart from edits
    assert 'imgedit_mask_outlines_total{outcome="invalid_input",source="rest"}' in counted
    assert 'imgedit_mask_outlines_total{outcome="ok",source="rest"}' in counted

    # /v1/jobs: each item is outlined in its own job; one that found nothing fails, saying so
    job = httpx.post(f"{live_server.url}/v1/jobs", files=[("image", ("a.png", png(photo()), "image/png"))],
                     data={"prompt": "blue", "mask_prompt": "the red car", "num_inference_steps": "2"}, timeout=60)
    assert job.status_code == 202, job.text
    view = wait_job(live_server.url, job.json()["id"])
    assert view["state"] == "failed" and view["mask_prompt"] == "the red car", view
    assert all("found nothing it could outline" in item["error"] for item in view["items"]), view

    # gradio_client: /select_mask proposes (a mask file), /edit takes mask_prompt
    gradio = Client(live_server.url, verbose=False)
    try:
        path = gradio.predict([handle_file(str(_saved(photo())))], SCRIPTED, api_name="/select_mask")
        assert np.array_equal(np.asarray(Image.open(path)), np.asarray(boxes_mask([EXPECTED], (W, H))))
        with pytest.raises(Exception) as gradio_refused:
            gradio.predict([handle_file(str(_saved(photo())))], "the moon", api_name="/select_mask")
        assert "found nothing it could outline" in str(gradio_refused.value)
    finally:
        gradio.close()


def _saved(image: Image.Image):
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp()) / "in.png"
    image.save(path)
    return path
