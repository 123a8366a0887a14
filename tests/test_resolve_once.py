"""#45 item 2: an edit's parameters are resolved once, at the edge, and the `Resolved` travels to the worker
(the line does not resolve again). Before: a REST edit resolved twice (the edge's check, then the manager), a
gradio `/edit` three times (the validator, the event, the manager) and decoded its images twice. Gradio's
validator still checks before the queue (validation.check_params: it cannot hand its result to the event), so
`/edit` resolves twice, but the validator reads the images' headers only: each image is decoded once on its way to
the worker (when the job leaves the line)."""

from __future__ import annotations

import httpx
from conftest import picture
from gradio_client import Client, handle_file

from imgedit.engine import manager as manager_module
from imgedit.engine import validation
from imgedit.engine.images import Encoded


def test_an_edit_is_resolved_once_on_its_way_to_a_worker(live_server, image_file, monkeypatch, tmp_path):
    calls: list[str] = []
    real = validation.resolve

    def counting(req, *args, **kwargs):
        calls.append(req.source)
        return real(req, *args, **kwargs)

    monkeypatch.setattr(manager_module, "resolve", counting)  # PipelineManager.resolve's
    monkeypatch.setattr(validation, "resolve", counting)  # check_params' (the validator's)
    decoded: list[str] = []
    real_decoded = manager_module.decoded

    def decoding(image):
        if isinstance(image, Encoded):
            decoded.append(image.label)
        return real_decoded(image)

    # every edge's inputs wait in line as their bytes and are decoded once a worker takes the job (the page's
    # Before/after and the History's stored inputs decode their own copies afterwards)
    monkeypatch.setattr(manager_module, "decoded", decoding)
    picture().save(tmp_path / "in.png")
    r = httpx.post(f"{live_server.url}/v1/images/edits", timeout=120,
                   files={"image": ("in.png", (tmp_path / "in.png").read_bytes(), "image/png")},
                   data={"prompt": "make it red", "size": "64x64", "num_inference_steps": "2", "seed": "4"})
    assert r.status_code == 200, r.text
    assert calls == ["rest"] and len(decoded) == 1, decoded
    calls.clear()
    decoded.clear()
    client = Client(live_server.url, verbose=False)
    gallery, seed = client.predict(images=[handle_file(str(image_file))], prompt="make it red", negative_prompt="",
                                   seed=3, randomize_seed=False, num_inference_steps=2, true_cfg_scale=4.0,
                                   num_images=1, width=64, height=64, api_name="/edit")
    assert seed == 3 and len(gallery) == 1
    assert calls == ["validator", "api"]  # the validator's check before the queue, then the event's, once
    assert decoded == ["input.png (image 1)"], decoded  # the validator read the header only
