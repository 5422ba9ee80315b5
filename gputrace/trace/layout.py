"""What every trace format's writer shares, format-neutral: where spans go and what they are called.

Takes: a `Trace` (or a recorder's columns, piece by piece). Gives: the pid each process is written
with (`output_pids`: rank + 1 for ranks), each span's lane on its track (`Layout`: spans that
cannot nest where they are go to an overflow lane beside it, flush after flush), the tid, name
and sort order of each written (track, lane) (`ProcessLayout`), and a whole trace's plan
(`plan_write`: base, pids, lanes piece by piece, header fields). The JSON and Perfetto writers
both lay out through here, so both formats make the same tracks, tids and overflow tracks.

Also here, because both formats read and write them the same way: the header's JSON (`dumps`),
how a streamed header update joins the header (`update_header`), the facts a process carries
beyond its track (`process_facts`), how a track's name says it is a CUDA stream (`CUDA_TRACK`),
and the launch arrows (`launch_at`: where each span's host entry is drawn; the flow ids).

Conventions (Perfetto's importer punishes the alternatives): pid = rank + 1, since pid 0 is
Perfetto's kernel "swapper"; tids are small and never equal the pid, since Perfetto draws the
tid that equals the pid first, as the "main thread"; sort indices fit 32 bits.
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from array import array
from collections.abc import Callable, Iterator, Sequence
from itertools import compress, islice
from operator import eq, gt, itemgetter, neg
from typing import Any, Generic, TypeVar

import orjson

from gputrace import native
from gputrace.trace.model import Process, Trace, Track

# The C layout of a piece of a recorder's columns (the same lanes as the Python below), and the C
# loop of `entries_range`; None: the Python loops.
_nest_tracks: Any = None
_entries_range_c: Any = None


def _bind(hot: Any) -> None:
    global _nest_tracks, _entries_range_c
    _nest_tracks = hot.nest_tracks if hot is not None else None
    _entries_range_c = hot.entries_range if hot is not None else None


native.on_switch(_bind)

#: A track whose name starts "cuda:D " is a stream of device D (both readers ask).
CUDA_TRACK = re.compile(r"^cuda:(\d+) ")


# ---- the header -----------------------------------------------------------------------------------


def dumps(value: Any) -> bytes:
    """JSON bytes. Values JSON cannot hold (NaN, infinities, arbitrary objects, lone
    surrogates) are written as their string form rather than failing the save; a value that
    cannot be written at all (one that contains itself, nests past `MAX_DEPTH`, or whose `repr`
    raises) as a marked placeholder, `unserializable(value)`: one bad span argument never
    costs the trace."""
    try:
        return orjson.dumps(value, default=repr)
    except Exception:  # noqa: BLE001 - orjson re-raises whatever a repr raised; cleaned below
        pass
    try:
        return orjson.dumps(_clean(value), default=safe_repr)
    except Exception:  # noqa: BLE001 - an object orjson writes natively (a dataclass) that fails
        pass
    if isinstance(value, dict):  # the values that still fail alone become placeholders
        return orjson.dumps({_clean_str(_safe_str(k)): _one(v) for k, v in list(value.items())})
    return orjson.dumps(unserializable(value))


MAX_DEPTH = 64
"""Containers nested deeper than this in a span argument are written as a placeholder."""


def unserializable(value: Any) -> str:
    """What is written for a value that cannot be: its type, marked."""
    return f"<unserializable: {type(value).__name__}>"


def safe_repr(value: Any) -> str:
    """`repr(value)`, or the placeholder where that raises."""
    try:
        return _clean_str(repr(value))
    except Exception:  # noqa: BLE001 - a user's __repr__ may raise anything
        return unserializable(value)


def _safe_str(value: Any) -> str:
    try:
        return str(value)
    except Exception:  # noqa: BLE001 - as safe_repr
        return unserializable(value)


def _one(value: Any) -> Any:
    try:
        return orjson.loads(orjson.dumps(_clean(value), default=safe_repr))
    except Exception:  # noqa: BLE001
        return unserializable(value)


def clean(value: Any) -> Any:
    """`value` as plain JSON-like data every writer can take: containers as dicts and lists (one
    that contains itself, or nests past `MAX_DEPTH`, as a placeholder), strings valid UTF-8,
    non-finite floats and integers past 64 bits as strings, other objects as their `safe_repr`."""
    cleaned = _clean(value)
    return cleaned if not _other(cleaned) else _plain(cleaned)


def _other(value: Any) -> bool:
    return not (value is None or isinstance(value, (bool, int, float, str)))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value if not _other(value) else safe_repr(value)


def _clean(value: Any, depth: int = 0, path: set[int] | None = None) -> Any:
    import math

    if isinstance(value, (dict, list, tuple)):
        path = set() if path is None else path
        if depth >= MAX_DEPTH or id(value) in path:  # it contains itself, or nests too deep
            return unserializable(value)
        path.add(id(value))
        try:
            if isinstance(value, dict):
                return {_clean_str(_safe_str(k)): _clean(v, depth + 1, path) for k, v in list(value.items())}
            return [_clean(v, depth + 1, path) for v in list(value)]
        except Exception:  # noqa: BLE001 - changed while read (another thread), or worse
            return unserializable(value)
        finally:
            path.discard(id(value))
    if isinstance(value, str):
        return _clean_str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
        return str(value)  # JSON numbers past 64 bits lose digits in most readers
    return value


def _clean_str(s: str) -> str:
    return s.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def update_header(header: dict[str, Any], args: Any) -> None:
    """Join a streamed header update (new metadata, clock syncs) into `header`, as both formats'
    readers do for the updates a streamed file carries after its first header."""
    if not isinstance(args, dict):
        return
    for key, value in args.items():
        if key == "metadata" and isinstance(value, dict):
            meta = header.setdefault("metadata", {})
            for k, v in value.items():
                if k == "clock_syncs" and isinstance(v, list):
                    meta.setdefault("clock", {}).setdefault("sync_to_rank0", []).extend(v)
                else:
                    meta[k] = v
        else:
            header[key] = value


def pid_key(pid: Any) -> Any:
    """A pid as written in a header's keys (a string) back to the number it names."""
    try:
        return int(pid)
    except (TypeError, ValueError):
        return pid


def process_facts(processes: Sequence[Process], pid_of: dict[int, int]) -> dict[str, Any]:
    """What a written process cannot say by its name: its rank and whether it is another tool's
    (by written pid, as a header carries it)."""
    return {str(pid_of[i]): {"rank": p.rank, "foreign": p.foreign} for i, p in enumerate(processes)}


# ---- lanes ------------------------------------------------------------------------------------


class Layout:
    """Overflow lanes, decided incrementally: each span goes to the first lane of its track where
    it nests with everything already written there, so spans written in any number of pieces
    (flush by flush) still nest on every written track.

    Per lane it keeps the outermost spans written so far (disjoint, sorted). A new span fits a
    lane when it is disjoint from each of them or contains each it meets; inside one of them it
    fits only if it was written in the same piece (the stack pass below sees its parent), since
    a later span inside an earlier outermost one could cross that one's children. Kept spans are
    bounded per lane: the oldest are joined into one, which can only send a late span to an
    overflow lane, never let two spans cross."""

    MAX_KEPT = 256
    #: Spans that come in the order they ended and all nest skip the lane search; a layout whose
    #: `fits` adds rules turns this off.
    fast_path = True

    def __init__(self) -> None:
        self._lanes: dict[int, list[tuple[list[int], list[int]]]] = {}  # track -> lanes: (starts, ends)

    def lanes_used(self, track: int) -> int:
        return max(1, len(self._lanes.get(track, ())))

    def overflow_tracks(self) -> int:
        """Overflow tracks made so far, over every track."""
        return sum(max(0, len(lanes) - 1) for lanes in self._lanes.values())

    def place(self, tracks: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> list[int]:
        """The lane of each span of this piece."""
        if self.fast_path and _nest_tracks is not None and is_columns(tracks, starts, ends):
            # The usual case in C, every track at once; it changes nothing unless all nest.
            if _nest_tracks(self._lanes, tracks, starts, ends, self.MAX_KEPT) is not None:
                return [0] * len(starts)
        by_track: dict[int, list[int]] = {}
        for i, t in enumerate(tracks):
            by_track.setdefault(t, []).append(i)
        lane = [0] * len(starts)
        for t, rows in by_track.items():
            lanes = self._lanes.setdefault(t, [])
            if not lanes:
                lanes.append(([], []))
            kept = None
            if self.fast_path:
                kept = nest_in_end_order(lanes[0], [starts[i] for i in rows], [ends[i] for i in rows], self.MAX_KEPT)
            if kept is not None:  # the usual case: all on the track itself
                lanes[0] = kept
                continue
            order = sorted(rows, key=lambda i: (starts[i], -ends[i]))  # stable: ties keep their order
            stacks: list[list[int]] = [[] for _ in lanes]  # per lane: ends of this piece's open spans
            roots: list[list[tuple[int, int]]] = [[] for _ in lanes]
            for i in order:
                s, e = starts[i], ends[i]
                k = 0
                while True:
                    if k == len(lanes):
                        lanes.append(([], []))
                        stacks.append([])
                        roots.append([])
                    st = stacks[k]
                    while st and st[-1] <= s:
                        st.pop()
                    kept_ends = lanes[k][1]
                    # Past every kept span (the usual case) it meets none of them.
                    fits = not kept_ends or s >= kept_ends[-1] or self.fits(lanes[k], s, e)
                    # Nested in this piece's open span (its parent), and with earlier pieces'.
                    ok = (st[-1] >= e and fits) if st else fits
                    if ok:
                        if not st:
                            roots[k].append((s, e))
                        st.append(e)
                        lane[i] = k
                        break
                    k += 1
            for k, rs in enumerate(roots):
                for s, e in rs:
                    _keep(lanes[k], s, e, self.MAX_KEPT)
        return lane

    def fits(self, lane: tuple[list[int], list[int]], s: int, e: int) -> bool:
        """Does [s, e) nest with the spans kept for `lane` (those of earlier pieces)? A method, so
        a format with stricter rules can add them (Perfetto's begin/end events)."""
        return _fits(lane, s, e)


def is_columns(tracks: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> bool:
    """Are these a piece of a `SpanColumns`' arrays (what the C layout and encoder read)?"""
    return (
        type(tracks) is array
        and type(starts) is array
        and type(ends) is array
        and tracks.typecode == "l"
        and starts.typecode == "q"
        and ends.typecode == "q"
    )


def nest_in_end_order(
    lane: tuple[list[int], list[int]], starts: list[int], ends: list[int], limit: int
) -> tuple[list[int], list[int]] | None:
    """The fast path of `Layout.place`, for spans that come in the order they ended (as a
    recorder resolves them) and all nest: one pass keeps the outermost spans as a stack (a span
    takes in every kept span that starts at or after it, since those end no later). Returns the
    lane's new kept spans, or None (out of order, or a span crosses one) for the general path."""
    ks, ke = list(lane[0]), list(lane[1])
    last = ke[-1] if ke else None
    for s, e in zip(starts, ends):
        if last is not None and e < last:
            return None
        last = e
        while ks and ks[-1] >= s:
            ks.pop()
            ke.pop()
        if ke and ke[-1] > s:
            return None
        ks.append(s)
        ke.append(e)
    if len(ks) > limit:  # join the oldest into one (see the class docstring)
        k = len(ks) - limit + 1
        ks[:k] = [ks[0]]
        ke[:k] = [ke[k - 1]]
    return ks, ke


def _fits(lane: tuple[list[int], list[int]], s: int, e: int) -> bool:
    starts, ends = lane
    # Kept spans are disjoint and sorted, so their ends are sorted too: the ones that meet
    # [s, e) are those with end > s and start < e.
    i = bisect.bisect_right(ends, s)
    j = bisect.bisect_left(starts, e)
    if i >= j:
        return True  # meets none
    return starts[i] >= s and ends[j - 1] <= e  # contains every one it meets


def _keep(lane: tuple[list[int], list[int]], s: int, e: int, limit: int) -> None:
    starts, ends = lane
    i = bisect.bisect_right(ends, s)
    j = bisect.bisect_left(starts, e)
    if i < j:  # it contains these: it replaces them
        s, e = min(s, starts[i]), max(e, ends[j - 1])
        del starts[i:j], ends[i:j]
    starts.insert(i, s)
    ends.insert(i, e)
    if len(starts) > limit:  # join the two oldest
        starts[0:2] = [starts[0]]
        ends[0:2] = [ends[1]]


class ProcessLayout:
    """One process's written tracks, kept across pieces: its pid, the lanes its spans take
    (`layout`), and the tid of each (track, lane), given in the order they are first asked for.
    A format's writer subclasses it to write a new track's description (`describe`)."""

    def __init__(self, pid: int, process: Process, layout: Layout | None = None) -> None:
        self.pid = pid
        self.process = process
        self.layout = Layout() if layout is None else layout
        self._tids: dict[tuple[int, int], int] = {}  # (track, lane) -> tid
        self._next_tid = 0
        self._flows = 0  # flow ids given out so far

    def tid(self, trace: Trace, track: int, lane: int, out: list[bytes]) -> int:
        """The tid of (track, lane); a new one is described into `out` first."""
        key = (track, lane)
        tid = self._tids.get(key)
        if tid is None:
            self._next_tid += 1
            if self._next_tid == self.pid:  # never the pid: see the module docstring
                self._next_tid += 1
            tid = self._tids[key] = self._next_tid
            self.describe(trace, track, lane, tid, out)
        return tid

    def describe(self, trace: Trace, track: int, lane: int, tid: int, out: list[bytes]) -> None:
        """Write what a new written track needs (the JSON format: its name and sort events)."""

    def launch_tid(self, out: list[bytes]) -> int:
        """The tid of the process's launch track (see "launch arrows" below), described into `out` when
        new; tids are given in the order asked, so both formats give it the same one."""
        tid = self._tids.get(_LAUNCH_KEY)
        if tid is None:
            self._next_tid += 1
            if self._next_tid == self.pid:
                self._next_tid += 1
            tid = self._tids[_LAUNCH_KEY] = self._next_tid
            self.describe_launch(tid, out)
        return tid

    def describe_launch(self, tid: int, out: list[bytes]) -> None:
        """Write what the launch track needs (the JSON format: its name and sort events)."""

    def flow_ids(self, n: int) -> int:
        """The first of `n` new flow ids: unique in a file (the pid in the high bits, so a merged
        file's processes never share one), numbered on across pieces and flushes."""
        first = (self.pid << 32) + self._flows + 1
        self._flows += n
        return first


# ---- launch arrows ------------------------------------------------------------------------------
# A span with a host entry time (`SpanColumns.entry` > 0: a CUDA span, the moment the host queued
# it) is drawn with a flow arrow from that moment to the span on its stream, so Perfetto shows the
# launch queue: how far the GPU runs behind the host. The arrow's source is a zero-length slice
# named as the span, on one host track per process (`LAUNCH_TRACK`); the JSON links the two by
# `bind_id` + `flow_out`/`flow_in` (Perfetto's flow v2), protobuf by an instant's `flow_ids` and
# the span's `terminating_flow_ids`.
#
# Perfetto imports events in time order and starts a flow only at its source: an arrow whose
# source comes at or after the span's start is dropped without a word (seen in the v52 UI, both
# formats). The host enters a span before the GPU runs it, but the two clocks meet only within
# the anchors' error, so a measured entry can lie at or after the start: the source is then drawn
# 1 ns before the start (and never before the trace's base), and the exact entry travels with it
# as its argument `ENTRY_ARG`, which the readers prefer.

#: The launch track's name and kind of its slices (the readers know a source by them).
LAUNCH_TRACK = "launches (host)"
LAUNCH_CAT = "launch"
ENTRY_ARG = "entry_ns"
#: The launch track's sort index: after every CUDA stream (see `track_sort`), before host threads.
LAUNCH_SORT = 10_000_000 - 1
_LAUNCH_KEY = (-1, 0)


def launch_at(entry: int, start: int, base_ns: int) -> int:
    """Where a span's launch arrow starts (epoch ns): its host entry, or 1 ns before the span
    where the entry is not before it, never before `base_ns`."""
    return max(min(entry, start - 1), base_ns)


def launch_rows(entry: Sequence[int] | None, rows: Sequence[int]) -> list[int]:
    """Of `rows`, the positions (0..len(rows)-1) whose span has a host entry."""
    if entry is None:
        return []
    return [j for j, i in enumerate(rows) if entry[i] > 0]


def entries_range(entry: Sequence[int]) -> tuple[int, int]:
    """(how many of `entry` are host entry times (> 0), the least item that is not 0, or 0): what
    the writers ask of a column of entries, in one pass (in C for an array('q'))."""
    if _entries_range_c is not None and isinstance(entry, array) and entry.typecode == "q":
        return _entries_range_c(entry)  # type: ignore[no-any-return]
    return _entries_range_py(entry)


def _entries_range_py(entry: Sequence[int]) -> tuple[int, int]:
    count = sum(map((0).__lt__, entry))
    return count, min(filter(None, entry), default=0)  # filter(None): at C speed, past the zeros


def first_entry(trace: Trace) -> int | None:
    """The earliest host entry of the trace's spans (None: none known)."""
    entry = trace.spans.entry
    if entry is None:
        return None
    first = entries_range(entry)[1]
    return first if first > 0 else None


def lane_name(track: Track, lane: int) -> str:
    """A written track's name: the track's, with "(overflow N)" for its overflow lanes."""
    return track.name if lane == 0 else f"{track.name} (overflow {lane})"


def lane_sort(track: Track, lane: int) -> int:
    """A written track's sort index: its track's place, then its lanes in order."""
    return track_sort(track) * 10 + min(lane, 9)


def track_sort(t: Track) -> int:
    # CUDA streams first, by device and stream; then host threads; then the rest. Small numbers:
    # Perfetto reads sort indices as 32-bit integers.
    kind = {"cuda": 0, "cpu": 1, "counter": 3}.get(t.kind, 2)
    ordinal = t.ordinal if isinstance(t.ordinal, int) else 0
    return kind * 1_000_000 + min(t.device or 0, 99) * 10_000 + min(max(ordinal, 0), 9_999)


# ---- a whole trace's plan ----------------------------------------------------------------------


def output_pids(trace: Trace) -> dict[int, int]:
    """The pid each process is written with: rank + 1 for ranks, then the other processes
    numbered after every rank's pid."""
    out: dict[int, int] = {}
    used: set[int] = set()
    for i, p in enumerate(trace.processes):
        if p.rank is not None and not p.foreign:
            out[i] = p.rank + 1
            used.add(p.rank + 1)
    nxt = max(used, default=0)
    for i, p in enumerate(trace.processes):
        if i not in out:
            nxt += 1
            out[i] = nxt
    return out


W = TypeVar("W", bound=ProcessLayout)


@dataclasses.dataclass
class WritePlan(Generic[W]):
    """What both writers decide before writing a whole trace: its base, the pid of each process,
    the lanes of every span (so the header can count overflow tracks), and the header's fields."""

    base_ns: int
    pid_of: dict[int, int]
    writers: dict[int, W]
    pieces: list[tuple[W, Sequence[int], list[int]]]
    metadata: dict[str, Any]
    rank: int | None  # a one-rank trace's rank (merged traces have none)
    world_size: int | None


def plan_write(
    trace: Trace,
    base_ns: int | None = None,
    ordered: bool = False,
    *,
    writer: Callable[[int, Process], W],
) -> WritePlan[W]:
    """The plan of a whole trace. `writer` makes each process's `ProcessLayout` (a format's own
    subclass describes the tracks it is asked for). `ordered`: the spans of each track are stored
    in the order they ended (a recorder's are), so no sort is needed before laying them out."""
    rng = trace.time_range()
    if base_ns is None:
        base_ns = rng[0] if rng else int(trace.metadata.get("base_ns", 0) or 0)
        first = first_entry(trace)
        if first is not None and rng and first < base_ns:  # the launch arrows start there
            base_ns = first
    own = [p for p in trace.processes if p.rank is not None and not p.foreign]
    meta = {k: v for k, v in trace.metadata.items() if k != "base_ns"}
    pid_of = output_pids(trace)
    rank = own[0].rank if len(own) == 1 and not meta.get("merged") else None
    world = meta.get("world_size") if isinstance(meta.get("world_size"), int) else None
    if meta.get("merged"):
        meta["pid_rank"] = {str(pid_of[i]): p.rank for i, p in enumerate(trace.processes) if p.rank is not None}
        meta["foreign_pids"] = [pid_of[i] for i, p in enumerate(trace.processes) if p.foreign]
    writers = {i: writer(pid_of[i], p) for i, p in enumerate(trace.processes)}
    pieces = layout_pieces(trace, writers, ordered)
    if own and not meta.get("merged"):
        meta["overflow_tracks"] = sum(w.layout.overflow_tracks() for w in writers.values())
    return WritePlan(base_ns, pid_of, writers, pieces, meta, rank, world)


def layout_pieces(
    trace: Trace, writers: dict[int, W], ordered: bool = False, step: int = 16384
) -> list[tuple[W, Sequence[int], list[int]]]:
    """Each process's spans in pieces of at most `step`, with the lane of each span decided by its
    process's writer (`writers`: process index -> writer). The JSON and Perfetto writers both lay
    out through this, so they make the same overflow tracks."""
    sp = trace.spans
    pieces: list[tuple[W, Sequence[int], list[int]]] = []
    if ordered and len(trace.processes) == 1:
        for k in range(0, len(sp), step):
            rows: Sequence[int] = range(k, min(k + step, len(sp)))
            pieces.append((writers[0], rows, _place(trace, rows, writers[0])))
    else:
        proc_of_track = [t.process for t in trace.tracks]
        by_proc: dict[int, list[int]] = {}
        track_col = sp.track
        for i in range(len(sp)):
            by_proc.setdefault(proc_of_track[track_col[i]], []).append(i)
        for p, prows in by_proc.items():
            # The layout sees the spans in the order they ended (children before their parents,
            # as a recorder resolves them): a later piece then holds only spans that contain,
            # follow or cross earlier ones, never spans inside them, so nesting is judged right
            # across pieces.
            # By end, the later start first at equal ends: two stable sorts on the columns'
            # values (a (end, -start) tuple a span costs ~100 bytes more while sorting).
            prows.sort(key=sp.start.__getitem__, reverse=True)
            prows.sort(key=sp.end.__getitem__)
            for k in range(0, len(prows), step):
                rows = prows[k : k + step]
                pieces.append((writers[p], rows, _place(trace, rows, writers[p])))
    return pieces


def iter_layout_pieces(
    trace: Trace, writers: dict[int, W], step: int = 16384, track_rows: dict[int, array[int]] | None = None
) -> Iterator[tuple[W, list[int], list[int]]]:
    """`layout_pieces(trace, writers)` made as they are wanted: the same pieces and lanes, the
    writers' layouts left the same. It holds each track's rows (8 bytes a span) where that
    holds a list of each process's rows and its sort keys (~100 bytes a span): a track's spans
    in the order they ended (as a gputrace file's are; sorted here where not), the process's
    merged from its tracks'. `track_rows` is given each track's rows in that order."""
    sp = trace.spans
    start, end, track_col = sp.start, sp.end, sp.track
    proc_of_track = [t.process for t in trace.tracks]
    rows_of: dict[int, array[int]] = {}
    used = set(track_col)
    if len(used) <= 8:  # a pass over the column per track, at C speed
        for t in used:
            rows_of[t] = array("q", compress(range(len(track_col)), map(t.__eq__, track_col)))
    else:
        for i, t in enumerate(track_col):
            rows = rows_of.get(t)
            if rows is None:
                rows = rows_of[t] = array("q")
            rows.append(i)
    # Processes in the order of their first span (as `layout_pieces` meets them).
    by_proc: dict[int, list[array[int]]] = {}
    for _, t in sorted((rows[0], t) for t, rows in rows_of.items()):
        rows = rows_of[t]
        if not _in_end_order(start, end, rows):
            listed = list(rows)
            listed.sort(key=start.__getitem__, reverse=True)  # as `layout_pieces`: stable
            listed.sort(key=end.__getitem__)
            rows = array("q", listed)
            del listed
        by_proc.setdefault(proc_of_track[t], []).append(rows)
        if track_rows is not None:
            track_rows[t] = rows
    del rows_of
    for p, tracks in by_proc.items():
        # By end, the later start first, then by row: `layout_pieces`'s two stable sorts.
        ordered = iter([list(tracks[0])]) if len(tracks) == 1 else _merged(start, end, tracks)
        held: list[int] = []
        for batch in ordered:
            held += batch
            while len(held) >= step:
                piece = held[:step]
                del held[:step]
                yield writers[p], piece, _place(trace, piece, writers[p])
        if held:
            yield writers[p], held, _place(trace, held, writers[p])
        tracks.clear()


def _in_end_order(start: Sequence[int], end: Sequence[int], rows: Sequence[int], step: int = 65536) -> bool:
    """Are `rows` sorted by end, the later start first at equal ends?"""
    last: int | None = None
    for lo in range(0, len(rows), step):
        chunk = rows[lo : lo + step]
        ends = array("q", map(end.__getitem__, chunk))
        if (last is not None and ends[0] < last) or any(map(gt, ends, islice(ends, 1, None))):
            return False
        # Equal ends (few): the later start first.
        for i in compress(range(len(ends) - 1), map(eq, ends, islice(ends, 1, None))):
            if start[chunk[i]] < start[chunk[i + 1]]:
                return False
        if last is not None and ends[0] == last and start[rows[lo - 1]] < start[chunk[0]]:
            return False
        last = ends[-1]
    return True


def _merged(
    start: Sequence[int], end: Sequence[int], tracks: list[array[int]], window: int = 4096
) -> Iterator[list[int]]:
    """The rows of `tracks` (each sorted by end, the later start first) in that order over all of
    them, ties by row, a list at a time: sorted a window at a time (a track's next `window` rows
    at most), where each round gives every row up to the least last row read of a track not yet
    read to its end (no later row of any track comes before it)."""
    feeds = [zip(map(end.__getitem__, r), map(neg, map(start.__getitem__, r)), r) for r in tracks]
    held: list[list[tuple[int, int, int]]] = [[] for _ in feeds]
    done = [False] * len(feeds)
    while True:
        for k, feed in enumerate(feeds):
            if not done[k] and len(held[k]) < window:
                more = list(islice(feed, window))
                done[k] = len(more) < window
                held[k] += more
        open_lasts = [h[-1] for k, h in enumerate(held) if not done[k] and h]
        bound = min(open_lasts) if open_lasts else None
        out: list[tuple[int, int, int]] = []
        for k, h in enumerate(held):
            cut = len(h) if bound is None else bisect.bisect_right(h, bound)
            if cut:
                out += h[:cut]
                del h[:cut]
        if not out:
            return
        out.sort()  # sorted runs, merged at C speed
        yield list(map(itemgetter(2), out))


def _place(trace: Trace, rows: Sequence[int], writer: ProcessLayout) -> list[int]:
    sp = trace.spans
    if type(rows) is range and rows.step == 1:  # slices of the columns, which the C layout reads
        lo, hi = rows.start, rows.stop
        return writer.layout.place(sp.track[lo:hi], sp.start[lo:hi], sp.end[lo:hi])
    return writer.layout.place([sp.track[i] for i in rows], [sp.start[i] for i in rows], [sp.end[i] for i in rows])
