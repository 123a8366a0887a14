"""A real browser (Debian's Chromium, driven by Playwright) edits an image through the page.

Saves a screenshot to artifacts/browser-edit.png (the README shows it).
"""

from __future__ import annotations

import shutil

import pytest
from conftest import ARTIFACTS, make_manager, picture, start_server

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def browser():
    playwright = pytest.importorskip("playwright.sync_api")
    if not shutil.which("chromium"):
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update"])
        yield browser
        browser.close()


def test_upload_prompt_edit_and_see_the_result(browser, plus_ckpt, tmp_path):
    manager = make_manager(plus_ckpt, DEFAULT_STEPS="3")
    source = tmp_path / "photo.png"
    picture(120, 90).save(source)
    with start_server(manager) as server:
        page = browser.new_page(viewport={"width": 1280, "height": 1100})
        page.goto(server.url, wait_until="networkidle")
        page.locator("#input-files input[type=file]").set_input_files(str(source))
        page.locator("#prompt textarea").fill("turn the yellow stripes blue")
        page.get_by_text("Advanced").click()
        page.get_by_label("Width (0 = auto)").fill("64")
        page.get_by_label("Height (0 = auto)").fill("64")
        page.locator("#edit-button").click()
        page.locator("#result img").first.wait_for(state="visible", timeout=120_000)
        page.wait_for_timeout(2500)  # let the GPU panel tick once more
        assert "no GPU is visible" in page.locator("#gpu-panel").inner_text()
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "browser-edit.png"), full_page=True)
        src = page.locator("#result img").first.get_attribute("src")
        assert src and (".png" in src or src.startswith("data:image/png"))
        assert manager.workers[0].jobs_done == 1


def test_bad_upload_shows_a_clear_message(browser, plus_ckpt, tmp_path):
    manager = make_manager(plus_ckpt, DEFAULT_STEPS="2")
    notes = tmp_path / "notes.png"
    notes.write_text("not an image at all")
    with start_server(manager) as server:
        page = browser.new_page()
        page.goto(server.url, wait_until="networkidle")
        page.locator("#input-files input[type=file]").set_input_files(str(notes))
        page.locator("#prompt textarea").fill("anything")
        page.locator("#edit-button").click()
        page.get_by_text("is not a readable image").first.wait_for(timeout=30_000)
        assert "Traceback" not in page.content()
        assert manager.workers[0].jobs_done == 0
