"""Each rank's step broken down (idle, collective wait and transfer, exposed collective time,
launch lag) and self time per name: the names and shapes `summary --json` gives, exact numbers
on hand-built traces for each definition, the same numbers from digests as from traces, and real
gloo runs with planted causes that the text says in words."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from array import array
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

import gputrace
from gputrace import digest, digest_breakdown, stats, summary
from gputrace.cli import main
from gputrace.trace import chrome, digestfile
from gputrace.trace.model import Process, Trace, Track
from tests.test_stats import rank_file, steps_of

BREAKDOWN = ("idle_ns", "collective_wait_ns", "collective_transfer_ns", "exposed_collective_ns", "launch_lag_ns")


def test_summary_json_has_the_breakdown_beside_busy_and_wait_and_self_time_in_name_rows(tmp_path) -> None:  # type: ignore[no-untyped-def]
    rank_file(tmp_path / "trace_rank0.json", 0, steps_of([1000, 1000, 1000]))
    rank_file(tmp_path / "trace_rank1.json", 1, steps_of([1000, 1500, 1000]))
    for extra in ([], ["--full"]):
        r = CliRunner().invoke(main, ["summary", "--json", *extra, str(tmp_path)])
        assert r.exit_code == 0, r.output
        data = orjson.loads(r.output)
        steps = data["steps"]
        for key in BREAKDOWN:
            assert set(steps[key]) == {"0", "1"}, key
            for r_ in ("0", "1"):
                assert len(steps[key][r_]) == steps["count"] == 3
                assert all(v is None or isinstance(v, int) for v in steps[key][r_])
        for row in data["names"] + data["by_rank"]["0"]:
            assert row["self_total_ns"] is None or isinstance(row["self_total_ns"], int)


# ---- exact numbers on hand-built traces -----------------------------------------------------------

B = 1_700_000_000_000_000_000


def mk(by_rank: dict[int, list[tuple[Any, ...]]], entries: bool = False) -> Trace:
    """A merged trace: spans (name, start, end, track label, args, host entry) at B + the times;
    tracks named "cuda..." are CUDA streams, others threads."""
    t = Trace({"merged": True})
    entry: list[int] = []
    for r, spans in by_rank.items():
        p = t.add_process(Process(r + 1, r, f"rank {r}", r, {}))
        tracks: dict[str, int] = {}
        for name, s, e, label, *rest in spans:
            if label not in tracks:
                cuda = label.startswith("cuda")
                tracks[label] = t.add_track(
                    Track(p, len(tracks) + 1, label, "cuda" if cuda else "cpu", 0 if cuda else None, len(tracks))
                )
            t.add_span(name, tracks[label], B + s, B + e, rest[0] if rest else None)
            entry.append(B + rest[1] if len(rest) > 1 and rest[1] is not None else 0)
    if entries:
        t.spans.entry = array("q", entry)
    return t


def test_idle_is_step_time_with_nothing_open_on_any_track_but_the_step_and_its_ancestors() -> None:
    t = mk(
        {
            0: [
                ("fwd", 10, 40, "main"),
                ("bwd", 50, 90, "main"),
                ("step", 0, 100, "main"),
                ("kernel", 35, 55, "cuda stream 7"),  # fills fwd..bwd's gap on another track
                ("opt", 120, 130, "main"),
                ("step", 100, 200, "main"),
                ("late", 190, 230, "cuda stream 7"),  # open across the step's end: 10 ns in it
                ("epoch", 0, 300, "main"),  # encloses the steps on their own track: not work
            ]
        }
    )
    st = stats.summarize(t).steps
    assert st is not None
    assert st.idle_ns[0] == [100 - 80, 100 - 10 - 10]
    assert st.collective_wait_ns[0] == st.collective_transfer_ns[0] == st.exposed_collective_ns[0] == [0, 0]
    assert st.launch_lag_ns[0] == [None, None]


def test_a_span_on_another_thread_open_across_the_whole_step_is_work_not_an_ancestor() -> None:
    t = mk({0: [("step", 0, 100, "main"), ("loader", -5, 205, "loader thread"), ("same", 0, 100, "main")]})
    st = stats.summarize(t).steps
    assert st is not None and st.idle_ns[0] == [0]
    # a span of the step's very times on its track is its child: work, not an ancestor
    t = mk({0: [("same", 0, 100, "main"), ("step", 0, 100, "main")]})
    st = stats.summarize(t).steps
    assert st is not None and st.idle_ns[0] == [0]


def test_collective_wait_is_before_the_last_arrival_and_transfer_after_it() -> None:
    t = mk(
        {
            0: [("work", 0, 60, "main"), ("all_reduce", 60, 100, "main"), ("step", 0, 100, "main")],
            1: [("work", 0, 80, "main"), ("all_reduce", 80, 100, "main"), ("step", 0, 100, "main")],
        }
    )
    s = stats.summarize(t)
    st = s.steps
    assert st is not None
    assert st.collective_wait_ns == {0: [20], 1: [0]}
    assert st.collective_transfer_ns == {0: [20], 1: [20]}
    assert all(
        w + x == y
        for r in (0, 1)
        for w, x, y in zip(st.collective_wait_ns[r], st.collective_transfer_ns[r], st.wait_ns[r])
    )
    # on its own thread, nothing else of the rank runs beside the collective: all of it exposed
    assert st.exposed_collective_ns == {0: [40], 1: [20]}
    assert st.idle_ns == {0: [0], 1: [0]}


def test_overlapping_collectives_count_once_and_transfer_wins_where_they_overlap() -> None:
    # rank 0: two collectives on two streams, [10, 50) and [30, 70); rank 1 arrives at 40 and 60
    t = mk(
        {
            0: [
                ("all_reduce", 10, 50, "cuda stream 13"),
                ("all_gather", 30, 70, "cuda stream 14"),
                ("step", 0, 100, "main"),
            ],
            1: [
                ("all_reduce", 40, 50, "cuda stream 13"),
                ("all_gather", 60, 70, "cuda stream 14"),
                ("step", 0, 100, "main"),
            ],
        }
    )
    st = stats.summarize(t).steps
    assert st is not None
    assert st.wait_ns[0] == [60]
    assert st.collective_transfer_ns[0] == [10 + 10]  # [40, 50) and [60, 70)
    assert st.collective_wait_ns[0] == [40]
    assert st.idle_ns[0] == [40]  # [0, 10) and [70, 100)


def test_exposed_collective_is_the_part_no_work_on_another_track_overlaps() -> None:
    t = mk(
        {
            0: [
                ("step", 0, 200, "main"),
                ("backward", 40, 100, "main"),  # the collective's parent on its own thread hides nothing
                ("all_reduce", 60, 100, "main"),
                ("compute", 50, 80, "cuda stream 7"),  # hides [60, 80)
                ("all_gather", 150, 170, "cuda stream 13"),  # another collective hides nothing
                ("all_reduce", 160, 180, "cuda stream 14"),
                ("other", 165, 168, "cuda stream 7"),
            ]
        }
    )
    st = stats.summarize(t).steps
    assert st is not None
    assert st.exposed_collective_ns[0] == [20 + (30 - 3)]
    assert st.wait_ns[0] == [40 + 30]


def test_launch_lag_is_device_start_less_host_entry_of_the_first_cuda_span_started_in_the_step() -> None:
    t = mk(
        {
            0: [
                ("fwd", 30, 60, "cuda stream 7", None, 10),  # started first: 30 - 10
                ("bwd", 60, 90, "cuda stream 7", None, 5),
                ("step", 0, 100, "main"),
                ("opt", 150, 160, "cuda stream 7", None, None),  # entry not known
                ("step", 100, 200, "main"),
                ("x", 260, 280, "cuda stream 7", None, 199),  # entered in step 1, ran in step 2
                ("y", 240, 250, "main", None, 150),  # not a CUDA span
                ("step", 200, 300, "main"),
            ]
        },
        entries=True,
    )
    st = stats.summarize(t).steps
    assert st is not None
    assert st.launch_lag_ns[0] == [20, None, 61]
    # Steps timed on the GPU while the host runs ahead: the host enters step k+1 (and its spans)
    # while the GPU is still in step k. Each step's lag is its own, not its successor's.
    gpu = mk(
        {
            0: [
                ("step", 100, 200, "cuda stream 7", None, 40),
                ("fwd", 110, 190, "cuda stream 7", None, 45),
                ("step", 200, 300, "cuda stream 7", None, 120),
                ("fwd", 210, 290, "cuda stream 7", None, 125),
            ]
        },
        entries=True,
    )
    st = stats.summarize(gpu).steps
    assert st is not None
    assert st.launch_lag_ns[0] == [100 - 40, 200 - 120]
    assert stats.summarize(mk({0: [("step", 0, 100, "main")]})).steps.launch_lag_ns[0] == [None]  # type: ignore[union-attr]


def test_self_time_is_total_less_children_on_the_same_track() -> None:
    spans = [
        ("b", 10, 30, "main"),
        ("d", 50, 60, "main"),
        ("c", 40, 90, "main"),
        ("a", 0, 100, "main"),
        ("e", 0, 100, "cuda stream 7"),  # another track: no child of a
        ("d", 0, 5, "cuda stream 7"),  # a child of e
    ]
    s = stats.summarize(mk({0: spans, 1: spans[:4]}))
    got = {x.name: (x.total_ns, x.self_total_ns) for x in s.names}
    assert got == {"a": (200, 60), "b": (40, 40), "c": (100, 80), "d": (25, 25), "e": (100, 95)}
    got0 = {x.name: x.self_total_ns for x in s.by_rank[0]}
    assert got0 == {"a": 30, "b": 20, "c": 40, "d": 15, "e": 95}


def test_json_carries_the_breakdown_numbers() -> None:
    t = mk(
        {
            0: [("all_reduce", 60, 100, "main"), ("step", 0, 100, "main")],
            1: [("all_reduce", 80, 100, "main"), ("step", 0, 100, "main")],
        }
    )
    j = stats.to_json(stats.summarize(t))
    assert j["steps"]["collective_wait_ns"] == {"0": [20], "1": [0]}
    assert j["steps"]["idle_ns"] == {"0": [60], "1": [80]}
    assert j["steps"]["launch_lag_ns"] == {"0": [None], "1": [None]}
    assert {x["name"]: x["self_total_ns"] for x in j["names"]} == {"step": 200 - 60, "all_reduce": 60}


def test_the_text_says_the_causes_in_words_and_has_a_self_column() -> None:
    ms = 1_000_000
    by: dict[int, list[tuple[Any, ...]]] = {}
    for r in range(4):
        spans: list[tuple[Any, ...]] = []
        for k in range(50):
            t = k * 100 * ms
            idle = 30 * ms if (r == 2 and 40 <= k <= 44) else 0
            arrive = t + 10 * ms + r * 1000 + idle
            last = t + 10 * ms + 3 * 1000 + (30 * ms if 40 <= k <= 44 else 0)
            end = last + 2 * ms + (18 * ms if 20 <= k <= 29 else 0)
            spans += [("fwd", t, t + 10 * ms + r * 1000, "main"), ("all_reduce", arrive, end, "main")]
            spans.append(("step", t, end + ms, "main"))
        by[r] = spans
    s = stats.summarize(mk(by))
    text = stats.table(s, width=120)
    assert "every rank: all_reduce transfer +18.000 ms a step in steps 20-29" in text
    assert "rank 2 slowest in steps 40-44: 31.000 ms idle outside any span a step (the others 1.000 ms)" in text
    assert text.splitlines()[0].split()[:4] == ["name", "count", "total", "self"]
    assert stats.to_json(s)["steps"]["causes"][:2] == [
        "every rank: all_reduce transfer +18.000 ms a step in steps 20-29",
        "rank 2 slowest in steps 40-44: 31.000 ms idle outside any span a step (the others 1.000 ms)",
    ]


# ---- the same numbers from digests as from traces -----------------------------------------------


def rank_trace(rank: int, world: int = 3, steps: int = 30, entries: bool = True, phase: bool = False) -> Trace:
    """One rank's trace with every shape the breakdown meets: an epoch around the steps on their
    thread, nested ops, gaps, work on two CUDA streams (with host entry times), a marked
    all_reduce on a third stream arriving at rank-dependent times, a data wait named like a
    collective but marked collective=False, a loader thread, and rank 1 idle in steps 20-24."""
    meta = {
        "gputrace_version": gputrace.__version__,
        "rank": rank,
        "world_size": world,
        "run_id": "bd",
        "spans_dropped": 0,
    }
    t = Trace(dict(meta))
    p = t.add_process(Process(rank + 1, rank, f"rank {rank}", rank, meta))
    main = t.add_track(Track(p, 1, "main", "cpu"))
    loader = t.add_track(Track(p, 2, "loader", "cpu"))
    s7 = t.add_track(Track(p, 3, "cuda:0 stream 7", "cuda", 0, 7))
    s8 = t.add_track(Track(p, 4, "cuda:0 stream 8", "cuda", 0, 8))
    s13 = t.add_track(Track(p, 5, "cuda:0 stream 13", "cuda", 0, 13))
    entry: list[int] = []
    step_len = 1_000_000

    def add(name: str, track: int, s: int, e: int, args: dict[str, Any] | None = None, x: int = 0) -> None:
        t.add_span(name, track, B + s, B + e, args)
        entry.append(B + x if x else 0)

    for k in range(steps):
        a = k * step_len
        idle = 200_000 if rank == 1 and 20 <= k <= 24 else 0
        w = 100_000 + 7_000 * ((k * 31 + rank * 17) % 5)
        add("wait_data", main, a + 1_000, a + 5_000 + rank, {"collective": False})
        for i in range(3):
            add("op", main, a + 10_000 + i * 20_000, a + 25_000 + i * 20_000)
        add("fwd", main, a + 10_000, a + 10_000 + w)
        add("compute", s7, a + 30_000 + idle, a + 30_000 + w + idle, None, a + 12_000 + idle)
        add("copy", s8, a + 40_000 + idle, a + 60_000 + idle, None, a + 11_000 + idle if k % 3 else 0)
        arrive = a + 200_000 + idle + rank * 3_000 + (150_000 if 10 <= k <= 14 else 0) * 0
        last = a + 200_000 + (200_000 if 20 <= k <= 24 else 0) + (world - 1) * 3_000
        tail = 50_000 + (300_000 if 10 <= k <= 14 else 0)
        add("all_reduce", s13, arrive, last + tail, {"collective": True})
        add("bwd", main, a + 150_000 + idle, a + 180_000 + idle)
        add("load", loader, a + 500_000, a + 520_000)
        add("step", main, a, a + 900_000)
        if phase and k == 14:  # around steps 5-14, written as it ends
            add("phase", main, 5 * step_len, 15 * step_len - 50_000)
    add("epoch", main, -10, steps * step_len)
    if entries:
        t.spans.entry = array("q", entry)
    t.metadata["base_ns"] = B - 10
    return t


def same_breakdown(a: stats.Summary, b: stats.Summary, lags: bool = True) -> None:
    assert a.steps is not None and b.steps is not None
    for key in ("busy_ns", "wait_ns", *BREAKDOWN):
        if key == "launch_lag_ns" and not lags:
            continue
        assert getattr(a.steps, key) == getattr(b.steps, key), key
    assert {x.name: x.self_total_ns for x in a.names} == {x.name: x.self_total_ns for x in b.names}
    for r in a.ranks:
        assert {x.name: x.self_total_ns for x in a.by_rank[r]} == {x.name: x.self_total_ns for x in b.by_rank[r]}


def test_digests_give_the_breakdown_and_self_times_of_the_traces(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for r in range(3):
        trace = rank_trace(r, entries=False)
        path = str(tmp_path / f"trace_rank{r}.json")
        chrome.write(trace, path)
        assert digest.write_for_trace(trace, path, "step") is not None
    for skip in (0, 3):
        full = summary.summary_of_files([str(tmp_path)], skip_steps=skip, full=True)
        dig = summary.summary_of_files([str(tmp_path)], skip_steps=skip)
        assert "read from the ranks' digests" in dig.notes[0]
        same_breakdown(full, dig)
        st = full.steps
        assert st is not None
        assert all(x is not None for r in st.ranks for x in st.idle_ns[r])
        # the planted idle: rank 1 in steps 20-24, others not
        assert (
            min(st.idle_ns[1][k - skip] for k in range(20, 25))
            > max(st.idle_ns[0][k - skip] for k in range(20, 25)) + 50_000
        )
    text = stats.table(dig, width=140)
    assert "rank 1 slowest in steps 20-24" in text and "idle outside any span" in text
    assert "every rank: all_reduce transfer +300.000 ms" not in text
    assert "every rank: all_reduce transfer +300.0 us a step in steps 10-14" in text


@pytest.mark.parametrize("loops", ["c", "python"])
@pytest.mark.parametrize("batch", [7, 1 << 14])
def test_a_digest_built_in_batches_has_the_launch_lags_and_self_times_of_the_whole_trace(
    monkeypatch: pytest.MonkeyPatch, loops: str, batch: int
) -> None:
    if loops == "python":
        monkeypatch.setattr(digest_breakdown, "_cover_c", None)
        monkeypatch.setattr(digest_breakdown, "_nest_c", None)
        monkeypatch.setattr(digest_breakdown, "_entries_c", None)
        monkeypatch.setattr(digest_breakdown, "_lags_c", None)
        monkeypatch.setattr(digest, "_rows_c", None)
        monkeypatch.setattr(digest, "_fold_c", None)
    elif digest_breakdown._nest_c is None:
        pytest.skip("the C build is not in use")
    monkeypatch.setattr(digest, "BATCH_SPANS", batch)
    monkeypatch.setattr(digest_breakdown, "CARRY_SPANS", 8 if batch == 7 else 1 << 16)
    trace = rank_trace(0)
    full = stats.summarize(trace)
    b = digest.Builder("step")
    sp = trace.spans
    assert sp.entry is not None
    for lo in range(0, len(sp), 11):  # chunks of 11 spans, each with its entry times
        part = Trace(dict(trace.metadata))
        part.processes, part.tracks, part.names = trace.processes, trace.tracks, trace.names
        for i in range(lo, min(lo + 11, len(sp))):
            part.spans.append(sp.name[i], sp.track[i], sp.start[i], sp.end[i], sp.args[i])
        part.spans.entry = sp.entry[lo : lo + 11]
        b.add(part)
    doc = b.document(dict(trace.processes[0].metadata), B - 10, "rank 0")
    assert doc == digest.from_trace(trace, "step") | {"trace": None, "trace_bytes": None} or batch == 7
    dig = summary.summarize([digestfile.from_document(doc, "rank0.digest")])[1]
    same_breakdown(full, dig)
    st = dig.steps
    assert st is not None
    assert st.launch_lag_ns[0][:3] == [30_000 - 12_000] * 3  # `compute` starts first on the GPU in each step


def test_a_parent_of_some_summed_up_spans_has_its_self_time_unknown_not_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(digest, "BATCH_SPANS", 7)
    monkeypatch.setattr(digest_breakdown, "CARRY_SPANS", 8)
    trace = rank_trace(0, steps=20, phase=True)
    full = stats.summarize(trace)
    dig = summary.summarize([digestfile.from_document(digest.from_trace(trace, "step"), "r.digest")])[1]
    got = {x.name: x.self_total_ns for x in dig.names}
    want = {x.name: x.self_total_ns for x in full.names}
    assert got["phase"] is None and want["phase"] is not None
    assert got["epoch"] is None  # it encloses the phase, which took some of the spans summed up
    assert all(got[n] in (None, want[n]) for n in want)  # unknown, never wrong
    assert all(got[n] == want[n] for n in ("compute", "copy", "all_reduce", "load", "op"))


@pytest.mark.parametrize("seed", range(8))
def test_the_c_loops_of_the_breakdown_give_what_their_python_references_give(seed: int) -> None:
    """Random columns: nested, overlapping, equal and inverted spans on a few tracks, other
    tools' and left-out ones, steps and their ancestors, carried spans and a floor."""
    import random

    if digest_breakdown._cover_c is None or digest_breakdown._nest_c is None:
        pytest.skip("the C build is not in use")
    from .conftest import random_cover_columns

    rng = random.Random(seed)
    names, tracks, starts, ends, skip, mask, ss, se, st = random_cover_columns(rng)
    n = len(names)
    cover = (names, tracks, starts, ends, skip, mask, array("q", ss), se, st)
    assert digest_breakdown._cover_c(*cover) == digest_breakdown._cover_py(*cover)
    carry = sorted((rng.randrange(5), rng.randrange(10**6)) for _ in range(rng.randrange(0, 30)))
    ct = array("q", (t for t, _ in carry))
    cs = array("q", (s for _, s in carry))
    ce = array("q", (s + rng.randrange(10**4) for s in cs))
    floor = array("q", (rng.choice([-(2**63), rng.randrange(10**6)]) for _ in range(rng.randrange(0, 5))))
    for bucket in (-1, 0, digest._REST):
        args = (names, tracks, starts, ends, skip, array("q", ss[:17]), bucket, digest._NB, ct, cs, ce, floor)
        c, py = digest_breakdown._nest_c(*args), digest_breakdown._nest_py(*args)
        assert c == py
        if n > 100:
            assert sum(py[1]) > 0 and len(py[2]) > 0


@pytest.mark.parametrize("seed", range(8))
def test_the_c_loops_of_the_launch_lags_give_what_their_python_references_give(seed: int) -> None:
    """Random host entries (none, zero, equal device starts, ties broken by the entry) on CUDA and
    host tracks, placed in random steps, waiting past the last one or dropped between them."""
    import random

    if digest_breakdown._entries_c is None or digest_breakdown._lags_c is None:
        pytest.skip("the C build is not in use")
    from .conftest import random_cover_columns

    rng = random.Random(seed)
    names, tracks, starts, ends, skip, mask, ss, se, st = random_cover_columns(rng)
    entry = array("q", (rng.choice([0, -3, s - rng.randrange(10**4)]) for s in starts))
    cuda = bytes(rng.random() < 0.6 for _ in range(rng.randrange(0, 6)))
    c = digest_breakdown._entries_c(entry, tracks, starts, ends, skip, cuda)
    xs, ss_ = digest_breakdown._entries_py(entry, tracks, starts, ends, skip, cuda)
    assert c == (xs.tobytes(), ss_.tobytes())
    # Ties: equal device starts with different entries.
    xs.extend(x - 1 for x in xs[: len(xs) // 3])
    ss_.extend(ss_[: len(ss_) // 3])
    for final in (False, True):
        steps = (array("q", ss), se)
        got = digest_breakdown._lags_c(xs, ss_, *steps, final)
        idx, px, ps, wx, ws = digest_breakdown._lags_py(xs, ss_, *steps, final)
        assert got == (idx, px, ps, wx.tobytes(), ws.tobytes())
        if len(xs) > 100 and ss:
            assert idx and (final or len(wx) or max(ss_) < max(se))


@pytest.mark.parametrize("seed", range(6))
def test_the_c_interval_loops_give_what_their_python_references_give(seed: int) -> None:
    import random

    from gputrace import breakdown as bd

    if bd._union_c is None:
        pytest.skip("the C build is not in use")
    rng = random.Random(seed)

    def cols(n: int) -> tuple[array[int], array[int]]:
        s = array("q", (rng.randrange(10**5) for _ in range(n)))
        return s, array("q", (x + rng.choice([-3, 0, rng.randrange(50), rng.randrange(3000)]) for x in s))

    for n in (0, 1, 40, 2000):
        a = cols(n)
        b = cols(rng.randrange(0, 300))
        ua, ub = bd._union_py(*a), bd._union_py(*b)
        assert bd._union_c(*a) == ua
        assert bd._minus_c(*map(_arr, ua), *map(_arr, ub)) == bd._minus_py(*ua, *ub)
        ws = sorted(rng.randrange(10**5) for _ in range(rng.randrange(0, 50)))
        we = [w + rng.randrange(0, 5000) for w in ws]
        assert bd._within_c(*map(_arr, ua), _arr(ws), _arr(we)) == bd._within_py(*ua, ws, we)
        # The union's length in each window without its columns: windows in any order, nested,
        # overlapping, empty and inverted ones too.
        vs = [rng.randrange(-10, 10**5) for _ in range(rng.randrange(0, 50))]
        ve = [v + rng.choice([-5, 0, rng.randrange(0, 5000), rng.randrange(0, 10**5)]) for v in vs]
        got = bd._covered_c(*a, _arr(vs), _arr(ve))
        assert got == bd._covered_py(*a, vs, ve) == bd._within_py(*ua, vs, ve)
        assert bd._covered_c(*a, _arr(ws), _arr(we)) == bd._within_py(*ua, ws, we)


def test_the_python_twins_give_the_summary_and_digest_of_the_c_build() -> None:
    from gputrace import native

    if native.hot is None:
        pytest.skip("the C build is not in use")
    traces = [rank_trace(r) for r in range(2)]
    fast = [stats.to_json(stats.summarize(t)) for t in traces]
    docs = [digest.from_trace(t, "step") for t in traces]
    with native.using(False):
        assert digest_breakdown._nest_c is None
        assert [stats.to_json(stats.summarize(t)) for t in traces] == fast
        assert [digest.from_trace(t, "step") for t in traces] == docs


def _arr(v: list[int]) -> array[int]:
    return array("q", v)


def _downgrade(doc: dict[str, Any]) -> dict[str, Any]:
    """A digest as version 1 wrote it: no cover, self times or launch lags."""
    old = {k: v for k, v in doc.items() if k not in ("cover", "launch_lag")}
    old["format"] = "gputrace-digest/1"
    old["stats"] = {k: v for k, v in doc["stats"].items() if k != "self"}
    return old


def test_old_digests_are_read_again_from_their_traces_or_their_breakdown_is_unknown(tmp_path) -> None:  # type: ignore[no-untyped-def]
    alone = tmp_path / "alone"
    both = tmp_path / "both"
    alone.mkdir()
    both.mkdir()
    for r in range(2):
        trace = rank_trace(r, world=2, steps=8, entries=False)
        path = str(both / f"trace_rank{r}.json")
        chrome.write(trace, path)
        doc = digest.from_trace(trace, "step", path)
        digestfile.write(_downgrade(doc), digestfile.digest_path(path))
        (alone / f"digest_rank{r}.digest").write_bytes((both / f"digest_rank{r}.digest").read_bytes())
    # Without their traces: the step times and collectives are known, the rest said to be unknown.
    s = summary.summary_of_files([str(alone)])
    st = s.steps
    assert st is not None and st.count == 8
    assert all(x is None for r in (0, 1) for x in st.idle_ns[r] + st.exposed_collective_ns[r] + st.launch_lag_ns[r])
    assert all(isinstance(x, int) for r in (0, 1) for x in st.collective_wait_ns[r] + st.collective_transfer_ns[r])
    assert all(x.self_total_ns is None for x in s.names)
    assert any("older version" in n and "not known" in n for n in s.notes)
    r = CliRunner().invoke(main, ["summary", str(alone)])
    assert r.exit_code == 0 and "older version" in r.output
    assert r.output.splitlines()[1].split()[4] == "?"  # the self column, after "total" and its unit
    # Beside their traces: computed from the traces, as if there were no digest.
    s = summary.summary_of_files([str(both)])
    full = summary.summary_of_files([str(both)], full=True)
    assert "computed from the trace" in s.notes[0]
    same_breakdown(full, s)


def test_a_damaged_cover_is_one_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    trace = rank_trace(0, world=1, steps=4, entries=False)
    doc = digest.from_trace(trace, "step")
    doc["cover"]["dur"] = doc["cover"]["dur"][:-1]
    digestfile.write(doc, str(tmp_path / "digest_rank0.digest"))
    r = CliRunner().invoke(main, ["summary", str(tmp_path)])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1
    assert "damaged gputrace digest" in r.output


# ---- real gloo runs with planted causes ---------------------------------------------------------

WORLD = 3
BIG = range(20, 30)  # every rank's all_reduce 32x larger (its transfer well above a loaded machine's noise)
IDLE = range(40, 45)  # rank 2 sleeps outside any span
STEPS = 50


def worker(out: str) -> None:
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gputrace.enable(cuda=False, out_dir=out)
    gputrace.sync_clocks(exchanges=8)
    small, big = torch.ones(1 << 18), torch.ones(1 << 23)
    for k in range(STEPS):
        with gputrace.span("step", step=k):
            with gputrace.span("fwd"):
                time.sleep(0.004)
            if rank == 2 and k in IDLE:
                time.sleep(0.03)  # inside the step, outside any span
            with gputrace.span("all_reduce", collective=True):
                dist.all_reduce(big if k in BIG else small)
        if k % 5 == 4:
            gputrace.flush()
    gputrace.save()
    print(orjson.dumps({"rank": rank, "pid": os.getpid()}).decode(), flush=True)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from .conftest import run_rank_processes

    out = tmp_path_factory.mktemp("planted")
    run_rank_processes(["tests.test_breakdown", "worker", str(out)], WORLD)
    return out


@pytest.mark.dist
def test_planted_causes_in_real_gloo_runs_are_found_and_said(planted: Any) -> None:
    out = str(planted)
    assert sorted(p.name for p in planted.glob("digest_rank*.digest")) == [
        f"digest_rank{r}.digest" for r in range(WORLD)
    ]
    runs = {}
    for extra in ([], ["--full"]):
        r = CliRunner().invoke(main, ["summary", "--json", *extra, out])
        assert r.exit_code == 0, r.output
        runs[bool(extra)] = orjson.loads(r.output)
    dig, full = runs[False], runs[True]
    assert "read from the ranks' digests" in dig["notes"][0] and "digests" not in full["notes"][0]
    for key in ("busy_ns", "wait_ns", *BREAKDOWN):
        assert dig["steps"][key] == full["steps"][key], key
    assert {x["name"]: x["self_total_ns"] for x in dig["names"]} == {
        x["name"]: x["self_total_ns"] for x in full["names"]
    }
    st = full["steps"]
    assert st["count"] == STEPS
    for r in map(str, range(WORLD)):
        tr = st["collective_transfer_ns"][r]
        inside = sorted(tr[k] for k in BIG)
        outside = sorted(tr[k] for k in range(STEPS) if k not in BIG)
        assert inside[0] > 2 * outside[len(outside) // 2], (r, inside, outside)
        assert all(x is None for x in st["launch_lag_ns"][r])  # no CUDA spans
    idle = st["idle_ns"]
    assert min(idle["2"][k] for k in IDLE) > 25_000_000
    assert max(idle[r][k] for r in ("0", "1") for k in IDLE) < 10_000_000
    # the self time of a step is what is outside its fwd and all_reduce: rank 2's sleeps in it
    step_self = next(x for x in full["by_rank"]["2"] if x["name"] == "step")["self_total_ns"]
    assert step_self > 5 * 30_000_000
    # Said in words; on a loaded machine a neighbouring step may join the run, not more.
    causes = st["causes"]

    def run_of(pattern: str) -> tuple[int, int]:
        for c in causes:
            m = re.match(pattern, c)
            if m:
                return int(m.group(1)), int(m.group(2) or m.group(1))
        raise AssertionError(causes)

    a, b = run_of(r"every rank: all_reduce transfer \+[0-9.]+ ms a step in steps? (\d+)(?:-(\d+))?$")
    assert a <= BIG[0] and b >= BIG[-1] and b - a <= len(BIG) + 1
    a, b = run_of(r"rank 2 slowest in steps? (\d+)(?:-(\d+))?: [0-9.]+ ms idle outside any span")
    assert a <= IDLE[0] and b >= IDLE[-1] and b - a <= len(IDLE) + 1
    text = subprocess.run(
        [sys.executable, "-m", "gputrace", "summary", out],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "160"},
    )
    assert text.returncode == 0, text.stderr
    assert "every rank: all_reduce transfer +" in text.stdout and "rank 2 slowest in step" in text.stdout
    assert "self" in text.stdout.splitlines()[0].split()


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        worker(sys.argv[2])


def test_a_rank_slower_in_every_step_by_less_than_the_steps_vary_is_said() -> None:
    from gputrace.causes import causes

    def run(slower: bool) -> list[str]:
        # Steps of 1-3 ms that every rank shares (the step-to-step noise is ~1 ms), and rank 1
        # doing 0.25-0.29 ms more work in each when `slower`: by far less than the steps vary.
        spans: dict[int, list[tuple[Any, ...]]] = {0: [], 1: [], 2: []}
        for k in range(16):
            at, common = k * 4_000_000, 1_000_000 + (k * 7919 % 13) * 150_000
            for r in spans:
                work = common + r * 1_000 + (250_000 + (k % 3) * 20_000 if slower and r == 1 else 0)
                spans[r] += [("fwd", at, at + work, "main"), ("step", at, at + work + 10_000, "main")]
        s = stats.summarize(mk(spans))
        assert s.steps is not None
        return causes(s.steps, s.collectives, stats.fmt_ns)

    said = run(True)
    assert len(said) == 1 and said[0].startswith("rank 1 slowest in 16 of 16 steps: "), said
    assert "work inside spans" in said[0]
    assert run(False) == []  # the same steps without the slower rank: nothing is said
