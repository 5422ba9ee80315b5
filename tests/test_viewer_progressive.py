"""`gputrace view` of many ranks in two stages: the page's first document (the heatmap, from the
digests' step rows) served at once, the full one computed in a worker process and drawn in place
when it is ready; its numbers are the full document's; an error in the full one is one line on
the page and in the command's log."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from gputrace import digest, native, summary
from gputrace.trace import chrome
from gputrace.trace.model import Process, Trace, Track
from gputrace.viewer import background, data, first

from .conftest import TWINS
from .test_viewer_digests import RANKS, write_run

ROOT = Path(__file__).resolve().parent.parent
BASE = 1_764_000_000_000_000_000
STEP = 10_000_000
#: The keys of the document the first one holds as the full one does.
SAME = ("format", "title", "inputs", "ranks", "labels", "base_ns", "duration_ns", "step_name", "timeline", "pids")


def write_varied(
    d: Path, ranks: int, steps: int, *, marked: bool = True, warm: bool = True, unfinished: bool = False
) -> None:
    """Ranks with clock syncs (a drifting host map, and a device map for their CUDA streams), a
    host track beside two streams, a warm-up first step, a slow rank in a few steps, a spread of
    work; collectives marked, or only named like one (with an all_gather marked not one)."""
    for r in range(ranks):

        def sync(at: int, host: int, device: int) -> dict[str, Any]:
            dev = {"at_ns": at, "offset_ns": device, "error_ns": 90}
            return {"at_ns": at, "offset_ns": host, "error_ns": 900, "device": dev}

        syncs = [
            sync(BASE, 1_000 * r + 7, 1_000 * r + 3),
            sync(BASE + 3_000_000_000, 1_000 * r + 2_007, 1_000 * r + 1_503),
        ]
        anchors = [{"uncertainty_ns_max": 2_000 + 100 * r}]
        meta = {
            "gputrace_version": "test",
            "rank": r,
            "world_size": ranks,
            "run_id": "varied",
            "clock": {"sync_to_rank0": syncs, "device_anchors": anchors},
        }
        t = Trace(dict(meta))
        p = t.add_process(Process(r + 1, r, f"rank {r}", r, meta))
        host = t.add_track(Track(p, 1, "main thread", "cpu", None, 0))
        compute = t.add_track(Track(p, 2, "cuda:0 stream 7", "cuda", 0, 7))
        comm = t.add_track(Track(p, 3, "cuda:0 stream 13", "cuda", 0, 13))
        s = BASE
        for k in range(steps):
            work = 5_000_000 + 37_000 * ((r * 7 + k * 3) % 11)
            if warm and k == 0:
                work *= 4
            if r == ranks - 2 and k % 5 == 2:
                work += 1_500_000
            end = s + work + 2_500_000
            t.add_span("data", host, s, s + 300_000)
            t.add_span("fwd", compute, s + 300_000, s + work)
            coll = {"collective": True} if marked else None
            t.add_span("all_reduce", comm, s + work, s + work + 2_000_000, coll)
            if not marked:
                t.add_span("all_gather", comm, s + work + 2_000_000, end, {"collective": False})
            t.add_span("step", compute, s, end)
            s = end + 50_000 + 1_000 * r
        if unfinished and r == 1:  # a step and a collective open when the trace was written
            t.add_span("step", compute, s, s + 3_000_000, {"unfinished": True})
            t.add_span("all_reduce", comm, s + 1_000_000, s + 3_000_000, {"collective": True, "unfinished": True})
        path = d / f"trace_rank{r}.json"
        chrome.write(t, str(path))
        assert digest.write_for_trace(t, str(path), "step") is not None


@pytest.mark.parametrize(
    "marked, warm, skip, unfinished",
    [
        (True, True, None, False),
        (True, True, 2, False),
        (False, False, None, False),
        (False, True, 0, False),
        (True, True, None, True),
        (False, False, 1, True),
    ],
)
@pytest.mark.parametrize("c", TWINS)
def test_the_first_documents_steps_are_the_full_documents(
    tmp_path: Path, marked: bool, warm: bool, skip: int | None, unfinished: bool, c: bool, twins_restored: None
) -> None:
    native.use(c)  # the C loops (csrc/first.c) and their Python twins give the same document
    write_varied(tmp_path, 5, 12, marked=marked, warm=warm, unfinished=unfinished)
    job = data.DigestJob(summary.find([str(tmp_path)]), "step", skip, False, [str(tmp_path)])
    doc = first.document(job)
    assert doc is not None and doc["partial"] is True
    # The full document found its own warm-up steps, as a view without a first one does ...
    full = data.join(*dataclasses.replace(job, warmup=None).compute())
    # ... and the worker's, told them by the first document, summarises once to the same bytes.
    assert (job.warmup is not None) == (skip is None)
    assert data.join(*job.compute()) == full
    for k in SAME:
        assert doc[k] == full[k], k
    assert doc["steps"] == {k: full["steps"][k] for k in doc["steps"]}
    assert set(full["steps"]) - set(doc["steps"]) == {"idle", "coll_wait", "coll_transfer", "trend", "totals"}
    assert doc["worst"] == full["worst"] and doc["warmup_auto"] == full["warmup_auto"]
    assert doc["alignment"] == full["alignment"]
    # The durations themselves: each cell's step time and busy time, as the full document's.
    st, fs = doc["steps"], full["steps"]
    assert [list(map(int.__sub__, e, s)) for s, e in zip(st["end"], st["start"])] == [
        list(map(int.__sub__, e, s)) for s, e in zip(fs["end"], fs["start"])
    ]
    assert st["count"] == 12 - (skip if skip is not None else (1 if warm else 0))
    # What it does not hold, it says it does not hold: null, never zeros.
    assert doc["collectives"] is None and doc["stats"] is None and doc["causes"] is None and doc["phases"] is None
    if marked and warm:
        assert any(st["verdict"]["called"])  # the slow rank is called, as in the full document


def test_a_rank_without_a_fresh_digest_gets_the_full_document_at_once(tmp_path: Path) -> None:
    write_varied(tmp_path, 3, 6)
    (tmp_path / "digest_rank1.digest").unlink()
    job = data.DigestJob(summary.find([str(tmp_path)]), "step", None, False, [str(tmp_path)])
    assert first.document(job) is None
    (tmp_path / "digest_rank1.digest").write_bytes(b'{"format": "gputrace-digest/2", "spans": 3}')
    assert first.document(data.DigestJob(summary.find([str(tmp_path)]), "step", None, False, [])) is None


# ---- the command, and the page in Chromium -----------------------------------------------------


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("progressive")
    write_run(d)  # 65 ranks of 5 steps: the command reads their digests; rank 7 slow in step 2
    return d


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class _View:
    """`gputrace view DIR` in a real process, its full document held back `delay` seconds."""

    def __init__(self, folder: Path, ui: Path, delay: float, first_after_run: bool = True, group: bool = False) -> None:
        for old in folder.glob(".gputrace-view-*") if first_after_run else ():
            old.unlink()  # the first view after the run
        env = {**os.environ, background.DELAY_ENV: str(delay)}
        cmd = [sys.executable, "-m", "gputrace", "view", str(folder), "--no-browser", "--perfetto-ui", str(ui)]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
            start_new_session=group,  # a process group of its own, as a terminal's job is
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        m = re.match(r"gputrace view: (http://127\.0\.0\.1:\d+/) ", line)
        assert m, (line, self.stop())
        self.url = m.group(1)

    def stop(self) -> str:
        self.proc.terminate()
        _, err = self.proc.communicate(timeout=60)
        return err


@pytest.fixture
def ui(tmp_path: Path) -> Path:
    d = tmp_path / "ui"
    d.mkdir()
    (d / "index.html").write_text("<!doctype html><title>no timeline here</title>")
    return d


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    playwright = pytest.importorskip("playwright.sync_api")
    if not os.path.exists("/usr/bin/chromium"):
        pytest.skip("no Chromium at /usr/bin/chromium")
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


@pytest.mark.browser
def test_the_heatmap_comes_first_then_the_page_upgrades_in_place(many: Path, ui: Path, browser: Any) -> None:
    view = _View(many, ui, delay=8)
    try:
        # The URL is printed while the full document is still being computed.
        status, body = _get(view.url + "full.json?wait=0")
        assert status == 202 and orjson.loads(body)["state"] == "computing"
        status, body = _get(view.url + "data.json")
        first_doc = orjson.loads(body)
        assert status == 200 and first_doc["partial"] is True

        page = browser.new_page(viewport={"width": 1300, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(view.url)
        page.wait_for_selector("body[data-ready='1']", timeout=60_000)
        assert page.get_attribute("body", "data-full") == "computing"
        # The heatmap from the first document: every rank, every step, rank 7's slow step marked.
        canvas = "[data-testid=heatmap]"
        assert page.get_attribute(canvas, "data-ranks") == str(RANKS)
        assert page.get_attribute(canvas, "data-steps") == "5"
        probe = "([r, k]) => document.querySelector('[data-testid=heatmap]').probe.pixel(r, k)"
        assert page.evaluate(probe, [7, 2]) == [0, 0, 0]  # the verdict's mark
        assert page.evaluate(probe, [3, 2]) != [0, 0, 0]
        assert "Computing" in page.text_content("[data-testid=full-status]")
        assert page.is_visible("[data-testid=heatmap-computing]")
        assert page.query_selector("[data-testid=trend]") is None  # no breakdown yet, and none shown
        page.click("[data-testid=tab-collectives]")
        assert page.is_visible("#collectives [data-testid=computing]")
        assert page.query_selector("[data-testid=collective-row]") is None
        page.click("[data-testid=tab-stats]")
        assert page.is_visible("#stats [data-testid=computing]")

        # Then the full document, drawn in place: the tab the user is on stays.
        page.wait_for_selector("body[data-full='1']", timeout=120_000)
        assert page.is_visible("[data-testid=stats-table]")
        assert page.query_selector("[data-testid=computing]") is None
        assert page.is_hidden("[data-testid=full-status]")
        page.click("[data-testid=tab-collectives]")
        assert page.locator("[data-testid=collective-row]").count() > 0
        page.click("[data-testid=tab-heatmap]")
        assert page.query_selector("[data-testid=trend]") is not None
        assert page.query_selector("[data-testid=heatmap-computing]") is None
        assert page.evaluate(probe, [7, 2]) == [0, 0, 0]
        assert errors == []
        page.close()

        # The full document, served now on both routes; its steps hold the first one's numbers.
        status, body = _get(view.url + "full.json?wait=0")
        full = orjson.loads(body)
        assert status == 200 and "partial" not in full and full["collectives"] is not None
        assert orjson.loads(_get(view.url + "data.json")[1]) == full
        assert first_doc["steps"] == {k: full["steps"][k] for k in first_doc["steps"]}
        assert first_doc["base_ns"] == full["base_ns"] and first_doc["timeline"] == full["timeline"]
    finally:
        err = view.stop()
    assert "the full document is ready" in err and "Traceback" not in err
    assert len(list(many.glob(".gputrace-view-*"))) == 1  # kept for the next view
    # The next view serves the kept document, all of it at once.
    again = _View(many, ui, delay=60, first_after_run=False)
    try:
        doc = orjson.loads(_get(again.url + "data.json")[1])
        assert "partial" not in doc and doc["collectives"] is not None and doc["steps"] == full["steps"]
        assert _get(again.url + "full.json?wait=0")[0] == 200
    finally:
        again.stop()


@pytest.mark.browser
def test_an_error_in_the_full_document_is_one_line_on_the_page_and_in_the_log(
    tmp_path: Path, ui: Path, browser: Any
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    write_run(run)
    view = _View(run, ui, delay=4)
    try:
        page = browser.new_page(viewport={"width": 1300, "height": 900})
        page.goto(view.url)
        page.wait_for_selector("body[data-ready='1']", timeout=60_000)
        assert page.get_attribute("body", "data-full") == "computing"
        # While it waits, rank 3's files are overwritten: the full document cannot be made.
        (run / "trace_rank3.json").write_text("this is not a trace\n")
        (run / "digest_rank3.digest").write_text("{")
        page.wait_for_selector("body[data-full='error']", timeout=120_000)
        line = page.text_content("[data-testid=full-status]")
        assert line.startswith("The full statistics could not be computed: ") and "trace_rank3.json" in line
        assert "\n" not in line and "Traceback" not in line
        assert "error" in (page.get_attribute("[data-testid=full-status]", "class") or "")
        page.click("[data-testid=tab-collectives]")
        assert page.is_visible("#collectives [data-testid=not-computed]")
        # The heatmap of the first document stays.
        assert page.get_attribute("[data-testid=heatmap]", "data-ranks") == str(RANKS)
        status, body = _get(view.url + "full.json?wait=0")
        assert status == 500 and "trace_rank3.json" in orjson.loads(body)["error"]
        page.close()
    finally:
        err = view.stop()
    said = [x for x in err.splitlines() if "could not be computed" in x]
    assert len(said) == 1 and said[0].startswith("gputrace view: the full document could not be computed: ")
    assert "trace_rank3.json" in said[0] and "Traceback" not in err


def test_ctrl_c_in_a_terminal_ends_the_view_and_its_worker_without_a_traceback(many: Path, ui: Path) -> None:
    """A terminal's Ctrl-C is SIGINT to the whole process group, the worker computing the full
    document included: the view ends as Ctrl-C ends it, the worker with it, and nothing is
    printed from the worker."""
    import signal
    import time

    psutil = pytest.importorskip("psutil")
    view = _View(many, ui, delay=60, group=True)
    workers = psutil.Process(view.proc.pid).children()
    assert workers, "no worker computing the full document"
    time.sleep(1.0)  # the worker past its start (its imports; then it waits, as a long job would)
    os.killpg(view.proc.pid, signal.SIGINT)
    out, err = view.proc.communicate(timeout=60)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    gone, alive = psutil.wait_procs(workers, timeout=20)
    assert alive == [] and len(gone) == len(workers)


def test_the_worker_leaves_sigint_to_the_view(tmp_path: Path) -> None:
    """SIGINT reaches the worker too where a terminal sends it (the process group): the worker
    ignores it (no traceback of its own, no error for the page); the view ends it."""
    import signal
    import time

    write_varied(tmp_path, 3, 6)
    job = data.DigestJob(summary.find([str(tmp_path)]), "step", None, False, [str(tmp_path)])
    build = background.FullBuild(job, delay_s=30).start()
    try:
        pid = build._process.pid
        time.sleep(1.5)  # past its start
        os.kill(pid, signal.SIGINT)
        time.sleep(1.5)
        assert build._process.is_alive() and not build.done
    finally:
        build.stop()
    assert not build._process.is_alive()


def test_a_view_ended_by_a_signal_leaves_no_worker_behind(many: Path, ui: Path) -> None:
    psutil = pytest.importorskip("psutil")
    view = _View(many, ui, delay=60)  # the worker waits: it is still there when the view ends
    try:
        workers = psutil.Process(view.proc.pid).children()
        assert workers, "no worker computing the full document"
        status, _ = _get(view.url + "full.json?wait=0")
        assert status == 202
    finally:
        view.proc.terminate()  # SIGTERM: no exit handler runs in the view
        view.proc.communicate(timeout=60)
    gone, alive = psutil.wait_procs(workers, timeout=20)
    assert alive == [] and len(gone) == len(workers)


@pytest.mark.parametrize("c", TWINS)
def test_digests_written_before_the_first_documents_c_loops_are_read_by_them(
    tmp_path: Path, c: bool, twins_restored: None
) -> None:
    """tests/golden/digests_v2: three ranks' traces and digests as main's code wrote them before
    the first document read digests in C (waiting names, a collective marked not one, clock
    syncs, a warm-up step): the first document is made from them (not refused), and its steps are
    the full document's."""
    import shutil

    native.use(c)
    run = tmp_path / "run"
    shutil.copytree(ROOT / "tests" / "golden" / "digests_v2", run)  # the kept document goes here, not there
    job = data.DigestJob(summary.find([str(run)]), "step", None, False, [str(run)])
    doc = first.document(job)
    assert doc is not None and doc["partial"] is True
    full = data.join(*job.compute())
    assert doc["steps"] == {k: full["steps"][k] for k in doc["steps"]}
    assert doc["worst"] == full["worst"] and doc["warmup_auto"] is True and doc["steps"]["count"] == 5
