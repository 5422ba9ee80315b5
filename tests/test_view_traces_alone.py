"""`gputrace view` of large per-rank traces that came without their digests: each rank's digest
is made from its trace in worker processes and written beside it, and the page is drawn from
them, the same page as from the digests the recorder writes."""

from __future__ import annotations

import shutil
from pathlib import Path

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
