"""A merge into a protobuf trace holds about one rank's columns, whatever the number of ranks: the
ranks are read, taken and spooled one at a time, and the file is written a rank at a time (its
beginning, which needs every rank's first instant and processes, after the last is read). The
merge runs in a fresh process, whose peak resident memory above its imports (VmHWM, reset after
them) is what is measured, as in tests/test_reader_memory.py."""

from __future__ import annotations

import json
import subprocess
import sys
from array import array
from pathlib import Path

import pytest

from gputrace.trace.model import Process, Trace, Track

# The readers' bound for one rank: 100 bytes an event or 1.5 times its file, whichever is larger,
# and what one batch costs whatever the file's size.
from .test_reader_memory import BASE, BATCH, PEAK, PER_EVENT, PER_SIZE

RANKS = 4
EVENTS = 150_000  # a rank's spans

CHILD = r"""
from gputrace import merge
from gputrace.trace import perfetto
folder, out = sys.argv[1], sys.argv[2]
before = peak_from_here()
merge.merge([folder], out, workers=1)
peak = status("VmHWM:") - before
t = perfetto.read_spans(out)
print(json.dumps({"peak": peak, "n": len(t.spans), "ranks": t.ranks}))
"""


def rank_trace(rank: int, n: int) -> Trace:
    """One rank of `n` spans on four streams and a host thread (a step every 100), an argument on
    one in ten."""
    meta = {"gputrace_version": "test", "rank": rank, "world_size": RANKS, "run_id": "merge-memory"}
    t = Trace(dict(meta))
    p = t.add_process(Process(rank + 1, rank, f"rank {rank}", rank, meta))
    streams = [t.add_track(Track(p, i + 1, f"cuda:0 stream {i}", "cuda", 0, i)) for i in range(4)]
    host = t.add_track(Track(p, 9, "thread MainThread (host)", "cpu", None, 9))
    names = [t.intern(f"kernel_{k}") for k in range(37)]
    step = t.intern("step")
    first = BASE + rank * 777
    start = array("q", (first + k * 1_000 + (k * 7919) % 333 for k in range(n)))
    is_step = [k % 100 == 0 for k in range(n)]
    t.spans.extend(
        array("l", (step if s else names[k % 37] for k, s in enumerate(is_step))),
        array("l", (host if s else streams[k % 4] for k, s in enumerate(is_step))),
        start,
        array("q", (s + (99_000 if h else 400 + k % 97) for k, (s, h) in enumerate(zip(start, is_step)))),
        [{"bytes": k} if k % 10 == 0 else None for k in range(n)],
    )
    return t


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gputrace.trace import perfetto

    d = tmp_path_factory.mktemp("ranks")
    for r in range(RANKS):
        perfetto.write(rank_trace(r, EVENTS), str(d / f"trace_rank{r}.pftrace"))
    return d


def test_a_protobuf_merge_holds_about_one_ranks_columns(ranks: Path, tmp_path: Path) -> None:
    """Before, the merged trace of every rank was loaded and written whole: its columns, its
    layout and each track's events as Python lists (about 4 times this bound here)."""
    pytest.importorskip("gputrace.trace.perfetto")
    out = tmp_path / "merged.pftrace"
    r = subprocess.run(
        [sys.executable, "-c", PEAK + CHILD, str(ranks), str(out)], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["n"] == RANKS * EVENTS and got["ranks"] == list(range(RANKS))
    size = max(p.stat().st_size for p in ranks.iterdir())
    bound = max(PER_SIZE * size, PER_EVENT * EVENTS) + BATCH
    assert got["peak"] <= bound, (
        f"merge of {RANKS} ranks of {EVENTS:,} events into protobuf held {got['peak'] / 1e6:.1f} MB "
        f"> {bound / 1e6:.1f} MB (one rank's bound)"
    )
