"""Resolving: closed spans -> absolute spans in integer epoch nanoseconds.

Takes: spans the GPU has finished (their device events) or host spans (monotonic ns), the
device timelines of anchors, and the host clock.
Gives: rows appended to a columnar `SpanStore` (interned names, int ns), the events returned
to their device's pool, and the spans that must wait for a newer anchor.
"""

from __future__ import annotations

import os
from array import array
from typing import TYPE_CHECKING, Any

from gputrace.clock import DeviceTimeline
from gputrace.trace.model import intern

if TYPE_CHECKING:
    from gputrace.clock import HostClock
    from gputrace.record import Span


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
        self.args: list[dict[str, Any] | None] = []
        self.dropped = 0
        self._last_id = 0
        # Per parent span id: (least start, largest end) of its resolved children on its device
        # track, so the parent can take in a child that sticks out by rounding alone.
        self.child_extent: dict[int, tuple[int, int]] = {}

    def clear(self) -> None:
        """Forget the rows (they have been written); names, ids and counts go on."""
        for col in (self.name, self.track, self.start, self.end):
            del col[:]
        self.args = []

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
    ) -> None:
        """Append rows column by column (one call per column, not per row)."""
        room = max(self.capacity - len(self.start), 0)
        if len(starts) > room:
            self.dropped += len(starts) - room
            names, tracks, starts, ends = names[:room], tracks[:room], starts[:room], ends[:room]
            args = args[:room]
        index = self._name_index
        self.name.extend([index[n] if n in index else self.intern(n) for n in names])
        self.track.extend(tracks)
        self.start.extend(starts)
        self.end.extend(ends)
        self.args.extend(args)


def resolve(
    done: list[Span],
    timelines: list[DeviceTimeline],
    clock: HostClock,
    store: SpanStore,
    pools: list[list[Any]],
) -> list[Span]:
    """Append every span of `done` to `store`; return those whose events lie after the newest
    anchor of their device (they resolve at a later flush).

    The C build does this in one loop for spans of its own type (the ones the C hot path makes);
    `resolve_py` is the reference, and resolves any other span (a snapshot's copies)."""
    if _resolve_c is not None:
        later = _resolve_c(done, clock.epoch_offset_ns, store, timelines, pools, ROUNDING_NS, DeviceTimeline)
        if later is not NotImplemented:
            return later
    return resolve_py(done, timelines, clock, store, pools)


def resolve_py(
    done: list[Span],
    timelines: list[DeviceTimeline],
    clock: HostClock,
    store: SpanStore,
    pools: list[list[Any]],
) -> list[Span]:
    """`resolve` in Python: the reference for the C loop, and the path for every other span."""
    later: list[Span] = []
    offset = clock.epoch_offset_ns
    names: list[str] = []
    tracks: list[int] = []
    starts: list[int] = []
    ends: list[int] = []
    argss: list[dict[str, Any] | None] = []
    id_of = store.id_of
    extent = store.child_extent
    for s in done:
        track = s.stack.track  # the track it was recorded on (s.track, one call less)
        dev = track.device
        if dev is None:
            start, end = s.t0 + offset, s.t1 + offset
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
            pool = pools[dev]
            pool.append(s.t0)
            pool.append(s.t1)
            s.t0 = s.t1 = 0  # the events are the pool's again
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
        argss.append(args)
        if s.owner is not None:
            s.owner.add_ns(end - start)
    store.extend(names, tracks, starts, ends, argss)
    return later


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


try:  # the C loop for the C hot path's spans (same rows, ids and side effects as resolve_py)
    if os.environ.get("GPUTRACE_PURE_PYTHON", "") not in ("", "0"):
        raise ImportError("GPUTRACE_PURE_PYTHON is set")
    from gputrace._hot import resolve as _resolve_c
except ImportError:
    _resolve_c = None  # type: ignore[assignment]
