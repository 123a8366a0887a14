"""Regenerate the README's screenshots: the real page in demo mode after a finished demo edit.

Starts `app.py --demo` on a free port, fills the form from the first example, runs the edit in
Chromium (Debian's package, driven by Playwright) and saves docs/screenshot.png (desktop 1400x1000)
and docs/screenshot-phone.png (390x844). Usage: python benchmarks/screenshots.py
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, server: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the demo server exited with {server.returncode}")
        try:
            with urllib.request.urlopen(f"{url}health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit("the demo server did not become ready")


def shoot(browser, url: str, path: Path, width: int, height: int, full_page: bool) -> None:
    page = browser.new_page(viewport={"width": width, "height": height})
    page.goto(url, wait_until="networkidle")
    page.locator("#examples").get_by_text("Landscape: sunset sky").first.click()
    page.locator("#input-files").get_by_text("landscape").first.wait_for(timeout=30_000)
    page.locator("#edit-button").click()
    page.locator("#edit-status").get_by_text("Seed used").wait_for(timeout=180_000)
    page.locator("#result img").first.wait_for(state="visible", timeout=30_000)
    if not full_page:
        page.locator("#result").scroll_into_view_if_needed()
    page.wait_for_timeout(2500)  # the GPU panel's next tick
    page.screenshot(path=str(path), full_page=full_page)
    page.close()


def main() -> int:
    from playwright.sync_api import sync_playwright

    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    env = {**os.environ, "GRADIO_SERVER_PORT": str(port), "GRADIO_SERVER_NAME": "127.0.0.1",
           "OUTPUT_DIR": tempfile.mkdtemp(prefix="imgedit-shots-")}
    server = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--demo"], cwd=ROOT, env=env)
    try:
        wait_ready(url, server)
        DOCS.mkdir(exist_ok=True)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            shoot(browser, url, DOCS / "screenshot.png", 1400, 1000, full_page=True)
            shoot(browser, url, DOCS / "screenshot-phone.png", 390, 844, full_page=False)
            browser.close()
    finally:
        server.send_signal(signal.SIGTERM)  # the app stops its worker processes on SIGTERM
        server.wait(timeout=60)
    print(f"wrote {DOCS / 'screenshot.png'} and {DOCS / 'screenshot-phone.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
