"""Step caches for quality edits (#24 item 3): CACHE / a request's `cache`, diffusers' FirstBlockCache and
TaylorSeerCache hooks on the tiny real checkpoint.

CACHE_THRESHOLD=10 makes first-block reuse the other blocks on every step after the first, so its effect
is certain on random weights; the GPU machine measures the speed and the fidelity (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import group_plan, http, make_manager, picture, start_server

from imgedit.errors import Cancelled, InvalidInput, PlacementError
from imgedit.protocol import EditRequest


@pytest.fixture(scope="module")
def manager(plus_ckpt):
    return make_manager(plus_ckpt, CACHE_THRESHOLD="10")


def edit(manager, cache=None, **kw):
    args = dict(images=(picture(),), prompt="make it red", negative_prompt="blurry", seed=3, num_inference_steps=12,
                width=64, height=64, cache=cache)
    return manager.edit(EditRequest(**{**args, **kw}))


def pixels(result) -> np.ndarray:
    return np.asarray(result.images[0], dtype=np.int16)


def test_a_step_cache_changes_the_image_the_same_way_every_time_and_leaves_nothing_behind(manager):
    plain = pixels(edit(manager))
    first_block = edit(manager, "first-block")
    assert not np.array_equal(pixels(first_block), plain)  # lossy: the other blocks were reused
    assert first_block.images[0].info["cache"] == "first-block:10" and "cache" not in edit(manager).images[0].info
    assert np.array_equal(pixels(edit(manager, "first-block")), pixels(first_block))  # its state starts afresh
    taylor = pixels(edit(manager, "taylorseer"))
    assert not np.array_equal(taylor, plain) and not np.array_equal(taylor, pixels(first_block))
    assert np.array_equal(pixels(edit(manager, "taylorseer")), taylor)
    # A cached job cancelled half-way (diffusers resets the hooks' state only when a call ends normally).
    cancel = threading.Event()

    def on_step(step, total):
        if step == 5:
            cancel.set()

    with pytest.raises(Cancelled):
        manager.edit(EditRequest(images=(picture(),), prompt="make it red", negative_prompt="blurry", seed=3,
                                 num_inference_steps=12, width=64, height=64, cache="first-block"),
                     on_step=on_step, cancel=cancel)
    assert np.array_equal(pixels(edit(manager, "first-block")), pixels(first_block))
    assert np.array_equal(pixels(edit(manager, "none")), plain)  # and no hook stays for the next uncached job


def test_the_server_setting_applies_the_request_overrides_and_bad_values_are_refused(plus_ckpt, manager):
    cached = make_manager(plus_ckpt, CACHE="first-block", CACHE_THRESHOLD="10")
    assert cached.status().cache == "first-block (threshold 10)"
    assert np.array_equal(pixels(edit(cached)), pixels(edit(manager, "first-block")))
    assert np.array_equal(pixels(edit(cached, "none")), pixels(edit(manager)))
    done = sum(w.jobs_done for w in manager.workers)
    with pytest.raises(InvalidInput, match="cache must be one of none, first-block, taylorseer") as refused:
        edit(manager, "teacache")
    assert refused.value.field == "cache" and sum(w.jobs_done for w in manager.workers) == done
    with start_server(cached) as server:
        r = http.post(f"{server.url}/v1/images/edits", timeout=60, data={"prompt": "x", "cache": "fast"},
                       files={"image": ("a.png", picture_bytes(), "image/png")})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache", r.text
        health = http.get(f"{server.url}/health", timeout=30).json()
        assert health["cache"] == "first-block (threshold 10)"


def test_a_cache_where_the_workers_cannot_run_it_is_refused_at_start_with_the_reason(plus_ckpt):
    """Compiled workers and Ulysses groups (the latter refused while planning, before any worker starts)."""
    with pytest.raises(PlacementError, match="CACHE=taylorseer cannot run here: the workers are compiled"):
        make_manager(plus_ckpt, CACHE="taylorseer", COMPILE="on")
    with pytest.raises(PlacementError, match="CACHE=taylorseer cannot run here: a Ulysses group splits each"):
        make_manager(plus_ckpt, plan=group_plan("ulysses", 2, 2), load=False, CACHE="taylorseer").prepare()
    # A job's (or a batch's) own `cache` on such workers: a 400 naming the field, before anything runs.
    ulysses = make_manager(plus_ckpt, plan=group_plan("ulysses", 2, 2), load=False).prepare()
    with pytest.raises(InvalidInput, match="cache first-block is not available on this server: a Ulysses") as refused:
        ulysses.check(EditRequest(images=(), prompt="x", cache="first-block"))
    assert refused.value.field == "cache"
    ulysses.check(EditRequest(images=(), prompt="x", cache="none"))  # no cache asked: nothing to refuse
    ulysses.check(EditRequest(images=(), prompt="x"))


def picture_bytes() -> bytes:
    import io

    buffer = io.BytesIO()
    picture().save(buffer, "PNG")
    return buffer.getvalue()
