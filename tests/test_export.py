"""The exporter: golden output, exact timestamps, and overflow lanes for spans that cannot nest."""

from __future__ import annotations

import math
import os
import random
from pathlib import Path

import orjson

from gputrace.export import ProcessInfo, TrackInfo, build_trace, dumps, lay_out

GOLDEN = Path(__file__).parent / "golden"
BASE = 1_764_000_000_123_456_789


def small_trace() -> dict:
    tracks = [
        TrackInfo("thread MainThread (host)", False, None, 0),
        TrackInfo("cuda:0 default stream", True, 0, 0),
        TrackInfo("cuda:0 stream 1", True, 0, 1),
    ]
    names = ["step", "fwd", "copy", "late"]
    rows = [  # name, track, start, end, args
        (0, 1, BASE + 0, BASE + 10_000_001, {"step": 0}),
        (1, 1, BASE + 1, BASE + 4_000_000, None),
        (2, 2, BASE + 2_500, BASE + 3_000_999, None),
        (3, 1, BASE + 5_000_000, BASE + 12_000_000, {"note": "starts inside step, ends after it"}),
        (0, 0, BASE + 7, BASE + 9, None),
    ]
    process = ProcessInfo(2, 4, "rank 2 (node7, NVIDIA H200)", {"gputrace_version": "test"})
    return build_trace(
        names,
        [r[0] for r in rows],
        [r[1] for r in rows],
        [r[2] for r in rows],
        [r[3] for r in rows],
        [r[4] for r in rows],
        tracks,
        process,
    )


def test_golden_file() -> None:
    got = orjson.dumps(small_trace(), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
    golden = GOLDEN / "small_trace.json"
    if os.environ.get("REGEN_GOLDEN"):
        golden.write_bytes(got)
    assert got == golden.read_bytes()


def test_shape_perfetto_expects() -> None:
    t = small_trace()
    assert dumps(t).startswith(b'{"')
    assert t["baseTimeNanoseconds"] == BASE and t["distributedInfo"] == {"rank": 2, "world_size": 4}
    meta = {(e["name"], e["tid"]): e["args"] for e in t["traceEvents"] if e["ph"] == "M"}
    assert meta[("process_name", 0)] == {"name": "rank 2 (node7, NVIDIA H200)"}
    assert meta[("process_sort_index", 0)] == {"sort_index": 2}
    # Streams first, then their overflow lane, then host threads; no tid equals the pid (Perfetto
    # would draw that thread first as the process's main thread).
    tids = sorted(tid for (name, tid) in meta if name == "thread_name")
    order = [meta[("thread_name", tid)]["name"] for tid in tids]
    assert order == [
        "cuda:0 default stream",
        "cuda:0 default stream (overflow 1)",
        "cuda:0 stream 1",
        "thread MainThread (host)",
    ]
    assert 3 not in tids and [meta[("thread_sort_index", tid)]["sort_index"] for tid in tids] == tids
    assert all(e["pid"] == 3 for e in t["traceEvents"])


def test_timestamps_survive_perfettos_rounding_exactly() -> None:
    rng = random.Random(5)
    for _ in range(20_000):
        ns = rng.randrange(0, 10 * 3600 * 10**9)  # ten hours from the base
        ts = orjson.loads(orjson.dumps(ns / 1000))
        assert math.floor(ts * 1000 + 0.5) == ns  # Perfetto: llround(ts * 1000)


def test_misnested_span_goes_to_an_overflow_lane() -> None:
    # step [0, 10), fwd [1, 4) nest; late [5, 12) overlaps step partly: overflow.
    starts, ends = [0, 1, 5, 12], [10, 4, 12, 13]
    assert lay_out(starts, ends, list(range(4))) == [0, 0, 1, 0]


def test_lanes_nest_after_perfettos_sort_for_random_intervals() -> None:
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randrange(1, 40)
        starts = [rng.randrange(0, 50) for _ in range(n)]
        ends = [s + rng.randrange(0, 20) for s in starts]
        lanes = lay_out(starts, ends, list(range(n)))
        for lane in set(lanes):
            rows = sorted((i for i in range(n) if lanes[i] == lane), key=lambda i: (starts[i], -ends[i]))
            stack: list[int] = []
            for i in rows:
                while stack and stack[-1] <= starts[i]:
                    stack.pop()
                assert not stack or ends[i] <= stack[-1], "partial overlap on one lane"
                stack.append(ends[i])


def test_values_json_cannot_hold_are_written_not_fatal() -> None:
    tracks = [TrackInfo("t", False, None, 0)]
    weird = {"nan": float("nan"), "inf": float("inf"), "obj": object(), "surrogate": "\udc80", "html": "</script>"}
    t = build_trace(['na\u00efve "quoted"\n'], [0], [0], [BASE], [BASE + 5], [weird], tracks, ProcessInfo(0, 1, "r"))
    back = orjson.loads(dumps(t))
    args = next(e for e in back["traceEvents"] if e["ph"] == "X")["args"]
    assert args["html"] == "</script>" and args["obj"].startswith("<object")
    assert next(e for e in back["traceEvents"] if e["ph"] == "X")["name"] == 'na\u00efve "quoted"\n'


def test_c_encoder_and_layout_match_their_python_twins() -> None:
    from gputrace import export

    if export.encode_events is export._encode_events_py:
        return  # the C hot path is not built here (or GPUTRACE_PURE_PYTHON is set)
    rng = random.Random(11)
    n, ntracks = 3000, 4
    starts = [rng.randrange(0, 10**9) for _ in range(n)]
    ends = [s + rng.randrange(0, 10**7) for s in starts]
    track = [rng.randrange(ntracks) for _ in range(n)]
    assert export.layout(track, starts, ends, ntracks) == export._layout_py(track, starts, ends, ntracks)
    lanes, used = export.layout(track, starts, ends, ntracks)
    base = [1 + 10 * t for t in range(ntracks)]
    names = [export.dumps(x) for x in ["a", "b\u00e9", 'c"q']]
    idx = [rng.randrange(3) for _ in range(n)]
    cats = [b'"cuda"', b'"cpu"', b'"cuda"', b'"cpu"']
    args = [export.dumps({"i": i}) if i % 3 else None for i in range(n)]
    a = export.encode_events(names, idx, cats, track, lanes, base, 3, starts, ends, 0, args)
    b = export._encode_events_py(names, idx, cats, track, lanes, base, 3, starts, ends, 0, args)
    assert a == b
