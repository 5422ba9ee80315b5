"""`gputrace view` over many ranks: the page's numbers from the ranks' step digests, the timeline
read from the trace files one window at a time (no rank's whole trace held)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from gputrace import digest, summary
from gputrace.cli import main
from gputrace.trace import chrome
from gputrace.trace.model import Process, Trace, Track
from gputrace.viewer import data, server

BASE = 1_764_000_000_000_000_000
RANKS = summary.DIGEST_MIN_RANKS  # as many as the summary reads digests for
STEP = 10_000_000  # 10 ms steps
SLOW = (7, 2)  # rank 7 is slow in step 2


def write_run(d: Path) -> None:
    for r in range(RANKS):
        meta = {"gputrace_version": "test", "rank": r, "world_size": RANKS, "run_id": "run-1"}
        t = Trace(dict(meta, world_size=RANKS))
        p = t.add_process(Process(r + 1, r, f"rank {r}", r, meta))
        compute = t.add_track(Track(p, 1, "cuda:0 default stream", "cuda", 0, 0))
        comm = t.add_track(Track(p, 2, "cuda:0 stream 1", "cuda", 0, 1))
        t.add_span("setup", compute, BASE - 5_000_000, BASE - 1_000_000)  # before the first step
        for k in range(5):
            s = BASE + k * STEP
            work = 6_000_000 + (2_000_000 if (r, k) == SLOW else 0)
            t.add_span("fwd", compute, s, s + work)
            t.add_span("all_reduce", comm, s + work, s + 9_000_000, {"collective": True})
            t.add_span("step", compute, s, s + 9_000_000, {"step": k})
        path = d / f"trace_rank{r}.json"
        chrome.write(t, str(path))
        assert digest.write_for_trace(t, str(path), "step") is not None


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("many")
    write_run(d)
    return d


def test_the_document_comes_from_the_digests(run: Path) -> None:
    doc = data.from_digests([str(run)])
    assert doc is not None and doc["ranks"] == list(range(RANKS))
    assert "step digests" in doc["notes"][0]
    v = doc["steps"]["verdict"]
    called = [(doc["ranks"][v["slot"][k]], k) for k in range(doc["steps"]["count"]) if v["called"][k]]
    assert called == [SLOW]
    assert doc["timeline"]["whole"] is False and doc["spans"] == RANKS * 16


def test_fewer_ranks_read_the_traces(tmp_path: Path, run: Path) -> None:
    assert data.from_digests([str(run / "trace_rank0.json"), str(run / "trace_rank1.json")]) is None


def test_the_timeline_reads_one_window_of_the_files(run: Path) -> None:
    doc = data.from_digests([str(run)])
    assert doc is not None
    files = sorted(str(p) for p in run.glob("trace_rank*.json"))
    v = server.WindowedViewer(files, doc, server.UISource("url", "https://ui.perfetto.dev", "test"))
    assert v.trace is not None and len(v.trace.spans) == 0  # nothing held
    base = doc["base_ns"]
    body, lo, hi = v.window(2 * STEP, 3 * STEP)  # step 2 only
    got = chrome.read("window", body)
    names = sorted({got.names[i] for i in got.spans.name})
    assert names == ["all_reduce", "fwd", "step"] and len(got.spans) == 3 * RANKS
    assert lo == 2 * STEP and hi == 3 * STEP and base == BASE - 0
    first = chrome.read("first", v.whole_trace())  # the first steps, the setup span clipped to the base
    assert len(first.spans) > 0 and min(first.spans.start) >= first.metadata["base_ns"]


def test_view_export_from_digests(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    r = CliRunner().invoke(main, ["view", str(run), "--export", str(out)])
    assert r.exit_code == 0, r.output
    assert f"read the step digests of {RANKS} ranks" in r.output
    html = out.read_text()
    assert "step digests" in html and "<script" in html
