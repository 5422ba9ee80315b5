"""Exporting: resolved spans -> Chrome trace JSON that Perfetto imports without complaint.

Takes: a `SpanStore` (int epoch ns), its tracks and the process description.
Gives: the trace as a dict (`build_trace`) and bytes (`dumps`), written atomically by `write`.

Perfetto's importer sorts events by `ts` (equal `ts`: longest `dur` first) and drops or spills
any slice that partly overlaps another on its thread. `lay_out` assigns spans to lanes in the
same order, so a span that cannot nest on its track (misuse: an outer span ended before an
inner one, two threads on one stream) goes to an overflow track beside it, never to the bin.
`ts` is written relative to `baseTimeNanoseconds` as int ns / 1000, which Perfetto's
`llround(ts * 1000)` turns back into the exact nanosecond.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from gputrace.traceio import write_atomic


@dataclass(frozen=True)
class TrackInfo:
    name: str
    cuda: bool
    device: int | None
    ordinal: int


@dataclass(frozen=True)
class ProcessInfo:
    rank: int
    world_size: int
    label: str  # e.g. "rank 0 (host, NVIDIA H200)"
    metadata: dict[str, Any] = field(default_factory=dict)


def lay_out(starts: Sequence[int], ends: Sequence[int], rows: list[int]) -> list[int]:
    """Lane of each row (0 = the track itself, n = its n-th overflow) such that on every lane
    spans nest, visited in Perfetto's import order."""
    rows = sorted(rows, key=lambda i: (starts[i], starts[i] - ends[i]))
    lanes: list[list[int]] = []  # per lane: ends of the open spans, innermost last
    lane_of: dict[int, int] = {}
    for i in rows:
        s, e = starts[i], ends[i]
        for n, open_ends in enumerate(lanes):
            while open_ends and open_ends[-1] <= s:  # ended: [start, end) slices
                open_ends.pop()
            if not open_ends or open_ends[-1] >= e:
                open_ends.append(e)
                lane_of[i] = n
                break
        else:
            lanes.append([e])
            lane_of[i] = len(lanes) - 1
    return [lane_of[i] for i in range(len(starts))]


def build_trace(
    names: Sequence[str],
    name_idx: Sequence[int],
    track_idx: Sequence[int],
    starts: Sequence[int],
    ends: Sequence[int],
    args: Sequence[dict[str, Any] | None],
    tracks: Sequence[TrackInfo],
    process: ProcessInfo,
    base_ns: int | None = None,
) -> dict[str, Any]:
    """The trace as a dict in Chrome JSON object form."""
    n = len(starts)
    if base_ns is None:
        base_ns = min(starts) if n else 0
    pid = process.rank + 1
    by_track: dict[int, list[int]] = {}
    for i in range(n):
        by_track.setdefault(track_idx[i], []).append(i)
    lane = [0] * n
    lanes_used: dict[int, int] = {}
    for t, rows in by_track.items():
        sub = lay_out([starts[i] for i in rows], [ends[i] for i in rows], list(range(len(rows))))
        for j, i in enumerate(rows):
            lane[i] = sub[j]
        lanes_used[t] = max(sub) + 1

    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": process.label}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": process.rank}},
    ]
    # CUDA streams first, by device and stream; then host threads. Overflow lanes sit beside
    # their track.
    order = sorted(range(len(tracks)), key=lambda t: (not tracks[t].cuda, tracks[t].device or 0, tracks[t].ordinal))
    tid_of: dict[tuple[int, int], int] = {}
    for t in order:
        for k in range(lanes_used.get(t, 1)):
            tid = len(tid_of) + 1
            tid_of[(t, k)] = tid
            label = tracks[t].name if k == 0 else f"{tracks[t].name} (overflow {k})"
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    cats = ["cuda" if t.cuda else "cpu" for t in tracks]
    for i in range(n):
        s = starts[i]
        ev: dict[str, Any] = {
            "ph": "X",
            "cat": cats[track_idx[i]],
            "name": names[name_idx[i]],
            "pid": pid,
            "tid": tid_of[(track_idx[i], lane[i])],
            "ts": (s - base_ns) / 1000,
            "dur": (ends[i] - s) / 1000,
        }
        a = args[i]
        if a:
            ev["args"] = a
        events.append(ev)
    meta = dict(process.metadata)
    meta["overflow_tracks"] = sum(v - 1 for v in lanes_used.values())
    # The header first: `gputrace merge` reads it without parsing the events.
    return {
        "baseTimeNanoseconds": base_ns,
        "distributedInfo": {"rank": process.rank, "world_size": process.world_size},
        "metadata": meta,
        "displayTimeUnit": "ns",
        "traceEvents": events,
    }


def dumps(trace: dict[str, Any]) -> bytes:
    """JSON bytes. Values JSON cannot hold (NaN, infinities, arbitrary objects, lone
    surrogates) are written as their string form rather than failing the save."""
    try:
        return orjson.dumps(trace, default=_fallback)
    except (TypeError, orjson.JSONEncodeError):
        return orjson.dumps(_clean(trace), default=_fallback)


def write(path: str, trace: dict[str, Any]) -> None:
    write_atomic(path, dumps(trace))


def _fallback(value: Any) -> Any:
    return repr(value)


def _clean(value: Any) -> Any:
    if isinstance(value, dict):
        return {_clean_str(str(k)): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, str):
        return _clean_str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return value


def _clean_str(s: str) -> str:
    return s.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
