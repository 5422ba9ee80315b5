"""The viewer in real Chromium: the heatmap marks the slow rank in exactly its slow steps, the
collectives view names it last, a click moves the embedded Perfetto UI to that moment (asked of
the UI itself), hostile names stay text, the page fetches nothing from elsewhere, and the
exported report makes no request at all. On hand-built traces, a real gloo run and the H200
sample."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from gputrace.demo import free_port, rank_environment
from gputrace.viewer import data, report, server

from . import perfetto_ui
from .test_viewer import BASE, HOSTILE, STEP, make_trace

pytestmark = pytest.mark.browser
ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "samples" / "h200x2-nccl"
SLOW = {2: {3, 7, 8}}  # rank 2 is slow in steps 3, 7 and 8 of 12
PROBE = "() => document.querySelector('[data-testid=heatmap]').probe"
SLICES = "select count(*) as n from slice"

why_not = perfetto_ui.available()
if why_not:
    pytestmark = [pytestmark, pytest.mark.skip(reason=why_not)]  # type: ignore[assignment]


@contextmanager
def serving(trace: Any, ui: server.UISource, **kw: Any) -> Iterator[str]:
    viewer = server.Viewer(trace, data.document(trace, **kw), ui, name="test")
    httpd = viewer.serve(0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        httpd.server_close()


def open_page(browser: Any, url: str) -> Any:
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    page.requests = []  # (url, whether the viewer's own page asked, not a frame inside it)
    page.errors = []  # uncaught errors and content security policy violations

    def record(req: Any) -> None:
        try:
            main = req.frame == page.main_frame
        except Exception:  # a worker's request has no frame: a worker of the Perfetto UI
            main = False
        page.requests.append((req.url, main))

    page.on("request", record)
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    page.on("console", lambda m: page.errors.append(m.text) if "Content Security Policy" in m.text else None)
    page.goto(url)
    page.wait_for_selector("body[data-ready='1']", timeout=30_000)
    return page


def marked_cells(page: Any) -> tuple[set[tuple[int, int]], list[list[int]]]:
    """The cells drawn with the verdict's mark, and every cell's centre colour."""
    ranks = int(page.get_attribute("[data-testid=heatmap]", "data-ranks"))
    steps = int(page.get_attribute("[data-testid=heatmap]", "data-steps"))
    colours = page.evaluate(
        f"([n, s]) => {{ const p = ({PROBE})(); const out = [];"
        " for (let r = 0; r < n; r++) for (let k = 0; k < s; k++) out.push(p.pixel(r, k)); return out; }",
        [ranks, steps],
    )
    assert len(colours) == ranks * steps
    marks = {(i // steps, i % steps) for i, c in enumerate(colours) if c == [0, 0, 0]}
    return marks, colours


def click_cell(page: Any, rank_slot: int, k: int) -> None:
    box = page.locator("[data-testid=heatmap]").bounding_box()
    c = page.evaluate(f"([r, k]) => ({PROBE})().centre(r, k)", [rank_slot, k])
    page.mouse.click(box["x"] + c["x"], box["y"] + c["y"])


def ui_frame(page: Any) -> Any:
    for _ in range(600):
        frames = [f for f in page.frames if "mode=embedded" in f.url]
        if frames:
            return frames[0]
        page.wait_for_timeout(100)  # lets Playwright take in the frame's events, unlike a sleep
    raise AssertionError("no Perfetto UI frame")


VISIBLE_JS = """() => {
  const t = window.app && window.app.trace;
  if (!t || !t.timeline) return null;
  const v = t.timeline.visibleWindow;
  return [Number(v.start.integral) + v.start.fractional, v.duration];
}"""


def wait_visible(frame: Any, start_ns: float, end_ns: float, bounds: tuple[int, int] | None = None) -> list[float]:
    """Wait until the Perfetto UI shows [start_ns, end_ns) of trace time as the viewer asks: the
    range in the middle 80% of the visible window, which the UI fits within the loaded trace's
    `bounds` (its first start and last end)."""
    d = end_ns - start_ns
    want = [start_ns - 0.1 * d, 1.2 * d]
    if bounds is not None:
        lo, hi = bounds
        if want[1] >= hi - lo:
            want = [lo, hi - lo]
        else:
            want[0] = min(max(want[0], lo), hi - want[1])
    deadline = time.monotonic() + 90
    got = None
    while time.monotonic() < deadline:
        got = frame.evaluate(VISIBLE_JS)
        if got and abs(got[0] - want[0]) < 2 and abs(got[1] - want[1]) < 2:
            return got
        time.sleep(0.2)
    raise AssertionError(f"the Perfetto UI shows {got}, not {want}")


def loaded_bounds(page: Any, trace: Any) -> tuple[int, int]:
    """The first start and last end (trace time) of the spans in the window the page loaded."""
    lo, hi = map(int, page.get_attribute("[data-testid=timeline-view]", "data-loaded").split(","))
    part = data.window(trace, BASE + lo, BASE + hi)
    return min(part.spans.start) - BASE, max(part.spans.end) - BASE


# ---- hand-built traces ---------------------------------------------------------------------------


def test_heatmap_collectives_and_stats_on_a_known_straggler(browser: Any, still_ui: server.UISource) -> None:
    with serving(make_trace(4, 12, SLOW), still_ui) as url:
        page = open_page(browser, url)
        try:
            marks, colours = marked_cells(page)
            assert marks == {(2, k) for k in SLOW[2]}
            # Every other cell is drawn in the scale's colours: neither background nor "missing".
            assert all(c not in ([255, 255, 255], [210, 210, 210]) for c in colours)
            assert "rank 2 in 3 of 12 steps" in page.inner_text("[data-testid=heatmap-verdict]")
            page.hover("[data-testid=heatmap]", position={"x": 2, "y": 2})  # outside the cells
            box = page.locator("[data-testid=heatmap]").bounding_box()
            c = page.evaluate(f"() => ({PROBE})().centre(2, 7)")
            page.mouse.move(box["x"] + c["x"], box["y"] + c["y"])
            tip = page.inner_text("[data-testid=heatmap-tooltip]")
            assert "rank 2, step 7" in tip and "called slowest" in tip and "+50.0%" in tip

            page.click("[data-testid=tab-collectives]")
            assert "Rank 2 arrived last in 3 of 12" in page.inner_text("[data-testid=collectives-lead]")
            first = page.locator("[data-testid=collectives-rank-row]").first.locator("td")
            assert first.nth(0).inner_text() == "rank 2" and first.nth(1).inner_text() == "3"
            rows = page.locator("[data-testid=collective-row]")
            top = [rows.nth(i).locator("td").all_inner_texts() for i in range(3)]
            assert sorted(int(r[0]) for r in top) == sorted(SLOW[2]) and all(r[3] == "rank 2" for r in top)
            rows.nth(1).click()
            assert page.get_attribute("[data-testid=collective-last]", "data-slot") == "2"
            order = page.locator("[data-testid=collective-arrival]").all_inner_texts()
            assert len(order) == 4 and order[-1].startswith("rank 2")

            page.click("[data-testid=tab-stats]")
            names = page.locator("[data-testid=stats-row] td:first-child").all_inner_texts()
            assert names == ["step", "compute", "all_reduce"]  # by total, descending
            page.click("[data-testid=stats-table] th[data-key='0'] button")  # sort by name
            assert page.locator("[data-testid=stats-row] td:first-child").all_inner_texts() == sorted(names)
            page.select_option("[data-testid=stats-scope]", "2")
            counts = page.locator("[data-testid=stats-row] td:nth-child(2)").all_inner_texts()
            assert counts == ["12", "12", "12"]
            assert page.errors == []
        finally:
            page.close()


def test_hostile_names_render_as_text(browser: Any, still_ui: server.UISource) -> None:
    trace = make_trace(2, 3, {1: {1}}, extra_names=HOSTILE)
    p0 = trace.processes[0]
    trace.processes[0] = type(p0)(p0.pid, p0.rank, '<img src=x onerror="window.pwned = 3">', p0.sort_index)
    with serving(trace, still_ui) as url:
        page = open_page(browser, url)
        try:
            page.click("[data-testid=tab-stats]")
            shown = page.locator("[data-testid=stats-row] td:first-child").all_text_contents()
            assert set(shown) == set(HOSTILE) | {"step", "compute", "all_reduce"}
            page.click("[data-testid=tab-collectives]")
            page.locator("[data-testid=collective-row]").first.click()
            page.click("[data-testid=tab-heatmap]")
            page.locator("[data-testid=heatmap]").scroll_into_view_if_needed()  # the click went to the timeline
            box = page.locator("[data-testid=heatmap]").bounding_box()
            c = page.evaluate(f"() => ({PROBE})().centre(0, 1)")
            page.mouse.move(box["x"] + c["x"], box["y"] + c["y"])
            assert page.inner_text("[data-testid=heatmap-tooltip]").startswith('<img src=x onerror="window.pwned = 3">')
            assert page.evaluate("() => window.pwned") is None
            assert page.evaluate("() => document.querySelectorAll('img, b').length") == 0
            assert page.evaluate("() => document.scripts.length") == 1  # app.js alone
            assert page.errors == []
        finally:
            page.close()


@contextmanager
def perfetto(where: str, tmp: Path) -> Iterator[server.UISource]:
    """The real Perfetto UI, served by the viewer under /ui/ ("dir") or from another origin as a
    URL ("url", the way ui.perfetto.dev is used)."""
    dist = perfetto_ui.web_dist()
    assert dist is not None
    if where == "dir":
        yield server.resolve_ui(str(dist))
    else:
        with perfetto_ui.serve(dist, tmp) as origin:
            yield server.resolve_ui(f"{origin}/index.html")


@pytest.mark.parametrize("where", ["dir", "url"])
def test_a_click_moves_the_perfetto_ui_and_nothing_else_is_fetched(
    browser: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """With the UI served under /ui/, the whole trace; with the UI at a URL, a trace too large for
    it (the limit lowered to 40 spans): windows of it, loaded as the clicks ask."""
    trace = make_trace(4, 12, SLOW)
    whole = where == "dir"
    if not whole:
        monkeypatch.setattr(data, "TIMELINE_SPANS", 40)
    with perfetto(where, tmp_path) as ui, serving(trace, ui) as url:
        page = open_page(browser, url)
        try:
            frame = ui_frame(page)
            frame.wait_for_function("() => window.app && window.app.trace && window.app.trace.engine", timeout=90_000)
            click_cell(page, 2, 7)
            s, e = BASE + 7 * STEP, BASE + 7 * STEP + 16_002_000  # rank 2's step 7: 15 ms of work, 1 ms all-reduce
            if whole:
                wait_visible(frame, s - BASE, e - BASE)
                assert frame.evaluate(perfetto_ui.QUERY_JS, SLICES)[0]["n"] == len(trace.spans)
            else:
                page.wait_for_selector("[data-testid=timeline-view][data-zoom]")
                lo, hi = loaded_bounds(page, trace)
                assert lo <= s - BASE and e - BASE <= hi
                wait_visible(frame, s - BASE, e - BASE, (lo, hi))
                assert (
                    frame.evaluate(perfetto_ui.QUERY_JS, SLICES)[0]["n"]
                    == data.spans_in(trace, BASE + lo, BASE + hi)
                    <= 40
                )
            assert "rank 2, step 7" in page.inner_text("[data-testid=timeline-status]")
            # The stats table's click: the slowest "compute" (rank 2, in a slow step).
            page.click("[data-testid=tab-stats]")
            page.locator("[data-testid=stats-row]", has_text="compute").click()
            k = min(SLOW[2])
            if whole:
                wait_visible(frame, k * STEP, k * STEP + 15_002_000)
            else:
                page.wait_for_selector(f"[data-testid=timeline-view][data-zoom='{k * STEP},{k * STEP + 15_002_000}']")
                lo, hi = loaded_bounds(page, trace)
                assert lo <= k * STEP and k * STEP + 15_002_000 <= hi
                wait_visible(frame, k * STEP, k * STEP + 15_002_000, (lo, hi))
            origin = url.rstrip("/")
            mine = [u for u, main in page.requests if main]
            assert mine and all(u.startswith(origin + "/") for u in mine), mine
            # The only other requests are the Perfetto UI's, from its own frame, which the page
            # points at the chosen UI (whatever that UI then asks for is its own business).
            theirs = [u for u, main in page.requests if not main]
            assert theirs[0] == ui.src.split("#")[0] if where == "url" else theirs[0].startswith(origin + "/ui/")
            assert page.errors == []
        finally:
            page.close()


def test_the_report_makes_no_request(browser: Any, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    out.write_bytes(report.html(data.document(make_trace(4, 12, SLOW, extra_names=HOSTILE))))
    page = open_page(browser, out.as_uri())
    try:
        assert [u for u, _ in page.requests] == [out.as_uri()]
        marks, _ = marked_cells(page)
        assert marks == {(2, k) for k in SLOW[2]}
        click_cell(page, 2, 3)
        assert "rank 2, step 3" in page.inner_text("[data-testid=timeline-status]")
        page.click("[data-testid=tab-collectives]")
        assert "Rank 2 arrived last in 3 of 12" in page.inner_text("[data-testid=collectives-lead]")
        assert page.evaluate("() => window.pwned") is None
        assert [u for u, _ in page.requests] == [out.as_uri()]
        assert page.errors == []  # no policy violation: the inline script and style are the hashed ones
    finally:
        page.close()


# ---- real runs ----------------------------------------------------------------------------------

GLOO_SLOW_RANK = 1
GLOO_SLOW_STEPS = {2, 4}
# Long sleeps: on a loaded two-core machine a sleep overshoots by milliseconds, and the verdict's
# 2% must stay above that for the ranks that are not slow.
WORKER = """
import sys, time
import torch, torch.distributed as dist
import gputrace
out, slow_rank, slow_steps = sys.argv[1], int(sys.argv[2]), {int(s) for s in sys.argv[3].split(",")}
dist.init_process_group("gloo")
rank = dist.get_rank()
gputrace.enable(cuda=False)
gputrace.sync_clocks()
t = torch.ones(1000)
for i in range(6):
    with gputrace.span("step", step=i):
        with gputrace.span("compute"):
            time.sleep(0.4 + (0.4 if rank == slow_rank and i in slow_steps else 0))
        with gputrace.span("all_reduce"):
            dist.all_reduce(t)
gputrace.save(out)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three real gloo ranks; rank 1 works twice as long in steps 2 and 4."""
    out = tmp_path_factory.mktemp("gloo")
    port = free_port()
    world = 3
    pythonpath = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                WORKER,
                str(out),
                str(GLOO_SLOW_RANK),
                ",".join(map(str, sorted(GLOO_SLOW_STEPS))),
            ],
            env={**os.environ, **rank_environment(r, world, port), "PYTHONPATH": pythonpath},
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err
    return out


def test_a_real_gloo_run(browser: Any, still_ui: server.UISource, gloo_run: Path) -> None:
    trace = data.load([str(gloo_run)])
    with serving(trace, still_ui) as url:
        page = open_page(browser, url)
        try:
            assert page.get_attribute("[data-testid=heatmap]", "data-ranks") == "3"
            assert page.get_attribute("[data-testid=heatmap]", "data-steps") == "6"
            marks, _ = marked_cells(page)
            assert marks == {(GLOO_SLOW_RANK, k) for k in GLOO_SLOW_STEPS}
            page.click("[data-testid=tab-collectives]")
            rows = page.locator("[data-testid=collective-row]")
            top = [rows.nth(i).locator("td").all_inner_texts() for i in range(len(GLOO_SLOW_STEPS))]
            assert {int(r[0]) for r in top} == GLOO_SLOW_STEPS
            assert all(r[3] == f"rank {GLOO_SLOW_RANK}" and r[5] == "yes" for r in top)
            per_rank = page.locator("[data-testid=collectives-rank-row]").first.locator("td").all_inner_texts()
            assert per_rank[0] == f"rank {GLOO_SLOW_RANK}" and int(per_rank[1]) >= len(GLOO_SLOW_STEPS)
        finally:
            page.close()


def test_the_h200_sample(browser: Any, still_ui: server.UISource) -> None:
    trace = data.load([str(SAMPLE)])
    with serving(trace, still_ui) as url:
        page = open_page(browser, url)
        try:
            doc = page.evaluate("async () => (await fetch('data.json')).json()")
            st = doc["steps"]
            assert page.get_attribute("[data-testid=heatmap]", "data-ranks") == str(len(doc["ranks"])) == "2"
            # The first step (CUDA and cuBLAS warm-up, ~20x the others) is left out, and said.
            assert page.get_attribute("[data-testid=heatmap]", "data-steps") == str(st["count"]) == "7"
            assert st["skipped"] == 1 and "step is left out as warm-up" in page.inner_text("[data-testid=warmup-note]")
            marks, _ = marked_cells(page)
            assert marks == {(st["verdict"]["slot"][k], k) for k in range(7) if st["verdict"]["called"][k]}
            assert marks  # the sample's last rank carries 1.5x the batch
            page.click("[data-testid=tab-collectives]")
            assert "Rank 1 arrived last" in page.inner_text("[data-testid=collectives-lead]")
        finally:
            page.close()


def test_more_steps_than_pixels(browser: Any, still_ui: server.UISource) -> None:
    """3,000 steps on ~1,200 pixels: a column shows the worst of its steps, marks survive the
    binning, and zooming in gives each step its own cells again."""
    with serving(make_trace(3, 3000, {1: {100, 2000}}), still_ui) as url:
        page = open_page(browser, url)
        try:
            assert page.evaluate(f"() => ({PROBE})().view()") == [0, 3000]
            colours = page.evaluate(
                f"() => {{ const p = ({PROBE})(); const out = [];"
                " for (let r = 0; r < 3; r++) for (let k = 0; k < 3000; k++) out.push(p.pixel(r, k)); return out; }"
            )
            marked = {(i // 3000, i % 3000) for i, c in enumerate(colours) if c == [0, 0, 0]}
            # Only rank 1 is marked, only in the columns that hold step 100 or step 2000.
            assert {r for r, _ in marked} == {1}
            assert {100, 2000} <= {k for _, k in marked}
            assert all(abs(k - 100) < 4 or abs(k - 2000) < 4 for _, k in marked)
            page.evaluate(f"() => ({PROBE})().setView(90, 120)")
            zoomed = page.evaluate(
                f"() => {{ const p = ({PROBE})(); const out = [];"
                " for (let k = 90; k < 120; k++) out.push(p.pixel(1, k)); return out; }"
            )
            assert {90 + i for i, c in enumerate(zoomed) if c == [0, 0, 0]} == {100}
            assert page.get_attribute("[data-testid=heatmap]", "data-view") == "90,120"
        finally:
            page.close()
