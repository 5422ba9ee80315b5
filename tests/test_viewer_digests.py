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


def write_small_run(d: Path, ranks: int, slow: tuple[int, int]) -> None:
    """`ranks` ranks of 5 steps, each trace with its digest; rank slow[0] is slow in step slow[1]."""
    for r in range(ranks):
        meta = {"gputrace_version": "test", "rank": r, "world_size": ranks, "run_id": "run-2"}
        t = Trace(dict(meta))
        p = t.add_process(Process(r + 1, r, f"rank {r}", r, meta))
        compute = t.add_track(Track(p, 1, "cuda:0 default stream", "cuda", 0, 0))
        comm = t.add_track(Track(p, 2, "cuda:0 stream 1", "cuda", 0, 1))
        for k in range(5):
            s = BASE + k * STEP
            work = 6_000_000 + (2_000_000 if (r, k) == slow else 0)
            t.add_span("fwd", compute, s, s + work)
            t.add_span("all_reduce", comm, s + work, s + 9_000_000, {"collective": True})
            t.add_span("step", compute, s, s + 9_000_000)
        path = d / f"trace_rank{r}.json"
        chrome.write(t, str(path))
        assert digest.write_for_trace(t, str(path), "step") is not None


def _get(port: int, path: str) -> bytes:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
        return r.read()


def test_large_traces_with_digests_serve_the_page_without_reading_a_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    import orjson

    from gputrace.trace import digestfile

    write_small_run(tmp_path, 4, (2, 3))
    monkeypatch.setattr(data, "DIGEST_VIEW_BYTES", 1)  # these few KB count as large traces
    reads: list[str] = []
    digest_reads: list[str] = []
    read, read_digest = chrome.read, digestfile.read
    monkeypatch.setattr(chrome, "read", lambda path, b=None: reads.append(path) or read(path, b))
    monkeypatch.setattr(digestfile, "read", lambda path: digest_reads.append(path) or read_digest(path))
    monkeypatch.setattr("gputrace.summary.read", digestfile.read)

    got = data.digest_view([str(tmp_path)], inputs=[str(tmp_path)])
    assert got is not None and reads == [] and len(digest_reads) == 4
    head, body = got
    files = sorted(str(p) for p in tmp_path.glob("trace_rank*.json"))
    v = server.WindowedViewer(files, head, server.UISource("url", "https://ui.perfetto.dev", "test"), body=body)
    httpd = v.serve(0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        port = httpd.server_address[1]
        assert b"<html" in _get(port, "/").lower()
        doc = orjson.loads(_get(port, "/data.json"))
        assert reads == []  # the page and its document: no trace read
        v_ = doc["steps"]["verdict"]
        called = [(doc["ranks"][v_["slot"][k]], k) for k in range(doc["steps"]["count"]) if v_["called"][k]]
        assert called == [(2, 3)] and doc["ranks"] == [0, 1, 2, 3] and doc["timeline"]["ui"]["trace"] == "trace.json"
        assert {k: v for k, v in doc.items() if k != "timeline"} == {
            k: v for k, v in data.join(head, body).items() if k != "timeline"
        }
        window = chrome.read("window", _get(port, f"/trace.json?start={3 * STEP}&end={4 * STEP}"))
        assert reads  # the timeline asked: now the traces are read, that window of them
        assert len(window.spans) == 3 * 4
    finally:
        httpd.shutdown()
        httpd.server_close()

    # Again on the same files: the document kept beside the digests, no digest read.
    digest_reads.clear()
    assert data.digest_view([str(tmp_path)], inputs=[str(tmp_path)]) == (head, body) and digest_reads == []
    # A rank's trace and digest written again (rank 1 now slow in step 0): computed afresh.
    write_small_run(tmp_path, 4, (1, 0))
    again = data.from_digests([str(tmp_path)], inputs=[str(tmp_path)])
    assert again is not None and len(digest_reads) == 4
    v_ = again["steps"]["verdict"]
    assert [(k, again["ranks"][v_["slot"][k]]) for k in range(5) if v_["called"][k]] == [(0, 1)]
    assert len(list(tmp_path.glob(".gputrace-view-*"))) == 1  # the old document removed


def test_small_traces_with_digests_are_read_whole(tmp_path: Path) -> None:
    write_small_run(tmp_path, 2, (1, 1))
    assert data.digest_view([str(tmp_path)]) is None  # below DIGEST_VIEW_BYTES: the traces
    assert not list(tmp_path.glob(".gputrace-view-*"))


def test_a_damaged_kept_document_is_made_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_small_run(tmp_path, 3, (0, 2))
    monkeypatch.setattr(data, "DIGEST_VIEW_BYTES", 1)
    first = data.from_digests([str(tmp_path)])
    (kept,) = tmp_path.glob(".gputrace-view-*")
    kept.write_bytes(kept.read_bytes()[:100])  # cut short
    assert data.from_digests([str(tmp_path)]) == first
    kept.write_bytes(b"not json\n{}")
    assert data.from_digests([str(tmp_path)]) == first


def test_view_served_from_digests_keeps_compare_and_open(run: Path, tmp_path: Path) -> None:
    # The real command, twice: the second serves the document kept beside the digests; both add
    # the --compare tab and the open section to it.
    import re
    import signal
    import subprocess
    import sys

    import orjson

    b = tmp_path / "b"
    b.mkdir()
    write_small_run(b, 2, (1, 1))
    root = Path(__file__).resolve().parent.parent
    for _ in range(2):
        proc = subprocess.Popen(
            [sys.executable, "-m", "gputrace", "view", str(run), "--compare", str(b), "--no-browser"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=root,
        )
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            m = re.match(r"gputrace view: http://127\.0\.0\.1:(\d+)/ ", line)
            assert m, (line, proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
            doc = orjson.loads(_get(int(m.group(1)), "/data.json"))
            assert doc["compare"]["b"]["paths"] == [str(b)] and "open" in doc  # the first document too
            # The full document (computed behind the first one, then kept beside the digests).
            doc = orjson.loads(_get(int(m.group(1)), "/full.json?wait=15"))
            while "format" not in doc:
                doc = orjson.loads(_get(int(m.group(1)), "/full.json?wait=15"))
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
        assert f"read the step digests of {RANKS} ranks" in err
        assert doc["ranks"] == list(range(RANKS)) and "step digests" in " ".join(doc["notes"])
        assert doc["compare"]["b"]["paths"] == [str(b)] and "open" in doc
    assert len(list(run.glob(".gputrace-view-*"))) == 1
