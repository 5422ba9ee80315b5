"""Validation: does a trace file pass the rules Perfetto's JSON importer applies?

Takes: a trace file. Gives: a `Report` of problems (errors: Perfetto would drop, spill or
misplace something; warnings: it loads, but not as meant), checked the way the importer reads:
file shape, pid/tid ranges, non-negative times that survive `llround(ts * 1000)`, and per-track
nesting after its sort (by ts; at equal ts the longest first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gputrace.errors import TraceFormatError
from gputrace.traceio import read_trace

UINT32 = 2**32
MAX_EXACT_TS_US = 2**53 / 1000  # beyond this a double cannot hold every nanosecond


@dataclass
class Report:
    path: str
    spans: int = 0
    tracks: int = 0
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def validate_file(path: str, limit: int = 20) -> Report:
    """Check one file; at most `limit` problems of each kind are listed (the count is kept)."""
    report = Report(path)
    try:
        with open(path, "rb") as f:
            head = f.read(64).lstrip()
    except OSError as e:
        raise TraceFormatError(path, e.strerror or str(e)) from None
    if not (head.startswith(b'{"') or head.startswith(b"[{") or head.startswith(b"[ {") or head.startswith(b"[\n")):
        report.errors.append('file does not start with {" or [{ : Perfetto will not detect it as JSON')
    trace = read_trace(path)
    validate(trace, report, limit)
    return report


def validate(trace: dict[str, Any], report: Report, limit: int = 20) -> Report:
    errors: list[str] = []
    warnings: list[str] = []
    named_pids: set[Any] = set()
    pids: set[Any] = set()
    by_track: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    base = trace.get("baseTimeNanoseconds")
    if base is not None and not isinstance(base, int):
        errors.append("baseTimeNanoseconds is not an integer")
    meta = trace.get("metadata")
    if "traceEvents" in trace and meta is not None and not isinstance(meta, dict):
        errors.append("metadata is not an object")
    for i, e in enumerate(trace["traceEvents"]):
        if not isinstance(e, dict):
            errors.append(f"event {i}: not an object")
            continue
        ph = e.get("ph")
        if ph == "M":
            if e.get("name") == "process_name":
                named_pids.add(e.get("pid"))
            continue
        if ph != "X":
            continue
        pid, tid = e.get("pid"), e.get("tid")
        where = f"event {i} ({e.get('name')!r})"
        if not _uint32(pid) or not _uint32(tid):
            errors.append(f"{where}: pid/tid must be integers in 0..2^32-1, got {pid!r}/{tid!r}")
            continue
        if pid == 0:
            warnings.append(f"{where}: pid 0 is the kernel's swapper in Perfetto; gputrace uses rank + 1")
        pids.add(pid)
        if not isinstance(e.get("name"), str):
            errors.append(f"{where}: name is not a string")
        ts, dur = e.get("ts"), e.get("dur", 0)
        if not _number(ts) or not _number(dur):
            errors.append(f"{where}: ts/dur must be finite numbers, got {ts!r}/{dur!r}")
            continue
        if ts < 0:
            errors.append(f"{where}: negative ts {ts}")
        if dur < 0:
            errors.append(f"{where}: negative dur {dur}")
            continue
        if abs(ts) > MAX_EXACT_TS_US:
            warnings.append(f"{where}: ts {ts} us is too large for nanosecond precision; write it relative to a base")
        start = _llround(ts * 1000)
        end = start + _llround(dur * 1000)
        by_track.setdefault((pid, tid), []).append((start, end, i))
    for pid in sorted(pids - named_pids):
        warnings.append(f"pid {pid} has no process_name")
    for (pid, tid), spans in sorted(by_track.items()):
        spans.sort(key=lambda s: (s[0], -(s[1] - s[0])))
        stack: list[tuple[int, int, int]] = []
        for s in spans:
            while stack and stack[-1][1] <= s[0]:
                stack.pop()
            if stack and s[1] > stack[-1][1]:
                p = stack[-1]
                errors.append(
                    f"pid {pid} tid {tid}: event {s[2]} [{s[0]}, {s[1]}) ns partly overlaps event {p[2]} "
                    f"[{p[0]}, {p[1]}) ns: Perfetto drops it or moves it to an error track"
                )
                continue
            stack.append(s)
    report.spans = sum(len(v) for v in by_track.values())
    report.tracks = len(by_track)
    report.errors += errors[:limit] + ([f"... and {len(errors) - limit} more errors"] if len(errors) > limit else [])
    report.warnings += warnings[:limit] + ([f"... and {len(warnings) - limit} more"] if len(warnings) > limit else [])
    return report


def _uint32(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < UINT32


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _llround(x: float) -> int:
    return int(math.floor(x + 0.5)) if x >= 0 else -int(math.floor(-x + 0.5))


def format_report(r: Report) -> str:
    status = "ok" if r.ok else "INVALID"
    lines = [
        f"{r.path}: {status}: {r.spans} spans on {r.tracks} tracks"
        + (f", {len(r.errors)} errors" if r.errors else "")
        + (f", {len(r.warnings)} warnings" if r.warnings else "")
    ]
    lines += [f"  error: {m}" for m in r.errors]
    lines += [f"  warning: {m}" for m in r.warnings]
    return "\n".join(lines)
