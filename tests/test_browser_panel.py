"""The GPU panel in a real browser (Debian's Chromium, driven by Playwright), on a desktop and a phone.

On this GPU-less machine the live page says so in one line and shows the worker's state; a server
whose GPU readings come from made-up GPUs (tests/fake_nvml.py, the NVML seam) shows cards with
bars and a plot that grows with the page's refreshes; a made-up 2-GPU snapshot with a split model
and a running job is laid out with sensible sizes. Saves artifacts/browser-panel-*.png.
"""

from __future__ import annotations

import pytest
from conftest import ARTIFACTS, LiveServer, free_port, make_manager, open_app, start_server
from fake_nvml import FakeGpu, FakeNvml

from imgedit.engine.workers.gpus import GpuMonitor, discover_gpus, snapshot
from imgedit.protocol import ManagerStatus, WorkerStatus
from imgedit.web.app import build_app
from imgedit.web.page.panel import PLOT_H, panel_html

pytestmark = pytest.mark.browser
VIEWPORTS = {"desktop": {"width": 1400, "height": 1000}, "phone": {"width": 390, "height": 844}}


@pytest.fixture(scope="module")
def manager(plus_ckpt):
    return make_manager(plus_ckpt, DEFAULT_STEPS="2")


def overflow(page, selector: str = "html") -> dict:
    """How far the page, and the element, reach past the viewport's right edge (0 = no overflow)."""
    return page.evaluate("""(sel) => {
        const el = document.querySelector(sel), box = el.getBoundingClientRect();
        return {page: document.documentElement.scrollWidth - window.innerWidth,
                element: Math.max(0, box.right - window.innerWidth, el.scrollWidth - el.clientWidth)};
    }""", selector)


def boxes(page, selector: str) -> list[dict]:
    return [page.locator(selector).nth(i).bounding_box() for i in range(page.locator(selector).count())]


def test_without_gpus_the_live_panel_says_so_in_one_line_with_the_workers_state(browser, manager):
    if discover_gpus():
        pytest.skip("this machine has GPUs: the panel shows them instead")
    with start_server(manager) as server:
        for name, viewport in VIEWPORTS.items():
            page = browser.new_page(viewport=viewport)
            open_app(page, server.url)
            panel = page.locator("#gpu-panel")
            panel.locator(".gp-worker").first.wait_for(timeout=30_000)
            assert panel.locator(".gp-none").all_inner_texts() == ["no GPU is visible: the model runs on the CPU"]
            assert panel.locator(".gp-worker").all_inner_texts() == ["worker-0 on cpu: idle"]
            assert panel.locator(".gp-card").count() == 0
            line = panel.locator(".gp-none").bounding_box()
            assert line["height"] < 40, line  # one line, even on the phone
            assert overflow(page, "#gpu-panel") == {"page": 0, "element": 0}, name
            text = panel.inner_text()
            assert "Traceback" not in text and "Error" not in text
            # The detail lines (placement, weights) are readable: they were tiny light-grey text.
            size, color = page.evaluate("""() => { const s = getComputedStyle(document.querySelector(
                '#gpu-panel .gp-foot')); return [parseFloat(s.fontSize), s.color]; }""")
            grey = [int(v) for v in color[color.index("(") + 1:color.index(")")].split(",")[:3]]
            assert size >= 12 and max(grey) < 100, (size, color)
            page.close()


def test_made_up_gpus_get_bars_and_a_plot_that_grows_in_the_live_page(browser, manager):
    pid = manager.status().workers[0].pids[0]
    nvml = FakeNvml([FakeGpu("NVIDIA H200", 143_771, used_mib=40_000, util=65, processes={pid: 30_000, 1: 9_000}),
                     FakeGpu("NVIDIA H200", 143_771, used_mib=600, util=0)])
    with start_server_with(manager, GpuMonitor(nvml=nvml)) as server:
        for name, viewport in VIEWPORTS.items():
            page = browser.new_page(viewport=viewport)
            open_app(page, server.url)
            page.locator("#gpu-panel .gp-card").nth(1).wait_for(timeout=30_000)
            # The page refreshes the panel every 2 s; each refresh adds a reading to the plot (slower on 2 busy cores).
            page.wait_for_function("""() => {
                const area = document.querySelector('#gpu-panel .gp-card .gp-area');
                return area && area.getAttribute('points').trim().split(/\\s+/).length >= 6; }""", timeout=60_000)
            cards = boxes(page, "#gpu-panel .gp-card")
            assert len(cards) == 2
            check_card_sizes(page, "#gpu-panel")
            if name == "desktop":
                assert abs(cards[0]["y"] - cards[1]["y"]) < 2 and cards[1]["x"] > cards[0]["x"] + 200  # side by side
            else:
                assert cards[1]["y"] > cards[0]["y"] + cards[0]["height"] - 2  # stacked
            first = page.locator("#gpu-panel .gp-card").first.inner_text()
            assert "activations 29.3 GiB" in first and "other processes 9.8 GiB" in first and "util 65%" in first
            assert overflow(page, "#gpu-panel") == {"page": 0, "element": 0}, name
            ARTIFACTS.mkdir(exist_ok=True)
            page.locator("#gpu-panel").screenshot(path=str(ARTIFACTS / f"browser-panel-live-{name}.png"))
            page.close()


def start_server_with(manager, monitor: GpuMonitor) -> LiveServer:
    return LiveServer(build_app(manager.settings, manager, monitor=monitor), free_port())


def check_card_sizes(page, root: str) -> None:
    """Every bar spans its card; its segments fill the bar exactly; the plot is as wide as the bar."""
    for i in range(page.locator(f"{root} .gp-card").count()):
        card = page.locator(f"{root} .gp-card").nth(i)
        box, bar = card.bounding_box(), card.locator(".gp-bar").bounding_box()
        plot = card.locator(".gp-plot").bounding_box()
        assert bar["width"] > 0.85 * box["width"] - 24 and 12 <= bar["height"] <= 24, (box, bar)
        segments = [s.bounding_box() for s in card.locator(".gp-seg").all()]
        assert len(segments) == 4 and abs(sum(s["width"] for s in segments) - bar["width"]) < 1.5, (bar, segments)
        assert all(abs(s["y"] - bar["y"]) < 1 and abs(s["height"] - bar["height"]) < 1 for s in segments)
        assert abs(plot["width"] - bar["width"]) < 1.5 and abs(plot["height"] - PLOT_H) < 1, (bar, plot)
        assert box["x"] >= 0 and box["x"] + box["width"] <= page.viewport_size["width"]


def made_up_two_gpus() -> str:
    """A split model on two GPUs, running a job, with two minutes of readings and a pause in them."""
    nvml = FakeNvml([FakeGpu("NVIDIA H200", 143_771, used_mib=31_000, util=88, processes={41: 29_500}),
                     FakeGpu("NVIDIA H200", 143_771, used_mib=50_000, util=12, processes={41: 36_000, 77: 13_000})])
    split = WorkerStatus("worker-0", ("cuda:0", "cuda:1"),
                         {"transformer": "blocks 0-29 -> cuda:0, blocks 30-59 -> cuda:1", "text_encoder": "cuda:1",
                          "vae": "cuda:0"}, "busy", "job-31337-4", 17, 40, 3, None, pids=(41,),
                         weights_mib={"cuda:0": 19_900.0, "cuda:1": 35_100.0})
    status = ManagerStatus(True, "m", "plus", "balanced", "transformer split by blocks because no single GPU can "
                           "hold it", 2, (split,))
    monitor = GpuMonitor(nvml=nvml)
    for t in range(0, 120, 2):
        if not 50 <= t < 70:  # nobody looked for 20 s
            nvml.gpus[0].processes[41] = 25_000 + 60 * t
            nvml.gpus[0].used_mib = 26_500 + 60 * t
            snapshot(monitor, status, now=float(t))
    return panel_html(snapshot(monitor, status, history=True, now=120.0))


def test_a_made_up_two_gpu_snapshot_is_laid_out_with_sensible_sizes(browser):
    html = made_up_two_gpus()
    for name, viewport in VIEWPORTS.items():
        page = browser.new_page(viewport=viewport)
        page.set_content(f'<!doctype html><html><body style="margin:8px;font-family:sans-serif">{html}</body></html>')
        cards = boxes(page, ".gp-card")
        assert len(cards) == 2
        check_card_sizes(page, "body")
        if name == "desktop":
            assert abs(cards[0]["y"] - cards[1]["y"]) < 2 and 300 <= cards[0]["width"] <= 700
        else:
            assert cards[1]["y"] > cards[0]["y"] + cards[0]["height"] - 2 and cards[0]["width"] > 300
        first, second = page.locator(".gp-card").nth(0), page.locator(".gp-card").nth(1)
        assert "worker-0: transformer (blocks 0-29)" in first.inner_text()
        assert "worker-0: transformer (blocks 30-59)" in second.inner_text()
        assert "worker-0: running job-31337-4 — step 17/40" in first.inner_text()
        progress = first.locator(".gp-progress span").bounding_box()
        track = first.locator(".gp-progress").bounding_box()
        assert abs(progress["width"] / track["width"] - 17 / 40) < 0.02
        assert first.locator(".gp-area").count() == 6  # the pause leaves a gap: two runs of 3 layers
        weights = first.locator(".gp-weights").bounding_box()["width"]
        assert abs(weights / first.locator(".gp-bar").bounding_box()["width"] - 19_900 / 143_771) < 0.01
        assert overflow(page) == {"page": 0, "element": 0}, name
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"browser-panel-{name}.png"), full_page=True)
        page.close()
