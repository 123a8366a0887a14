"""A real browser runs a batch in the page, then finds it in History; a second browser does not.

Saves a screenshot to artifacts/browser-batch.png.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import ARTIFACTS, make_manager, open_app, picture, start_server

pytestmark = pytest.mark.browser


def test_batch_in_the_page_then_history_per_browser(browser, plus_ckpt, tmp_path):
    from playwright.sync_api import expect

    manager = make_manager(plus_ckpt, DEFAULT_STEPS="2")
    sources = []
    for i in range(3):
        path = tmp_path / f"photo{i}.png"
        picture(96, 64, (60 * i, 90, 200)).save(path)
        sources.append(str(path))
    broken = tmp_path / "broken.png"
    broken.write_text("not an image")
    sources.append(str(broken))
    with start_server(manager) as server:
        context = browser.new_context(viewport={"width": 1280, "height": 1400})
        page = context.new_page()
        open_app(page, server.url)
        page.get_by_text("Advanced").click()
        page.get_by_label("Width (0 = auto)").fill("64")
        page.get_by_label("Height (0 = auto)").fill("64")
        page.get_by_role("tab", name="Batch").click()
        page.locator("#batch-files input[type=file]").set_input_files(sources)
        page.locator("#batch-prompt textarea").fill("turn the stripes blue")
        # Watch the tab while the batch runs: Gradio's overlays ("0.0%" on every output, a bar that stayed at 0,
        # a timer restarting at each update) are gone; one progress line counts up.
        page.evaluate("""() => {
            window.seen = {overlays: 0, values: []};
            const tab = document.querySelector('#batch-gallery').closest('.tabitem') || document.body;
            new MutationObserver(() => {
                const shown = [...tab.querySelectorAll('.progress-text, .eta-bar, .progress-level, .meta-text')]
                    .filter(el => el.checkVisibility({opacityProperty: true, visibilityProperty: true}));
                window.seen.overlays = Math.max(window.seen.overlays, shown.length);
                if (shown.length) window.seen.where = shown.map(el => el.closest('[id]')?.id + ': ' + el.innerText);
                const bar = document.querySelector('#batch-progress progress');
                if (bar) window.seen.values.push([bar.value, bar.max]);
            }).observe(tab, {subtree: true, childList: true, attributes: true, characterData: true});
        }""")
        page.locator("#batch-button").click()
        page.locator("#batch-zip a").first.wait_for(state="visible", timeout=180_000)
        report = page.locator("#batch-report").inner_text()
        assert "3 of 4 done, 1 failed" in report and "broken.png is not a readable image" in report, report
        seen = page.evaluate("window.seen")
        values = [v for v, _ in seen["values"]]
        assert seen["overlays"] == 0 and values and values == sorted(values), seen
        assert seen["values"][-1] == [4, 4] and len(set(values)) >= 2, seen
        assert "4 of 4 image(s) finished" in page.locator("#batch-progress").inner_text()
        assert page.locator("#batch-gallery img").count() == 3
        # #62: the zip is named from the prompt, as single downloads are (it was job_Obh1Y4DbJcwVPcOk.zip)
        link = page.locator("#batch-zip a").first
        name = (link.get_attribute("download") or link.get_attribute("href").rsplit("/", 1)[-1]).strip()
        assert name == "turn-the-stripes-blue-3-results.zip", name
        # #62: the GPU panel says the worker is idle as soon as the tab says done. It showed the worker busy
        # ("busy — a job preparing") until its next 2 s tick: read at once here, with no tick waited for.
        page.get_by_role("tab", name="GPUs").click()
        panel = page.locator("#gpu-panel")
        panel.wait_for(state="visible", timeout=5_000)
        assert not re.search(r"busy|step \d+/\d+|running|preparing|not yet done", panel.inner_text()), \
            panel.inner_text()
        page.get_by_role("tab", name="Batch").click()
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "browser-batch.png"), full_page=True)

        page.get_by_role("tab", name="History").click()
        page.locator("#history-gallery img").nth(2).wait_for(state="visible", timeout=30_000)
        assert page.locator("#history-gallery img").count() == 3
        # Fixed-size thumbnails with their captions (a few entries once stretched into full-width banners).
        boxes = [page.locator("#history-gallery img").nth(k).bounding_box() for k in range(3)]
        assert all(b["width"] <= 200 and b["height"] <= 200 for b in boxes), boxes
        captions = page.locator("#history-gallery .caption-label").all_inner_texts()
        assert len(captions) == 3 and all("turn the stripes blue" in c and "seed" in c for c in captions), captions
        page.locator("#history-gallery img").first.click()
        page.locator("#history-details").get_by_text("turn the stripes blue").wait_for(timeout=30_000)
        page.locator("#history-result img").first.wait_for(state="visible", timeout=30_000)
        shown = page.locator("#history-result img").first.bounding_box()  # one result: not a full-width banner
        assert shown["width"] <= 340 and shown["height"] <= 340, shown
        page.locator("#history-download a").first.wait_for(state="visible", timeout=30_000)
        # #46 item 6: named as Download PNG names a result (it was imgedit-<hash>.png)
        link = page.locator("#history-download a").first
        name = link.get_attribute("download") or link.get_attribute("href").rsplit("/", 1)[-1]
        assert re.fullmatch(r"turn-the-stripes-blue-seed\d+\.png", name.strip()), name
        # #62: the entry's seed into the editor in one click
        seed = re.search(r"seed (\d+)", page.locator("#history-details").inner_text()).group(1)
        page.get_by_label("Seed", exact=True).fill("0")
        page.locator("#history-reuse-seed").click()
        expect(page.get_by_label("Seed", exact=True)).to_have_value(seed, timeout=30_000)
        assert not page.get_by_label("Randomize seed").is_checked()
        page.locator("#history-open").click()
        expect(page.locator("#prompt textarea")).to_have_value("turn the stripes blue", timeout=30_000)
        expect(page.locator("#input-files")).to_contain_text("input-1", timeout=30_000)

        # #46 item 6: a re-run's result shows here, where it was asked for, and joins the list; Delete removes
        # an entry and its files
        stored = Path(manager.settings.output_dir)
        page.locator("#history-rerun").click()
        page.locator("#history-details").get_by_text("Re-run done").wait_for(timeout=120_000)
        expect(page.locator("#history-gallery img")).to_have_count(4, timeout=30_000)
        page.locator("#history-result img").first.wait_for(state="visible", timeout=30_000)
        assert "turn the stripes blue" in page.locator("#history-details").inner_text()
        assert len(list(stored.rglob("thumb.png"))) == 4
        # #62: Delete asks first (it acted at once); "Keep it" keeps it
        page.locator("#history-delete").click()
        page.locator("#history-delete-keep").click()
        expect(page.locator("#history-confirm")).to_be_hidden(timeout=30_000)
        assert len(list(stored.rglob("thumb.png"))) == 4
        page.locator("#history-delete").click()
        page.locator("#history-delete-confirm").click()
        page.locator("#history-details").get_by_text("Deleted:").wait_for(timeout=30_000)
        expect(page.locator("#history-gallery img")).to_have_count(3, timeout=30_000)
        assert len(list(stored.rglob("thumb.png"))) == 3
        assert page.locator("#history-result img").count() == 0

        stranger = browser.new_context().new_page()
        open_app(stranger, server.url)
        stranger.get_by_role("tab", name="History").click()
        stranger.get_by_text("Nothing here yet").wait_for(timeout=30_000)
        assert stranger.locator("#history-gallery img").count() == 0
        assert sum(w.jobs_done for w in manager.workers) == 4  # the batch's three and the re-run
