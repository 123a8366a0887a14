"""The page's half of #64 in a real browser (Chromium through Playwright), on the shared live server (the tiny
real checkpoint, two CPU workers): the live preview while an edit runs (web/page/live_preview.py), gone on
Cancel and replaced by the result; the Expand box (web/page/expand.py) padding the canvas by presets and pixels,
its picture before the edit, the expanded edit keeping the input's pixels, and Copy as API call repeating it
over REST pixel for pixel (an unwatched REST job makes no preview)."""

from __future__ import annotations

import base64
import io
import shlex
import threading

import numpy as np
import pytest
from conftest import http, open_app, picture, wait_for
from PIL import Image

pytestmark = pytest.mark.browser


def previews_while_running(page, minimum: int, timeout_ms: int = 60_000) -> set[str]:
    """The live preview's distinct pictures, each read while the progress bar shows the steps, until
    `minimum`. Read in the browser every 50 ms (a test process slowed by a loaded machine misses none)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page.evaluate("() => { window.previewsSeen = new Set(); }")
    try:
        page.wait_for_function("""(minimum) => {
            const src = document.querySelector('#live-preview img')?.src;
            const stepping = /denoising|decoding the result/.test(document.querySelector('#result').innerText);
            if (src && stepping) window.previewsSeen.add(src);
            return window.previewsSeen.size >= minimum; }""", arg=minimum, polling=50, timeout=timeout_ms)
    except PlaywrightTimeout:
        pass
    seen = set(page.evaluate("() => [...window.previewsSeen]"))
    assert len(seen) >= minimum, f"{len(seen)} live preview(s) seen while the steps ran, wanted {minimum}"
    return seen


def test_live_preview_and_expanding_the_canvas_in_one_page(browser, live_server, server_manager, tmp_path):
    from playwright.sync_api import expect

    photo = tmp_path / "photo.png"
    original = picture(80, 60)
    original.save(photo)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    threads: list[threading.Thread] = []  # a REST edit beside the page's, and a look at the workers meanwhile
    ended = threading.Event()
    try:
        open_app(page, live_server.url)
        page.get_by_text("Advanced").click()
        for label, value in (("Width (0 = auto)", "64"), ("Steps (", "6")):
            page.get_by_label(label).fill(value)
            page.get_by_label(label).press("Tab")  # a Number updates on blur
        page.locator("#input-files input[type=file]").set_input_files(str(photo))
        page.locator("#compare img").first.wait_for(state="visible", timeout=30_000)  # the upload check is done

        # Cancel: the preview goes with the run. 0.3 s per forward ([slow]: tests/faults.py), two a step (CFG).
        page.locator("#prompt textarea").fill("[slow] continue the scene")
        page.locator("#edit-button").click()
        previews_while_running(page, 1)
        page.locator("#cancel-button").click()
        page.locator("#edit-status").get_by_text("Cancelled").wait_for(timeout=30_000)
        expect(page.locator("#live-preview")).to_be_hidden(timeout=10_000)
        wait_for(lambda: all(w.state == "idle" for w in server_manager.workers), 30, "cancel left a worker busy")

        # Expand: an aspect preset, a side typed in pixels, then a side preset (a quarter of the input's width).
        page.locator("#expand-accordion").get_by_text("Expand the canvas").click()
        text = page.locator("#param-expand textarea")
        page.locator("#expand-to-16-9").click()
        expect(text).to_have_value("left=13,right=14", timeout=10_000)  # 80x60 -> 107x60
        expect(page.locator("#expand-px-right input")).to_have_value("14", timeout=10_000)
        page.locator("#expand-px-top input").fill("16")
        expect(text).to_have_value("left=13,top=16,right=14", timeout=10_000)
        page.locator("#expand-left").click()
        expand = "left=33,top=16,right=14"
        expect(text).to_have_value(expand, timeout=10_000)
        expect(page.locator("#expand-note")).to_contain_text("Canvas 127x76", timeout=10_000)
        canvas = page.locator("#expand-canvas img")
        canvas.wait_for(state="visible", timeout=10_000)
        # visible before its picture has loaded (naturalWidth 0 on a loaded machine, 2026-11-30): wait for it
        page.wait_for_function("() => { const img = document.querySelector('#expand-canvas img');"
                               " return img !== null && img.complete && img.naturalWidth > 0; }", timeout=10_000)
        assert canvas.evaluate("img => [img.naturalWidth, img.naturalHeight]") == [127, 76]
        page.locator("#expand-px-left input").fill("5000")  # over MAX_SIDE: our message, before any edit
        expect(page.locator("#expand-note")).to_contain_text("out of range", timeout=10_000)
        page.locator("#expand-px-left input").fill("33")
        expect(text).to_have_value(expand, timeout=10_000)

        # Copy as API call says the same; its curl snippet, sent as written, runs beside the page's edit (two
        # workers): the page's job, watched, shows its previews; the REST one, unwatched, has none.
        page.locator("#copy-api").click()
        page.locator("#api-curl").get_by_text("expand=").wait_for(timeout=30_000)
        assert f"expand={expand!r}" in page.locator("#api-gradio").inner_text()
        assert f"'expand': '{expand}'" in page.locator("#api-openai").inner_text()
        curl = page.locator("#api-curl").inner_text()
        words = shlex.split(curl.split("| python3")[0].replace("\\\n", " "), comments=True)
        fields = dict(words[i + 1].split("=", 1) for i, word in enumerate(words) if word == "-F")
        assert fields.pop("image") == "@input-1.png" and fields["expand"] == expand, fields
        previews: dict[str, bool] = {}  # job -> whether its worker ever held a preview for it
        replies = []

        def rest_edit() -> None:
            replies.append(http.post(f"{live_server.url}/v1/images/edits", data=fields, timeout=120,
                                     files={"image": ("input-1.png", photo.read_bytes(), "image/png")}))

        def look() -> None:
            while not ended.wait(0.05):
                for w in server_manager.workers:
                    if job := w.job_id:
                        previews[job] = previews.get(job, False) or w.preview is not None

        threads += [threading.Thread(target=rest_edit), threading.Thread(target=look)]
        for thread in threads:
            thread.start()
        # The expanded edit, watched: several previews while it runs, then the result in their place.
        page.locator("#edit-button").click()
        assert len(previews_while_running(page, 2)) >= 2
        page.locator("#result img").first.wait_for(state="visible", timeout=120_000)
        expect(page.locator("#live-preview")).to_be_hidden(timeout=10_000)
        assert "The canvas was expanded" in page.locator("#edit-status").inner_text()
        got = Image.open(io.BytesIO(http.get(page.locator("#result img").first.get_attribute("src")).content))
        assert got.size == (127, 76) and got.info["expand"] == expand
        pixels = np.asarray(got.convert("RGB"))
        assert (pixels[16:76, 33:113] == np.asarray(original)).all()  # the input's pixels, where they were
        assert np.abs(pixels[:16].astype(int) - 128).mean() > 1  # the new area is the model's, not grey
        threads[0].join()
    finally:
        ended.set()
        page.context.close()
        for thread in threads:
            thread.join()
    [r] = replies
    assert r.status_code == 200, r.text
    again = Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"])))
    assert np.array_equal(np.asarray(again.convert("RGB")), pixels)  # the snippet repeats the page's edit
    assert sorted(previews.values()) == [False, True], previews
