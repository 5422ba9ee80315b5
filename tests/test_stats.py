"""The summary: exact numbers on hand-built traces, the straggler rule both ways, collective
matching and attribution, what is left out and counted, JSON labels, table width, the CLI."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

import gputrace
from gputrace import stats
from gputrace.cli import main
from gputrace.errors import GputraceError
from gputrace.trace import chrome
from gputrace.trace.model import Process, Trace, Track

B = 1_700_000_000_000_000_000  # epoch ns of the hand-built traces
Span = tuple  # (name, start, end) or (name, start, end, args) or (name, start, end, args, track)


def build(
    by_rank: dict[int, list[Span]],
    rank_meta: dict[int, dict[str, Any]] | None = None,
    errors: dict[int, int] | None = None,
    str_keys: bool = False,
) -> Trace:
    """A merged trace: spans at B + the times given; `errors`: per-rank alignment error bars, keyed
    by int as merge.load holds them (or by string, as a merged file has them)."""
    meta: dict[str, Any] = {"merged": True}
    if errors is not None:
        meta["alignment"] = {
            "method": "clock",
            "per_rank": {(str(r) if str_keys else r): {"offset_ns": 0, "error_ns": e} for r, e in errors.items()},
        }
    t = Trace(meta)
    for r, spans in by_rank.items():
        p = t.add_process(Process(r + 1, r, f"rank {r}", r, (rank_meta or {}).get(r, {})))
        tracks: dict[str, int] = {}
        for sp in spans:
            name, s, e = sp[:3]
            args = sp[3] if len(sp) > 3 else None
            label = sp[4] if len(sp) > 4 else "cuda:0 stream 7"
            if label not in tracks:
                tracks[label] = t.add_track(Track(p, len(tracks) + 1, label, "cuda", 0, len(tracks)))
            t.add_span(name, tracks[label], B + s, B + e, args)
    return t


def steps_of(busy: list[int], step: int = 2_000_000, gap: int = 1000) -> list[Span]:
    """Back-to-back steps of `step` ns; in each, work for busy[k] then an all_reduce to the end."""
    out: list[Span] = []
    t = 0
    for b in busy:
        out += [("step", t, t + step), ("work", t, t + b), ("all_reduce", t + b, t + step, None, "cuda:0 stream 13")]
        t += step + gap
    return out


# ---- name statistics --------------------------------------------------------------------------


def test_percentiles_totals_and_the_slowest_instance_are_exact() -> None:
    spans = [("op", 1000 * i, 1000 * i + d) for i, d in enumerate(random.Random(1).sample(range(1, 101), 100))]
    t = build({0: spans, 1: [("op", 0, 500), ("op", 1000, 1700)]})
    s = stats.summarize(t)
    (op,) = s.names
    assert (op.count, op.total_ns, op.max_ns) == (102, 5050 + 1200, 700)
    assert (op.ranks, op.min_rank, op.min_rank_total_ns, op.max_rank, op.max_rank_total_ns) == (2, 1, 1200, 0, 5050)
    assert op.imbalance == pytest.approx(5050 / 1200)
    assert op.slowest == stats.Instance(1, B + 1000, B + 1700)
    (r0,) = s.by_rank[0]
    assert (r0.count, r0.total_ns, r0.mean_ns, r0.p50_ns, r0.p90_ns, r0.p99_ns, r0.max_ns) == (
        100, 5050, 50.5, 50, 90, 99, 100,
    )  # fmt: skip
    i = next(k for k, sp in enumerate(spans) if sp[2] - sp[1] == 100)
    assert r0.slowest == stats.Instance(0, B + spans[i][1], B + spans[i][2])
    assert s.by_rank[1][0].ranks == 1 and s.by_rank[1][0].imbalance == 1.0


def test_names_are_sorted_by_total_and_other_tools_processes_are_left_out() -> None:
    t = build({0: [("a", 0, 10), ("b", 0, 30), ("c", 40, 60)]})
    kineto = t.add_process(Process(99, 0, "GPU 0 (kineto)", 99, {}, foreign=True))
    t.add_span("kernel", t.add_track(Track(kineto, 7, "stream 7", "other")), B, B + 10**9)
    s = stats.summarize(t)
    assert [r.name for r in s.names] == ["b", "c", "a"]
    assert s.counts[0].spans == 3
    assert any("1 spans of processes that are not gputrace ranks" in n for n in s.notes)


def test_a_name_on_some_ranks_only_says_so_beside_its_imbalance() -> None:
    t = build({0: [("a", 0, 10), ("ckpt", 0, 500)], 1: [("a", 0, 30)], 2: [("a", 0, 20)]})
    s = stats.summarize(t)
    ckpt = next(r for r in s.names if r.name == "ckpt")
    assert ckpt.ranks == 1 and ckpt.imbalance == 1.0
    lines = stats.table(s).splitlines()
    assert next(x for x in lines if x.startswith("ckpt")).endswith("1.00x on 1/3")
    assert next(x for x in lines if x.startswith("a ")).endswith("3.00x")


# ---- steps: busy time and the straggler rule --------------------------------------------------


def test_busy_time_subtracts_the_union_of_overlapping_collectives_clipped_to_the_step() -> None:
    comm = "cuda:0 stream 13"
    t = build(
        {
            0: [
                ("step", 0, 10_000),
                ("all_reduce", 2000, 5000, None, comm),
                ("nccl:wait", 4000, 6000),  # overlaps the all_reduce: counted once
                ("barrier", 9000, 12_000, None, comm),  # crosses the step's end
                ("step", 12_000, 20_000),
                ("broadcast", 13_000, 14_000, None, comm),
                ("broadcast", 13_500, 13_800),  # inside the other one
            ]
        }
    )
    st = stats.summarize(t).steps
    assert st is not None and st.count == 2 and st.ranks == [0]
    assert st.wait_ns[0] == [4000 + 1000, 1000]
    assert st.busy_ns[0] == [5000, 7000]
    assert st.start_ns[0] == [B, B + 12_000] and st.end_ns[0] == [B + 10_000, B + 20_000]
    assert st.median_busy_ns == [5000, 7000]
    assert not any(v.called for v in st.verdicts)  # one rank: nobody to be slower than


def test_a_rank_is_called_slowest_only_above_2_percent() -> None:
    base = 1_000_000
    t = build({0: steps_of([base] * 3), 1: steps_of([base] * 3), 2: steps_of([base + 20_001, base + 20_000, base])})
    st = stats.summarize(t).steps
    assert st is not None
    v0, v1, v2 = st.verdicts
    assert (v0.step, v0.rank, v0.busy_ns, v0.median_ns, v0.margin_ns, v0.called) == (
        0,
        2,
        base + 20_001,
        base,
        20_001,
        True,
    )
    assert v0.margin_pct == pytest.approx(2.0001)
    assert (v1.rank, v1.margin_ns, v1.margin_pct, v1.called) == (2, 20_000, 2.0, False)  # exactly 2% is not more
    assert (v2.rank, v2.margin_ns, v2.called) == (0, 0, False)  # a tie names the lowest rank, uncalled
    assert st.times_slowest == {0: 0, 1: 0, 2: 1}
    assert "2%" in st.rule and "clock error" in st.rule


def test_the_margin_must_also_beat_twice_the_device_anchor_uncertainty() -> None:
    base = 1_000_000
    anchors = {2: {"clock": {"device_anchors": [{"device": 0, "uncertainty_ns_max": 15_000}]}}}
    busy = [base + 25_000, base + 35_000]  # 2.5% and 3.5%: both above 2%
    t = build({0: steps_of([base] * 2), 1: steps_of([base] * 2), 2: steps_of(busy)}, anchors)
    st = stats.summarize(t).steps
    assert st is not None
    assert [(v.rank, v.margin_ns, v.noise_ns, v.called) for v in st.verdicts] == [
        (2, 25_000, 30_000, False),
        (2, 35_000, 30_000, True),
    ]


def test_alignment_error_bars_do_not_hide_a_straggler_in_busy_time() -> None:
    # Busy time is a duration on one rank: the offset between ranks' clocks cancels out of it.
    t = build({0: steps_of([1_000_000]), 1: steps_of([1_300_000])}, errors={0: 0, 1: 5_000_000})
    st = stats.summarize(t).steps
    assert st is not None and st.verdicts[0].called and st.verdicts[0].rank == 1
    assert st.verdicts[0].median_ns == 1_150_000 and st.verdicts[0].margin_ns == 150_000


def test_with_equal_work_no_rank_is_called_slowest() -> None:
    rng = random.Random(7)
    t = build({r: steps_of([1_000_000 + rng.randrange(-9_000, 9_000) for _ in range(40)]) for r in range(8)})
    s = stats.summarize(t)
    assert s.steps is not None and s.steps.count == 40
    assert not any(v.called for v in s.steps.verdicts)
    assert set(s.steps.times_slowest.values()) == {0}
    text = stats.table(s)
    assert "no rank was slowest beyond the noise in any of the 40 steps" in text
    assert "largest margin: rank" in text


def test_skip_steps_leaves_out_warm_up_and_everything_before_it() -> None:
    spans = {
        r: [("init", 0, 50_000)] + steps_of([400_000 if r else 900_000, 300_000, 300_000 + 100_000 * r])
        for r in range(2)
    }
    for r in spans:  # shift the steps after init
        spans[r] = [spans[r][0]] + [(n, s + 100_000, e + 100_000, *rest) for n, s, e, *rest in spans[r][1:]]
    full = stats.summarize(build(spans))
    assert full.steps is not None and full.steps.verdicts[0].rank == 0
    s = stats.summarize(build(spans), skip_steps=1)
    st = s.steps
    assert st is not None and (st.skipped, st.count) == (1, 2)
    assert [v.step for v in st.verdicts] == [1, 2] and st.number(0) == 1
    assert st.busy_ns[1] == [300_000, 400_000]
    assert [(v.step, v.rank, v.called) for v in st.verdicts] == [(1, 0, False), (2, 1, True)]
    assert "init" not in {r.name for r in s.names}
    assert next(r for r in s.names if r.name == "work").count == 4
    assert s.counts[0].warmup == 1 + 3 and s.counts[0].spans == 6
    assert s.collectives is not None and {o.step for o in s.collectives.occurrences} == {1, 2}
    with pytest.raises(GputraceError, match="skipping 3 steps leaves none"):
        stats.summarize(build(spans), skip_steps=3)


def test_unequal_step_counts_use_the_steps_on_every_rank_and_say_so() -> None:
    t = build({0: steps_of([100] * 5), 1: steps_of([100] * 3), 2: [("other", 0, 10)]})
    s = stats.summarize(t)
    assert s.steps is not None and s.steps.count == 3 and s.steps.ranks == [0, 1]
    assert any("between 3 and 5 'step' spans" in n for n in s.notes)
    assert any("ranks 2 have no 'step' spans" in n for n in s.notes)


# ---- collectives -------------------------------------------------------------------------------


@pytest.mark.parametrize("str_keys", [False, True])
def test_collectives_are_matched_by_step_name_and_ordinal_with_last_arrivals_and_waits(str_keys: bool) -> None:
    mark = {"collective": True}

    def rank(arrivals: list[int]) -> list[Span]:
        a, b, c, d = arrivals
        return [
            ("broadcast", -500 + a // 10, -100, mark),  # before every step
            ("step", 0, 1000),
            ("all_reduce", a, 1000, mark),
            ("wait_for_data", 10, 20),  # named like a collective, but the trace marks its collectives
            ("step", 2000, 3000),
            ("all_reduce", 2000 + b, 2450, mark),
            ("all_reduce", 2500 + c, 2700, mark),
            ("all_gather", 2700 + d, 3000, mark),
        ]

    t = build(
        {0: rank([100, 100, 0, 10]), 1: rank([300, 0, 50, 10]), 2: rank([200, 400, 20, 10])},
        errors={0: 0, 1: 60, 2: 60},
        str_keys=str_keys,
    )
    co = stats.summarize(t).collectives
    assert co is not None and "marked collective=True" in co.rule
    got = {(o.step, o.name, o.ordinal): o for o in co.occurrences}
    assert set(got) == {
        (None, "broadcast", 0),
        (0, "all_reduce", 0),
        (1, "all_reduce", 0),
        (1, "all_reduce", 1),
        (1, "all_gather", 0),
    }
    o = got[(0, "all_reduce", 0)]
    assert o.arrivals == {0: B + 100, 1: B + 300, 2: B + 200} and o.ends == {0: B + 1000, 1: B + 1000, 2: B + 1000}
    assert o.last_rank == 1 and o.waits_ns == {0: 200, 1: 0, 2: 100}
    assert o.last_margin_ns == 100 and not o.last_called  # 100 ns <= 60 + 60 of clock error
    o = got[(1, "all_reduce", 0)]
    assert o.last_rank == 2 and o.waits_ns == {0: 300, 1: 400, 2: 0}
    assert o.last_margin_ns == 300 and o.last_called
    o = got[(1, "all_reduce", 1)]
    assert o.last_rank == 1 and o.waits_ns == {0: 50, 1: 0, 2: 30} and not o.last_called  # 30 <= 120
    assert got[(1, "all_gather", 0)].waits_ns == {0: 0, 1: 0, 2: 0}  # a tie
    o = got[(None, "broadcast", 0)]  # arrivals -490, -470, -480
    assert o.last_rank == 1 and o.waits_ns == {0: 20, 1: 0, 2: 10} and o.last_margin_ns == 10
    pr = co.per_rank
    assert pr[2] == stats.CollectiveRank(
        times_last=1, wait_caused_ns=700, wait_suffered_ns=10 + 100 + 0 + 30 + 0, times_last_within_noise=0
    )
    assert pr[1].times_last == 0 and pr[1].times_last_within_noise == 3
    assert pr[1].wait_caused_ns == 30 + 300 + 80 and pr[1].wait_suffered_ns == 400
    assert pr[0].times_last_within_noise == 1 and pr[0].wait_caused_ns == 0  # the tie goes to rank 0
    assert pr[0].wait_suffered_ns == 20 + 200 + 300 + 50 + 0
    # in order of first arrival
    assert [o.name for o in co.occurrences][:2] == ["broadcast", "all_reduce"]


def test_without_marks_collectives_are_found_by_name_and_collective_false_opts_out() -> None:
    t = build(
        {
            r: [
                ("step", 0, 1000),
                ("all_reduce", 100 + 100 * r, 600),
                ("wait_for_data", 700, 800),
                ("barrier", 800, 900, {"collective": False}),
            ]
            for r in range(2)
        }
    )
    s = stats.summarize(t)
    assert s.collectives is not None and "named like one" in s.collectives.rule
    assert sorted({o.name for o in s.collectives.occurrences}) == ["all_reduce", "wait_for_data"]
    assert s.steps is not None and s.steps.busy_ns == {0: [1000 - 500 - 100], 1: [1000 - 400 - 100]}
    assert any("no alignment error bars" in n for n in s.notes)


def test_arrival_order_without_clock_syncs_is_flagged_only_across_hosts() -> None:
    spans = {r: [("step", 0, 1000), ("all_reduce", 100 + 100 * r, 600)] for r in range(2)}
    one_host = {r: {"hostname": "node1", "clock": {"sync_to_rank0": []}} for r in range(2)}
    two_hosts = {r: {"hostname": f"node{r}", "clock": {"sync_to_rank0": []}} for r in range(2)}
    synced = {r: {"hostname": f"node{r}", "clock": {"sync_to_rank0": [{"offset_ns": 0}]}} for r in range(2)}
    errors = {0: 0, 1: 0}

    def flagged(meta: dict[int, dict[str, Any]]) -> bool:
        return any("recorded no clock sync" in n for n in stats.summarize(build(spans, meta, errors)).notes)

    assert not flagged(one_host) and flagged(two_hosts) and not flagged(synced)


def test_unmatched_collectives_still_match_by_key_when_ranks_differ() -> None:
    # Rank 1 ran one extra all_gather in step 0: the rest still match by (step, name, ordinal).
    t = build(
        {
            0: [("step", 0, 1000), ("all_reduce", 100, 200), ("step", 1000, 2000), ("all_reduce", 1100, 1200)],
            1: [
                ("step", 0, 1000),
                ("all_gather", 50, 80),
                ("all_reduce", 150, 200),
                ("step", 1000, 2000),
                ("all_reduce", 1120, 1200),
            ],
        }
    )
    co = stats.summarize(t).collectives
    assert co is not None
    got = {(o.step, o.name, o.ordinal): o for o in co.occurrences}
    assert got[(0, "all_reduce", 0)].waits_ns == {0: 50, 1: 0}
    assert got[(1, "all_reduce", 0)].waits_ns == {0: 20, 1: 0}
    assert got[(0, "all_gather", 0)].arrivals == {1: B + 50}
    assert co.per_rank[1].wait_caused_ns == 70


# ---- left out, counted -------------------------------------------------------------------------


def test_unfinished_spans_are_left_out_and_counted_and_drops_are_reported() -> None:
    meta = {0: {"spans_dropped": 5, "spans_skipped_in_cuda_graph_capture": 3}}
    t = build(
        {
            0: [
                ("step", 0, 100),
                ("step", 100, 200),
                ("step", 200, 10**9, {"unfinished": True}),
                ("fwd", 210, 10**9, {"unfinished": True}),
            ],
            1: [("step", 0, 150), ("step", 150, 300)],
        },
        meta,
    )
    s = stats.summarize(t)
    assert s.counts[0] == stats.RankCounts(spans=2, unfinished=2, dropped=5, skipped_in_capture=3, warmup=0)
    assert s.counts[1] == stats.RankCounts(spans=2, unfinished=0, dropped=None, skipped_in_capture=None, warmup=0)
    assert [(r.name, r.count, r.max_ns) for r in s.names] == [("step", 4, 150)]
    assert s.steps is not None and s.steps.count == 2
    assert any("2 unfinished spans" in n for n in s.notes)
    assert any("5 spans were dropped" in n for n in s.notes)
    text = stats.table(s)
    assert "unfinished, dropped or skipped spans on ranks 0" in text


def test_an_unknown_step_is_an_error_that_lists_the_names_present() -> None:
    t = build({0: [("train_step", 0, 100), ("fwd", 0, 50)]})
    with pytest.raises(stats.UnknownStepError, match=r"no span is named 'nosuch'.*'train_step', 'fwd'"):
        stats.summarize(t, "nosuch", require_step=True)
    assert stats.summarize(t, "nosuch").steps is None  # not required: step analysis omitted
    assert stats.summarize(t).steps is None
    assert stats.summarize(t, "train_step", require_step=True).steps is not None
    assert stats.summarize(Trace(), "nosuch", require_step=True).names == []  # nothing to list


# ---- JSON and text -----------------------------------------------------------------------------


def _walk(value: Any) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            assert isinstance(k, str), k
            _walk(v)
    elif isinstance(value, list):
        assert not any(isinstance(v, (list, tuple)) for v in value), "a bare tuple in a list"
        for v in value:
            _walk(v)
    else:
        assert isinstance(value, (str, int, float, bool, type(None))), type(value)


def test_json_is_labelled_objects_with_string_rank_keys() -> None:
    t = build({r: steps_of([1000, 1000 + 500 * r]) for r in range(2)})
    s = stats.summarize(t)
    data = stats.to_json(s)
    _walk(data)
    data = orjson.loads(orjson.dumps(data))  # plain JSON, no options needed
    work = next(x for x in data["names"] if x["name"] == "work")
    assert work["slowest"] == {"rank": 1, "start_ns": B + 2_001_000, "end_ns": B + 2_002_500}
    assert set(data["by_rank"]) == {"0", "1"} and data["by_rank"]["1"][0]["name"] == "step"
    assert data["counts"]["0"] == {
        "spans": 6,
        "unfinished": 0,
        "dropped": None,
        "skipped_in_capture": None,
        "warmup": 0,
    }
    st = data["steps"]
    assert st["busy_ns"] == {"0": [1000, 1000], "1": [1000, 1500]} and st["times_slowest"] == {"0": 0, "1": 1}
    assert st["verdicts"][1] == {
        "step": 1, "rank": 1, "busy_ns": 1500, "median_ns": 1250, "margin_ns": 250, "margin_pct": 20.0,
        "noise_ns": 0, "called": True,
    }  # fmt: skip
    occ = data["collectives"]["occurrences"][0]
    assert set(occ) == {
        "step",
        "name",
        "ordinal",
        "arrivals",
        "ends",
        "last_rank",
        "last_margin_ns",
        "last_called",
        "waits_ns",
    }
    assert set(occ["arrivals"]) == {"0", "1"}
    assert set(data["collectives"]["per_rank"]["0"]) == {
        "times_last", "times_last_within_noise", "wait_caused_ns", "wait_suffered_ns",
    }  # fmt: skip


def _cols(line: str) -> int:
    return stats._cell_width(line)


@pytest.mark.parametrize("width", [40, 60, 80, 100, 160])
def test_the_table_fits_the_width_whatever_the_names(width: int) -> None:
    hostile = ["x" * 200, "line\nbreak\tand tab", "<script>alert(1)</script>", "名前の長いスパン" * 5, "all_reduce"]
    t = build(
        {
            r: [(n, 10 * i, 10 * i + 5 + r) for i, n in enumerate(hostile)] + steps_of([900, 800 + 50 * r])
            for r in range(3)
        }
    )
    s = stats.summarize(t)
    text = stats.table(s, width=width, by_rank=True)
    lines = text.splitlines()
    assert all(_cols(line) <= width for line in lines), max(lines, key=_cols)
    assert not any("\t" in line for line in lines)
    assert sum(line.startswith("line?break?and tab") for line in lines) == 4  # all ranks and each rank


def test_the_table_shows_verdicts_with_margins_and_collective_attribution() -> None:
    t = build({r: steps_of([1_000_000 + (300_000 if r == 1 and k % 2 else 0) for k in range(6)]) for r in range(3)})
    text = stats.table(stats.summarize(t), width=100)
    assert "rank 1 was slowest most often: 3 of 6 steps" in text
    assert "+300.000 ms" not in text and "+300.0 us" in text and "+30.0%" in text
    assert "wait caused" in text and "wait suffered" in text and "longest waits:" in text
    assert all(len(line) <= 100 for line in text.splitlines())


def test_64_ranks_one_straggler_in_chosen_steps() -> None:
    slow_rank, slow_steps, n = 41, {4, 17, 25}, 30
    rng = random.Random(3)
    mark = {"collective": True}
    by_rank: dict[int, list[Span]] = {r: [] for r in range(64)}
    t0 = 0
    for k in range(n):
        work = {r: 1_000_000 + rng.randrange(-5_000, 5_000) for r in range(64)}
        if k in slow_steps:
            work[slow_rank] += 100_000
        end = t0 + max(work.values()) + 20_000
        for r in range(64):
            by_rank[r] += [
                ("step", t0, end),
                ("fwd", t0, t0 + work[r]),
                ("all_reduce", t0 + work[r], end, mark, "cuda:0 stream 13"),
            ]
        t0 = end + 1000
    s = stats.summarize(build(by_rank, errors={r: 1_000 for r in range(64)}))
    assert s.ranks == list(range(64)) and len(s.counts) == 64
    assert all(c.spans == 3 * n for c in s.counts.values())
    st = s.steps
    assert st is not None and st.count == n and len(st.ranks) == 64
    assert {v.step for v in st.verdicts if v.called} == slow_steps
    assert {v.rank for v in st.verdicts if v.called} == {slow_rank}
    assert st.times_slowest[slow_rank] == 3 and sum(st.times_slowest.values()) == 3
    co = s.collectives
    assert co is not None and len(co.occurrences) == n
    for o in co.occurrences:
        assert len(o.arrivals) == 64 and o.waits_ns[o.last_rank] == 0
        if o.step in slow_steps:
            assert o.last_rank == slow_rank and o.last_called and o.last_margin_ns > 80_000
    assert co.per_rank[slow_rank].times_last >= 3
    worst = max(co.per_rank, key=lambda r: co.per_rank[r].wait_caused_ns)
    assert worst == slow_rank
    text = stats.table(s)
    assert all(len(line) <= 100 for line in text.splitlines())
    assert "rank 41 was slowest most often: 3 of 30 steps" in text


# ---- the command -------------------------------------------------------------------------------


def rank_file(path: Any, rank: int, spans: list[Span], world: int = 2, run: str = "run-1") -> str:
    meta = {"gputrace_version": gputrace.__version__, "rank": rank, "world_size": world, "spans_dropped": 0}
    meta["run_id"] = run
    t = Trace(dict(meta))
    p = t.add_process(Process(rank + 1, rank, f"rank {rank}", rank, meta))
    tr = t.add_track(Track(p, 1, "cuda:0 stream 7", "cuda", 0))
    for name, s, e, *rest in spans:
        t.add_span(name, tr, B + s, B + e, rest[0] if rest else None)
    chrome.write(t, str(path))
    return str(path)


def test_summary_table_and_json_of_a_recorded_trace(tmp_path) -> None:  # type: ignore[no-untyped-def]
    gputrace.enable(cuda=False)
    for i in range(4):
        with gputrace.span("step", i=i):
            with gputrace.span("fwd"):
                pass
    path = gputrace.save(tmp_path / "t")
    r = CliRunner().invoke(main, ["summary", path])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].split()[:3] == ["name", "count", "total"]
    assert lines[1].split()[:2] == ["step", "4"] and lines[2].split()[:2] == ["fwd", "4"]
    assert "steps ('step'): 4 on every rank of 0" in r.output
    assert all(len(line) <= 100 for line in lines)  # not a terminal: 100 columns
    r = CliRunner().invoke(main, ["summary", "--json", path])
    data = orjson.loads(r.output)
    assert [(x["name"], x["count"]) for x in data["names"]] == [("step", 4), ("fwd", 4)]
    assert data["counts"]["0"]["dropped"] == 0 and data["counts"]["0"]["unfinished"] == 0


def test_per_rank_files_and_by_rank(tmp_path) -> None:  # type: ignore[no-untyped-def]
    a = rank_file(tmp_path / "trace_rank0.json", 0, steps_of([1000, 1000]))
    b = rank_file(tmp_path / "trace_rank1.json", 1, steps_of([1000, 1500]))
    r = CliRunner().invoke(main, ["summary", "--json", "--skip-steps", "1", str(tmp_path)])
    assert r.exit_code == 0, r.output
    data = orjson.loads(r.output)
    assert data["ranks"] == [0, 1] and data["steps"]["busy_ns"] == {"0": [1000], "1": [1500]}
    assert data["steps"]["verdicts"][0]["step"] == 1 and data["steps"]["verdicts"][0]["called"]
    r = CliRunner().invoke(main, ["summary", "--by-rank", a, b])
    assert r.exit_code == 0, r.output
    assert "\nrank 0\n" in r.output and "\nrank 1\n" in r.output


def test_the_same_rank_twice_is_an_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    a = rank_file(tmp_path / "trace_rank0.json", 0, steps_of([1000]))
    copy = tmp_path / "copy_of_rank0.json"
    copy.write_bytes((tmp_path / "trace_rank0.json").read_bytes())
    r = CliRunner().invoke(main, ["summary", a, str(copy)])
    assert r.exit_code == 2 and "rank 0 appears twice" in r.output and r.output.count("\n") == 1


def test_files_of_different_runs_need_allow_mixed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    a = rank_file(tmp_path / "trace_rank0.json", 0, steps_of([1000]), run="run-1")
    b = rank_file(tmp_path / "old" / "trace_rank1.json", 1, steps_of([5000]), run="run-0")
    r = CliRunner().invoke(main, ["summary", a, b])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "--allow-mixed" in r.output
    r = CliRunner().invoke(main, ["summary", "--allow-mixed", "--json", a, b])
    assert r.exit_code == 0, r.output
    data = orjson.loads(r.output)
    assert data["ranks"] == [0, 1] and any("run" in n for n in data["notes"])


def test_unknown_step_on_the_command_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = rank_file(tmp_path / "trace_rank0.json", 0, [("train_step", 0, 100), ("fwd", 0, 50)])
    r = CliRunner().invoke(main, ["summary", "--step", "nosuch", path])
    assert r.exit_code == 2 and r.output.count("\n") == 1
    assert "'nosuch'" in r.output and "'train_step', 'fwd'" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["summary", path])  # no `step` spans and no --step: no step analysis
    assert r.exit_code == 0 and "steps (" not in r.output
    r = CliRunner().invoke(main, ["summary", "--step", "train_step", path])
    assert r.exit_code == 0 and "steps ('train_step'): 1 on every rank of 0" in r.output


def test_a_streamed_file_cut_by_a_crash_is_summarized(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "trace_rank0.json")
    meta = {"gputrace_version": gputrace.__version__, "rank": 0, "world_size": 1}
    t = Trace(dict(meta))
    p = t.add_process(Process(1, 0, "rank 0", 0, meta))
    tr = t.add_track(Track(p, 1, "cuda:0 stream 7", "cuda", 0))
    t.add_span("a", tr, B, B + 5000)
    t.add_span("b", tr, B + 6000, B + 7000)
    w = chrome.StreamWriter(
        path, B, t.processes[0], {"distributedInfo": {"rank": 0, "world_size": 1}, "metadata": meta}
    )
    w.append(t, [0, 1])
    w.abandon()
    with open(path, "ab") as f:
        f.write(b'{"ph": "X", "na')  # the kill came mid-line
    r = CliRunner().invoke(main, ["summary", "--json", path])
    assert r.exit_code == 0, r.output
    assert sorted(x["name"] for x in orjson.loads(r.output)["names"]) == ["a", "b"]


def test_bad_input_is_one_line_and_exit_2(tmp_path) -> None:  # type: ignore[no-untyped-def]
    runner = CliRunner()
    r = runner.invoke(main, ["summary", str(tmp_path / "missing.json")])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "no such file" in r.output
    bad = tmp_path / "cut.json"
    bad.write_bytes(b'{"traceEvents": [{"ph": "X", "na')
    r = runner.invoke(main, ["summary", str(bad)])
    assert r.exit_code == 2 and "cut off" in r.output and "Traceback" not in r.output
    notrace = tmp_path / "other.json"
    notrace.write_bytes(b'{"hello": 1}')
    r = runner.invoke(main, ["summary", str(notrace)])
    assert r.exit_code == 2 and "not a Chrome trace" in r.output
