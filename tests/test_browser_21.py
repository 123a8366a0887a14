"""Qwen-Image-2.1's page in a real browser (Debian's Chromium through Playwright): with no input image the
button reads Generate and makes an image from the prompt; an upload turns it into Edit, and ten inputs are
taken (an eleventh is left out with a message)."""

from __future__ import annotations

import pytest
from conftest import make_manager, open_app, picture, start_server

from imgedit.model.demo_checkpoint import build_checkpoint

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = build_checkpoint(tmp_path_factory.mktemp("ckpt") / "q21", kind="21", seed=0)
    with start_server(make_manager(ckpt, DEFAULT_STEPS="2")) as server:
        yield server


def test_generate_without_an_input_then_edit_with_ten(browser, server, tmp_path):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        open_app(page, server.url)
        button = page.locator("#edit-button")
        assert button.inner_text().strip() == "Generate"
        page.get_by_text("Advanced").click()
        for label in ("Width (0 = auto)", "Height (0 = auto)"):
            page.get_by_label(label).fill("64")
            page.get_by_label(label).press("Tab")
        page.locator("#prompt textarea").fill("a lighthouse at dusk")
        button.click()
        page.locator("#result img").first.wait_for(state="visible", timeout=120_000)
        assert "Seed used:" in page.locator("#edit-status").inner_text()
        assert page.locator("#edit-message").inner_text().strip() == ""  # nothing refused
        files = []
        for k in range(11):
            path = tmp_path / f"ref{k}.png"
            picture(48 + 4 * k, 48, (20 * k, 100, 200)).save(path)
            files.append(str(path))
        page.locator("#input-files input[type=file]").set_input_files(files)
        page.wait_for_function("() => document.querySelector('#edit-button')?.innerText.trim() === 'Edit'",
                               timeout=30_000)
        page.get_by_text("only the first 10 are kept").first.wait_for(timeout=30_000)
        page.wait_for_function("() => document.querySelectorAll('#input-preview img').length === 10",
                               timeout=30_000)
    finally:
        page.context.close()
