"""Validation: will Perfetto load this trace the way it was meant?

Takes: a trace file (Chrome JSON written by gputrace or any other tool, Perfetto protobuf, or any
format in the registry), or a Chrome trace already parsed into a dict. Gives: a `Report` of errors
(Perfetto rejects the file, or drops, spills or misplaces events, and says so in its import
errors) and warnings (it loads, but not quite as meant).

A format whose module offers raw Chrome JSON events (`parse`, a capability in the registry) is
checked event by event by the rules below; any other format is read into the trace model, whose
spans must end after they start and nest on every track.

The rules are Perfetto's own, from its JSON importer (json_trace_tokenizer.cc, json_trace_parser.cc,
slice_tracker.cc, trace_sorter), not gputrace's habits, so another tool's trace that the UI loads
cleanly passes:
- Detection: the first 128 bytes with all whitespace removed start with `{"` or `[{"`.
- The object form must be complete; the array form may end anywhere (a streamed file).
- Every event is an object; a non-empty one has `ph`; all but metadata (`M`) events have a `ts`
  that is a number or a numeric string; `X` events have a numeric `dur`, not negative.
- Times are `ts * 1000` ns (exact for integers, `llround` otherwise); a negative one is dropped.
- pid/tid are strings (kept as names) or integers in 0..2^32-1 (others become 0); tid 0 means
  the pid's main thread.
- `X` events of one thread, sorted by start and at equal starts the longest first, must nest:
  one that partly overlaps an open one is spilled to an overflow track with an import error.
- A flow (`bind_id` with `flow_out` on its source, `flow_in` on its end) is drawn only when its
  source comes before its end in time: otherwise Perfetto drops the arrow without a word (a
  warning here).
For gputrace's own files its conventions are checked as well, as warnings (pid = rank + 1 and
never 0, named processes, no thread whose tid equals its pid, `"rank": R` findable by HTA).
"""

from __future__ import annotations

import itertools
import math
import re
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from gputrace.trace import registry
from gputrace.trace.files import read_bytes, read_head

UINT32 = 2**32
MAX_EXACT_TS_US = 2**53 / 1000  # beyond this a double cannot hold every nanosecond
SNIFF_BYTES = 128  # what Perfetto looks at to decide a file is JSON
HEAD_BYTES = 4096  # the file's first bytes: its detection, and the header HTA looks at
_JSON_NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?")
_HTA_RANK = re.compile(rb'"rank":\s+(\d+)')


@dataclass
class Report:
    path: str
    spans: int = 0
    tracks: int = 0
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    own: bool = False  # written by gputrace (its conventions were checked too)

    @property
    def ok(self) -> bool:
        return not self.errors


def validate_file(path: str, limit: int = 20) -> Report:
    """Check one file; at most `limit` problems of each kind are listed (the count is kept)."""
    data = read_head(path, HEAD_BYTES)
    report = Report(path)
    fmt = registry.detect(path, data[:64])
    parse = fmt.capability("parse", path)
    if parse is None:  # no raw Chrome events: what its reader makes of it
        return _validate_model(fmt, path, read_bytes(path), report, limit)
    sniff = bytes(b for b in data[:SNIFF_BYTES] if b not in b" \t\n\r\v\f")
    if not (sniff.startswith(b'{"') or sniff.startswith(b'[{"')):
        report.errors.append(
            'the file does not start with {" or [{" (whitespace aside): Perfetto will not recognise it as JSON'
        )
    header = _validate_batches(fmt, path, report, limit)
    if header is None:  # the whole file at once (a file cut inside an event, bytes not UTF-8, ...)
        header, events = parse(path, read_bytes(path))  # also a file cut off: its complete events
        trace: dict[str, Any] = {**header, "traceEvents": events}
        trace.setdefault("metadata", {})
        validate(trace, report, limit)
    complete = not header.get("_cut")
    if not complete and data.lstrip()[:1] == b"{":
        # The array form may lack its end (Perfetto reads it as a stream); the object form may not.
        report.errors.append(
            "the file ends before its closing brackets (cut off?): Perfetto reports the trace as incomplete"
        )
    if report.own and complete and data.lstrip()[:1] == b"{" and _is_rank_file(header):
        if not _HTA_RANK.search(data[:4096]):
            report.warnings.append('no "rank": R (with a space) in the header: HTA will not find this trace\'s rank')
    return report


def _is_rank_file(trace: dict[str, Any]) -> bool:
    meta = trace.get("metadata")
    return not (isinstance(meta, dict) and meta.get("merged"))


def _validate_batches(fmt: registry.Format, path: str, report: Report, limit: int) -> dict[str, Any] | None:
    """Check the file a batch of events at a time (`parse_batches`, where the format offers it),
    holding per event only what the nesting check needs; its header, or None when the file is
    to be checked whole (the report is then left as it was)."""
    batches = fmt.capability("parse_batches", path)
    if batches is None:
        return None
    checker: _Checker | None = None
    header: dict[str, Any] | None = None
    for src, events in batches(path):  # the last batch is empty, and the header whole
        if src.failed:
            return None
        header = src.header
        if checker is None:
            checker = _Checker(header, limit)
        checker.add(events)
    if checker is None or header is None:
        return None
    if checker.own != _own(header):
        return None  # the header that says whose file it is came after its events: check it whole
    checker.finish(header, report)
    return header


def validate(trace: dict[str, Any], report: Report, limit: int = 20) -> Report:
    """Check a parsed Chrome trace (`{"traceEvents": [...], ...}`) into `report`."""
    checker = _Checker(trace, limit)
    checker.add(trace["traceEvents"])
    return checker.finish(trace, report)


def _own(trace: dict[str, Any]) -> bool:
    meta = trace.get("metadata")
    return isinstance(meta, dict) and ("gputrace_version" in meta or bool(meta.get("merged")))


class _Capped:
    """The first `limit` messages and how many there were (what `_capped` reports)."""

    def __init__(self, limit: int) -> None:
        self.items: list[str] = []
        self.limit = limit
        self.n = 0

    def append(self, msg: str) -> None:
        self.n += 1
        if len(self.items) < self.limit:
            self.items.append(msg)

    def out(self, what: str) -> list[str]:
        more = self.n - len(self.items)
        return self.items + ([f"... and {more} more {what}"] if more > 0 else [])


class _Thread:
    """One thread's X events: start and end ns, and the event's index, in columns."""

    __slots__ = ("start", "end", "index")

    def __init__(self) -> None:
        self.start: Any = array("q")
        self.end: Any = array("q")
        self.index = array("q")

    def add(self, start: int, end: int, i: int) -> None:
        try:
            self.start.append(start)
        except OverflowError:  # past 64 bits of ns: this thread's times as Python ints
            self.start, self.end = list(self.start), list(self.end)
            self.start.append(start)
        try:
            self.end.append(end)
        except OverflowError:
            self.start, self.end = list(self.start), list(self.end)
            self.end.append(end)
        self.index.append(i)


class _Checker:
    """The rules, checked event by event as batches of a file's events come (`add`), with the
    nesting of each thread's X events checked at the end (`finish`)."""

    def __init__(self, trace: dict[str, Any], limit: int) -> None:
        self.limit = limit
        self.own = _own(trace)
        self.errors = _Capped(limit)
        self.warnings = _Capped(limit)
        self.named_pids: set[Any] = set()
        self.pids: set[Any] = set()
        self.main_threads: set[Any] = set()
        self.by_thread: dict[tuple[Any, Any], _Thread] = {}
        self.flows: dict[str, dict[Any, tuple[int, int]]] = {"out": {}, "in": {}}  # bind_id -> (ts, event)
        self.i = 0  # the index of the next event in the file

    def add(self, events: list[Any]) -> None:
        errors, warnings, own = self.errors, self.warnings, self.own
        named_pids, pids, main_threads, by_thread = self.named_pids, self.pids, self.main_threads, self.by_thread
        for i, e in enumerate(events, self.i):
            if not isinstance(e, dict):
                errors.append(f"event {i}: not a JSON object: Perfetto stops reading the file here")
                continue
            ph = e.get("ph")
            if not ph:
                if e:
                    errors.append(f"event {i}: no 'ph': Perfetto drops it")
                continue
            if ph == "M":
                if e.get("name") == "process_name":
                    named_pids.add(_key(e.get("pid")))
                continue
            where = f"event {i} ({e.get('name')!r})"
            pid = _id(e.get("pid"))
            tid = _id(e.get("tid"))
            if ph == "X":
                raw_pid, raw_tid = e.get("pid"), e.get("tid")
                if _out_of_range(raw_pid) or _out_of_range(raw_tid):
                    errors.append(
                        f"{where}: pid/tid must be integers in 0..2^32-1 (or strings), got {raw_pid!r}/{raw_tid!r}: "
                        "Perfetto turns others into 0"
                    )
                for label, raw, key in (("pid", raw_pid, pid), ("tid", raw_tid, tid)):
                    if key is None:
                        warnings.append(f"{where}: {label} {raw!r} is not a number or string: Perfetto uses 0")
            ts = _to_ns(e.get("ts"))
            if ts is None:
                errors.append(f"{where}: ts {e.get('ts')!r} is not a number: Perfetto drops the event")
                continue
            if ts < 0:
                errors.append(f"{where}: negative ts {e.get('ts')}: Perfetto drops events before time 0")
                continue
            if isinstance(e.get("ts"), float) and abs(e["ts"]) > MAX_EXACT_TS_US:
                warnings.append(
                    f"{where}: ts {e['ts']} us is too large for nanosecond precision; write it relative to a base"
                )
            if ph != "X":
                continue
            if "dur" not in e:
                errors.append(f"{where}: an X event without dur: Perfetto drops it")
                continue
            dur = _to_ns(e.get("dur"))
            if dur is None:
                errors.append(f"{where}: dur {e.get('dur')!r} is not a number: Perfetto drops the event")
                continue
            if dur < 0:
                errors.append(f"{where}: negative dur {e.get('dur')}: Perfetto drops the slice")
                continue
            if not isinstance(e.get("name"), str):
                warnings.append(f"{where}: name is not a string: the slice has no name")
            pid = pid if pid is not None else ("n", 0)
            tid = tid if tid is not None else ("n", 0)
            if tid == ("n", 0) and pid != ("n", 0):
                tid = pid  # Perfetto: tid 0 is the process's main thread
            if own:
                if pid == ("n", 0):
                    warnings.append(f"{where}: pid 0 is the kernel's swapper in Perfetto; gputrace uses rank + 1")
                elif tid == pid:
                    main_threads.add(pid)
            pids.add(_key(e.get("pid")))
            th = by_thread.get((pid, tid))
            if th is None:
                th = by_thread[(pid, tid)] = _Thread()
            th.add(ts, ts + dur, i)
            if "bind_id" in e:
                _flow(e, ts, i, self.flows)
        self.i += len(events)

    def finish(self, trace: dict[str, Any], report: Report) -> Report:
        """The checks that need every event, and the findings into `report`; `trace`: the
        file's top-level keys."""
        errors, warnings, own = self.errors, self.warnings, self.own
        report.own = own
        base = trace.get("baseTimeNanoseconds")
        if own and base is not None and (not isinstance(base, int) or isinstance(base, bool)):
            # Said first, as it is of the whole file.
            errors.items.insert(0, "baseTimeNanoseconds is not an integer")
            errors.n += 1
            del errors.items[self.limit :]
        if own:
            for pid in sorted(self.pids - self.named_pids, key=repr):
                warnings.append(f"pid {pid!r} has no process_name")
            for pid in sorted(self.main_threads, key=repr):
                warnings.append(f"pid {pid[1]!r}: a thread whose tid equals the pid is drawn first, as the main thread")
        spans = 0
        for (pid, tid), th in sorted(self.by_thread.items(), key=lambda kv: repr(kv[0])):
            start, end, index = th.start, th.end, th.index
            spans += len(index)
            order = sorted(range(len(index)), key=lambda j: (start[j], start[j] - end[j]))
            stack: list[int] = []  # positions of the open events
            for j in order:
                s = start[j]
                while stack and end[stack[-1]] <= s:
                    stack.pop()
                if stack and end[j] > end[stack[-1]]:
                    p = stack[-1]
                    errors.append(
                        f"pid {pid[1]!r} tid {tid[1]!r}: event {index[j]} [{s}, {end[j]}) ns partly overlaps event "
                        f"{index[p]} [{start[p]}, {end[p]}) ns: Perfetto moves it to an overflow track and reports an "
                        "import error"
                    )
                    continue
                stack.append(j)
        sources = self.flows["out"]
        for flow, (ts, i) in sorted(self.flows["in"].items(), key=lambda kv: kv[1][1]):
            src = sources.get(flow)
            if src is None or src[0] >= ts:
                where = "has no source" if src is None else f"starts at or after it (event {src[1]})"
                warnings.append(f"event {i}: its flow (bind_id {flow!r}) {where}: Perfetto draws no arrow")
        report.spans += spans
        report.tracks += len(self.by_thread)
        report.errors += errors.out("errors")
        report.warnings += warnings.out("warnings")
        return report


def _flow(e: dict[str, Any], ts: int, i: int, flows: dict[str, dict[Any, tuple[int, int]]]) -> None:
    """Note an X event's flow ends (v2: `bind_id` with `flow_out` / `flow_in`)."""
    try:
        hash(e["bind_id"])
    except TypeError:
        return
    for side in ("out", "in"):
        if e.get(f"flow_{side}") is True:
            flows[side].setdefault(e["bind_id"], (ts, i))


def _validate_model(fmt: registry.Format, path: str, data: bytes, report: Report, limit: int) -> Report:
    """A file of a format without raw Chrome events (Perfetto protobuf, say): readable, and its
    slices nest and run forwards on each track. Read without the spans' arguments where the
    format can (`read_spans`), and checked on the columns a track at a time (memory: the columns
    and one track's order, not a tuple a span)."""
    read = fmt.capability("read_spans", path) or fmt.read
    trace = read(path, data)
    report.own = "gputrace_version" in trace.metadata or bool(trace.metadata.get("merged"))
    errors: list[str] = []
    sp = trace.spans
    start, end = sp.start, sp.end
    negative: set[int] = set()
    # Any span that ends before it starts, found at C speed; the per-row loop runs only then.
    if len(sp) and min(map(int.__sub__, end, start)) < 0:
        negative = {i for i in range(len(sp)) if end[i] < start[i]}
        for i in sorted(negative):
            errors.append(f"span {i} ({trace.names[sp.name[i]]!r}) ends before it starts")
    per_track = list(_track_rows(sp.track))
    if negative:  # without those spans; tracks in the order of their first span left
        kept = [(t, [i for i in rows if i not in negative]) for t, rows in per_track]
        per_track = sorted(((t, rows) for t, rows in kept if rows), key=lambda tr: tr[1][0])
    tracks = 0
    for t, rows in per_track:
        tracks += 1
        # By start, the longer first at equal starts, then in file order: two stable sorts.
        order = list(rows)
        order.sort(key=end.__getitem__, reverse=True)
        order.sort(key=start.__getitem__)
        stack: list[int] = []
        for i in order:
            s, e = start[i], end[i]
            while stack and stack[-1] <= s:
                stack.pop()
            if stack and e > stack[-1]:
                errors.append(f"track {trace.tracks[t].name!r}: span {i} partly overlaps the span it starts in")
                continue
            stack.append(e)
        del order
    report.spans = len(sp)
    report.tracks = tracks
    report.errors += _capped(errors, limit, "errors")
    return report


def _track_rows(track: Sequence[int]) -> Iterator[tuple[int, Sequence[int]]]:
    """Each track's rows, tracks in the order they first appear: as ranges where a track's rows
    are one run (a reader that builds its columns a track at a time), else as lists."""
    runs: list[tuple[int, int, int]] = []  # (track, first row, past the last)
    at = 0
    for t, group in itertools.groupby(track):
        n = sum(1 for _ in group)
        runs.append((t, at, at + n))
        at += n
    if len({t for t, _, _ in runs}) == len(runs):
        for t, lo, hi in runs:
            yield t, range(lo, hi)
        return
    rows: dict[int, list[int]] = {}
    for t, lo, hi in runs:
        rows.setdefault(t, []).extend(range(lo, hi))
    yield from rows.items()


def _capped(items: list[str], limit: int, what: str) -> list[str]:
    return items[:limit] + ([f"... and {len(items) - limit} more {what}"] if len(items) > limit else [])


def _to_ns(v: Any) -> int | None:
    """A `ts`/`dur` as Perfetto reads it (CoerceToTs): integers exactly, other numbers by
    llround(x * 1000), numeric strings as the number they hold; anything else is None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v * 1000 if -(2**63) <= v < 2**63 else None  # Perfetto reads 64-bit integers only
    if isinstance(v, float):
        if not math.isfinite(v):
            return None
        return int(v) * 1000 if v == math.trunc(v) else _llround(v * 1000)
    if isinstance(v, str) and len(v) <= 400 and _JSON_NUMBER.fullmatch(v):  # longer: past any double
        return _to_ns(float(v) if any(c in v for c in ".eE") else int(v))
    return None


def _key(v: Any) -> Any:
    """A pid as a set member: a list or object (which Perfetto reads as 0) by its text."""
    try:
        hash(v)
    except TypeError:
        return ("unhashable", type(v).__name__)
    return v


def _id(v: Any) -> tuple[str, Any] | None:
    """A pid/tid as Perfetto keys it: strings by name, integers in uint32 range as themselves,
    others in range after truncation, out of range as 0; None when it cannot be read at all."""
    if isinstance(v, str):
        return ("s", v)
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, int):
        return ("n", v if 0 <= v < UINT32 else 0)
    if isinstance(v, float) and math.isfinite(v):
        n = int(v)
        return ("n", n if 0 <= n < UINT32 else 0)
    return None


def _out_of_range(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not (0 <= v < UINT32)


def _llround(x: float) -> int:
    return int(math.floor(x + 0.5)) if x >= 0 else -int(math.floor(-x + 0.5))


def format_report(r: Report) -> str:
    status = "ok" if r.ok else "INVALID"
    lines = [
        f"{r.path}: {status}: {_count(r.spans, 'span')} on {_count(r.tracks, 'track')}"
        + (f", {_count(len(r.errors), 'error')}" if r.errors else "")
        + (f", {_count(len(r.warnings), 'warning')}" if r.warnings else "")
    ]
    lines += [f"  error: {m}" for m in r.errors]
    lines += [f"  warning: {m}" for m in r.warnings]
    return "\n".join(lines)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")
