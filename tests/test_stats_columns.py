"""The statistics' columns and C loops give exactly what they gave as Python lists: `summary
--json` (from digests and from full traces, with and without warm-up skipped) and the viewer's
document, on seeded runs, equal to what the code before them wrote (tests/golden/
stats_columns.json.gz, made by `python -m tests.test_stats_columns --write PATH` on that code),
and the C loops equal to their Python twins.

Run with --write on a tree, the module writes that tree's outputs for the seeded runs."""

from __future__ import annotations

import gzip
import os
import random
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

import gputrace
from gputrace import digest
from gputrace.cli import main
from gputrace.trace import chrome
from gputrace.trace.model import Process, Trace, Track
from tests.conftest import TWINS

B = 1_700_000_000_000_000_000
GOLDEN = Path(__file__).parent / "golden" / "stats_columns.json.gz"
STEP = 1_000_000


def rank_trace(rank: int, world: int, steps: int, seed: int, marked: bool) -> Trace:
    """One rank with the shapes the statistics meet: nested ops, two CUDA streams, a collective
    (marked, or only named like one), a data wait marked collective=False, a loader thread, a
    span open when the trace was written, another tool's process, collectives a rank skips, a
    warm-up step, ties in start times, and seeded jitter."""
    rng = random.Random(seed * 1000 + rank)
    meta = {"gputrace_version": gputrace.__version__, "rank": rank, "world_size": world, "run_id": f"cols-{seed}"}
    meta["spans_dropped"] = 0
    t = Trace(dict(meta))
    p = t.add_process(Process(rank + 1, rank, f"rank {rank}", rank, meta))
    main_t = t.add_track(Track(p, 1, "main", "cpu"))
    loader = t.add_track(Track(p, 2, "loader", "cpu"))
    s7 = t.add_track(Track(p, 3, "cuda:0 stream 7", "cuda", 0, 7))
    s13 = t.add_track(Track(p, 5, "cuda:0 stream 13", "cuda", 0, 13))
    if rank == 0:
        k = t.add_process(Process(99, 0, "GPU 0 (kineto)", 99, {}, foreign=True))
        kt = t.add_track(Track(k, 7, "stream 7", "other"))
        t.add_span("kernel", kt, B + 5, B + 900)
    coll = {"collective": True} if marked else None
    for k in range(steps):
        a = k * STEP
        w = 100_000 + rng.randrange(0, 60_000) + (400_000 if k == 0 else 0)
        slow = 90_000 if (k % 5 == 2 and rank == world - 1) else 0
        t.add_span("wait_data", main_t, B + a + 1_000, B + a + 5_000 + rank, {"collective": False})
        for i in range(rng.randrange(1, 4)):
            t.add_span("op", main_t, B + a + 10_000 + i * 20_000, B + a + 25_000 + i * 20_000)
        t.add_span("fwd", main_t, B + a + 10_000, B + a + 10_000 + w)
        t.add_span("compute", s7, B + a + 30_000, B + a + 30_000 + w + slow)
        arrive = a + 200_000 + slow + rng.randrange(0, 20_000)
        end = a + 200_000 + 90_000 + 30_000
        t.add_span("all_reduce", s13, B + arrive, B + end, coll)
        if k % 4 != 1 or rank != 1:  # rank 1 skips every 4th broadcast: matched by (step, name, ordinal)
            t.add_span("broadcast", s13, B + end + 1_000, B + end + 20_000, coll)
        t.add_span("reduce_scatter", s13, B + arrive, B + arrive + 5_000, coll)  # ties all_reduce's start
        t.add_span("load", loader, B + a + 500_000, B + a + 520_000 + rng.randrange(0, 9_000))
        t.add_span("step", main_t, B + a, B + a + 900_000, {"k": k})
    t.add_span("save", main_t, B + steps * STEP, B + steps * STEP + 50_000, {"unfinished": True})
    t.add_span("epoch", main_t, B - 10, B + steps * STEP)
    return t


def write_run(d: Path, world: int, steps: int, seed: int, marked: bool) -> list[str]:
    d.mkdir(parents=True, exist_ok=True)
    paths = []
    for r in range(world):
        t = rank_trace(r, world, steps, seed, marked)
        path = str(d / f"trace_rank{r}.json")
        chrome.write(t, path)
        assert digest.write_for_trace(t, path, "step") is not None
        paths.append(path)
    return paths


RUNS = {"marked": (4, 40, 1, True), "named": (3, 30, 2, False)}


def _cli_json(args: list[str]) -> Any:
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    return orjson.loads(r.output)


def _doc_without_paths(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k not in ("inputs", "title")}


def outputs(root: Path) -> dict[str, Any]:
    """Every output the statistics feed, for each seeded run written under `root`."""
    from gputrace import summary
    from gputrace.viewer import data

    out: dict[str, Any] = {}
    for name, (world, steps, seed, marked) in RUNS.items():
        d = root / name
        paths = write_run(d, world, steps, seed, marked)
        out[f"{name}: summary (digests)"] = _cli_json(["summary", "--json", str(d)])
        out[f"{name}: summary --full"] = _cli_json(["summary", "--json", "--full", str(d)])
        out[f"{name}: summary --skip-steps 3"] = _cli_json(["summary", "--json", "--skip-steps", "3", str(d)])
        out[f"{name}: summary --full --skip-steps 3"] = _cli_json(
            ["summary", "--json", "--full", "--skip-steps", "3", str(d)]
        )
        out[f"{name}: view (traces)"] = _doc_without_paths(data.document(data.load(paths)))
        digests = summary.collect(summary.find([str(d)]), "step")
        out[f"{name}: view (digests)"] = _doc_without_paths(data._from_digests(digests, "step", None, False, []))
    return orjson.loads(orjson.dumps(out, option=orjson.OPT_SORT_KEYS))


def test_summary_and_view_are_what_they_were_before_the_columns(tmp_path: Path) -> None:
    want = orjson.loads(gzip.decompress(GOLDEN.read_bytes()))
    got = outputs(tmp_path)
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key] == want[key], key


if __name__ == "__main__":
    import tempfile

    if sys.argv[1:2] != ["--write"] or len(sys.argv) != 3:
        raise SystemExit("usage: python -m tests.test_stats_columns --write PATH")
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        body = orjson.dumps(outputs(Path(tmp)), option=orjson.OPT_SORT_KEYS)
    with open(sys.argv[2], "wb") as f:
        f.write(gzip.compress(body, mtime=0))


@pytest.mark.parametrize("seed", range(6))
def test_the_c_grouping_and_sorting_give_what_their_python_twins_give(seed: int) -> None:
    from array import array

    from gputrace import stats_columns as columns

    if columns._hot is None:
        pytest.skip("the C build is not in use")
    rng = random.Random(seed)
    n = rng.randrange(0, 400)
    stride = rng.randrange(1, 6)
    n_tracks = rng.randrange(1, 7)
    slot_of_track = array("q", (rng.randrange(stride) for _ in range(n_tracks)))
    names = array("l", (rng.randrange(9) for _ in range(n)))
    tracks = array("l", (rng.randrange(n_tracks) for _ in range(n)))
    choices: list[Any] = [None, None, {}, {"collective": True}, {"collective": False}, {"collective": 0}]
    choices += [{"unfinished": True}, {"cover": 1}, {"unfinished": True, "collective": True}, {"k": 3}]
    choices += [{"cover": True, "collective": None}, {"unfinished": 0, "cover": 0, "collective": "yes"}]
    args = [rng.choice(choices) for _ in range(n)]
    want = columns._groups_py(names, tracks, args, slot_of_track, stride)
    got = columns._hot.stats_groups(names, tracks, args, slot_of_track, stride)
    assert [columns._from_bytes(x) if i != 3 else x for i, x in enumerate(got)] == [
        array("q", want[1]) if i == 1 else x for i, x in enumerate(want)
    ]
    starts = array("q", (rng.randrange(-(10**12), 10**12) for _ in range(n)))
    ends = array("q", (s + rng.randrange(-5, 10**6) for s in starts))
    idx = array("q", (rng.randrange(n) for _ in range(rng.randrange(n + 1)))) if n else array("q")
    want_d = columns._sorted_durations_py(starts, ends, idx)
    assert columns._from_bytes(columns._hot.stats_sorted_durations(starts, ends, idx)) == want_d
    assert columns._from_bytes(columns._hot.stats_sorted_durations(starts, ends, memoryview(idx))) == want_d


@pytest.mark.parametrize("c", TWINS)
def test_summary_from_both_twins_is_the_golden_one(c: bool, twins_restored: None, tmp_path: Path) -> None:
    from gputrace import native

    native.use(c)
    want = orjson.loads(gzip.decompress(GOLDEN.read_bytes()))
    d = tmp_path / "named"
    world, steps, seed, marked = RUNS["named"]
    write_run(d, world, steps, seed, marked)
    got = orjson.loads(orjson.dumps(_cli_json(["summary", "--json", "--full", str(d)]), option=orjson.OPT_SORT_KEYS))
    assert got == want["named: summary --full"]


@pytest.mark.parametrize("seed", range(6))
def test_the_lean_cover_and_nesting_give_what_their_python_references_give(seed: int) -> None:
    """The breakdown's C loops as `stats` calls them (the cover as int64 columns, the nesting
    without carried spans) against their Python references, on random columns: nested,
    overlapping, equal and inverted spans, other tools' and left-out ones, steps and ancestors."""
    from array import array

    from gputrace import digest_breakdown as dbk

    from .conftest import random_cover_columns

    if dbk._cover_c is None or dbk._nest_c is None:
        pytest.skip("the C build is not in use")
    rng = random.Random(seed)
    names, tracks, starts, ends, skip, mask, steps, se, st = random_cover_columns(rng)
    ss = array("q", steps)
    cover = (names, tracks, starts, ends, skip, mask, ss, se, st)
    want = tuple(array("q", x) for x in dbk._cover_py(*cover))
    assert dbk.cover_columns(*cover) == want
    e = array("q")
    for cut in (array("q"), ss[:1]):
        args = (names, tracks, starts, ends, None, cut, -1, 2, e, e, e, e)
        assert dbk.nest_keys(*args) == tuple(dbk._nest_py(*args)[:2])
        lean = dbk._nest_c(*args, True)
        assert lean[:2] == dbk._nest_c(*args)[:2] and not any(lean[2:])


@pytest.mark.parametrize("seed", range(6))
def test_the_union_as_columns_is_the_python_union(seed: int) -> None:
    from array import array

    from gputrace import breakdown as bd

    rng = random.Random(seed)
    n = rng.choice([0, 1, 50, 2000])
    starts = [rng.randrange(10**5) for _ in range(n)]
    ends = [s + rng.choice([0, -3, rng.randrange(100), rng.randrange(10**4)]) for s in starts]
    want = tuple(array("q", x) for x in bd._union_py(starts, ends))
    assert bd.union_columns(starts, ends) == want
    assert bd.union_columns(sorted(starts), [s + 5 for s in sorted(starts)]) == tuple(
        array("q", x) for x in bd._union_py(sorted(starts), [s + 5 for s in sorted(starts)])
    )


def test_grouping_takes_an_argument_column_of_no_memory() -> None:
    """A trace read without its spans' arguments (`perfetto.read_spans`) has an all-None column
    that takes no memory; the grouping reads it as all None, in the C build and its twin alike."""
    from array import array

    from gputrace import stats_columns
    from gputrace.trace.model import _NoCats

    names = array("l", [0, 1, 0, 2, 1])
    tracks = array("l", [0, 0, 1, 1, 0])
    slots = array("q", [0, 1])
    empty = stats_columns.groups(names, tracks, _NoCats(5), slots, 2)
    plain = stats_columns.groups(names, tracks, [None] * 5, slots, 2)
    assert empty == plain
    assert list(empty.keys) == [0, 2, 1, 5]  # name * 2 + slot, in order of first sight
    assert list(empty.bounds) == [0, 1, 3, 4, 5] and not any(empty.marked)


@pytest.mark.parametrize("seed", range(8))
def test_the_collective_calls_by_columns_are_the_per_rank_loops(seed: int) -> None:
    """Last rank, runner-up (ties included: few distinct arrival times), margin, call, waits and
    each rank's counts: `_calls_columns` on tuples equal `_calls_py` on the same occurrences as
    dicts, with ranks in an order other than sorted and ranks that ran no collective."""
    from gputrace import stats

    rng = random.Random(seed)
    world = rng.choice([1, 2, 3, 8, 64])
    ranks = list(range(world + 2))
    rl = rng.sample(range(world), world)
    names = ["all_reduce", "all_gather", "broadcast"]
    err = {r: rng.choice([0, 5, 40]) for r in ranks}
    cols = []
    for _ in range(rng.choice([0, 1, 30, 500])):
        spread = rng.choice([1, 3, 100, 10_000])
        cs = tuple(rng.randrange(spread) * 7 for _ in rl)
        ce = tuple(a + rng.randrange(1, 1000) for a in cs)
        cols.append((min(cs), rng.randrange(-1, 20), rng.randrange(len(names)), rng.randrange(3), cs, ce))
    cols.sort(key=stats._first)
    found = [(f, k, n, o, dict(zip(rl, cs)), dict(zip(rl, ce))) for f, k, n, o, cs, ce in cols]
    assert stats._calls_columns(cols, rl, ranks, names, err) == stats._calls_py(found, ranks, names, err)


@pytest.mark.parametrize("seed", range(6))
def test_the_c_gather_gives_what_its_python_twin_gives(seed: int) -> None:
    """`stats_columns.take` in C equals `_take_py`: int64 and long columns, an index column as a
    list, an array or a view, none at all, repeats; an index past the end or below 0 raises."""
    from array import array

    from gputrace import stats_columns as columns

    if columns._hot is None:
        pytest.skip("the C build is not in use")
    rng = random.Random(seed)
    n = rng.choice([0, 1, 7, 3000])
    cols = [
        array("q", (rng.randrange(-(2**63), 2**63) for _ in range(n))),
        array("l", (rng.randrange(-(10**9), 10**9) for _ in range(n))),
        [rng.randrange(10**15) for _ in range(n)],
    ]
    idx = [rng.randrange(n) for _ in range(rng.randrange(2 * n + 1))] if n else []
    want = columns._take_py(idx, *cols)
    assert [len(w) for w in want] == [len(idx)] * 3
    for form in (idx, array("q", idx), memoryview(array("q", idx))):
        assert columns.take(form, *cols) == want
        assert columns.take(form) == ()
    for bad in ([n], [-1], [0, n + 5]):
        for fn in (columns.take, columns._take_py):
            with pytest.raises(IndexError):
                fn(bad, *cols)


@pytest.mark.parametrize("seed", range(8))
def test_the_c_step_lookup_gives_what_its_python_twin_gives(seed: int) -> None:
    """`stats_columns.step_of` in C equals `_step_of_py` (bisection into steps sorted by start,
    ends exclusive): steps that touch, overlap, have gaps or none at all, times on their edges,
    before the first and after the last."""
    from array import array

    from gputrace import stats_columns as columns

    if columns._hot is None:
        pytest.skip("the C build is not in use")
    rng = random.Random(seed)
    n = rng.choice([0, 1, 5, 500])
    ss = sorted(rng.randrange(-1000, 10**6) for _ in range(n))
    se = [s + rng.choice([0, 1, 50, 3000]) for s in ss]
    edges = [x + d for x in ss + se for d in (-1, 0, 1)]
    starts = [rng.randrange(-2000, 10**6 + 5000) for _ in range(rng.randrange(300))] + edges
    want = columns._step_of_py(ss, se, starts)
    assert len(want) == len(starts) and (not n or max(want) < n)
    assert columns.step_of(ss, se, starts) == want
    assert columns.step_of(array("q", ss), array("q", se), array("q", starts)) == want
    with pytest.raises(ValueError):
        columns.step_of(ss, se[:-1] if n else [1], starts)


@pytest.mark.parametrize("seed", range(8))
def test_the_spread_from_sorted_columns_is_the_median_absolute_deviation(seed: int) -> None:
    """`causes._mad` (deviations of the sorted column) equals the median absolute deviation taken
    in step order: odd and even lengths, repeats, a median between two values (a half)."""
    from itertools import repeat
    from operator import sub
    from statistics import median

    from gputrace import causes

    rng = random.Random(seed)
    for _ in range(20):
        n = rng.choice([1, 2, 3, 10, 101, 1000])
        spread = rng.choice([1, 3, 10**3, 10**9])
        v = [rng.randrange(spread) + rng.choice([0, 0, 10**6]) for _ in range(n)]
        want = float(median(map(abs, map(sub, v, repeat(median(v))))))
        assert causes._mad(v) == want
        assert causes._mad_sorted(sorted(v), median(v)) == want


@pytest.mark.parametrize("seed", range(6))
def test_the_c_track_split_gives_what_its_python_twin_gives(seed: int) -> None:
    """`stats_columns.track_split` in C equals `_track_split_py`: collectives on the track, and
    spans neither collectives nor on it, from columns of any length (none too), bytes not 0/1."""
    from array import array

    from gputrace import stats_columns as columns

    if columns._hot is None:
        pytest.skip("the C build is not in use")
    rng = random.Random(seed)
    n = rng.choice([0, 1, 9, 2000])
    starts = [rng.randrange(-(10**12), 10**12) for _ in range(n)]
    ends = [s + rng.randrange(10**6) for s in starts]
    tracks = array("l", (rng.randrange(4) for _ in range(n)))
    is_coll = bytes(rng.choice([0, 0, 1, 2, 255]) for _ in range(n))
    for t in range(-1, 5):
        want = columns._track_split_py(starts, ends, tracks, is_coll, t)
        assert columns.track_split(starts, ends, tracks, is_coll, t) == want
        assert columns.track_split(array("q", starts), array("q", ends), tracks, is_coll, t) == want
    with pytest.raises(ValueError):
        columns.track_split(starts, ends, tracks, is_coll + b"\0", 0)


def test_a_duration_past_64_bits_is_refused_by_both_twins() -> None:
    """A span from the far past to the far future: its duration does not fit an int64. The C loop
    says so as the Python twin's int64 column does, rather than wrapping to a negative time."""
    from array import array

    from gputrace import stats_columns

    hot = stats_columns._hot
    starts, ends, idx = array("q", [-(2**63), 0]), array("q", [2**63 - 1, 5]), array("q", [1, 0])
    with pytest.raises(OverflowError):
        stats_columns._sorted_durations_py(starts, ends, idx)
    if hot is None:
        pytest.skip("the C build is not in use")
    with pytest.raises(OverflowError, match="past 64 bits"):
        hot.stats_sorted_durations(starts, ends, idx)
    # the other span alone is fine: 5 ns
    assert array("q", hot.stats_sorted_durations(starts, ends, array("q", [1]))).tolist() == [5]
