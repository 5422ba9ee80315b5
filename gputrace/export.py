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
import os
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
    order = sorted((starts[i], starts[i] - ends[i], j) for j, i in enumerate(rows))
    lanes: list[list[int]] = []  # per lane: ends of the open spans, innermost last
    lane_of = [0] * len(rows)  # aligned with `rows`
    for s, neg_dur, i in order:
        e = s - neg_dur
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
    return lane_of


def encode_trace(
    names: Sequence[str],
    name_idx: Sequence[int],
    track_idx: Sequence[int],
    starts: Sequence[int],
    ends: Sequence[int],
    args: Sequence[dict[str, Any] | None],
    tracks: Sequence[TrackInfo],
    process: ProcessInfo,
    base_ns: int | None = None,
) -> bytes:
    """The trace as Chrome JSON (object form) bytes. Spans are encoded straight from the columns
    (no dict per event): ts and dur are written as exact decimals of integer nanoseconds."""
    n = len(starts)
    if base_ns is None:
        base_ns = min(starts) if n else 0
    pid = process.rank + 1
    starts, ends, track_idx = list(starts), list(ends), list(track_idx)
    lane, lanes_used = layout(track_idx, starts, ends, len(tracks))
    meta_events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": process.label}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": process.rank}},
    ]
    # CUDA streams first, by device and stream; then host threads. Overflow lanes sit beside
    # their track.
    order = sorted(range(len(tracks)), key=lambda t: (not tracks[t].cuda, tracks[t].device or 0, tracks[t].ordinal))
    # Perfetto takes the thread whose tid equals the pid for the "main thread" and draws it
    # first, whatever its sort index: the tids are numbered past the pid when they would meet it.
    n_tids = sum(lanes_used[t] for t in order)
    tid = pid if pid <= n_tids else 0
    tid_base = [0] * len(tracks)
    for t in order:
        tid_base[t] = tid + 1
        for k in range(lanes_used[t]):
            tid += 1
            label = tracks[t].name if k == 0 else f"{tracks[t].name} (overflow {k})"
            meta_events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}})
            meta_events.append(
                {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
            )
    cats = [b'"cuda"' if t.cuda else b'"cpu"' for t in tracks]
    name_json = [dumps(nm) for nm in names]
    try:  # one pass at C speed; item by item only when some value needs cleaning
        args_json = [orjson.dumps(a, default=_fallback) if a else None for a in args]
    except (TypeError, orjson.JSONEncodeError):
        args_json = [dumps(a) if a else None for a in args]
    body = encode_events(
        name_json, list(name_idx), cats, track_idx, lane, tid_base, pid, starts, ends, base_ns, args_json
    )
    meta = dict(process.metadata)
    meta["overflow_tracks"] = sum(v - 1 for v in lanes_used)
    # The header first: `gputrace merge` reads it without parsing the events.
    header = {
        "baseTimeNanoseconds": base_ns,
        "distributedInfo": {"rank": process.rank, "world_size": process.world_size},
        "metadata": meta,
        "displayTimeUnit": "ns",
    }
    out = dumps(header)[:-1] + b',"traceEvents":[' + dumps(meta_events)[1:-1]
    return out + (b"," + body if body else b"") + b"]}"


def build_trace(*columns: Any, **kw: Any) -> dict[str, Any]:
    """The trace as a dict (what `encode_trace` writes, read back)."""
    return orjson.loads(encode_trace(*columns, **kw))


def _layout_py(track_idx: list[int], starts: list[int], ends: list[int], ntracks: int) -> tuple[list[int], list[int]]:
    """The pure-Python twin of the C layout: each span's lane, and lanes used per track."""
    by_track: dict[int, list[int]] = {}
    for i, t in enumerate(track_idx):
        by_track.setdefault(t, []).append(i)
    lane = [0] * len(starts)
    used = [1] * ntracks
    for t, rows in by_track.items():
        sub = lay_out(starts, ends, rows)
        for i, k in zip(rows, sub):
            lane[i] = k
        used[t] = max(sub) + 1
    return lane, used


def _encode_events_py(
    name_json: list[bytes],
    name_idx: list[int],
    cats: list[bytes],
    track_idx: list[int],
    lanes: list[int],
    tid_base: list[int],
    pid: int,
    starts: list[int],
    ends: list[int],
    base: int,
    args_json: list[bytes | None],
) -> bytes:
    """The pure-Python twin of the C encoder: X events separated by commas."""
    pid_b = str(pid).encode()
    parts = []
    for i, s in enumerate(starts):
        ts, dur = s - base, ends[i] - s
        if ts < 0 or dur < 0:
            raise ValueError("encode_events: a span starts before the base or ends before it starts")
        a = args_json[i]
        parts.append(
            b'{"ph":"X","cat":%s,"name":%s,"pid":%s,"tid":%d,"ts":%d.%03d,"dur":%d.%03d%s}'
            % (
                cats[track_idx[i]],
                name_json[name_idx[i]],
                pid_b,
                tid_base[track_idx[i]] + lanes[i],
                ts // 1000,
                ts % 1000,
                dur // 1000,
                dur % 1000,
                b',"args":' + a if a else b"",
            )
        )
    return b",".join(parts)


try:
    if os.environ.get("GPUTRACE_PURE_PYTHON", "") not in ("", "0"):
        raise ImportError("GPUTRACE_PURE_PYTHON is set")
    from gputrace._hot import encode_events, layout
except ImportError:
    encode_events, layout = _encode_events_py, _layout_py


def dumps(value: Any) -> bytes:
    """JSON bytes. Values JSON cannot hold (NaN, infinities, arbitrary objects, lone
    surrogates) are written as their string form rather than failing the save."""
    try:
        return orjson.dumps(value, default=_fallback)
    except (TypeError, orjson.JSONEncodeError):
        return orjson.dumps(_clean(value), default=_fallback)


def write(path: str, data: bytes | dict[str, Any]) -> None:
    write_atomic(path, data if isinstance(data, bytes) else dumps(data))


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
