"""The viewer's words and comparisons without a browser: the other ranks' median, the worst steps
and phases in words, warm-up outliers, and the timeline trace's rank names in numeric order."""

from __future__ import annotations

import orjson

from gputrace.trace.model import Process, Trace, Track
from gputrace.viewer import data, findings

from .test_viewer import BASE, STEP, make_trace


def test_others_median_leaves_each_rank_out() -> None:
    busy = [[10, 40, 7], [15, 20, 7], [30, 10, 7], [12, 30, 9]]
    got = findings.others_median(busy)
    for r in range(4):
        for k in range(3):
            others = [busy[q][k] for q in range(4) if q != r]
            assert got[r][k] == sorted(others)[1]  # three others: the middle one
    # Two ranks: each is compared with the other; one rank: with itself.
    assert findings.others_median([[100, 5], [149, 5]]) == [[149, 5], [100, 5]]
    assert findings.others_median([[3, 4]]) == [[3, 4]]
    # Four others (five ranks): the mean of the middle two, in integer ns.
    five = [[1], [2], [3], [4], [10]]
    assert [v[0] for v in findings.others_median(five)] == [3, 3, 3, 2, 2]


def test_a_two_rank_document_compares_with_the_other_rank() -> None:
    doc = data.document(make_trace(2, 4, {1: {0, 1, 2, 3}}))
    st = doc["steps"]
    assert st["ref"][1] == st["busy"][0] and st["ref"][0] == st["busy"][1]
    assert round(100 * (st["busy"][1][0] - st["ref"][1][0]) / st["ref"][1][0]) == 50


def test_worst_steps_and_phases() -> None:
    slow = {5: set(range(10, 20)) | {21} | set(range(30, 34)), 2: {25}}
    doc = data.document(make_trace(8, 40, slow))
    # Step 20 (not slow) lies inside the first run: 15 steps +5 ms over 16 steps of ~10 ms.
    assert [p["words"] for p in doc["phases"]] == ["rank 5: steps 10-21 and 30-33, +47% in compute"]
    assert doc["phases"][0]["runs"] == [[10, 21], [30, 33]] and doc["phases"][0]["steps"] == 16
    worst = doc["worst"]
    assert {(w["rank"], w["step"]) for w in worst} == {(5, k) for k in slow[5]} | {(2, 25)}
    assert [w["margin_ns"] for w in worst] == sorted((w["margin_ns"] for w in worst), reverse=True)


def test_a_phase_names_the_innermost_span_that_grew() -> None:
    """`block` inside `forward` is slower on rank 1: the phase names `block`, not `forward`."""
    t = Trace({"merged": True})
    for r in range(3):
        p = t.add_process(Process(r + 1, r, f"rank {r}", r, {}))
        tr = t.add_track(Track(p, 2, "main", "cpu", None, 0))
        for k in range(8):
            s = BASE + k * STEP
            extra = 4_000_000 if r == 1 and 2 <= k <= 6 else 0
            t.add_span("step", tr, s, s + 20_000_000 + extra, {"step": k})
            t.add_span("forward", tr, s, s + 15_000_000 + extra)
            t.add_span("block", tr, s + 1_000_000, s + 9_000_000 + extra)
            t.add_span("opt", tr, s + 15_000_000 + extra, s + 20_000_000 + extra)
    doc = data.document(t)
    assert [p["words"] for p in doc["phases"]] == ["rank 1: steps 2-6, +50% in block"]


def test_warm_up_outliers_only() -> None:
    trace = make_trace(3, 30)
    assert not data.document(trace)["warmup_auto"]
    sp = trace.spans
    for i in range(len(sp)):
        if sp.start[i] < BASE + STEP:  # step 0: 3x as long
            sp.end[i] = sp.start[i] + 3 * (sp.end[i] - sp.start[i])
    doc = data.document(trace)
    assert doc["warmup_auto"] and doc["steps"]["skipped"] == 1
    assert doc["notes"][0].startswith("the first step is left out as warm-up (it took 3.0x")
    kept = data.document(trace, skip_steps=0)
    assert not kept["warmup_auto"] and kept["steps"]["skipped"] == 0


def test_the_timeline_names_ranks_so_their_order_is_numeric() -> None:
    trace = make_trace(12, 2)
    events = orjson.loads(data.timeline_trace(trace, BASE))["traceEvents"]
    names = [e["args"]["name"] for e in events if e.get("name") == "process_name"]
    assert names == [f"rank {r:02d}" for r in range(12)]
    assert sorted(names) == names
    # The viewer's own labels, and the trace, are untouched.
    assert data.document(trace)["labels"][3] == "rank 3" and trace.processes[3].label == "rank 3"
    small = orjson.loads(data.timeline_trace(make_trace(3, 2), BASE))["traceEvents"]
    assert [e["args"]["name"] for e in small if e.get("name") == "process_name"] == ["rank 0", "rank 1", "rank 2"]
