"""Chrome trace JSON: the one reader and the one writer of the format.

Takes: a file (gputrace's own object form, the array form, a file cut off at any byte, or
another tool's trace such as torch.profiler's) or a `Trace`. Gives: a `Trace` (`read`), or the
trace as JSON written atomically (`write`), or appended flush by flush (`StreamWriter`).

What the writer guarantees, because Perfetto's importer punishes the alternatives:
- `ts` is relative to `baseTimeNanoseconds`, written as an exact decimal of integer ns (ns /
  1000 with three decimals), so Perfetto's `llround(ts * 1000)` returns the exact nanosecond.
- Spans on one written track nest: a span that cannot nest where it is (misuse: an outer span
  closed before an inner one, two threads on one stream) goes to an overflow track beside it.
- pid = rank + 1 (pid 0 is Perfetto's kernel "swapper"), named with `process_name` and ordered
  by rank; tracks are small tids named with `thread_name`, never equal to the pid (Perfetto
  draws the tid that equals the pid first, as the "main thread"). The pids, tids and lanes
  come from `layout.py`, which the Perfetto writer shares, so both formats draw the same tracks.
- `"rank": R` is written with a space after the colon, the way Kineto writes it: HTA finds a
  trace's rank with the pattern `"rank":\\s+(\\d+)`.

Streaming (`StreamWriter`): while recording, the file is the array form `[{...},\\n{...},\\n`,
which Perfetto and this reader load even without its closing bracket, so a process killed at any
instant leaves a loadable file. The header travels as a `gputrace` metadata event. `finish()`
rewrites the file atomically into the object form (header first, then the same event bytes).

Reading parses the events a batch at a time (`Batches`, cut at events' ends) and turns each batch
into columns before the next (`_Builder`): memory holds the columns and one batch. A file of a
shape that this does not take (cut inside an event, bytes that are not UTF-8, a number past a
double) is parsed whole, as it always was.

Beyond what every format offers (see `registry.py`), `parse` gives a file's raw events, and
`parse_batches` the same a batch at a time, which `validate` checks against the rules of
Perfetto's JSON importer.
"""

from __future__ import annotations

import collections
import functools
import io
import json
import os
import re
import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, BinaryIO

import orjson

from gputrace import native
from gputrace.errors import TraceFormatError
from gputrace.trace.files import AppendFile, atomic_writer, open_regular, read_bytes, read_head, writes_behind
from gputrace.trace.layout import (
    CUDA_TRACK,
    ENTRY_ARG,
    LAUNCH_CAT,
    LAUNCH_SORT,
    LAUNCH_TRACK,
    ProcessLayout,
    entries_range,
    is_columns,
    lane_name,
    lane_sort,
    launch_at,
    launch_rows,
    pid_key,
    plan_write,
    update_header,
)
from gputrace.trace.layout import Layout as Layout  # re-exported: the writer lays spans out with it
from gputrace.trace.layout import dumps as dumps  # re-exported: the one JSON dump every writer uses
from gputrace.trace.model import Process, Trace, Track, _NoCats

# The C encoder of span events (same output as the Python loop below), and the C encoder of a
# piece of a recorder's columns (same bytes again; its lanes: layout.py); None: the Python loops.
_encode_events: Any = None
_encode_rows: Any = None
# The reader's C loop over plain X events (csrc/readx.c; the loop in `_Builder.add` is its twin),
# where the columns it fills take 8-byte items.
_read_x_rows: Any = None


def _bind(hot: Any) -> None:
    global _encode_events, _encode_rows, _read_x_rows
    _encode_events, _encode_rows = (hot.encode_events, hot.encode_rows) if hot is not None else (None, None)
    fits = array("l").itemsize == 8
    _read_x_rows = getattr(hot, "read_x_rows", None) if hot is not None and fits else None


native.on_switch(_bind)

# ---- reading ------------------------------------------------------------------------------------


def read(path: str, data: bytes | None = None) -> Trace:
    """Parse a Chrome trace file into a `Trace`. Raises `TraceFormatError` with the reason when
    the file is not a trace; a file cut off mid-write loses only its last, incomplete event.

    The events are parsed a batch at a time and become columns as they come (`_read_batches`),
    so memory holds the columns and one batch, not the file and an object per event; a file
    whose shape that path does not take (bytes that are not UTF-8, numbers past a double, a
    header that changes after the events begin) is parsed whole, as before."""
    return _read(path, data, None)


def read_spans(path: str, data: bytes | None = None, keys: Iterable[str] | None = None) -> Trace:
    """`read`, keeping of the spans' arguments only those named in `keys`, and no categories: for
    a stage that looks at nothing else (the statistics: `collective`, `unfinished`, `cover`).
    Each span's args is a dict of the named ones it has, else None, and its category None, in
    plain lists (which merge moves into its trace rather than copying); `keys` None: neither
    column takes memory (columns of None). Memory: the columns, not an args dict a span."""
    return _read(path, data, frozenset(keys or ()), lists=keys is not None)


def _read(path: str, data: bytes | None, keys: frozenset[str] | None, lists: bool = True) -> Trace:
    """`read` (`keys` None), or `read_spans` (the arguments named in `keys` only)."""
    if data is None:
        with open_regular(path) as f:
            trace = _read_batches(path, f, keys)
        if trace is None:
            data = read_bytes(path)
    else:
        trace = _read_batches(path, io.BytesIO(data), keys)
    if trace is None:
        assert data is not None
        header, events = parse(path, data)
        trace = _build(path, header, events, keys)
        del events
    if keys is not None and not lists:
        trace.spans.args, trace.spans.cat = _NoCats(len(trace.spans)), _NoCats(len(trace.spans))
    return trace


#: Bytes read and parsed at a time by `Batches` (~11,000 of gputrace's events).
BATCH_BYTES = 1 << 20
#: How far into a file its header may reach before `"traceEvents"` (else: parsed whole).
HEADER_BYTES = 1 << 20
_WS = b" \t\n\r"
# The end of an event followed by the comma before the next: where a batch may be cut. A cut
# inside a string or a nested object makes the batch fail to parse, and the one before is tried.
_EVENT_END = re.compile(rb"\}[ \t\n\r]*,")


def _read_batches(path: str, f: BinaryIO, keys: frozenset[str] | None = None) -> Trace | None:
    """The trace of `f`, built batch by batch (`Batches`); None when the file is not of a shape
    that path takes (then it is parsed whole). `keys`: as `read_spans`."""
    src = Batches(path, f)
    builder: _Builder | None = None
    for events in src:
        if builder is None:
            try:
                builder = _Builder(path, src.header, keys)
            except TraceFormatError:
                return None  # `parse` reads the whole header, and says what is wrong with it
        builder.add(events)
    if src.failed:
        return None
    try:
        final = _Builder(path, src.header)
    except TraceFormatError:
        return None
    if builder is None:
        builder = final
    elif final.facts[0] != builder.facts[0]:
        return None  # the time base the events were read with was not the file's
    return builder.finish(final)


class Batches:
    """A Chrome JSON file's raw events, BATCH_BYTES of the file parsed at a time, each batch cut
    at an event's end: iterate for the batches, in file order. `header` is the file's top-level
    keys (a streamed file's `gputrace` events joined into it as they come: whole once iterated,
    and `"_cut": True` for a streamed file left unfinished). `failed`: the file is not of a shape
    this reads (not UTF-8, a number past a double, cut inside an event, ...): whatever was given
    is to be dropped and the file parsed whole (`parse`)."""

    def __init__(self, path: str, f: BinaryIO) -> None:
        self.path = path
        self.f = f
        self.header: dict[str, Any] = {}
        self.failed = False

    def __iter__(self) -> Iterator[list[Any]]:
        f = self.f
        head = f.read(HEADER_BYTES)
        body = head.lstrip(_WS)
        header = self.header
        if body[:1] == b"[":
            obj = False
            buf = body[1:]
        elif body[:1] == b"{":
            cut = body.find(b'"traceEvents"')
            if cut < 0:
                self.failed = True
                return
            lead = body[:cut].rstrip(_WS)
            try:
                found = orjson.loads(lead.rstrip(b",") + b"}") if lead != b"{" else {}
            except orjson.JSONDecodeError:
                found = None
            rest = body[cut + len(b'"traceEvents"') :].lstrip(_WS)
            if not isinstance(found, dict) or "traceEvents" in found or rest[:1] != b":":
                self.failed = True
                return
            rest = rest[1:].lstrip(_WS)
            if rest[:1] != b"[":
                self.failed = True
                return
            header.update(found)
            obj, buf = True, rest[1:]
        else:
            self.failed = True
            return
        guess = None
        if obj and "baseTimeNanoseconds" not in header:
            guess = _trailing_base(f)  # Kineto writes it after the events
            if guess is not None:
                header["baseTimeNanoseconds"] = guess
        given = False
        eof = False
        while True:
            if not eof:
                more = f.read(BATCH_BYTES)
                eof = not more
                buf += more
            events, buf = _batch(buf, eof)
            if events is None:
                if eof:
                    break
                if len(buf) >= BATCH_BYTES:  # a batch's worth with no event end that parses: not for this path
                    self.failed = True
                    return
                continue
            if not obj:  # a streamed file's header travels in its `gputrace` events
                _header_events(header, events)
            given = True
            yield events
        # What is left: the last events and the end of the array (and of the object). A file cut
        # off inside an event, or anything else this does not take, is parsed whole.
        last, tail = _last_events(buf, obj)
        if last is None or (tail is not None and ("traceEvents" in tail or (given and not last))):
            self.failed = True  # (no event after the last cut: a comma before the `]`, which JSON refuses)
            return
        if not obj:
            _header_events(header, last)
            if tail is None:
                header["_cut"] = True  # a streamed file whose writer did not finish it
        elif tail:
            header.update(tail)
        if guess is not None and (tail is None or tail.get("baseTimeNanoseconds") != guess):
            self.failed = True  # the look at the file's end was wrong: what came was read with another base
            return
        if last:
            yield last


def parse_batches(path: str) -> Iterator[tuple[Batches, list[Any]]]:
    """The events of the file at `path` batch by batch, each with the `Batches` that gives them
    (its `header` and `failed`), and last an empty batch, once the header is whole; what
    `validate` checks a large file with, holding one batch."""
    with open_regular(path) as f:
        src = Batches(path, f)
        for events in src:
            yield src, events
        yield src, []  # the end: the header whole, or `failed`


def _header_events(header: dict[str, Any], events: list[Any]) -> None:
    for e in events:
        if type(e) is dict and e.get("ph") == "M" and e.get("name") == "gputrace":
            update_header(header, e.get("args"))


_TRAILING_BASE = re.compile(rb'"baseTimeNanoseconds"[ \t\n\r]*:[ \t\n\r]*(-?\d+)[ \t\n\r]*[,}]')


def _trailing_base(f: BinaryIO) -> int | None:
    """The baseTimeNanoseconds written after a file's events, by a look at its last bytes (the
    reader checks it against the file's own once it gets there)."""
    try:
        at = f.tell()
        size = f.seek(0, os.SEEK_END)
        f.seek(max(at, size - 4096))
        tail = f.read()
        f.seek(at)
    except OSError:
        return None
    found = _TRAILING_BASE.findall(tail)
    return int(found[-1]) if found else None


def _batch(buf: bytes, eof: bool) -> tuple[list[Any] | None, bytes]:
    """The complete events at the start of `buf` (up to the last event end that parses, leaving
    at least the last one for `_last_events`), and the bytes after them; None: none yet."""
    if eof:
        return None, buf
    end = len(buf)
    for _ in range(4):
        m = None
        for m in _EVENT_END.finditer(buf, max(0, end - (64 << 10)), end):
            pass
        if m is None:
            return None, buf
        try:
            events = orjson.loads(b"[" + buf[: m.start() + 1] + b"]")
        except orjson.JSONDecodeError:
            end = m.start()
            continue
        if isinstance(events, list):
            return events, buf[m.end() :]
    return None, buf


def _last_events(buf: bytes, obj: bool) -> tuple[list[Any] | None, dict[str, Any] | None]:
    """The events of the array's last part and, after its `]`, the object's other keys ({}:
    none; None: the array is not closed). (None, None): the array is cut off."""
    stripped = buf.rstrip(_WS)
    if not obj:
        if not stripped.endswith(b"]"):
            try:
                events = orjson.loads(b"[" + stripped.rstrip(b",") + b"]") if stripped.strip(_WS + b",") else []
            except orjson.JSONDecodeError:
                return None, None
            return (events, None) if isinstance(events, list) else (None, None)
        try:
            events = orjson.loads(b"[" + stripped)
        except orjson.JSONDecodeError:
            return None, None
        return (events, {}) if isinstance(events, list) else (None, None)
    # The object form: `...events] , "key": value ... }`; the `]` that closes the array is one of
    # the last few (a key after it may hold arrays too).
    at = len(stripped)
    for _ in range(8):
        at = stripped.rfind(b"]", 0, at)
        if at < 0:
            break
        after = stripped[at + 1 :].lstrip(_WS)
        try:
            events = orjson.loads(b"[" + stripped[: at + 1])
            if after.startswith(b","):
                tail = orjson.loads(b"{" + after[1:])
            else:
                tail = orjson.loads(b"{" + after) if after == b"}" else None
        except orjson.JSONDecodeError:
            continue
        if isinstance(events, list) and isinstance(tail, dict):
            return events, tail
    return None, None


def read_header(path: str, limit: int = 1 << 20) -> dict[str, Any]:
    """The top-level keys of a trace (baseTimeNanoseconds, distributedInfo, metadata) without
    parsing its events, when the file puts them first (gputrace's files do); else the whole
    file is parsed."""
    head = read_head(path, limit)
    stripped = head.lstrip()
    if stripped.startswith(b"{"):
        cut = stripped.find(b'"traceEvents":')
        if cut > 0:
            try:
                header = orjson.loads(stripped[:cut].rstrip().rstrip(b",") + b"}")
                if isinstance(header, dict) and "baseTimeNanoseconds" in header:
                    return header
            except orjson.JSONDecodeError:
                pass
    elif stripped.startswith(b"["):
        first = stripped.find(b"\n")
        if first > 0:
            try:
                ev = orjson.loads(stripped[1:first].rstrip().rstrip(b","))
                if isinstance(ev, dict) and ev.get("ph") == "M" and ev.get("name") == "gputrace":
                    return dict(ev.get("args") or {})
            except orjson.JSONDecodeError:
                pass
    header, _ = parse(path, read_bytes(path))
    return header


def parse(path: str, data: bytes) -> tuple[dict[str, Any], list[Any]]:
    """The file's top-level keys and its raw events (what `read` builds a `Trace` from, and what
    `validate` checks rule by rule). A streamed file's `gputrace` metadata events become the
    header; a file cut off keeps its complete events and gets `"_cut": True` in the header."""
    body = data.lstrip()
    if not body:
        raise TraceFormatError(path, "empty file")
    if body[:1] not in (b"{", b"["):
        raise TraceFormatError(path, "not a JSON trace (it does not start with { or [)")
    cut = False
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError as refused:
        parsed, body = _loads_odd(body, refused)
        if parsed is None:
            parsed = _repair(path, body)
            cut = True
    if isinstance(parsed, list):
        header: dict[str, Any] = {}
        events = parsed
        if cut or not body.rstrip().endswith(b"]"):
            header["_cut"] = True  # a streamed file whose writer did not finish it
        # A streamed file carries its header as `gputrace` metadata events (the first one, and
        # updates after it: clock syncs, tracks, counts).
        for e in events:
            if isinstance(e, dict) and e.get("ph") == "M" and e.get("name") == "gputrace":
                update_header(header, e.get("args"))
        return header, events
    if not isinstance(parsed, dict) or not isinstance(parsed.get("traceEvents"), list):
        raise TraceFormatError(path, "not a Chrome trace: expected a traceEvents list or an array of events")
    events = parsed.pop("traceEvents")
    if cut:
        parsed["_cut"] = True
    return parsed, events


def _loads_odd(body: bytes, e: orjson.JSONDecodeError) -> tuple[Any, bytes]:
    """A whole file that orjson refuses for what is not a cut: a number past a double (orjson's
    limit, not JSON's; Python's parser reads it), or bytes that are not UTF-8 (replaced). The
    parsed file (None: it is cut, or broken) and the bytes parsed."""
    if "infinity" in str(e):
        try:
            return json.loads(body), body
        except (ValueError, RecursionError):
            return None, body
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        body = body.decode("utf-8", "replace").encode("utf-8")
        try:
            return orjson.loads(body), body
        except orjson.JSONDecodeError as again:
            return _loads_odd(body, again) if "infinity" in str(again) else (None, body)
    return None, body


def _repair(path: str, body: bytes) -> Any:
    """A file cut off mid-write: keep every complete event. gputrace writes one event per line,
    so the cut goes back to the last line end; other files fall back to the last `}`."""
    if body[:1] == b"[":
        return _complete_array(path, body, 0, b"[")
    cut = body.find(b'"traceEvents":')
    if cut < 0:
        raise TraceFormatError(path, "not valid JSON, and no traceEvents in it; the file may be truncated")
    start = body.find(b"[", cut)
    try:
        header = orjson.loads(body[:cut].rstrip().rstrip(b",") + b"}")
    except orjson.JSONDecodeError:
        header = None
    if start < 0 or not isinstance(header, dict):
        # traceEvents not first-after-header: let the events carry the day, header lost.
        raise TraceFormatError(path, "not valid JSON; the file may be truncated before its events")
    events = _complete_array(path, body[start:], 0, b"[")
    header["traceEvents"] = events
    return header


# What the repair scan steps over: a whole string (its braces are text), an opening or closing
# bracket, or a quote that opens a string the cut left unfinished.
_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[{}\[\]]|"')
_REPAIR_TRIES = 8  # parses of the kept prefix before the file is given up on


def _complete_array(path: str, body: bytes, _depth: int, opener: bytes) -> list[Any]:
    """The complete elements of an array cut off at any byte (`body` starts with `[`). Time is
    linear in the file: the cut goes back to the last line end (gputrace's events are one per
    line), else to the end of the last complete element, found by one scan of the file's strings
    and brackets; only a few prefixes are ever parsed, whatever the cut-off event holds."""
    nl = body.rfind(b"}\n")
    if nl > 0:
        try:
            events = orjson.loads(body[: nl + 1] + b"]")
            if isinstance(events, list):
                return events
        except orjson.JSONDecodeError:
            pass
    # The ends of the last few top-level elements that are objects or arrays.
    ends: collections.deque[int] = collections.deque(maxlen=_REPAIR_TRIES)
    depth = 0
    for m in _TOKENS.finditer(body):
        c = m.group()
        if c in (b"{", b"["):
            depth += 1
        elif c in (b"}", b"]"):
            depth -= 1
            if depth == 1:
                ends.append(m.end())
            elif depth < 1:
                break  # the array's own end (then the file parsed, unless something else is wrong)
        elif c == b'"':
            break  # a string cut off: nothing after it is complete
    for cut in reversed(ends):
        try:
            events = orjson.loads(body[:cut] + b"]")
            if isinstance(events, list):
                return events
        except orjson.JSONDecodeError:
            pass
    if not ends and body.strip() == b"[":
        return []
    raise TraceFormatError(path, "cut off before its first complete event")


def _build(path: str, header: dict[str, Any], events: list[Any], keys: frozenset[str] | None = None) -> Trace:
    b = _Builder(path, header, keys)
    b.add(events)
    return b.finish()


class _Builder:
    """A trace's columns built from its events as they come, batch by batch (`add`), and the
    `Trace` made of them (`finish`). What the header says (time base, rank, merged or not) is
    taken when the builder is made; processes and tracks get their indices as they first appear
    and are made at the end, once every event has named them (`process_name`, `thread_name` may
    come anywhere in a file). `keys`: keep only these arguments, and no categories (`read_spans`)."""

    def __init__(self, path: str, header: dict[str, Any], keys: frozenset[str] | None = None) -> None:
        self.path = path
        self.keys = keys
        self.facts = _header_facts(path, header)
        base, meta, info, merged, own, file_rank = self.facts
        self.pid_rank: dict[Any, int] = {}
        self.foreign_pids: set[Any] = set()
        if merged:
            # Damaged tables are read as far as they make sense: a pid they do not place is foreign.
            table = meta.get("pid_rank")
            for pid, r in table.items() if isinstance(table, dict) else ():
                if type(r) is int and r >= 0:
                    self.pid_rank[pid_key(pid)] = r
            listed = meta.get("foreign_pids")
            if isinstance(listed, list):
                self.foreign_pids = {pid_key(p) for p in listed if isinstance(p, (int, str))}
        self.rank_meta: dict[str, Any] = (
            meta["rank_metadata"] if merged and isinstance(meta.get("rank_metadata"), dict) else {}
        )
        self.trace = Trace()
        self.cut = bool(header.get("_cut"))
        self.proc_name: dict[Any, str] = {}
        self.proc_sort: dict[Any, int] = {}
        self.thread_name: dict[tuple[Any, Any], str] = {}
        self.proc_index: dict[Any, int] = {}
        self.procs: list[Any] = []  # pids in the order they first appear: index -> pid
        self.track_index: dict[tuple[Any, Any], int] = {}
        self.counter_tracks: dict[tuple[Any, str], int] = {}
        self.tracks: list[tuple[Any, ...]] = []  # index -> what makes the track, in order of appearance
        self.open_b: dict[tuple[Any, Any], list[tuple[str, int, Any]]] = {}
        # X events, the bulk of any trace, go to columns of their own and join the trace's at the end.
        self.x_name = array("l")
        self.x_track = array("l")
        self.x_start = array("q")
        self.x_end = array("q")
        self.x_args: list[dict[str, Any] | None] = []
        self.x_cat: list[str | None] = []
        # Launch arrows (gputrace's own files, see layout.py): their sources are not spans; each
        # gives its entry to the X span that ends its arrow, joined at the end (`finish`).
        self.launches = merged or own  # a file whose launch-category flows are arrows' sources
        self.launch_seen = False
        self.launch_at: dict[Any, int] = {}  # bind_id -> the source's entry ns
        self.flows_in: list[tuple[int, Any]] = []  # (X row, bind_id) of spans that end an arrow

    def process_of(self, pid: Any) -> int:
        i = self.proc_index.get(pid)
        if i is None:
            i = self.proc_index[pid] = len(self.procs)
            self.procs.append(pid)
        return i

    def track_of(self, pid: Any, tid: Any, cat: Any) -> int:
        key = (pid, tid)
        t = self.track_index.get(key)
        if t is None:
            p = self.process_of(pid)
            t = self.track_index[key] = len(self.tracks)
            self.tracks.append((p, pid, tid, cat, len(self.track_index) - 1))
        return t

    def add(self, events: list[Any]) -> None:
        """Take a batch of the file's events, in file order."""
        base = self.facts[0]
        trace = self.trace
        proc_name, proc_sort, thread_name = self.proc_name, self.proc_sort, self.thread_name
        track_index, track_of, process_of = self.track_index, self.track_of, self.process_of
        open_b, counter_tracks = self.open_b, self.counter_tracks
        spans = trace.spans
        intern = trace.intern
        name_index = trace._name_index
        xs_append, xe_append = self.x_start.append, self.x_end.append
        xn_append, xt_append = self.x_name.append, self.x_track.append
        xa_append, xc_append = self.x_args.append, self.x_cat.append
        plain_cats = ("cuda", "cpu", None)
        keys = self.keys
        # The plain X events go to the columns in C, until one that is not (`_read_x_rows`,
        # csrc/readx.c): that one is taken below, then C goes on after it.
        fast = _read_x_rows if len(events) > 16 else None
        i, n_events = 0, len(events)
        while i < n_events:
            if fast is not None:
                i = self._add_x_rows(fast, events, i)
                if i >= n_events:
                    break
            e = events[i]
            i += 1
            if type(e) is not dict:
                continue
            ph = e.get("ph")
            if ph == "X":
                # Types first: a list `ts` times 1000 is a list a thousand times longer.
                ts = e.get("ts")
                dur = e.get("dur", 0)
                if (type(ts) is not int and type(ts) is not float) or (type(dur) is not int and type(dur) is not float):
                    continue  # validate reports it; readers skip what they cannot place
                try:
                    start = base + round(ts * 1000)
                    end = start + round(dur * 1000)
                except (ValueError, OverflowError):
                    continue
                cat = e.get("cat")
                flow = "bind_id" in e
                if flow and cat == LAUNCH_CAT and self.launches:
                    self.launch_seen = True
                    _launch_source(e, base, self.launch_at)
                    continue
                try:
                    t = track_index.get((e.get("pid"), e.get("tid")))
                except TypeError:
                    continue  # a list or object for a pid or tid: no thread to put it on
                if t is None:
                    t = track_of(e.get("pid"), e.get("tid"), cat)
                n = e.get("name", "")
                ni = name_index.get(n) if type(n) is str else None
                if ni is None:
                    ni = intern(str(n))
                # The one place a span's fields become columns.
                try:
                    xs_append(start)
                except OverflowError:
                    continue  # times past 64 bits of ns: the span cannot be placed
                try:
                    xe_append(end)
                except OverflowError:
                    self.x_start.pop()
                    continue
                xa = e.get("args")
                xn_append(ni)
                xt_append(t)
                if keys is None:
                    xa_append(xa if xa and type(xa) is dict else None)
                    xc_append(None if cat in plain_cats or not isinstance(cat, str) else cat)
                else:  # the named arguments alone, no category (a column of None made at the end)
                    xa_append(_only(xa, keys) if xa and type(xa) is dict else None)
                if flow:
                    self.flows_in.append((len(self.x_start) - 1, e["bind_id"]))
            elif ph == "M":
                if not _ids(e):
                    continue
                n = e.get("name")
                a: dict[str, Any] = e["args"] if isinstance(e.get("args"), dict) else {}
                if n == "process_name":
                    proc_name[e.get("pid")] = _text(a.get("name", ""))
                elif n == "process_sort_index" and type(a.get("sort_index")) is int:
                    proc_sort[e.get("pid")] = a["sort_index"]
                elif n == "thread_name":
                    thread_name[(e.get("pid"), e.get("tid"))] = _text(a.get("name", ""))
            elif ph in ("B", "E"):
                key = (e.get("pid"), e.get("tid"))
                ts = _ns(base, e.get("ts"))
                if ts is None or not _ids(e):
                    continue
                if ph == "B":
                    ba = e.get("args")
                    open_b.setdefault(key, []).append((_text(e.get("name", "")), ts, ba if type(ba) is dict else None))
                elif open_b.get(key):
                    name, t0, a = open_b[key].pop()
                    kept = _only(a, keys) if a and keys is not None else a
                    spans.append(intern(name), track_of(key[0], key[1], e.get("cat")), t0, ts, kept or None, None)
            elif ph == "C":
                ts = _ns(base, e.get("ts"))
                if ts is None or not _ids(e):
                    continue
                cargs: dict[str, Any] = e["args"] if isinstance(e.get("args"), dict) else {}
                for series, value in cargs.items():
                    if not isinstance(value, (int, float)) or isinstance(value, bool):
                        continue
                    try:
                        value = float(value)
                    except OverflowError:
                        continue  # an integer past what a double holds
                    name = f"{_text(e.get('name', ''))} {series}"
                    ck = (e.get("pid"), name)
                    t = counter_tracks.get(ck)
                    if t is None:
                        t = counter_tracks[ck] = len(self.tracks)
                        self.tracks.append((process_of(e.get("pid")), name))
                    trace.counters.append(t, ts, value)
            else:
                extra = dict(e)
                extra.pop("dur_ns", None)  # the model's own keys: a file's are not taken for them
                ts = _ns(base, extra.pop("ts", None))
                if ts is None or not _ids(e):
                    continue
                extra["ts_ns"] = ts
                if "dur" in extra:
                    dur = _ns(0, extra.pop("dur"))
                    if dur is not None:
                        extra["dur_ns"] = dur
                extra["process"] = process_of(extra.pop("pid", None))
                trace.extra.append(extra)

    def _add_x_rows(self, fast: Callable[..., Any], events: list[Any], i: int) -> int:
        """Take events[i:] while they are plain X events by the C loop; the index it stopped at."""
        cats = self.x_cat if self.keys is None else None
        got = fast(events, i, self.facts[0], self.track_index, self.trace._name_index, self.keys, self.x_args, cats)
        i, s, e, n, t = got  # the args and categories appended in place
        if s:
            self.x_start.frombytes(s)
            self.x_end.frombytes(e)
            self.x_name.frombytes(n)
            self.x_track.frombytes(t)
        return i

    def finish(self, final: _Builder | None = None) -> Trace:
        """The trace of every event taken; `final`: a builder made of the file's whole header
        (a streamed file's updates joined), which says what the processes are."""
        if final is not None:
            self.facts, self.cut = final.facts, final.cut
            self.pid_rank, self.foreign_pids, self.rank_meta = final.pid_rank, final.foreign_pids, final.rank_meta
        base, meta, info, merged, own, file_rank = self.facts
        trace = self.trace
        trace.metadata = dict(meta)
        trace.metadata["base_ns"] = base
        if self.cut:
            # Read up to its last complete event: a crash, a kill, or a copy cut short.
            trace.metadata["file_cut"] = True
        if "world_size" in info:
            trace.metadata.setdefault("world_size", info["world_size"])
        # Processes that only named themselves still exist (a rank that recorded nothing).
        for pid in self.proc_name:
            if pid not in self.proc_index and pid is not None:
                self.process_of(pid)
        if own and not merged and file_rank is not None and not self.procs:
            self.process_of(file_rank + 1)
        for pid in self.procs:
            trace.add_process(self._process(pid))
        for k, made in enumerate(self.tracks):
            trace.add_track(self._track(made, k))
        spans = trace.spans
        before = len(spans)
        x_entry = _launch_entries(self.launch_at, self.flows_in, len(self.x_start)) if self.launch_seen else None
        if self.keys is not None:
            self.x_cat = [None] * len(self.x_start)
        if len(spans):  # B/E spans first, as they were taken
            spans.extend(self.x_name, self.x_track, self.x_start, self.x_end, self.x_args, self.x_cat)
        else:  # the columns themselves, not copies
            spans.name, spans.track, spans.start, spans.end = self.x_name, self.x_track, self.x_start, self.x_end
            spans.args, spans.cat = self.x_args, self.x_cat
        if x_entry is not None:
            spans.entry = array("q", bytes(8 * before)) + x_entry if before else x_entry
        return trace

    def _process(self, pid: Any) -> Process:
        base, meta, info, merged, own, file_rank = self.facts
        if merged:
            rank = self.pid_rank.get(pid)
            foreign = pid in self.foreign_pids or rank is None
            pmeta = self.rank_meta.get(str(rank), {}) if rank is not None and not foreign else {}
            pmeta = pmeta if isinstance(pmeta, dict) else {}
        else:
            rank = file_rank
            # In gputrace's own per-rank file the rank's process is pid rank + 1; every other
            # process (or every process of another tool's trace) is foreign to gputrace.
            foreign = not own or (rank is not None and pid != rank + 1)
            pmeta = meta if not foreign else {}
        label = self.proc_name.get(pid) or (f"rank {rank}" if rank is not None and not foreign else f"process {pid}")
        sort = self.proc_sort.get(pid, rank if rank is not None else 1 << 20)
        return Process(pid, rank, label, sort, pmeta, foreign)

    def _track(self, made: tuple[Any, ...], k: int) -> Track:
        if len(made) == 2:  # a counter's series
            p, name = made
            dev = CUDA_TRACK.match(name)
            return Track(p, name, name, "counter", int(dev.group(1)) if dev else None)
        p, pid, tid, cat, seen = made
        name = self.thread_name.get((pid, tid)) or f"thread {tid}"
        m = CUDA_TRACK.match(name)
        if m:
            kind, device = "cuda", int(m.group(1))
        elif name.endswith("(host)") or cat == "cpu":
            kind, device = "cpu", None
        else:
            kind, device = "other", None
        ordinal = tid if isinstance(tid, int) else seen
        return Track(p, tid, name, kind, device, ordinal)


def _only(args: dict[str, Any], keys: frozenset[str]) -> dict[str, Any] | None:
    """The arguments named in `keys` (None when there are none)."""
    if keys.isdisjoint(args):
        return None
    return {k: v for k, v in args.items() if k in keys}


def _header_facts(path: str, header: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, Any], bool, bool, Any]:
    """What a file's header says that its events are read by: (time base, metadata,
    distributedInfo, merged, written by gputrace, the file's rank or None)."""
    meta: dict[str, Any] = header["metadata"] if isinstance(header.get("metadata"), dict) else {}
    info: dict[str, Any] = header["distributedInfo"] if isinstance(header.get("distributedInfo"), dict) else {}
    base = header.get("baseTimeNanoseconds", 0)
    if isinstance(base, bool) or not isinstance(base, int):
        if isinstance(base, float) and base.is_integer():
            base = int(base)
        elif base is None:
            base = 0
        else:
            raise TraceFormatError(path, "baseTimeNanoseconds is not an integer")
    if not INT64_MIN <= base <= INT64_MAX:
        raise TraceFormatError(path, "baseTimeNanoseconds is out of range (a 64-bit integer of ns)")
    merged = bool(meta.get("merged"))
    own = "gputrace_version" in meta
    file_rank = info.get("rank", meta.get("rank") if not merged else None)
    if isinstance(file_rank, bool) or not isinstance(file_rank, int) or file_rank < 0:
        file_rank = None
    return base, meta, info, merged, own, file_rank


def _launch_source(e: dict[str, Any], base: int, at: dict[Any, int]) -> None:
    """Note a launch arrow's source (see layout.py) in `at` (bind_id -> ns): its exact entry (its
    `entry_ns` argument, else its time)."""
    a = e.get("args")
    exact = a.get(ENTRY_ARG) if type(a) is dict else None
    ns = exact if type(exact) is int and exact > 0 else _ns(base, e.get("ts"))
    try:
        if ns is not None and ns > 0:
            at[e["bind_id"]] = ns
    except TypeError:  # a bind_id that is not an id (a list): no arrow
        pass


def _launch_entries(at: dict[Any, int], flows_in: list[tuple[int, Any]], n: int) -> array[int]:
    """The `entry` column of the file's X spans (`n` of them) from the launch arrows' sources
    (`_launch_source`): each source's entry given to the span whose `flow_in` has its `bind_id`;
    0 for every other span. A source without its span (a file cut between the two lines) is
    dropped."""
    entry = array("q", bytes(8 * n))
    for row, flow in flows_in:
        try:
            ns = at.get(flow)
        except TypeError:
            continue
        if ns is not None:
            entry[row] = ns
    return entry


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _in_range(ns: int) -> bool:
    return INT64_MIN <= ns <= INT64_MAX


def _ns(base: int, us: Any) -> int | None:
    """`base` plus a time in microseconds (`ts`, `dur`), as integer ns; None when it is not a
    number, or not finite, or past 64 bits of ns."""
    if type(us) is not int and type(us) is not float:
        return None
    try:
        ns = base + round(us * 1000)
    except (ValueError, OverflowError):
        return None
    return ns if _in_range(ns) else None


def _ids(e: dict[str, Any]) -> bool:
    """Are the event's pid and tid usable as ids (not lists or objects)?"""
    try:
        hash((e.get("pid"), e.get("tid")))
    except TypeError:
        return False
    return True


def _text(v: Any) -> str:
    """A name as text: strings as they are, anything else (a number, a list) as its JSON."""
    if type(v) is str:
        return v
    try:
        return dumps(v).decode("utf-8", "replace")
    except RecursionError:  # nested past what cleaning walks
        return "?"


# ---- writing ------------------------------------------------------------------------------------


def header_bytes(base_ns: int, metadata: dict[str, Any], rank: int | None, world_size: int | None) -> bytes:
    """`{"baseTimeNanoseconds": ..., "distributedInfo": {"rank": R, ...}, "metadata": ...,` with
    Kineto's spacing in distributedInfo (HTA's rank pattern needs the space)."""
    parts = [b'{"baseTimeNanoseconds": %d' % base_ns]
    info = []
    if rank is not None:
        info.append(b'"rank": %d' % rank)
    if world_size is not None:
        info.append(b'"world_size": %d' % world_size)
    parts.append(b'"distributedInfo": {' + b", ".join(info) + b"}")
    parts.append(b'"metadata": ' + dumps(metadata))
    parts.append(b'"displayTimeUnit": "ns"')
    return b", ".join(parts) + b', "traceEvents": [\n'


class ProcessWriter(ProcessLayout):
    """One process's metadata and span events in JSON, its tids and lanes kept across pieces (by
    `ProcessLayout`): a new written track is named with `thread_name` and ordered with
    `thread_sort_index` events."""

    def __init__(self, pid: int, process: Process, layout: Layout | None = None) -> None:
        super().__init__(pid, process, layout)
        self.name_json: list[bytes] = []  # the trace's names as JSON, by name index

    def describe(self, trace: Trace, track: int, lane: int, tid: int, out: list[bytes]) -> None:
        t = trace.tracks[track]
        out.append(
            b'{"ph":"M","name":"thread_name","pid":%d,"tid":%d,"args":{"name":%s}},\n'
            % (self.pid, tid, dumps(lane_name(t, lane)))
        )
        out.append(
            b'{"ph":"M","name":"thread_sort_index","pid":%d,"tid":%d,"args":{"sort_index":%d}},\n'
            % (self.pid, tid, lane_sort(t, lane))
        )

    def describe_launch(self, tid: int, out: list[bytes]) -> None:
        out.append(
            b'{"ph":"M","name":"thread_name","pid":%d,"tid":%d,"args":{"name":%s}},\n'
            % (self.pid, tid, dumps(LAUNCH_TRACK))
        )
        out.append(
            b'{"ph":"M","name":"thread_sort_index","pid":%d,"tid":%d,"args":{"sort_index":%d}},\n'
            % (self.pid, tid, LAUNCH_SORT)
        )

    def process_events(self) -> bytes:
        p = self.process
        return b'{"ph":"M","name":"process_name","pid":%d,"tid":0,"args":{"name":%s}},\n' % (
            self.pid,
            dumps(p.label),
        ) + b'{"ph":"M","name":"process_sort_index","pid":%d,"tid":0,"args":{"sort_index":%d}},\n' % (
            self.pid,
            p.sort_index,
        )


def encode_spans(
    trace: Trace,
    rows: Sequence[int],
    writer: ProcessWriter,
    base_ns: int,
    out: list[bytes],
    lanes: Sequence[int] | None = None,
) -> None:
    """The X events of `rows` (span indices, all of one process), one per line, each followed by
    `,\\n`, appended to `out` (metadata events for new tracks go first). `lanes`: already
    placed by the writer's layout; else placed now."""
    if not rows:
        return
    sp = trace.spans
    entry = sp.entry
    if _encode_rows is not None and type(rows) is range and rows.step == 1 and isinstance(sp.cat, _NoCats):
        lo, hi = rows.start, rows.stop
        starts_a, ends_a, tracks_a = sp.start[lo:hi], sp.end[lo:hi], sp.track[lo:hi]  # copies at C speed
        if is_columns(tracks_a, starts_a, ends_a):
            if lanes is None:
                lanes = writer.layout.place(tracks_a, starts_a, ends_a)
            if lanes.count(0) == len(lanes):  # every span on its track itself: encode from the columns in C
                _encode_piece(trace, writer, base_ns, out, lo, hi, tracks_a, starts_a, ends_a)
                return
    starts = [sp.start[i] for i in rows]
    ends = [sp.end[i] for i in rows]
    tracks = [sp.track[i] for i in rows]
    if lanes is None:
        lanes = writer.layout.place(tracks, starts, ends)
    meta: list[bytes] = []
    flows = launch_rows(entry, rows)  # positions of the spans drawn with a launch arrow
    launch_tid = writer.launch_tid(meta) if flows else 0
    first_flow = writer.flow_ids(len(flows)) if flows else 0
    keys = list(zip(tracks, lanes))
    slot_of: dict[tuple[int, int], int] = {}
    tid_list: list[int] = []
    cat_list: list[bytes] = []
    for key in dict.fromkeys(keys):  # the piece's (track, lane)s, first-seen order
        slot_of[key] = len(tid_list)
        tid_list.append(writer.tid(trace, key[0], key[1], meta))
        cat_list.append(b'"cuda"' if trace.tracks[key[0]].kind == "cuda" else b'"cpu"')
    out.extend(meta)
    names = trace.names
    name_json = writer.name_json
    while len(name_json) < len(names):
        name_json.append(dumps(names[len(name_json)]))
    cats = sp.cat
    if _encode_events is not None and (isinstance(cats, _NoCats) or all(cats[i] is None for i in rows)):
        # The C encoder (it refuses a span before the base or ending before it starts): each
        # row's "track" is its (track, lane)'s slot here, its lane 0.
        launch = ([entry[i] for i in rows], launch_tid, first_flow) if flows and entry is not None else ()
        body = _encode_events(
            name_json,
            [sp.name[i] for i in rows],
            cat_list,
            [slot_of[k] for k in keys],
            [0] * len(keys),
            tid_list,
            writer.pid,
            starts,
            ends,
            base_ns,
            _args_json([sp.args[i] for i in rows]),
            *launch,
        )
        # One event a line (a cut file loses only its last line): `},{"ph"` occurs only between
        # events, as JSON strings escape their quotes.
        out.append(body.replace(b'},{"ph"', b'},\n{"ph"') + b",\n")
        return
    if min(starts) < base_ns or any(e < s for s, e in zip(starts, ends)):
        raise ValueError("a span starts before the trace's base or ends before it starts")
    tids = [tid_list[slot_of[k]] for k in keys]
    pid = writer.pid
    default_cat = {t: (b'"cuda"' if trace.tracks[t].kind == "cuda" else b'"cpu"') for t in set(tracks)}
    flow_of = {j: first_flow + k for k, j in enumerate(flows)}
    lines = []
    for j, i in enumerate(rows):
        s, e = starts[j], ends[j]
        ts, dur = s - base_ns, e - s
        cat = cats[i]
        a = sp.args[i]
        flow = b""
        if flows and j in flow_of:
            assert entry is not None
            lines.append(launch_event(name_json[sp.name[i]], pid, launch_tid, entry[i], s, base_ns, flow_of[j]))
            flow = b',"bind_id":%d,"flow_in":true' % flow_of[j]
        lines.append(
            b'{"ph":"X","cat":%s,"name":%s,"pid":%d,"tid":%d,"ts":%d.%03d,"dur":%d.%03d%s%s},\n'
            % (
                dumps(cat) if cat is not None else default_cat[tracks[j]],
                name_json[sp.name[i]],
                pid,
                tids[j],
                ts // 1000,
                ts % 1000,
                dur // 1000,
                dur % 1000,
                (b',"args":' + dumps(a)) if a else b"",
                flow,
            )
        )
    out.append(b"".join(lines))


def launch_event(name: bytes, pid: int, tid: int, entry: int, start: int, base_ns: int, flow: int) -> bytes:
    """The source of a span's launch arrow (see layout.py's "launch arrows"): a zero-length
    slice named as the span on the launch track, its exact entry as an argument where it is not
    drawn at the entry."""
    at = launch_at(entry, start, base_ns)
    ts = at - base_ns
    return (
        b'{"ph":"X","cat":"%s","name":%s,"pid":%d,"tid":%d,"ts":%d.%03d,"dur":0.000,"bind_id":%d,"flow_out":true%s},\n'
        % (
            LAUNCH_CAT.encode(),
            name,
            pid,
            tid,
            ts // 1000,
            ts % 1000,
            flow,
            b',"args":{"%s":%d}' % (ENTRY_ARG.encode(), entry) if at != entry else b"",
        )
    )


def _encode_piece(
    trace: Trace,
    writer: ProcessWriter,
    base_ns: int,
    out: list[bytes],
    lo: int,
    hi: int,
    tracks: array[int],
    starts: array[int],
    ends: array[int],
) -> None:
    """`encode_spans` for spans `lo:hi` that all lie on lane 0 of their tracks, in C from the
    columns: the same bytes as the loops there."""
    sp = trace.spans
    meta: list[bytes] = []
    launch: tuple[Any, ...] = ()
    if sp.entry is not None:
        entry = sp.entry[lo:hi]
        n = entries_range(entry)[0]  # a negative entry is not a time: no arrow, as in the loops
        if n:  # the launch track is asked for first, as in encode_spans' loop
            launch = (entry, writer.launch_tid(meta), writer.flow_ids(n))

    def track_info(t: int) -> tuple[int, bytes]:  # asked in the order the tracks first appear
        return writer.tid(trace, t, 0, meta), b'"cuda"' if trace.tracks[t].kind == "cuda" else b'"cpu"'

    names = trace.names
    name_json = writer.name_json
    while len(name_json) < len(names):
        name_json.append(dumps(names[len(name_json)]))
    args = sp.args[lo:hi]
    enc = (name_json, sp.name[lo:hi], tracks, starts, ends, args)
    # The body comes in chunks of ~64 KiB, which a save writes as they come (`out` writes them
    # through): one bytes object a piece would pass through fresh pages, as dear as encoding it.
    # New tracks' metadata first: `track_info` has described them all before the first chunk.
    described: list[bool] = []

    def emit(chunk: bytes) -> None:
        if not described:
            described.append(True)
            out.extend(meta)
        out.append(chunk)

    # `dumps` is orjson's bytes wherever orjson takes the args, and cleans them only where not.
    _encode_rows(*enc, dumps, track_info, writer.pid, base_ns, *(launch or (None, 0, 0)), emit)
    if not described:
        out.extend(meta)


def _args_json(args: list[dict[str, Any] | None]) -> list[bytes | None]:
    try:  # one pass at C speed; item by item only when some value needs cleaning
        return [orjson.dumps(a, default=repr) if a else None for a in args]
    except (TypeError, orjson.JSONEncodeError):
        return [dumps(a) if a else None for a in args]


def encode_counters(trace: Trace, rows: Sequence[int], pid_of: dict[int, int], base_ns: int, out: list[bytes]) -> None:
    """`C` events, one per sample: a counter track named "A B" is event "A" with arg "B"
    (Perfetto names the track it makes "A B")."""
    c = trace.counters
    for i in rows:
        t = trace.tracks[c.track[i]]
        prefix, _, key = t.name.rpartition(" ")
        ts = c.ts[i] - base_ns
        if ts < 0:
            raise ValueError("a counter sample lies before the trace's base")
        v = c.value[i]
        value = b"%d" % v if v.is_integer() and abs(v) < 2**53 else dumps(v)
        out.append(
            b'{"ph":"C","name":%s,"pid":%d,"ts":%d.%03d,"args":{%s:%s}},\n'
            % (dumps(prefix or key), pid_of[t.process], ts // 1000, ts % 1000, dumps(key), value)
        )


def encode_extra(trace: Trace, pid_of: dict[int, int], base_ns: int, out: list[bytes]) -> None:
    for e in trace.extra:
        ev = {k: v for k, v in e.items() if k not in ("ts_ns", "dur_ns", "process")}
        ev["pid"] = pid_of[e["process"]]
        ev["ts"] = (e["ts_ns"] - base_ns) / 1000
        if "dur_ns" in e:
            ev["dur"] = e["dur_ns"] / 1000
        out.append(dumps(ev) + b",\n")


class _Through:
    """A list of encoded bytes to `encode_spans` (`append`, `extend`) that writes them at once."""

    def __init__(self, write: Callable[[bytes], object]) -> None:
        self.append = write

    def extend(self, parts: Iterable[bytes]) -> None:
        for p in parts:
            self.append(p)


def iter_encode(
    trace: Trace, base_ns: int | None = None, ordered: bool = False, write: Callable[[bytes], object] | None = None
) -> Iterator[bytes]:
    """The whole trace as object-form JSON, in pieces (memory: one piece of bytes at a time
    beyond the columns and one lane per span). `ordered`: the spans of each track are stored in
    the order they ended (a recorder's are), so no sort is needed before laying them out.
    `write`: the spans' events go there as they are encoded (the C encoder's chunks of ~64 KiB,
    written while the next is made: no piece is ever held whole, so a save's bytes reuse the
    same memory instead of passing through fresh pages, which cost as much as encoding them);
    the rest is yielded, for the caller to write with the same `write` before it asks for more.

    The layout runs first, so the header can say how many overflow tracks there are."""
    plan = plan_write(trace, base_ns, ordered, writer=ProcessWriter)
    base_ns, pid_of = plan.base_ns, plan.pid_of
    yield header_bytes(base_ns, plan.metadata, plan.rank, plan.world_size)
    yield b"".join(w.process_events() for w in plan.writers.values())
    for w, rows, lanes in plan.pieces:
        if write is not None:
            encode_spans(trace, rows, w, base_ns, _Through(write), lanes)  # type: ignore[arg-type]
            continue
        out: list[bytes] = []
        encode_spans(trace, rows, w, base_ns, out, lanes)
        yield b"".join(out)
    out = []
    encode_counters(trace, range(len(trace.counters)), pid_of, base_ns, out)
    encode_extra(trace, pid_of, base_ns, out)
    if out:
        yield b"".join(out)


def write(
    trace: Trace,
    path: str,
    base_ns: int | None = None,
    ordered: bool = False,
    meanwhile: Callable[[], object] | None = None,
) -> None:
    """Write the trace to `path` atomically (see `iter_encode` for `ordered`); `meanwhile` runs
    while the file reaches the disk."""
    with atomic_writer(path, meanwhile=meanwhile) as f:
        with writes_behind(f) as write:  # the disk's copy of a piece overlaps encoding the next
            for piece in iter_encode(trace, base_ns, ordered, write):
                write(piece)
        _close_list(f)


def encode(trace: Trace, base_ns: int | None = None, ordered: bool = False) -> bytes:
    """The whole trace as object-form JSON bytes (for small traces and tests)."""
    data = b"".join(iter_encode(trace, base_ns, ordered))
    return data[:-2] + b"\n]}" if data.endswith(b",\n") else data + b"]}"


def _close_list(f: BinaryIO) -> None:
    """Every event line ends with `,\n`; the last one's comma is replaced by the closing `]}`."""
    f.flush()
    f.seek(-2, os.SEEK_END)
    if f.read(2) == b",\n":
        f.seek(-2, os.SEEK_END)
        f.write(b"\n]}")
    else:
        f.seek(0, os.SEEK_END)
        f.write(b"]}")
    f.truncate()


# ---- streaming ----------------------------------------------------------------------------------


class StreamWriter(AppendFile):
    """One rank's trace, appended to its file flush by flush.

    The file stays loadable at every instant: it is the array form, one event per line, and
    each append is one `write()` of whole lines (a kill can cut only the last line, which the
    readers drop). `finish()` turns it into the object form, atomically."""

    def __init__(self, path: str, base_ns: int, process: Process, header: dict[str, Any]) -> None:
        super().__init__(path, base_ns, process, header)  # the header is rewritten whole at finish()
        self.writer = ProcessWriter(self.pid, process)
        first = dumps({"ph": "M", "name": "gputrace", "pid": self.pid, "tid": 0, "args": self._header_args()})
        self._write(b"[" + first + b",\n" + self.writer.process_events())

    def _header_args(self) -> dict[str, Any]:
        return {"baseTimeNanoseconds": self.base_ns, **self.header}

    def overflow_tracks(self) -> int:
        return self.writer.layout.overflow_tracks()

    def append(self, trace: Trace, rows: Sequence[int], counters: Sequence[int] = (), update: Any = None) -> None:
        """Append spans `rows` and counter samples `counters` of `trace` (one process, index 0),
        and, if given, a header update (new metadata) — in one write."""
        out: list[bytes] = []
        if update:
            out.append(dumps({"ph": "M", "name": "gputrace", "pid": self.pid, "tid": 0, "args": update}) + b",\n")
        encode_spans(trace, rows, self.writer, self.base_ns, out)
        if counters:
            encode_counters(trace, counters, {i: self.pid for i in range(len(trace.processes))}, self.base_ns, out)
        if out:
            self._write(b"".join(out))
        self.spans_written += len(rows)

    def finish(self, header: dict[str, Any] | None = None) -> None:
        """Rewrite the file as the object form with the final header, atomically, and close it.
        On failure the streamed file is left as it is (still loadable)."""
        if self._fd < 0:
            return
        if header is not None:
            self.header = header
        os.close(self._fd)
        self._fd = -1
        info = self.header.get("distributedInfo", {})
        head = header_bytes(self.base_ns, self.header.get("metadata", {}), info.get("rank"), info.get("world_size"))
        with open(self.path, "rb") as src, atomic_writer(self.path) as dst:
            dst.write(head)
            src.readline()  # `[` and the streamed header event: replaced by the real header
            _copy(src, dst)
            _close_list(dst)

    def resume(self) -> None:
        """After `finish()`: turn the file back into the streamed form and go on appending."""
        if self._fd >= 0:
            return
        with open(self.path, "rb") as src, atomic_writer(self.path) as dst:
            src.readline()  # the object form's header line
            first = dumps({"ph": "M", "name": "gputrace", "pid": self.pid, "tid": 0, "args": self._header_args()})
            dst.write(b"[" + first + b",\n")
            _copy(src, dst)  # every event line; the last one ends without a comma, then `]}`
            dst.flush()
            dst.seek(0, os.SEEK_END)
            size = dst.tell()
            dst.seek(max(size - 1, 0))
            if dst.read(1) == b"\n" and size > 1:
                dst.seek(size - 1)
                dst.write(b",\n")
        self._reopen()


def _copy(src: BinaryIO, dst: BinaryIO, block: int = 16 << 20) -> None:
    """Copy the streamed events, dropping a last line cut off mid-write (a killed writer)."""
    tail = b""
    while True:
        data = src.read(block)
        if not data:
            break
        data = tail + data
        cut = data.rfind(b"\n")
        dst.write(data[: cut + 1])
        tail = data[cut + 1 :]


# ---- following a stream -------------------------------------------------------------------------

_TAIL_NAME = re.compile(rb'"name":"((?:[^"\\]|\\.)*)"')
_TAIL_BASE = re.compile(rb'"baseTimeNanoseconds":\s*(\d+)')
_TAIL_KINDS = 4096


class StreamTail:
    """A streamed trace (`StreamWriter`'s file: one event a line, appended flush by flush, and
    rewritten whole once when the rank finishes) read as it grows: each `read` parses only the
    lines the file gained since the last (from the byte where it stopped; a rewritten file again
    from its start, after `restart`), holding one piece of `read_bytes` at a time.

    A subclass says which spans it wants and takes them: `select(raw_name, marked)` (the span's
    name as the file writes it, between its quotes; `marked`: its `"collective"` argument, None
    without one) gives a kind, 0 for a span not wanted, which is then not parsed at all (most
    lines of a long run), the same kind for the same arguments (it is asked once a name, for
    each marking);
    `span(kind, start, end)` takes each wanted span, in file order, times
    in ns after the file's base (`base_ns`, once its header was read); `restart()` is told the
    file was rewritten. A file longer than `tail_bytes` at the first read has its spans named
    `counted` before its last `tail_bytes` counted by byte search, not parsed (`skipped(n)`).
    `finished`: the file holds its closing line; `size` and `grew_at` (monotonic s): when it
    was last seen to change size. A line longer than `MAX_LINE` (a trace not written one event
    a line, or a hostile file) is not held: the file is then left unread, `not_a_stream` set."""

    MAX_LINE = 16 << 20

    def __init__(
        self, path: str, counted: str | None = None, tail_bytes: int = 64 << 20, read_bytes: int = 8 << 20
    ) -> None:
        self.path = path
        self.counted = counted
        self.tail_bytes = tail_bytes
        self.read_bytes = read_bytes
        self._selected: dict[bytes, tuple[int, int, int]] = {}  # what `select` said of a name
        self._reset(None)

    def _reset(self, ino: int | None) -> None:
        self.ino = ino
        self.offset = 0
        self.partial = b""
        self.base_ns: int | None = None
        self.finished = False
        self.grew_at = time.monotonic()
        self.size = 0
        self.not_a_stream = False

    # ---- what a subclass says -----------------------------------------------------------------

    def select(self, raw_name: bytes, marked: bool | None) -> int:
        return 0

    def span(self, kind: int, start: int, end: int) -> None:
        pass

    def restart(self) -> None:
        pass

    def skipped(self, count: int) -> None:
        pass

    # ---- reading --------------------------------------------------------------------------------

    def read(self) -> None:
        """What the file gained since the last read (all of it, if it was rewritten)."""
        try:
            f = open(self.path, "rb")
        except OSError:
            return
        with f:
            st = os.fstat(f.fileno())
            if self.ino is None:
                self.ino = st.st_ino
            elif st.st_ino != self.ino or st.st_size < self.offset:
                self._reset(st.st_ino)  # rewritten (the rank finished, or started again)
                self.restart()
            if st.st_size != self.size:
                self.size = st.st_size
                self.grew_at = time.monotonic()
            if self.offset == 0 and st.st_size > self.tail_bytes:
                self._skip(f, st.st_size - self.tail_bytes)
            f.seek(self.offset)
            while not self.not_a_stream:
                piece = f.read(self.read_bytes)
                if not piece:
                    break
                self.offset += len(piece)
                data = self.partial + piece
                cut = data.rfind(b"\n") + 1
                self.partial = data[cut:]
                self._lines(data[:cut])
                if len(self.partial) > self.MAX_LINE:
                    self._refuse(st.st_size)
            if self.partial.strip() in (b"]}", b"]"):  # the finished file's last line has no newline
                self.finished = True

    def _refuse(self, size: int) -> None:
        """A line too long to be one event: not a stream; read no more of it (till rewritten)."""
        self.not_a_stream = True
        self.partial = b""
        self.offset = size

    def _skip(self, f: Any, to: int) -> None:
        """Count the `counted` spans in the file's first `to` bytes (to the end of the line there)
        and go on from that line: no line before is parsed. The needle is how the stream writes a
        span's name, followed by its pid."""
        first = f.readline(self.MAX_LINE + 1)
        self._lines(first)  # the header: base time, the finished form
        f.seek(to)
        rest = f.readline(self.MAX_LINE + 1)
        if len(first) > self.MAX_LINE or len(rest) > self.MAX_LINE:
            self._refuse(os.fstat(f.fileno()).st_size)
            return
        end = f.tell()
        needle = b',"name":' + orjson.dumps(self.counted) + b',"pid":'
        f.seek(0)
        done, carry, count = 0, b"", 0
        while done < end:
            piece = f.read(min(self.read_bytes, end - done))
            if not piece:
                break
            done += len(piece)
            data = carry + piece
            count += data.count(needle)  # the carry is shorter than the needle: none counted twice
            carry = data[-(len(needle) - 1) :]
        self.skipped(count)
        self.offset = end

    def _lines(self, data: bytes) -> None:
        kinds, span = self._selected, self.span
        for line in data.splitlines():
            line = line.strip()
            if line.startswith(b"["):
                line = line[1:]
            if line.endswith(b","):
                line = line[:-1]
            if not line:
                continue
            if line in (b"]}", b"]"):
                self.finished = True
                continue
            if line.startswith(b'{"baseTimeNanoseconds"'):  # the finished file's header line
                self._header(line)
                continue
            if b'"ph":"X"' not in line:
                if self.base_ns is None and b'"baseTimeNanoseconds"' in line:
                    self._header(line)
                continue
            m = _TAIL_NAME.search(line)
            if m is None:
                continue
            # Most spans are not wanted: told apart without parsing them, by what `select` said
            # of the name once, unmarked, marked collective and marked not (kept for up to
            # `_TAIL_KINDS` names: names made per step must not grow this).
            raw = m.group(1)
            said = kinds.get(raw)
            if said is None:
                if len(kinds) >= _TAIL_KINDS:
                    kinds.clear()
                said = kinds[raw] = (self.select(raw, None), self.select(raw, True), self.select(raw, False))
            kind = said[1 if b'"collective":true' in line else 2 if b'"collective":false' in line else 0]
            if not kind:
                continue
            try:
                ev = orjson.loads(line)
                start = round(float(ev["ts"]) * 1000)
                end = start + round(float(ev.get("dur", 0)) * 1000)
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                continue  # a line cut short by a kill: the readers drop it too
            span(kind, start, end)

    def _header(self, line: bytes) -> None:
        m = _TAIL_BASE.search(line)
        if m:
            self.base_ns = int(m.group(1))
        if line.startswith(b'{"baseTimeNanoseconds"'):
            self.finished = False  # events follow; `]}` ends them


# ---- merged files, part by part -----------------------------------------------------------------
# A merge of many ranks writes one file rank by rank (memory about one rank's worth): the header
# first, then each part's event lines, which worker processes may encode (`encode_part` is a
# plain function of picklable arguments), then the closing bracket.


def complete_header(path: str) -> dict[str, Any] | None:
    """The header of a file whose header says everything the file knows (the object form, as
    `write` and a finished stream leave it), read without its events; else None. A streamed
    file (the array form) carries later clock syncs and its run id in events after its first
    line."""
    try:
        first = read_head(path, 4096).lstrip()[:1]
    except TraceFormatError:
        return None  # reading the whole file says why
    return read_header(path) if first == b"{" else None


class MergedWriter:
    """One merged trace written into `f` part by part: the header (`base_ns`, the merged
    `metadata`, `world_size`) when made, each part's event lines (`iter_encode_part`'s pieces)
    by `write`, and the closing bracket by `close`."""

    def __init__(self, f: BinaryIO, base_ns: int, metadata: dict[str, Any], world_size: int | None) -> None:
        self.f = f
        self.base_ns = base_ns
        f.write(header_bytes(base_ns, metadata, None, world_size))

    def encoder(self) -> Callable[[Trace, set[int] | frozenset[int]], Iterable[bytes]]:
        """`iter_encode_part` on this file's time base, as a value a worker process can be
        handed: a part's event lines in pieces, each written as it is made (a worker joins them)."""
        return functools.partial(iter_encode_part, base_ns=self.base_ns)

    def write(self, data: bytes) -> None:
        self.f.write(data)

    def close(self) -> None:
        _close(self.f)


def encode_part(part: Trace, nested: set[int] | frozenset[int] = frozenset(), *, base_ns: int) -> bytes:
    """Event lines (each ending ",\\n") for every process of `part` (`iter_encode_part`'s pieces
    joined)."""
    return b"".join(iter_encode_part(part, nested, base_ns=base_ns))


def iter_encode_part(part: Trace, nested: set[int] | frozenset[int] = frozenset(), *, base_ns: int) -> Iterator[bytes]:
    """Event lines (each ending ",\\n") for every process of `part`, through the Chrome writer,
    in pieces of at most `PART_PIECE` spans: each process with its own writer, its spans laid
    out once over all of them (`nested`: processes known to nest on every track already, which
    are written as they are, in storage order: a range of rows, no per-span list)."""
    sp = part.spans
    one = len(part.processes) == 1
    rows_of: dict[int, list[int]] = {} if one else {i: [] for i in range(len(part.processes))}
    if not one:
        proc_of_track = [t.process for t in part.tracks]
        for i, t in enumerate(sp.track):
            rows_of[proc_of_track[t]].append(i)
    tid_of: dict[tuple[int, Any], int] = {}
    wanted = {(e["process"], e["tid"]) for e in part.extra if "tid" in e}
    for pi, q in enumerate(part.processes):
        w = ProcessWriter(q.pid, q)  # type: ignore[arg-type]
        yield w.process_events()
        rows: Sequence[int] = range(len(sp)) if one else rows_of.pop(pi)
        layout = CheckedLayout(sp, rows, pi in nested)
        w.layout = layout  # type: ignore[assignment]
        if layout.fallback is not None:
            # The Chrome writer's layout judges nesting across pieces when they come in the
            # order spans ended (children before their parents).
            rows = list(rows)
            rows.sort(key=sp.start.__getitem__, reverse=True)
            rows.sort(key=sp.end.__getitem__)
        for k in range(0, len(rows), PART_PIECE):
            chunks: list[bytes] = []
            encode_spans(part, rows[k : k + PART_PIECE], w, base_ns, chunks)
            yield from chunks
            del chunks
        del rows
        meta: list[bytes] = []
        for ti, track in enumerate(part.tracks):
            if track.process == pi and (pi, track.tid) in wanted:
                tid_of[(pi, track.tid)] = w.tid(part, ti, 0, meta)
        if meta:
            yield b"".join(meta)
    # Other tools' instants and flows point at threads by tid: give them the tids written.
    for e in part.extra:
        if "tid" in e:
            e["tid"] = tid_of.get((e["process"], e["tid"]), e["tid"])
    pid_of = {i: q.pid for i, q in enumerate(part.processes)}
    chunks = []
    encode_counters(part, range(len(part.counters)), pid_of, base_ns, chunks)  # type: ignore[arg-type]
    encode_extra(part, pid_of, base_ns, chunks)  # type: ignore[arg-type]
    yield b"".join(chunks)


#: Spans a piece of a merged part holds (its lines are written before the next are made). A
#: track's description goes out with the first piece that holds one of its spans, so this size
#: is part of the merged file's bytes.
PART_PIECE = 65536


class CheckedLayout:
    """Lanes for spans that already nest on every track (a gputrace file, moved through monotone
    maps): all on lane 0, after one check over the whole process; if any two cross, the Chrome
    writer's own layout decides."""

    def __init__(self, sp: Any, rows: Sequence[int], known: bool = False) -> None:
        self.fallback: Layout | None = None if known or nests(sp, rows) else Layout()

    def place(self, tracks: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> list[int]:
        if self.fallback is not None:
            return self.fallback.place(tracks, starts, ends)
        return [0] * len(starts)

    def lanes_used(self, track: int) -> int:
        return self.fallback.lanes_used(track) if self.fallback is not None else 1


def nests(sp: Any, rows: Sequence[int]) -> bool:
    """Do the spans `rows` nest on each track the way Perfetto reads them (sorted by start, the
    longest first at equal starts; [start, end))?"""
    order = list(rows)
    order.sort(key=sp.end.__getitem__, reverse=True)
    order.sort(key=sp.start.__getitem__)
    stacks: dict[int, list[int]] = {}
    start, end, track = sp.start, sp.end, sp.track
    for i in order:
        st = stacks.get(track[i])
        if st is None:
            st = stacks[track[i]] = []
        s, e = start[i], end[i]
        while st and st[-1] <= s:
            st.pop()
        if st and e > st[-1]:
            return False
        st.append(e)
    return True


def _close(f: BinaryIO) -> None:
    """Every event line ends with `,\\n`: the last one's comma becomes the closing `]}`."""
    f.flush()
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(max(size - 2, 0))
    if f.read(2) == b",\n":
        f.seek(size - 2)
        f.write(b"\n]}")
    else:
        f.seek(0, os.SEEK_END)
        f.write(b"]}")
    f.truncate()
