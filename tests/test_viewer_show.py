"""The viewer shows what it names, in real Chromium: a click brings the clicked rank into view in
the real Perfetto UI and selects its span, with ranks in numeric order; the state of the view is in
the URL and a link restores it; the header stays; no table is cut; the verdict mark is drawn the
same at every size; two ranks are compared without halving the gap; the worst steps and the phases
are listed in words."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gputrace.trace.model import Trace
from gputrace.viewer import data, server

from . import perfetto_ui
from .test_viewer import BASE, STEP, make_trace
from .test_viewer_browser import PROBE, click_cell, open_page, serving, ui_frame

pytestmark = pytest.mark.browser
why_not = perfetto_ui.available()
if why_not:
    pytestmark = [pytestmark, pytest.mark.skip(reason=why_not)]  # type: ignore[assignment]


REVEALED_JS = """async (pid) => {
  const app = window.app;
  const sel = app.trace.selection.selection;
  if (!sel || sel.kind !== 'track_event') return null;
  const res = await app.trace.engine.query(
    'select p.pid as pid, s.name as name, s.ts as ts from slice s join thread_track t on s.track_id = t.id ' +
    'join thread using (utid) join process p using (upid) where s.id = ' + Number(sel.eventId));
  const it = res.iter({});
  if (!it.valid()) return null;
  const name = String(it.get('name'));
  const got = {pid: Number(it.get('pid')), name, ts: Number(it.get('ts'))};
  // Where the rank's group title is drawn in the UI's frame, against the frame's height.
  const title = [...document.querySelectorAll('.pf-track__title-popup')].find(
    (e) => e.textContent.endsWith(' ' + pid));
  got.top = title ? title.getBoundingClientRect().top : null;
  got.height = innerHeight;
  return got;
}"""
ORDER_JS = "() => window.app.trace.workspace.children.map(c => c.name)"


def href(page: Any) -> str:
    """The page's URL as the page has it now (history.replaceState reaches Playwright later)."""
    return str(page.evaluate("() => location.href"))


def wait_revealed(page: Any, frame: Any, rank: int, pid: int, name: str) -> dict[str, Any]:
    page.wait_for_selector(f"[data-testid=timeline-view][data-revealed^='{rank},']", timeout=90_000)
    got = None
    for _ in range(100):
        got = frame.evaluate(REVEALED_JS, pid)
        ok = got and got["pid"] == pid and got["name"] == name and got["top"] is not None
        if ok and 0 <= got["top"] < got["height"] - 20:
            return got
        page.wait_for_timeout(100)
    raise AssertionError(f"rank {rank} not selected and in view: {got}")


def test_a_click_brings_the_rank_into_view_and_selects_its_span(browser: Any, tmp_path: Path) -> None:
    """24 ranks; rank 3 has more spans than the others, so the UI would list it first and the
    rest as text (0, 1, 10, 11, ...): the page puts them in numeric order. A click on rank 17's
    cell, a collective (its last arriver, rank 5) and a stats row (its slowest rank) each select
    that rank's span in the UI, scrolled into view."""
    trace = make_trace(24, 6, {5: {2, 4}}, extra_names=None)
    comp = next(i for i, t in enumerate(trace.tracks) if trace.processes[t.process].rank == 3)
    for k in range(6):
        trace.add_span("extra", comp, BASE + k * STEP + 100, BASE + k * STEP + 200)
    ui = server.resolve_ui(str(perfetto_ui.web_dist()))
    with serving(trace, ui) as url:
        page = open_page(browser, url)
        try:
            frame = ui_frame(page)
            frame.wait_for_function("() => window.app && window.app.trace && window.app.trace.engine", timeout=90_000)
            click_cell(page, 17, 3)
            got = wait_revealed(page, frame, 17, 18, "step")
            assert got["ts"] == 3 * STEP
            assert "rank 17, step 3" in page.inner_text("[data-testid=timeline-status]")
            order = frame.evaluate(ORDER_JS)
            ranks = [int(n.split()[1]) for n in order if n.startswith("rank ")]
            assert ranks == list(range(24)), order
            assert all(n.startswith(f"rank {r:02d} ") for r, n in zip(range(24), order))

            page.click("[data-testid=tab-collectives]")
            page.locator("[data-testid=collective-row]").first.click()  # the longest wait: rank 5 last
            wait_revealed(page, frame, 5, 6, "all_reduce")

            page.click("[data-testid=tab-stats]")
            page.locator("[data-testid=stats-row]", has_text="compute").click()  # the slowest: rank 5
            wait_revealed(page, frame, 5, 6, "compute")
            assert page.errors == []
        finally:
            page.close()


def test_the_url_holds_the_view_and_a_link_restores_it(browser: Any, still_ui: server.UISource) -> None:
    with serving(make_trace(4, 40, {2: {3, 7, 30}}), still_ui) as url:
        page = open_page(browser, url)
        try:
            page.evaluate(f"() => ({PROBE})().setView(20, 36)")
            click_cell(page, 2, 30)
            link = href(page)
            assert "sel=cell%3A2%3A30" in link and "steps=20-35" in link
            page.click("[data-testid=tab-collectives]")
            page.locator("[data-testid=collective-row]").nth(1).click()
            coll_link = href(page)
            assert "tab=collectives" in coll_link and "sel=coll%3A" in coll_link
            page.click("[data-testid=tab-stats]")
            page.locator("[data-testid=stats-row]", has_text="compute").click()
            stats_link = href(page)
            page.click("[data-testid=tab-breakdown]")
            heads = page.locator("[data-testid=breakdown-matrix] thead th").all_inner_texts()
            row = page.locator("[data-testid=breakdown-row][data-rank='2']")
            row.locator("td").nth(heads.index("compute") - 1).click()
            matrix_link = href(page)
            assert "tab=breakdown" in matrix_link and "sel=bd%3A2%3Acompute" in matrix_link
        finally:
            page.close()

        page = open_page(browser, link)
        try:
            assert page.get_attribute("[data-testid=heatmap]", "data-view") == "20,36"
            assert page.get_attribute("[data-testid=tab-heatmap]", "aria-selected") == "true"
            assert "rank 2, step 30" in page.inner_text("[data-testid=timeline-status]")
        finally:
            page.close()
        page = open_page(browser, coll_link)
        try:
            assert page.get_attribute("[data-testid=tab-collectives]", "aria-selected") == "true"
            j = int(coll_link.rsplit("coll%3A", 1)[1].split("&")[0])
            doc = page.evaluate("async () => (await fetch('data.json')).json()")
            step = doc["collectives"]["step"][j]
            assert page.inner_text("[data-testid=collective-detail] h4").startswith(f"step {step},")
            assert f"step {step}, 'all_reduce'" in page.inner_text("[data-testid=timeline-status]")
        finally:
            page.close()
        page = open_page(browser, matrix_link)
        try:
            assert page.get_attribute("[data-testid=tab-breakdown]", "aria-selected") == "true"
            assert "rank 2's slowest 'compute'" in page.inner_text("[data-testid=timeline-status]")
        finally:
            page.close()
        page = open_page(browser, stats_link)
        try:
            assert page.get_attribute("[data-testid=tab-stats]", "aria-selected") == "true"
            assert "the slowest 'compute' (rank 2" in page.inner_text("[data-testid=timeline-status]")
            assert page.errors == []
        finally:
            page.close()


def test_the_header_stays_and_no_table_is_cut(browser: Any, still_ui: server.UISource) -> None:
    """16 ranks: the collectives' arrival table is longer than the old 52vh pane; after a click
    the page scrolls to the timeline and the header stays on screen."""
    with serving(make_trace(16, 12, {9: {3, 7}}), still_ui) as url:
        page = open_page(browser, url)
        try:
            page.click("[data-testid=tab-collectives]")
            page.locator("[data-testid=collective-row]").first.click()
            rows = page.locator("[data-testid=collective-arrival]")
            assert rows.count() == 16
            # No element around the table scrolls on its own (clips it).
            clipped = page.evaluate(
                """() => { const out = []; let e = document.querySelector('[data-testid=collective-order]');
                for (; e && e !== document.body; e = e.parentElement)
                  if (e.scrollHeight > e.clientHeight + 1 && getComputedStyle(e).overflowY !== 'visible')
                    out.push(e.id || e.className);
                return out; }"""
            )
            assert clipped == []
            page.click("[data-testid=tab-heatmap]")
            click_cell(page, 9, 7)
            page.wait_for_function("() => window.scrollY > 0")
            top = page.evaluate(
                """() => { const r = document.getElementById('top').getBoundingClientRect();
                const hit = document.elementFromPoint(r.left + 40, r.top + r.height / 2);
                return [r.top, r.bottom, document.getElementById('top').contains(hit), window.scrollY]; }"""
            )
            assert top[0] == 0 and top[1] > 40 and top[2], top
            title = page.locator("[data-testid=title]").bounding_box()
            assert title["y"] >= 0
            # The timeline's top sits just below the header.
            tl = page.locator("[data-testid=timeline-view]").bounding_box()
            assert abs(tl["y"] - top[1]) < 4
        finally:
            page.close()


MARK_JS = """([r, k]) => {
  const c = document.querySelector('[data-testid=heatmap]');
  const b = c.probe.bounds(r, k);
  const d = c.getContext('2d').getImageData(b.x0, b.y0, b.x1 - b.x0, b.y1 - b.y0).data;
  let xs = new Set(), ys = new Set();
  for (let y = 0; y < b.y1 - b.y0; y++) for (let x = 0; x < b.x1 - b.x0; x++) {
    const o = (y * (b.x1 - b.x0) + x) * 4;
    if (d[o] === 0 && d[o + 1] === 0 && d[o + 2] === 0) { xs.add(x); ys.add(y); }
  }
  return {w: b.x1 - b.x0, h: b.y1 - b.y0, mw: xs.size, mh: ys.size,
          corner: [d[0], d[1], d[2]]};
}"""


@pytest.mark.parametrize("steps", [12, 300, 3000])
def test_the_verdict_mark_is_the_middle_half_of_its_cell_at_every_size(
    browser: Any, still_ui: server.UISource, steps: int
) -> None:
    with serving(make_trace(3, steps, {1: {5}}), still_ui) as url:
        page = open_page(browser, url)
        try:
            got = page.evaluate(MARK_JS, [1, 5])
            # The cell (less its one-pixel gap when there is room for one) is half black each way.
            for side, mark in ((got["w"], got["mw"]), (got["h"], got["mh"])):
                inner = side - 1 if side >= 6 else side
                assert mark == max(1, int(inner / 2 + 0.5)), got
            if got["h"] > 2:
                assert got["corner"] != [0, 0, 0]  # the cell keeps its colour around the mark
        finally:
            page.close()


def two_ranks(ratio: float) -> Trace:
    """Two ranks: rank 1 computes `ratio` times as long as rank 0 in every step."""
    t = make_trace(2, 6)
    t.spans = type(t.spans)()
    p = [t.tracks.index(x) for x in t.tracks if x.name == "cuda:0 default stream"]
    q = [t.tracks.index(x) for x in t.tracks if x.name != "cuda:0 default stream"]
    for k in range(6):
        s = BASE + k * STEP
        work = [20_000_000, int(20_000_000 * ratio)]
        done = s + max(work) + 1_000_000
        for r in range(2):
            t.add_span("step", p[r], s, done, {"step": k})
            t.add_span("compute", p[r], s, s + work[r])
            t.add_span("all_reduce", q[r], s + work[r], done)
    return t


def test_two_ranks_the_slower_shows_its_whole_gap(browser: Any, still_ui: server.UISource) -> None:
    with serving(two_ranks(1.49), still_ui) as url:
        page = open_page(browser, url)
        try:
            box = page.locator("[data-testid=heatmap]").bounding_box()
            c = page.evaluate(f"() => ({PROBE})().centre(1, 2)")
            page.mouse.move(box["x"] + c["x"], box["y"] + c["y"])
            tip = page.inner_text("[data-testid=heatmap-tooltip]")
            assert "+49.0% against the other rank's 20.000 ms" in tip, tip
            # The slower rank takes the scale's end colour (+20% and more), not a middle shade (its
            # corner: the centre carries the verdict's mark).
            assert page.evaluate(MARK_JS, [1, 2])["corner"] == [178, 24, 43]
        finally:
            page.close()


def test_worst_steps_and_phases_in_words(browser: Any, still_ui: server.UISource) -> None:
    slow = {5: set(range(10, 20)) | set(range(30, 34)), 2: {25}}
    with serving(make_trace(8, 40, slow), still_ui) as url:
        page = open_page(browser, url)
        try:
            phases = page.locator("[data-testid=phase]").all_inner_texts()
            assert phases == ["rank 5: steps 10-19 and 30-33, +50% in compute"]
            worst = page.locator("[data-testid=worst-step]")
            ranks = {int(worst.nth(i).get_attribute("data-rank")) for i in range(worst.count())}
            assert ranks == {5, 2}
            one = page.locator("[data-testid=worst-step][data-step='25']")
            assert one.inner_text().startswith("step 25: rank 2, +4.99")
            one.click()
            assert "rank 2, step 25" in page.inner_text("[data-testid=timeline-status]")
            assert "sel=cell%3A2%3A25" in href(page)
            page.locator("[data-testid=phase]").click()
            assert "rank 5, step 10" in page.inner_text("[data-testid=timeline-status]")
        finally:
            page.close()


def test_warm_up_outliers_are_left_out_and_said(browser: Any, still_ui: server.UISource) -> None:
    trace = make_trace(3, 30)
    # Steps 0 and 1 of every rank take 3x as long: the whole step is stretched.
    sp = trace.spans
    for i in range(len(sp)):
        k = (sp.start[i] - BASE) // STEP
        if k < 2:
            sp.end[i] = sp.start[i] + 3 * (sp.end[i] - sp.start[i])
    doc = data.document(trace)
    assert doc["steps"]["skipped"] == 2 and doc["steps"]["count"] == 28 and doc["warmup_auto"]
    assert data.document(trace, skip_steps=0)["steps"]["skipped"] == 0
    with serving(trace, still_ui) as url:
        page = open_page(browser, url)
        try:
            note = page.inner_text("[data-testid=warmup-note]")
            assert note.startswith("The first 2 steps are left out as warm-up") and "--skip-steps 0" in note
            assert "(first 2 skipped)" in page.inner_text("[data-testid=facts]")
        finally:
            page.close()
