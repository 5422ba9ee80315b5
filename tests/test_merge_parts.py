"""A merge into protobuf is written part by part (`perfetto.MergedPartsWriter`, the ranks waiting
on disk in `merge.spool`): the same bytes as the whole writer gives the merged trace loaded in
memory, here or with worker processes, from rank files of either format beside another tool's
trace; and bad input is one line and exit 2 with nothing written, the spool gone."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from gputrace import merge
from gputrace.cli import main
from gputrace.trace import chrome

from .test_merge_bytes import kineto, rank_trace

perfetto = pytest.importorskip("gputrace.trace.perfetto")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("parts")
    for r in range(3):  # both formats in one merge
        fmt, ext = (perfetto, "pftrace") if r % 2 == 0 else (chrome, "json")
        fmt.write(rank_trace(r, steps=60, seed=7), str(d / f"trace_rank{r}.{ext}"))
    (d / "gpu_trace.json").write_bytes(kineto(2))
    return d


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("kw", [{}, {"ranks": [1, 2], "steps": (5, 40)}], ids=["whole", "selected"])
def test_written_part_by_part_as_the_whole_writer_writes_it(
    ranks: Path, tmp_path: Path, workers: int, kw: dict[str, object]
) -> None:
    out = tmp_path / "m.pftrace"
    meta = merge.merge([ranks], out, workers=workers, **kw)  # type: ignore[arg-type]
    whole = merge.load([ranks], workers=1, **kw)  # type: ignore[arg-type]
    perfetto.write(whole, str(tmp_path / "whole.pftrace"))
    assert out.read_bytes() == (tmp_path / "whole.pftrace").read_bytes()
    assert meta["ranks"] == whole.metadata["ranks"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pftrace", "whole.pftrace"]  # no spool left


def test_bad_input_is_one_line_and_nothing_is_written(ranks: Path, tmp_path: Path) -> None:
    bad = tmp_path / "trace_rank9.pftrace"
    bad.write_bytes(b"\x0a\xff\xff\xff\x0fnot a trace")
    out = tmp_path / "m.pftrace"
    for args in (
        [str(ranks), str(bad)],
        [str(ranks), "--steps", "5:9", "--step", "no_such_step"],
    ):
        r = CliRunner().invoke(main, ["merge", *args, "-o", str(out), "-q"])
        lines = [line for line in r.output.splitlines() if line.strip()]
        assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("gputrace: error:"), r.output
        assert "Traceback" not in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == [bad.name]
    # And in a real process.
    import subprocess

    p = subprocess.run(
        [sys.executable, "-m", "gputrace", "merge", str(ranks), str(bad), "-o", str(out), "-q"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert not out.exists()


def test_a_merge_into_a_folder_not_made_yet_makes_it(ranks: Path, tmp_path: Path) -> None:
    """The spool lies beside the output: its folder is made first, as the output's would be."""
    out = tmp_path / "new" / "deeper" / "m.pftrace"
    r = CliRunner().invoke(main, ["merge", str(ranks), "-o", str(out), "-q"])
    assert r.exit_code == 0, r.output
    assert [p.name for p in out.parent.iterdir()] == ["m.pftrace"]


def test_a_folder_that_refuses_the_spool_is_one_line(ranks: Path, tmp_path: Path) -> None:
    """A spool that cannot be written (here its folder is a file's name) says so in one line."""
    from gputrace.errors import GputraceError
    from gputrace.merge.spool import Spool
    from gputrace.trace.model import Trace

    (tmp_path / "file").write_text("")
    with pytest.raises(GputraceError, match=r"^cannot spool the merge's ranks in .*file, beside its output"):
        Spool(str(tmp_path / "file")).add(Trace({}))


def test_a_sparse_argument_column_comes_back_from_the_spool(tmp_path: Path) -> None:
    from gputrace.merge.spool import Spool
    from gputrace.trace.model import SparseArgs

    part = rank_trace(0, steps=3, seed=1)
    args = [None] * len(part.spans)
    args[1] = {"k": 1}
    part.spans.args = SparseArgs(args)
    s = Spool(str(tmp_path))
    s.add(part)
    s.add(rank_trace(1, steps=3, seed=1))
    back = next(s.parts())
    assert list(back.spans.args)[1] == {"k": 1} and list(back.spans.args).count(None) == len(args) - 1
    s.close()
