"""#64 "Select what to edit by words" on the page, in Chromium: the words go to the model's own text encoder, and
what it outlines becomes the mask canvas's brush layer, which the Edit button then sends as the painted mask.

The tiny checkpoint's random encoder finds nothing for plain words (the real refusal: the note says so and
nothing else changes); a box scripted at the encoder's output (tests/faults.py's `[answer:TEXT:answer]`)
stands in for a trained model's answer.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from conftest import ARTIFACTS, open_app, picture
from PIL import Image
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from imgedit.engine.masks import mask_digest
from imgedit.model.boxes import boxes_mask

W, H = 64, 64
EXPECTED = (8, 16, 32, 48)  # the scripted box [7, 14, 28, 42] on the encoder's 56x56 view of a 64x64 input
SCRIPTED = 'the door [answer:[{"bbox_2d": [7, 14, 28, 42], "label": "door"}]:answer]'


@pytest.fixture
def page(browser, live_server):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    open_app(page, live_server.url)
    yield page
    page.context.close()


def test_select_by_words_proposes_the_brush_layer_or_says_nothing_was_found(page, tmp_path, server_manager):
    from playwright.sync_api import expect

    photo = tmp_path / "photo.png"
    picture(W, H, (40, 140, 90)).save(photo)
    page.get_by_text("Advanced").click()  # the masked edit at the input's own 64x64 (the tiny model on a CPU)
    for label in ("Width (0 = auto)", "Height (0 = auto)"):
        page.get_by_label(label).fill(str(W))
        page.get_by_label(label).press("Tab")
    page.locator("#input-files input[type=file]").set_input_files(str(photo))
    page.get_by_text("Mask: edit only where you paint").click()
    expect(page.locator("#mask-canvas button[aria-label=Undo]")).to_be_enabled(timeout=60_000)
    words, note = page.locator("#mask-words textarea, #mask-words input").first, page.locator("#mask-select-note")

    # the random weights write no box: said plainly beside Select, and nothing else changes
    words.fill("the red car")
    page.locator("#mask-select").click()
    expect(note).to_contain_text("Nothing selected", timeout=120_000)
    assert "found nothing it could outline" in note.inner_text() and "draw the mask" in note.inner_text()
    assert page.locator("#edit-status").inner_text() == "Results appear here."

    # a box (scripted at the encoder's output): the canvas gets it as brush strokes, and Edit sends them
    words.fill(SCRIPTED)
    words.press("Enter")
    expect(note).to_contain_text("Selected 1 area(s)", timeout=120_000)
    expect(page.locator("#mask-canvas [data-testid=status-tracker]")).to_have_class(re.compile(r"\bhide\b"),
                                                                                   timeout=60_000)
    page.locator("#prompt textarea").fill("paint the door blue")
    done_before = sum(w.jobs_done for w in server_manager.workers)
    page.locator("#edit-button").click()
    try:
        page.locator("#edit-status").get_by_text("Done in").wait_for(timeout=120_000)
    except PlaywrightTimeout:  # once in a full run on the loaded 2-core machine: say what the page showed
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "browser-ground-no-done.png"), full_page=True)
        pytest.fail(f"no 'Done in' 120 s after Edit: the status said {page.locator('#edit-status').inner_text()!r}, "
                    f"the message {page.locator('#edit-message').inner_text()!r}, the workers finished "
                    f"{sum(w.jobs_done for w in server_manager.workers) - done_before} job(s) meanwhile, the Edit "
                    f"button is {'enabled' if page.locator('#edit-button').is_enabled() else 'disabled'} "
                    "(artifacts/browser-ground-no-done.png)")
    assert "Only the painted area" in page.locator("#edit-status").inner_text()  # masked by the proposal
    with page.expect_download(timeout=30_000) as download:
        page.locator("#download-result").click()
    saved = tmp_path / "result.png"
    download.value.save_as(saved)
    result = Image.open(saved)
    assert result.size == (W, H) and result.text["mask"] == f"sha256:{mask_digest(boxes_mask([EXPECTED], (W, H)))}"
    outside = np.asarray(boxes_mask([EXPECTED], (W, H))) == 0
    before = np.asarray(Image.open(photo).convert("RGB"))
    assert np.array_equal(np.asarray(result.convert("RGB"))[outside], before[outside])
