"""HolisticTraceAnalysis reads gputrace's per-rank files with the right ranks.

HTA finds a file's rank with the pattern `"rank":\\s+(\\d+)` (a space after the colon, as Kineto
writes it) on the first line that has one; without a match it warns and calls the file rank 0.
"""

from __future__ import annotations

import re
import shutil
import textwrap
from pathlib import Path

import orjson
import pytest

from gputrace.trace import chrome
from gputrace.trace.model import Process, Trace, Track

from .conftest import run_py

hta_file = pytest.importorskip("hta.common.trace_file")
SAMPLES = Path(__file__).resolve().parent.parent / "samples"
BASE = 1_700_000_000_000_000_000


def rank_file(directory: Path, rank: int, world: int, steps: int) -> Path:
    meta = {"gputrace_version": "test", "rank": rank, "world_size": world, "run_id": "r"}
    t = Trace(dict(meta))
    p = t.add_process(Process(rank + 1, rank, f"rank {rank}", rank, meta))
    host = t.add_track(Track(p, 1, "thread MainThread (host)", "cpu", None, 1))
    cuda = t.add_track(Track(p, 2, "cuda:0 stream 7", "cuda", 0, 0))
    for k in range(steps):
        s = BASE + k * 10_000 + rank * 500
        t.add_span("step", host, s, s + 9_000, {"step": k})
        t.add_span("compute", cuda, s + 100, s + 6_000)
        t.add_span("all_reduce", cuda, s + 6_000, s + 8_000)
    path = directory / f"trace_rank{rank}.json"
    chrome.write(t, str(path))
    return path


def hta_ranks_and_counts(directory: Path) -> dict[int, tuple[str, int, set[str]]]:
    """What HTA's loader makes of a directory: rank -> (file name, events, span names)."""
    from hta.trace_analysis import TraceAnalysis

    files = hta_file.get_trace_files(str(directory))
    analysis = TraceAnalysis(trace_dir=str(directory))
    names = analysis.t.symbol_table.get_sym_table()
    out = {}
    for rank, df in analysis.t.get_all_traces().items():
        out[rank] = (Path(files[rank]).name, len(df), {names[i] for i in df["name"].unique()})
    return out


def test_hta_reads_chrome_writer_files_with_their_ranks(tmp_path: Path) -> None:
    for r in range(4):
        rank_file(tmp_path, r, 4, steps=5 + r)
    got = hta_ranks_and_counts(tmp_path)
    assert {r: (f, n) for r, (f, n, _) in got.items()} == {r: (f"trace_rank{r}.json", 3 * (5 + r)) for r in range(4)}
    assert all(names == {"step", "compute", "all_reduce"} for _, _, names in got.values())


RECORD = textwrap.dedent(
    """
    import gputrace
    gputrace.enable(cuda=False)
    for i in range(3):
        with gputrace.span("step", i=i):
            with gputrace.span("fwd"):
                pass
    print(gputrace.save(OUT))
    """
)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the recorder writes for ranks 0 and 1 of a world of 2."""
    out = tmp_path_factory.mktemp("recorded")
    for rank in (0, 1):
        r = run_py(RECORD.replace("OUT", repr(str(out))), env={"RANK": str(rank), "WORLD_SIZE": "2"})
        assert r.returncode == 0, r.stderr
    return out


def test_hta_reads_the_recorders_files_with_their_ranks(recorded: Path, tmp_path: Path) -> None:
    for rank in (0, 1):
        shutil.copy(recorded / f"trace_rank{rank}.json", tmp_path)
    first_line = (tmp_path / "trace_rank1.json").read_bytes().split(b"\n", 1)[0]
    assert re.search(rb'"rank":\s+1\b', first_line)
    got = hta_ranks_and_counts(tmp_path)
    assert {r: (f, n) for r, (f, n, _) in got.items()} == {0: ("trace_rank0.json", 6), 1: ("trace_rank1.json", 6)}


def test_hta_reads_the_recorders_output_directory_as_it_is(recorded: Path) -> None:
    # HTA's directory rule (create_rank_to_trace_dict_from_dir): every *.json and *.gz is a trace.
    taken = sorted(p.name for p in recorded.iterdir() if p.name.endswith((".json", ".gz")))
    assert taken == ["trace_rank0.json", "trace_rank1.json"]  # the digests beside them are not *.json
    assert sorted(hta_ranks_and_counts(recorded)) == [0, 1]


def test_the_two_gpu_sample_is_read_with_both_ranks(tmp_path: Path) -> None:
    sample = SAMPLES / "h200x2-nccl"
    head = (sample / "trace_rank1.json").read_bytes()[:4096]
    if not re.search(rb'"rank":\s+\d', head):
        pytest.skip("the sample was recorded before gputrace wrote the rank HTA can find; re-record it")
    for name in ("trace_rank0.json", "trace_rank1.json"):
        shutil.copy(sample / name, tmp_path / name)
    got = hta_ranks_and_counts(tmp_path)
    for rank in (0, 1):
        events = orjson.loads((tmp_path / f"trace_rank{rank}.json").read_bytes())["traceEvents"]
        assert got[rank][:2] == (f"trace_rank{rank}.json", sum(1 for e in events if e.get("ph") == "X"))
