"""Each rank's step broken down (idle, collective wait and transfer, exposed collective time,
launch lag) and self time per name: the names and shapes `summary --json` gives, exact numbers
on hand-built traces for each definition, the same numbers from digests as from traces, and real
gloo runs with planted causes that the text says in words."""

from __future__ import annotations

from array import array
from typing import Any

import orjson
from click.testing import CliRunner

from gputrace import stats
from gputrace.cli import main
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


def test_launch_lag_is_device_start_less_host_entry_of_the_first_cuda_span_entered_in_the_step() -> None:
    t = mk(
        {
            0: [
                ("fwd", 30, 60, "cuda stream 7", None, 10),
                ("bwd", 60, 90, "cuda stream 7", None, 5),  # entered first: 60 - 5
                ("step", 0, 100, "main"),
                ("opt", 150, 160, "cuda stream 7", None, None),  # entry not known
                ("step", 100, 200, "main"),
                ("x", 260, 280, "cuda stream 7", None, 199),  # entered in step 1, ran after it
                ("y", 240, 250, "main", None, 150),  # not a CUDA span
                ("step", 200, 300, "main"),
            ]
        },
        entries=True,
    )
    st = stats.summarize(t).steps
    assert st is not None
    assert st.launch_lag_ns[0] == [55, 61, None]
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
