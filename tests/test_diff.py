"""`gputrace diff A B`: two runs compared name by name.

Hand-built runs written as real per-rank trace files (and digests) pin the rule exactly: the
medians, the noise band from the ranks' medians and the step's spread, the order, --fail-above
(noise never fails), the bad inputs. Real gloo runs then show it on what users meet: a second run
with `backward` slowed by 10 ms names it first, with the right sign and size, and fails
--fail-above 10; the same program run twice is noise and passes; files and digests agree; one real
subprocess.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from gputrace import diff, digest
from gputrace.cli import main
from gputrace.errors import GputraceError
from gputrace.trace import chrome
from gputrace.trace.model import Process, Trace, Track

from .conftest import run_rank_processes

ROOT = Path(__file__).resolve().parent.parent
BASE = 1_764_000_000_000_000_000
MS = 1_000_000
US = 1_000
STEPS = 8


def write_run(d: Path, durations: dict[str, list[int]], step: str = "step", digests: bool = True) -> Path:
    """A run of len(durations[name]) ranks: in each of STEPS steps every rank runs each name once,
    one after the other, for its duration (durations[name][rank]); the step span holds them."""
    d.mkdir(parents=True, exist_ok=True)
    ranks = len(next(iter(durations.values())))
    for r in range(ranks):
        meta = {"gputrace_version": "test", "rank": r, "world_size": ranks, "run_id": d.name}
        t = Trace(dict(meta))
        p = t.add_process(Process(r + 1, r, f"rank {r}", r, meta))
        track = t.add_track(Track(p, 1, "main thread", "cpu", None, 0))
        for k in range(STEPS):
            s = BASE + k * 100 * MS
            at = s
            for name, per_rank in durations.items():
                if per_rank[r] is not None:
                    t.add_span(name, track, at, at + per_rank[r])
                    at += per_rank[r]
            t.add_span(step, track, s, at, {"step": k})
        path = d / f"trace_rank{r}.json"
        chrome.write(t, str(path))
        if digests:
            assert digest.write_for_trace(t, str(path), step) is not None
    return d


# A: `work` differs by 1 ms between the ranks; B moves it 0.5 ms (+5%): inside that spread.
# `tiny` moves 1% (inside the floor), `slow` 50% on both ranks (beyond), `gone` and `new` are
# in one run each.
A = {"work": [10 * MS, 11 * MS], "tiny": [100 * US, 100 * US], "slow": [2 * MS, 2 * MS], "gone": [MS, MS]}
B = {"work": [10_500 * US, 11_500 * US], "tiny": [101 * US, 101 * US], "slow": [3 * MS, 3 * MS], "new": [MS, MS]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("hand")
    return write_run(d / "a", A), write_run(d / "b", B)


def cli(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(main, ["diff", *args], env={"COLUMNS": "160"})
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return r.exit_code, r.stdout, r.stderr


def test_medians_noise_and_order_from_the_traces(runs: tuple[Path, Path]) -> None:
    a, b = runs
    d = diff.read([str(a)], [str(b)], full=True)
    by = {c.name: c for c in d.names}
    assert [c.name for c in d.names] == ["slow", "work", "tiny"]  # beyond the noise first
    slow, work, tiny = by["slow"], by["work"], by["tiny"]
    assert (slow.a_ns, slow.b_ns, slow.delta_ns, slow.delta_pct) == (2 * MS, 3 * MS, MS, 50.0)
    assert not slow.noise and slow.regressed and slow.a_count == slow.b_count == 2 * STEPS
    # The pooled medians (nearest rank: the 8th of 16), and the spread of the ranks' medians.
    assert (work.a_ns, work.b_ns, work.delta_pct) == (10 * MS, 10_500 * US, 5.0)
    assert work.a_spread_ns == work.b_spread_ns == MS and work.noise_ns == MS and work.noise
    assert tiny.noise and tiny.a_spread_ns == 0 and tiny.noise_ns == math.ceil(diff.FLOOR_PCT / 100 * 101 * US)
    assert d.only_a == ["gone"] and d.only_b == ["new"]
    # The step: each rank's sum of its spans; its spread the range of the ranks' medians (1 ms),
    # larger than half the interquartile range of its step durations (0.5 ms).
    st = d.step
    assert st is not None and st.name == "step"
    assert st.a_ns == 13_100 * US and st.b_ns == 14_601 * US  # rank 0's (gone: 1 ms in A)
    assert st.a_spread_ns == st.b_spread_ns == MS and not st.noise and st.regressed
    assert [c.name for c in diff.regressed(d, 10)] == ["step", "slow"]
    assert [c.name for c in diff.regressed(d, 4)] == ["step", "slow"]  # work: +5%, but noise


def test_one_rank_runs_say_so(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", {"work": [10 * MS]})
    b = write_run(tmp_path / "b", {"work": [10_300 * US]})  # +3%: beyond the 2.2% floor, no spread
    d = diff.read([str(a)], [str(b)])
    (work,) = d.names
    assert work.a_spread_ns == work.b_spread_ns == 0 and not work.noise and work.regressed
    assert d.notes == [f"run {x} has one rank: its spread is only how much one occurrence differs from the next"
                       for x in "AB"]  # fmt: skip


def test_digests_give_the_same_verdicts(runs: tuple[Path, Path]) -> None:
    a, b = runs
    files = diff.read([str(a)], [str(b)], full=True)
    digests = diff.read([str(a)], [str(b)])
    assert "digests" in digests.a.notes[0] and "full traces" in files.a.notes[0]
    assert [c.name for c in digests.names] == [c.name for c in files.names]
    for f, g in zip([files.step, *files.names], [digests.step, *digests.names]):
        assert f is not None and g is not None
        assert (f.noise, f.regressed, f.a_count, f.b_count) == (g.noise, g.regressed, g.a_count, g.b_count)
        for x, y in ((f.a_ns, g.a_ns), (f.b_ns, g.b_ns)):
            assert abs(x - y) <= digest.HIST_ERROR * x + 1
    # The digest files alone, without their traces, as gathered to one machine.
    lone = diff.read([str(a / "digest_rank*.digest")], [str(b / "digest_rank*.digest")])
    assert diff.to_json(lone)["names"] == diff.to_json(digests)["names"]


def test_cli_json_text_and_fail_above(runs: tuple[Path, Path]) -> None:
    a, b = str(runs[0]), str(runs[1])
    code, out, _ = cli(a, b, "--json")
    assert code == 0
    doc = orjson.loads(out)
    assert [n["name"] for n in doc["names"]] == ["slow", "work", "tiny"]
    first = doc["names"][0]
    assert {k: first[k] for k in ("name", "a_ns", "b_ns", "delta_pct", "noise")} == {
        "name": "slow",
        "a_ns": 2 * MS,
        "b_ns": 3 * MS,
        "delta_pct": 50.0,
        "noise": False,
    }
    assert doc["step"]["name"] == "step" and doc["step"]["delta_ns"] > 0
    assert doc["only_a"] == ["gone"] and doc["only_b"] == ["new"] and "noise" in doc["rule"]

    code, out, err = cli(a, b, "--fail-above", "10")
    assert code == 1 and "slow +50.0%" in err and "step +" in err
    lines = out.splitlines()
    assert lines[0].startswith(f"A: {a} (2 ranks")
    row = next(line for line in lines if line.startswith("slow"))
    assert "+1.000 ms" in row and "+50.0%" in row and "slower" in row
    assert "noise" in next(line for line in lines if line.startswith("work"))
    # Work is 5% slower but within the noise: noise never fails the gate.
    assert cli(a, b, "--fail-above", "60")[0] == 0
    code, out, _ = cli(a, b, "--fail-above", "60", "--json")
    assert code == 0 and orjson.loads(out)["fail_above"] == {"pct": 60.0, "regressed": []}
    code, out, _ = cli(a, b, "--fail-above", "10", "--json")
    assert code == 1 and orjson.loads(out)["fail_above"]["regressed"] == ["step", "slow"]
    # Improvements never fail: B to A.
    assert cli(b, a, "--fail-above", "0")[0] == 0
    # The selection options select in both runs: rank 0 alone has no spread across ranks, and
    # work's +5% is then beyond the noise.
    code, out, _ = cli(a, b, "--json", "--ranks", "0", "--fail-above", "4")
    work = next(n for n in orjson.loads(out)["names"] if n["name"] == "work")
    assert code == 1 and (work["a_ns"], work["b_ns"], work["noise"]) == (10 * MS, 10_500 * US, False)
    assert orjson.loads(out)["a"]["ranks"] == [0]


def test_text_fits_the_terminal(runs: tuple[Path, Path]) -> None:
    r = CliRunner().invoke(main, ["diff", str(runs[0]), str(runs[1])], env={"COLUMNS": "60"})
    assert r.exit_code == 0
    assert max(len(line) for line in r.stdout.splitlines()) <= 60
    assert "left out to fit 60 columns" in r.stdout


def test_bad_input_is_one_line_and_exit_2(runs: tuple[Path, Path], tmp_path: Path) -> None:
    a = str(runs[0])

    def bad(*args: str) -> str:
        code, out, err = cli(*args)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (code, out, err)
        assert err.startswith("gputrace: error: ") and "Traceback" not in err
        return err

    assert "run B" in bad(a, str(tmp_path / "missing")) and "no such file" in bad(a, str(tmp_path / "missing"))
    other = write_run(tmp_path / "other", {"else": [MS, MS]}, step="iteration")
    err = bad(a, str(other))  # B's digests say which span marks its steps
    assert "run A has steps marked by 'step', run B steps marked by 'iteration'" in err
    plain = write_run(tmp_path / "plain", {"else": [MS, MS]}, step="iteration", digests=False)
    assert "run A has steps marked by 'step', run B no step spans" in bad(a, str(plain))
    err = bad(a, str(other), "--step", "iteration")
    assert "run A" in err and "'step'" in err  # A has no 'iteration' span: the names present are listed
    # No step spans of the default name in either run, and no name in common.
    x = write_run(tmp_path / "x", {"x": [MS]}, step="iter_x", digests=False)
    y = write_run(tmp_path / "y", {"y": [MS]}, step="iter_y", digests=False)
    assert "no span name in common" in bad(str(x), str(y))
    with pytest.raises(GputraceError, match="no span name in common"):
        diff.read([str(x / "trace_rank0.json")], [str(y / "trace_rank0.json")])


def test_view_compare_puts_the_diff_in_the_page(runs: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = str(runs[0]), str(runs[1])
    out = tmp_path / "report.html"
    r = CliRunner().invoke(main, ["view", a, "--compare", b, "--export", str(out)])
    assert r.exit_code == 0, r.output
    page = out.read_text()
    payload = page.split('id="gputrace-data">', 1)[1].split("</script>", 1)[0]
    doc = orjson.loads(payload)
    # The numbers `gputrace diff --json` prints, A being the page's run.
    assert doc["compare"] == orjson.loads(cli(a, b, "--json")[1])
    r = CliRunner().invoke(main, ["view", a, "--compare", str(tmp_path / "missing"), "--export", str(out)])
    assert r.exit_code == 2 and "run B" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = CliRunner().invoke(main, ["view", a, "--export", str(tmp_path / "plain.html")])
    plain = (tmp_path / "plain.html").read_text().split('id="gputrace-data">', 1)[1].split("</script>", 1)[0]
    assert r.exit_code == 0 and "compare" not in orjson.loads(plain)


def test_one_real_subprocess(runs: tuple[Path, Path]) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "gputrace", "diff", str(runs[0]), str(runs[1]), "--fail-above", "10", "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert p.returncode == 1, p.stderr
    assert orjson.loads(p.stdout)["names"][0]["name"] == "slow"


# ---- real gloo runs -----------------------------------------------------------------------------

GLOO_RANKS = 4
GLOO_STEPS = 30
SLOW_MS = 10


def gloo_run(out: Path, slow_ms: float) -> Path:
    run_rank_processes(["tests.diff_worker", str(out), str(GLOO_STEPS), str(slow_ms)], GLOO_RANKS)
    return out


@pytest.fixture(scope="module")
def gloo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Run A, the same program again (A2), and B: `backward` 10 ms slower on every rank."""
    d = tmp_path_factory.mktemp("gloo-diff")
    return {name: gloo_run(d / name, slow) for name, slow in (("a", 0), ("a2", 0), ("b", SLOW_MS))}


@pytest.mark.dist
def test_a_slowed_span_is_named_first(gloo: dict[str, Path]) -> None:
    a, b = str(gloo["a"]), str(gloo["b"])
    code, out, err = cli(a, b, "--json", "--fail-above", "10")
    assert code == 1, err
    doc = orjson.loads(out)
    first = doc["names"][0]
    assert first["name"] == "backward" and not first["noise"], doc["names"]
    # 10 ms more per occurrence than a random 1-3 ms (medians read from histograms: +-1.5 ms).
    assert abs(first["delta_ns"] - SLOW_MS * MS) < 1.5 * MS and first["delta_pct"] > 200, first
    assert "backward" in doc["fail_above"]["regressed"]
    assert first["a_count"] == first["b_count"] == GLOO_RANKS * GLOO_STEPS
    forward = next(n for n in doc["names"] if n["name"] == "forward")
    assert forward["noise"], forward  # untouched: a random 2-8 ms in both runs
    # The text says the same, the regression first.
    code, text, err = cli(a, b, "--fail-above", "10")
    assert code == 1 and "backward +" in err
    names = [line.split()[0] for line in text.splitlines() if line.split()[:1] in (["backward"], ["forward"])]
    assert names[0] == "backward"


@pytest.mark.dist
def test_the_same_program_twice_is_noise(gloo: dict[str, Path]) -> None:
    # The noise band is each run's own spread. Between two runs of 4 gloo ranks sharing 2 cores,
    # the whole run can shift (seen: the step -21%, all_reduce -39%), which no single run's spread
    # shows; a gate set above that shift passes, and the spans each rank times alone are noise.
    code, out, err = cli(str(gloo["a"]), str(gloo["a2"]), "--json", "--fail-above", "60")
    doc = orjson.loads(out)
    assert code == 0, doc
    assert {n["name"] for n in doc["names"]} == {"data", "forward", "backward", "all_reduce"}
    assert all(n["noise"] or abs(n["delta_pct"]) < 60 for n in doc["names"]), doc["names"]
    assert doc["fail_above"]["regressed"] == []
    # The slowed run against the same program is still caught with that gate.
    assert cli(str(gloo["a2"]), str(gloo["b"]), "--json", "--fail-above", "60")[0] == 1


@pytest.mark.dist
def test_gloo_files_and_digests_agree(gloo: dict[str, Path]) -> None:
    a, b = [str(gloo["a"])], [str(gloo["b"])]
    files, digests = diff.read(a, b, full=True), diff.read(a, b)
    assert "digests" in digests.a.notes[0] and "full traces" in files.a.notes[0]
    assert files.names[0].name == digests.names[0].name == "backward"
    assert files.step is not None and digests.step is not None
    assert (files.step.a_ns, files.step.b_ns) == (digests.step.a_ns, digests.step.b_ns)  # step spans: exact
    g = {c.name: c for c in digests.names}
    for f in files.names:
        # The same verdict, but where the change is within the histograms' precision of the band.
        if abs(abs(f.delta_ns) - f.noise_ns) > 2 * digest.HIST_ERROR * max(f.a_ns, f.b_ns):
            assert f.noise == g[f.name].noise, (f, g[f.name])
        assert abs(f.a_ns - g[f.name].a_ns) <= digest.HIST_ERROR * f.a_ns + 1
        assert abs(f.b_ns - g[f.name].b_ns) <= digest.HIST_ERROR * f.b_ns + 1


# ---- the compare tab in Chromium ----------------------------------------------------------------


def chromium() -> Any:
    from . import perfetto_ui

    if not os.path.exists(perfetto_ui.CHROMIUM):
        pytest.skip("chromium is not installed")
    sync_api = pytest.importorskip("playwright.sync_api")
    return sync_api, perfetto_ui


def open_tab(browser: Any, url: str) -> Any:
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    page.requests = []
    page.errors = []
    page.on("request", lambda req: page.requests.append(req.url))
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    page.on("console", lambda m: page.errors.append(m.text) if "Content Security Policy" in m.text else None)
    page.goto(url)
    page.wait_for_selector("body[data-ready='1']", timeout=30_000)
    page.click("[data-testid=tab-compare]")
    return page


@pytest.mark.dist
@pytest.mark.browser
def test_the_compare_tab_in_chromium(gloo: dict[str, Path], tmp_path: Path) -> None:
    from gputrace.viewer import data, server

    sync_api, perfetto_ui = chromium()
    a, b = str(gloo["a"]), str(gloo["b"])
    report = tmp_path / "report.html"
    r = CliRunner().invoke(main, ["view", a, "--compare", b, "--export", str(report)])
    assert r.exit_code == 0, r.output
    # The page served as `gputrace view A --compare B` serves it, and without --compare.
    trace = data.load([a])
    doc = data.document(trace, inputs=[a])
    plain = server.Viewer(trace, dict(doc), server.resolve_ui(str(ui_stub(tmp_path))), name="plain")
    doc["compare"] = data.compare([a], [b])
    served = server.Viewer(trace, doc, server.resolve_ui(str(ui_stub(tmp_path))), name="compare")
    httpds = [v.serve(0) for v in (served, plain)]
    for h in httpds:
        threading.Thread(target=h.serve_forever, daemon=True).start()
    urls = [f"http://127.0.0.1:{h.server_address[1]}/" for h in httpds]
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=perfetto_ui.CHROMIUM, args=perfetto_ui.ARGS, headless=True)
            try:
                for url in (report.as_uri(), urls[0]):
                    page = open_tab(browser, url)
                    assert page.is_visible("[data-testid=compare-view]")
                    lead = page.inner_text("[data-testid=compare-lead]")
                    assert "Largest regression: 'backward' +" in lead, lead
                    first = page.locator("[data-testid=compare-row]").first.locator("td").all_inner_texts()
                    assert first[1] == "backward" and first[5].startswith("+") and first[6] == "slower", first
                    rows = page.locator("[data-testid=compare-row] td:nth-child(2)").all_inner_texts()
                    assert sorted(rows) == ["all_reduce", "backward", "data", "forward"]
                    assert "noise" in page.inner_text("[data-testid=compare-rule]")
                    if url == report.as_uri():  # (the served page's stand-in UI never takes a zoom)
                        page.locator("[data-testid=compare-row]").first.click()
                        status = page.inner_text("[data-testid=timeline-status]")
                        assert "the slowest 'backward' of run A" in status, status
                        assert page.requests == [url]  # the report still makes no request
                    assert page.errors == []
                    page.close()
                page = browser.new_page()
                page.goto(urls[1])
                page.wait_for_selector("body[data-ready='1']", timeout=30_000)
                assert page.locator("[data-testid=tab-compare]").count() == 0
                assert page.is_hidden("[data-testid=compare-view]")
                page.close()
            finally:
                browser.close()
    finally:
        for h in httpds:
            h.shutdown()
            h.server_close()


def ui_stub(tmp_path: Path) -> Path:
    """A stand-in for the Perfetto UI that loads nothing (the timeline is not tested here)."""
    d = tmp_path / "still-ui"
    d.mkdir(exist_ok=True)
    (d / "index.html").write_text("<!doctype html><title>no timeline here</title>")
    return d
