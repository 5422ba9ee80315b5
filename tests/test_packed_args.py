"""A whole protobuf read keeps its spans' arguments packed (`model.PackedArgs`, no dict a span)
and its categories as a column of no memory where it has none: what a consumer reads from them is
what was written, value for value and type for type, and merge carries them as before."""

from __future__ import annotations

import pickle
import random
from array import array
from pathlib import Path
from typing import Any

import orjson
import pytest

from gputrace import merge
from gputrace.trace import chrome, perfetto
from gputrace.trace.model import PackedArgs, Process, Trace, Track, _NoCats

BASE = 1_700_000_000_000_000_000


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(12 if depth < 2 else 9)
    if kind == 0:
        return rng.randrange(-1000, 1000)
    if kind == 1:
        return rng.choice([1 << 63, (1 << 64) - 1, (1 << 63) - 1, -(1 << 63)])  # at and past int64
    if kind == 2:
        return rng.choice([True, False])
    if kind == 3:
        return rng.choice([0.0, -0.0, 1.0, 2.5, 1e300])
    if kind == 4:
        return rng.choice(["", "a", "all_reduce", "\u2713", 'q"uote'])  # repeated strings
    if kind == 5:
        return f"s{rng.randrange(10**6)}"
    if kind == 6:
        return None
    if kind in (7, 8):
        return rng.randrange(1 << 40)
    if kind == 9:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {f"k{j}": random_value(rng, depth + 1) for j in range(rng.randrange(3))}


def random_args(rng: random.Random) -> dict[str, Any] | None:
    if rng.random() < 0.5:
        return None
    keys = rng.sample(["bytes", "step", "collective", "stream", "x", "unfinished"], rng.randrange(1, 4))
    return {k: random_value(rng) for k in keys}


def exact(values: Any) -> bytes:
    """The values as text that tells True from 1, -0.0 from 0.0 and a list from a tuple."""
    return repr(values).encode()


@pytest.mark.parametrize("seed", range(6))
def test_packed_args_read_as_the_dicts_packed(seed: int) -> None:
    rng = random.Random(seed)
    rows = [random_args(rng) for _ in range(rng.randrange(1, 400))]
    col = PackedArgs(rows)
    n = len(rows)
    assert len(col) == n
    assert exact([col[i] for i in range(n)]) == exact(rows)
    assert exact([col[i] for i in range(-n, 0)]) == exact(rows)
    assert exact(list(col)) == exact(rows) and exact(col.dense()) == exact(rows)
    for sl in (slice(None), slice(3, None), slice(None, -2), slice(1, n, 3), slice(None, None, -1), slice(n, n + 5)):
        assert exact(col[sl]) == exact(rows[sl])
    with pytest.raises(IndexError):
        col[n]
    back = pickle.loads(pickle.dumps(col, pickle.HIGHEST_PROTOCOL))
    assert type(back) is PackedArgs and exact(list(back)) == exact(rows)
    more = [random_args(rng) for _ in range(50)]
    col.extend(more[:25])
    for a in more[25:]:
        col.append(a)
    assert exact(list(col)) == exact(rows + more)
    i = next(k for k, a in enumerate(rows + more) if a)
    got = col[i]
    got["changed"] = 1  # a row read is the reader's own dict: the column keeps what was packed
    assert col[i] == (rows + more)[i] and col[i] is not col[i]


def random_trace(seed: int, cats: bool, ranks: tuple[int, ...] = (0, 1)) -> Trace:
    """Ranks (a merged trace of two, or one rank's) of nested spans on CUDA streams and host
    threads with random arguments (and, where `cats`, categories on some spans), launch arrows
    (host entries), counters, and another tool's events."""
    rng = random.Random(seed)
    t = Trace({"gputrace_version": "test", "run_id": "packed", "world_size": 2})
    if len(ranks) > 1:
        t.metadata.update(merged=True, rank_metadata={str(r): {"rank": r} for r in ranks})
    else:
        t.metadata["rank"] = ranks[0]
    entries: list[int] = []
    for rank in ranks:
        meta = {"rank": rank} if len(ranks) > 1 else t.metadata
        p = t.add_process(Process(rank + 1, rank, f"rank {rank}", rank, meta))
        tracks = [
            t.add_track(Track(p, 1, "cuda:0 default stream", "cuda", 0, 0)),
            t.add_track(Track(p, 2, "cuda:0 stream 7", "cuda", 0, 7)),
            t.add_track(Track(p, 3, "thread MainThread (host)", "cpu", None, 100)),
        ]
        mem = t.add_track(Track(p, "cuda:0 memory allocated", "cuda:0 memory allocated", "counter", 0))
        at = BASE + rank * 777
        for k in range(rng.randrange(20, 120)):
            track = rng.choice(tracks)
            d = rng.randrange(1, 5_000)
            cat = rng.choice([None, "kernel", "user", "host,io"]) if cats else None
            t.add_span(f"op{rng.randrange(9)}", track, at, at + d, random_args(rng), cat)
            if rng.random() < 0.3:  # a child sharing its parent's start
                t.add_span("child", track, at, at + d // 2, random_args(rng), cat)
                entries.append(0)
            entries.append(at - rng.randrange(1, 500) if t.tracks[track].kind == "cuda" and rng.random() < 0.5 else 0)
            at += d + rng.randrange(0, 300)
            if rng.random() < 0.2:
                t.counters.append(mem, at, float(rng.randrange(1 << 30)))
    t.spans.entry = array("q", entries)
    t.extra.append({"ph": "i", "name": "marker", "s": "t", "tid": 7, "ts_ns": BASE + 300, "process": 0})
    return t


def counters(t: Trace) -> list[tuple[str, int, float]]:
    return sorted(zip((t.tracks[k].name for k in t.counters.track), t.counters.ts, t.counters.value))


def rows_of(t: Trace) -> list[tuple[Any, ...]]:
    """Every span (its process, track, name, times, host entry, exact arguments, category), sorted:
    a reader orders spans by track and end, a writer by its layout."""
    sp = t.spans
    out = []
    for i in range(len(sp)):
        tr = t.tracks[sp.track[i]]
        e = sp.entry[i] if sp.entry is not None else 0
        out.append(
            (t.processes[tr.process].label, tr.name, t.names[sp.name[i]], sp.start[i], sp.end[i], e)
            + (exact(sp.args[i]), sp.cat[i])
        )
    return sorted(out, key=repr)


@pytest.mark.parametrize("cats", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_a_whole_protobuf_read_is_the_trace_written(tmp_path: Path, seed: int, cats: bool) -> None:
    trace = random_trace(seed, cats)
    path = str(tmp_path / "t.pftrace")
    perfetto.write(trace, path)
    got = perfetto.read(path)
    assert type(got.spans.args) is PackedArgs
    assert (type(got.spans.cat) is _NoCats) is not cats
    assert rows_of(got) == rows_of(trace)
    # The JSON reader (dicts and a list of categories) gives the same of the same trace.
    chrome.write(trace, str(tmp_path / "t.json"))
    want = chrome.read(str(tmp_path / "t.json"))
    assert rows_of(got) == rows_of(want)
    assert got.names == want.names or sorted(got.names) == sorted(want.names)
    key = lambda tr: (tr.name, tr.kind, tr.device, str(tr.tid))  # noqa: E731
    assert sorted(map(key, got.tracks)) == sorted(map(key, want.tracks))
    assert got.processes == want.processes and got.metadata == want.metadata
    assert counters(got) == counters(want) and len(got.counters) == len(trace.counters)
    assert got.extra == want.extra
    # Merged to either format, every argument and category as the merge of the JSON file has them.
    for ext, fmt in (("json", chrome), ("pftrace", perfetto)):
        a, b = str(tmp_path / f"from-pb.{ext}"), str(tmp_path / f"from-json.{ext}")
        merge.merge([path], a, workers=1)
        merge.merge([str(tmp_path / "t.json")], b, workers=1)
        assert rows_of(fmt.read(a)) == rows_of(fmt.read(b)), ext


def test_a_group_whose_first_file_has_no_categories_keeps_the_others(tmp_path: Path) -> None:
    """A rank read without categories (a column of no memory, moved into the merged part) and
    then another tool's file of that rank with categories: the second file's categories stay."""
    trace = random_trace(1, cats=False, ranks=(1,))
    perfetto.write(trace, str(tmp_path / "trace_rank1.pftrace"))
    kineto = {
        "distributedInfo": {"rank": 1, "world_size": 2},
        "baseTimeNanoseconds": BASE,
        "traceEvents": [
            {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "GPU 0"}},
            {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 10.5, "dur": 2.25},
        ],
    }
    (tmp_path / "gpu_trace.json").write_bytes(orjson.dumps(kineto))
    out = str(tmp_path / "merged.json")
    merge.merge([str(tmp_path / "trace_rank1.pftrace"), str(tmp_path / "gpu_trace.json")], out, workers=1)
    got = chrome.read(out)
    cats = {(got.names[n], c) for n, c in zip(got.spans.name, got.spans.cat)}
    assert ("gemm", "kernel") in cats
    assert len(got.spans) == len(trace.spans) + 1
