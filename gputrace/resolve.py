"""Resolving: closed spans -> absolute spans in integer epoch nanoseconds. Pure: it changes
nothing but the store it fills and the spans it resolves.

Takes: spans the GPU has finished (their device events) or host spans (monotonic ns), the
device timelines of anchors, and the host clock.
Gives: rows appended to a columnar `SpanStore` (interned names, int ns), and `Resolved`: the
spans that must wait for a newer anchor, the events the resolved spans no longer need (per
device; the recorder returns them to its pools) and the owned spans' durations (per owner; the
recorder hands them to their timers).

What resolve reads of the objects it is handed (a span's stack and track, the store, the
timelines, their anchors and events) is `RESOLVE_LAYOUT`, declared here once; the C loop
(`csrc/resolve.c`) reads the same names, and a build that reads others is refused at import.
"""

from __future__ import annotations

from array import array
from typing import Any

from gputrace import native
from gputrace.clock import Anchor, DeviceTimeline, HostClock
from gputrace.trace.model import intern

Span = Any  # a closed span: record.Span, record.PySpan or a copy (resolve needs no more than the layout)


Resolved = tuple[list[Span], list[list[Any]], dict[Any, list[int]]]
"""What a resolve gives besides the rows: (later, freed, durations). `later`: the spans whose events
lie after the newest anchor of their device; `freed`: per device, the events of the spans resolved,
each span's start then end; `durations`: per owner (a timer), the ns of each of its spans resolved,
in order. A plain tuple: a flush a step makes one, and a named one costs more to build."""


class SpanStore:
    """Resolved spans, one column per field. Bounded by `capacity`; past it spans are counted
    in `dropped` (and the trace says so) rather than taking the host's memory."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.names: list[str] = []
        self._name_index: dict[str, int] = {}
        self.name = array("l")
        self.track = array("l")
        self.start = array("q")
        self.end = array("q")
        # Device spans: the host moment each was entered (epoch ns); host spans: 0 (their start is it).
        self.entry = array("q")
        self.args: list[dict[str, Any] | None] = []
        self.dropped = 0
        self._last_id = 0
        # Per parent span id: (least start, largest end) of its resolved children on its device
        # track, so the parent can take in a child that sticks out by rounding alone.
        self.child_extent: dict[int, tuple[int, int]] = {}

    def clear(self) -> None:
        """Forget the rows (they have been written); names, ids and counts go on."""
        for col in (self.name, self.track, self.start, self.end, self.entry):
            del col[:]
        self.args = []

    def take(self) -> SpanStore:
        """The rows, moved into a new store that shares the names; this one goes on empty (its
        ids and counts go on). The caller holds the lock resolves into this store under."""
        taken = SpanStore(self.capacity)
        taken.names, taken._name_index = self.names, self._name_index
        taken.name, taken.track, taken.start, taken.end, taken.entry, taken.args = (
            self.name, self.track, self.start, self.end, self.entry, self.args
        )  # fmt: skip
        self.name, self.track, self.start, self.end = array("l"), array("l"), array("q"), array("q")
        self.entry = array("q")
        self.args = []
        return taken

    def copy(self) -> SpanStore:
        """The rows, copied into a new store that shares the names (under the lock, as `take`)."""
        copied = SpanStore(self.capacity)
        copied.names, copied._name_index = self.names, self._name_index
        copied.name, copied.track, copied.start, copied.end = self.name[:], self.track[:], self.start[:], self.end[:]
        copied.entry = self.entry[:]
        copied.args = self.args[:]
        copied.dropped = self.dropped
        return copied

    def id_of(self, s: Span) -> int:
        """A span's id, given on first need (the hot path never numbers spans)."""
        i = getattr(s, "id", None)
        if i is None:
            self._last_id += 1
            i = s.id = self._last_id
        return i

    def __len__(self) -> int:
        return len(self.start)

    def intern(self, name: str) -> int:
        return intern(self.names, self._name_index, name)  # the trace model's names, shared with it

    def extend(
        self,
        names: list[str],
        tracks: list[int],
        starts: list[int],
        ends: list[int],
        args: list[dict[str, Any] | None],
        entries: list[int] | None = None,
    ) -> None:
        """Append rows column by column (one call per column, not per row); `entries` None: 0 each."""
        room = max(self.capacity - len(self.start), 0)
        if entries is None:
            entries = [0] * len(starts)
        if len(starts) > room:
            self.dropped += len(starts) - room
            names, tracks, starts, ends = names[:room], tracks[:room], starts[:room], ends[:room]
            args, entries = args[:room], entries[:room]
        index = self._name_index
        self.name.extend([index[n] if n in index else self.intern(n) for n in names])
        self.track.extend(tracks)
        self.start.extend(starts)
        self.end.extend(ends)
        self.entry.extend(entries)
        self.args.extend(args)


def resolve(done: list[Span], timelines: list[DeviceTimeline], clock: HostClock, store: SpanStore) -> Resolved:
    """Append every span of `done` that its device's anchors cover to `store`; the rest are
    `later` (they resolve at a later flush).

    The C build does this in one loop for spans of its own type (the ones the C hot path makes);
    `resolve_py` is the reference, and resolves any other span (a snapshot's copies)."""
    if _resolve_c is not None:
        got = _resolve_c(done, clock.epoch_offset_ns, store, timelines, None, ROUNDING_NS, DeviceTimeline)
        if got is not NotImplemented:
            return got  # type: ignore[no-any-return]
    return resolve_py(done, timelines, clock, store)


def resolve_py(done: list[Span], timelines: list[DeviceTimeline], clock: HostClock, store: SpanStore) -> Resolved:
    """`resolve` in Python: the reference for the C loop, and the path for every other span."""
    freed: list[list[Any]] = [[] for _ in timelines]
    durations: dict[Any, list[int]] = {}
    later: list[Span] = []
    offset = clock.epoch_offset_ns
    names: list[str] = []
    tracks: list[int] = []
    starts: list[int] = []
    ends: list[int] = []
    entries: list[int] = []
    argss: list[dict[str, Any] | None] = []
    id_of = store.id_of
    extent = store.child_extent
    for s in done:
        track = s.stack.track  # the track it was recorded on (s.track, one call less)
        dev = track.device
        if dev is None:
            start, end = s.t0 + offset, s.t1 + offset
            entry = 0  # a host span is entered at its start
        else:
            tl = timelines[dev]
            a = tl.locate(s.t0, s.gen)
            b = tl.locate(s.t1, a[0]) if a is not None else None
            if a is None or b is None:
                later.append(s)
                continue
            start, end = tl.to_host_ns(*a), tl.to_host_ns(*b)
            if end < start:  # back-to-back events either side of an anchor: a rounding nanosecond
                end = start
            if extent:
                start, end = _take_in_children(extent, id_of(s), start, end)
            events = freed[dev]
            events.append(s.t0)
            events.append(s.t1)
            s.t0 = s.t1 = 0  # the events are no longer the span's
            entry = s.entry + offset
        args = s.args
        error = getattr(s, "error", None)
        if error is not None:
            args = {**(args or {}), "error": error}
        parent = s.parent
        if dev is not None and parent is not None and parent.stack is s.stack:
            pid = id_of(parent)
            ext = extent.get(pid)
            extent[pid] = (start, end) if ext is None else (min(ext[0], start), max(ext[1], end))
        names.append(s.name)
        tracks.append(track.index)
        starts.append(start)
        ends.append(end)
        entries.append(entry)
        argss.append(args)
        if s.owner is not None:
            ns = durations.get(s.owner)
            if ns is None:
                ns = durations[s.owner] = []
            ns.append(end - start)
    store.extend(names, tracks, starts, ends, argss, entries)
    return later, freed, durations


def _take_in_children(extent: dict[int, tuple[int, int]], sid: int, start: int, end: int) -> tuple[int, int]:
    """A parent on a device track takes in its children's ends where they stick out by no more
    than rounding (float32 steps, anchor segments meeting; CUDA events resolve ~0.5 us anyway),
    so spans that nested on the GPU nest in the trace. Children are resolved before their parent
    (they close first on the same stream), so this is decided as the parent resolves and works
    flush by flush. A real misnest is left for the writer's overflow tracks."""
    ext = extent.pop(sid, None)
    if ext is None:
        return start, end
    lo, hi = ext
    if 0 < start - lo <= ROUNDING_NS:
        start = lo
    if 0 < hi - end <= ROUNDING_NS:
        end = hi
    return start, end


ROUNDING_NS = 1_000


RESOLVE_LAYOUT_VERSION = 2
RESOLVE_LAYOUT: tuple[tuple[str, str], ...] = (
    # (what, attribute): every attribute resolve and flush's split read, in the C build's order.
    ("stack", "track"),  # a span's stack (record._Stack): its track
    ("track", "index"),  # record.Track
    ("track", "device"),
    ("store", "names"),  # SpanStore: the names, their index, the columns and counts
    ("store", "_name_index"),
    ("store", "name"),
    ("store", "track"),
    ("store", "start"),
    ("store", "end"),
    ("store", "entry"),
    ("store", "args"),
    ("store", "capacity"),
    ("store", "dropped"),
    ("store", "_last_id"),
    ("store", "child_extent"),
    ("timeline", "_elapsed"),  # clock.DeviceTimeline
    ("timeline", "anchors"),
    ("timeline", "segment_ms"),
    ("timeline", "locate"),
    ("timeline", "to_host_ns"),
    ("anchor", "event"),  # clock.Anchor
    ("anchor", "host_ns"),
    ("event", "query"),  # a device's event (flush's split)
    ("event", "cuda_event"),  # torch's raw handle, where it has one (the raw elapsed call)
)
"""What resolve reads, declared once. Change RESOLVE_LAYOUT_VERSION with any change to what an
attribute holds; the C build reports the same pairs as `RESOLVE_LAYOUT`."""


def layout_missing() -> list[tuple[str, str]]:
    """The declared attributes that the classes declared here do not have (none, or a rename
    went unnoticed); a span's stack, track and events are the recorder's and the device's."""
    have = {
        "store": set(vars(SpanStore(0))) | set(dir(SpanStore)),
        "timeline": set(vars(DeviceTimeline())) | set(dir(DeviceTimeline)),
        "anchor": {f.name for f in Anchor.__dataclass_fields__.values()},
    }
    return [(what, name) for what, name in RESOLVE_LAYOUT if what in have and name not in have[what]]


def check_resolve_layout(hot: Any) -> None:
    """Raise ImportError unless the C build `hot` reads what RESOLVE_LAYOUT declares."""
    native.check_layout(hot, "RESOLVE_LAYOUT", (RESOLVE_LAYOUT_VERSION, RESOLVE_LAYOUT), "resolve layout")


_resolve_c: Any = None  # the C loop for the C hot path's spans (same rows, ids and results as resolve_py)


def _bind(hot: Any) -> None:
    global _resolve_c
    if hot is not None:
        check_resolve_layout(hot)
    _resolve_c = hot.resolve if hot is not None else None


if layout_missing():  # a renamed attribute fails here, at import, not mid-run
    raise ImportError(f"gputrace.resolve: RESOLVE_LAYOUT names attributes that do not exist: {layout_missing()}")
native.on_switch(_bind)
