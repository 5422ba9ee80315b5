"""The viewer's words and comparisons without a browser: the other ranks' median, the worst steps
and phases in words, warm-up outliers, and the timeline trace's rank names in numeric order."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
from click.testing import CliRunner

from gputrace.cli import main
from gputrace.trace.model import Process, Trace, Track
from gputrace.viewer import data, findings

from .test_viewer import BASE, ROOT, STEP, make_trace, write_ranks


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


def test_others_median_is_the_median_of_the_others_on_random_columns() -> None:
    # Its whole-row arithmetic against the definition: each rank left out, the others' median
    # (the mean of the middle two, floored, for an even count), ties and large values included.
    import random

    rng = random.Random(20)
    for _ in range(2000):
        n, steps = rng.randint(1, 9), rng.randint(0, 6)
        busy = [[rng.choice([rng.randint(-3, 3), rng.randint(0, 10**15)]) for _ in range(steps)] for _ in range(n)]
        want = []
        for r in range(n):
            row = []
            for k in range(steps):
                v = sorted(busy[q][k] for q in range(n) if q != r) or [busy[r][k]]
                m = len(v)
                row.append(v[m // 2] if m % 2 else (v[m // 2 - 1] + v[m // 2]) // 2)
            want.append(row)
        assert findings.others_median(busy) == want, busy


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


def _report_doc(path: Path) -> dict[str, Any]:
    payload = re.search(r'id="gputrace-data">(.*?)</script>', path.read_text(), re.S)
    assert payload is not None
    return dict(orjson.loads(payload.group(1)))


def _warm_trace() -> Trace:
    """Three ranks, 20 steps, the first two 3x as long on every rank."""
    trace = make_trace(3, 20)
    sp = trace.spans
    for i in range(len(sp)):
        if sp.start[i] < BASE + 2 * STEP:
            sp.end[i] = sp.start[i] + 3 * (sp.end[i] - sp.start[i])
    return trace


def test_view_leaves_warm_up_out_unless_skip_steps_is_given(tmp_path: Path) -> None:
    paths = write_ranks(_warm_trace(), tmp_path)
    out = tmp_path / "auto.html"
    res = CliRunner().invoke(main, ["view", *paths, "--export", str(out)])
    assert res.exit_code == 0, res.output
    doc = _report_doc(out)
    assert doc["steps"]["skipped"] == 2 and doc["warmup_auto"] and "--skip-steps 0" in doc["notes"][0]
    kept = tmp_path / "kept.html"
    res = CliRunner().invoke(main, ["view", *paths, "--export", str(kept), "--skip-steps", "0"])
    assert res.exit_code == 0, res.output
    doc = _report_doc(kept)
    assert doc["steps"]["skipped"] == 0 and not doc["warmup_auto"]
    # The same through a real process.
    real = tmp_path / "real.html"
    done = subprocess.run(
        [sys.executable, "-m", "gputrace.cli", "view", *paths, "--export", str(real)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    doc = _report_doc(real)
    assert doc["steps"]["skipped"] == 2 and doc["phases"] == [] and doc["worst"] == []
    assert doc["steps"]["trend"]["work"] and len(doc["steps"]["trend"]["work"]) == 18


def test_the_trend_adds_up_to_the_mean_step_time() -> None:
    doc = data.document(make_trace(4, 10, {2: {3, 4}}))
    st = doc["steps"]
    tr = st["trend"]
    for k in range(st["count"]):
        total = tr["work"][k] + tr["idle"][k] + tr["transfer"][k] + tr["wait"][k]
        mean = sum(st["end"][s][k] - st["start"][s][k] for s in range(4)) / 4
        assert abs(total - mean) <= 4  # integer division per part
    # In the slow steps the others wait for rank 2: the waiting part grows, transfer does not.
    assert tr["wait"][3] > 10 * tr["wait"][0] and tr["transfer"][3] == tr["transfer"][0]
    assert st["coll_wait"][0][3] + st["coll_transfer"][0][3] == st["wait"][0][3]
    totals = st["totals"]
    assert totals["collective_wait_ns"][0] == sum(st["coll_wait"][0])
    cols = doc["stats"]["columns"]
    assert "self_total_ns" in cols
    by_name = {r[0]: r for r in doc["stats"]["names"]}
    assert by_name["compute"][cols.index("self_total_ns")] == by_name["compute"][cols.index("total_ns")]
