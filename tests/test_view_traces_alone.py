"""`gputrace view` of large per-rank traces that came without their digests: each rank's digest
is made from its trace in worker processes and written beside it, and the page is drawn from
them, the same page as from the digests the recorder writes."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from gputrace import summary
from gputrace.cli import main
from gputrace.viewer import data
from tests.test_viewer_digests import write_small_run


def _page(doc: dict) -> dict:  # type: ignore[type-arg]
    return {k: v for k, v in doc.items() if k not in ("inputs", "title")}


def test_traces_alone_get_their_digests_beside_them_and_the_page_of_the_recorders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(data, "DIGEST_VIEW_BYTES", 1)  # these few KB count as large traces
    recorded, bare = tmp_path / "recorded", tmp_path / "bare"
    recorded.mkdir()
    write_small_run(recorded, 4, (2, 3))
    bare.mkdir()
    for f in recorded.glob("trace_rank*.json"):
        shutil.copy2(f, bare / f.name)
    assert not list(bare.glob("digest_rank*"))

    want = data.from_digests([str(recorded)])
    got = data.from_digests([str(bare)])
    assert want is not None and got is not None
    assert _page(got) == _page(want)
    assert sorted(p.name for p in bare.glob("digest_rank*")) == [f"digest_rank{r}.digest" for r in range(4)]
    # Fresh digests of those traces: the next summary reads them, not the traces.
    digests = summary.collect(summary.find([str(bare)]), "step")
    assert [d.rank for d in digests] == [0, 1, 2, 3] and not any(d.computed for d in digests)

    # The command, on another copy: the same page, exported.
    again = tmp_path / "again"
    shutil.copytree(bare, again, ignore=shutil.ignore_patterns("digest_rank*", ".gputrace-view-*"))
    out = tmp_path / "page.html"
    r = CliRunner().invoke(main, ["view", str(again), "--export", str(out)])
    assert r.exit_code == 0, r.output
    assert "read the step digests of 4 ranks" in r.output and out.exists()
    assert len(list(again.glob("digest_rank*"))) == 4


def test_a_bad_trace_among_them_is_one_clear_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data, "DIGEST_VIEW_BYTES", 1)
    write_small_run(tmp_path, 3, (1, 1))
    for f in tmp_path.glob("digest_rank*"):
        f.unlink()
    (tmp_path / "trace_rank1.json").write_bytes(b'{"traceEvents": [{"ph": "X", "ts": "no"')
    r = CliRunner().invoke(main, ["view", str(tmp_path), "--export", str(tmp_path / "p.html")])
    assert r.exit_code == 2, r.output
    assert "trace_rank1.json" in r.output and "Traceback" not in r.output


def _bare_run(tmp_path: Path, ranks: int = 4) -> Path:
    bare = tmp_path / "bare"
    bare.mkdir()
    write_small_run(bare, ranks, (2, 3))
    for f in bare.glob("digest_rank*"):
        f.unlink()
    return bare


def test_a_digest_that_cannot_be_written_leaves_its_rank_to_the_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A place that cannot take a digest (here a folder in its way; a read-only folder is the
    common case) is no error: the others are written, and `view` still draws the page (that
    rank read from its trace)."""
    monkeypatch.setattr(data, "DIGEST_VIEW_BYTES", 1)
    bare = _bare_run(tmp_path)
    (bare / "digest_rank2.digest").mkdir()
    summary.make_digests(summary.find([str(bare)]), "step", workers=1)
    assert sorted(p.name for p in bare.glob("digest_rank*") if p.is_file()) == [
        f"digest_rank{r}.digest" for r in (0, 1, 3)
    ]
    (bare / "digest_rank2.digest").rmdir()  # gone, as a read-only folder never had it
    out = tmp_path / "page.html"
    r = CliRunner().invoke(main, ["view", str(bare), "--export", str(out)])
    assert r.exit_code == 0, r.output
    assert out.exists() and "Traceback" not in r.output


def test_digests_of_other_steps_or_an_older_trace_are_made_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A view with another step name (a typo), or traces that grew since their digests were
    written, must not leave the folder computing every rank from its trace on every later view."""
    monkeypatch.setattr(data, "DIGEST_VIEW_BYTES", 1)
    bare = _bare_run(tmp_path)
    summary.make_digests(summary.find([str(bare)]), "stpe", workers=1)
    assert {summary.step_name_of(str(p)) for p in bare.glob("digest_rank*")} == {"stpe"}
    summary.make_digests(summary.find([str(bare)]), "step", workers=1)
    assert {summary.step_name_of(str(p)) for p in bare.glob("digest_rank*")} == {"step"}
    digests = summary.collect(summary.find([str(bare)]), "step")
    assert not any(d.computed for d in digests)
    # rank 1's trace written again, longer: its digest no longer fits and is made again
    with open(bare / "trace_rank1.json", "ab") as f:
        f.write(b"\n")
    before = {p.name: p.stat().st_mtime_ns for p in bare.glob("digest_rank*")}
    summary.make_digests(summary.find([str(bare)]), "step", workers=1)
    after = {p.name: p.stat().st_mtime_ns for p in bare.glob("digest_rank*")}
    assert [n for n in sorted(after) if after[n] != before[n]] == ["digest_rank1.digest"]
    assert not any(d.computed for d in summary.collect(summary.find([str(bare)]), "step"))


def test_a_trace_that_changes_while_it_is_read_gets_no_digest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run still writing its trace: the digest of what was read would hold part of it and look
    current once written, so none is written; nor over a current digest that appeared meanwhile."""
    from gputrace.trace import registry

    bare = _bare_run(tmp_path, 2)
    trace = bare / "trace_rank0.json"
    real_read = registry.read

    def read_then_grow(path: str, *a: object, **k: object) -> object:
        got = real_read(path, *a, **k)  # type: ignore[arg-type]
        with open(path, "ab") as f:
            f.write(b" ")  # the writer goes on meanwhile
        return got

    monkeypatch.setattr(registry, "read", read_then_grow)
    assert summary._digest_beside((str(trace), "step")) is False
    assert not (bare / "digest_rank0.digest").exists()
    monkeypatch.setattr(registry, "read", real_read)
    assert summary._digest_beside((str(trace), "step")) is True
    made = (bare / "digest_rank0.digest").stat().st_mtime_ns
    assert summary._digest_beside((str(trace), "step")) is False  # a current one is there: kept
    assert (bare / "digest_rank0.digest").stat().st_mtime_ns == made


def test_the_digests_workers_follow_the_cpus_idle_now(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers where CPUs idle now (measured over a moment, not the load average's minute); two
    while every CPU is busy (one where there is one); merge's rule (None) for traces too small
    for workers to pay."""
    import multiprocessing
    import os

    from gputrace.merge import run

    write_small_run(tmp_path, 4, (1, 1))
    traces = [str(p) for p in sorted(tmp_path.glob("trace_rank*.json"))]
    assert data.digest_workers(traces) is None  # a few KB
    idle = data.idle_cpus()
    cpus = os.cpu_count() or 1
    assert idle is not None and 0 <= idle <= cpus
    monkeypatch.setattr(run, "PARALLEL_MIN_BYTES", 1)
    got = data.digest_workers(traces)
    assert got is not None and min(cpus, 2) <= got <= max(min(cpus, 8), 1)
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    busy = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(cpus + 1)]
    for p in busy:
        p.start()
    try:
        import time

        time.sleep(1.0)  # the spinners started (a spawned interpreter's imports)
        assert data.digest_workers(traces) == min(cpus, 2)
    finally:
        stop.set()
        for p in busy:
            p.join(10)


def _spin(stop: Any) -> None:
    while not stop.is_set():
        pass
