"""Resolving: closed spans -> absolute spans in integer epoch nanoseconds.

Takes: spans the GPU has finished (their device events) or host spans (monotonic ns), the
device timelines of anchors, and the host clock.
Gives: rows appended to a columnar `SpanStore` (interned names, int ns), the events returned
to their device's pool, and the spans that must wait for a newer anchor.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gputrace.clock import DeviceTimeline, HostClock
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
        self.id = array("q")
        self.parent = array("q")  # 0: none
        self.args: list[dict[str, Any] | None] = []
        self.dropped = 0
        self._last_id = 0

    def id_of(self, s: Span) -> int:
        """A span's id, given on first need (the hot path never numbers spans)."""
        try:
            return s.id
        except AttributeError:
            self._last_id += 1
            s.id = self._last_id
            return s.id

    def __len__(self) -> int:
        return len(self.start)

    def intern(self, name: str) -> int:
        i = self._name_index.get(name)
        if i is None:
            i = self._name_index[name] = len(self.names)
            self.names.append(name)
        return i

    def add(
        self, name: str, track: int, start: int, end: int, id_: int, parent: int, args: dict[str, Any] | None
    ) -> None:
        if len(self.start) >= self.capacity:
            self.dropped += 1
            return
        self.name.append(self.intern(name))
        self.track.append(track)
        self.start.append(start)
        self.end.append(end)
        self.id.append(id_)
        self.parent.append(parent)
        self.args.append(args)


def resolve(
    done: list[Span],
    timelines: list[DeviceTimeline],
    clock: HostClock,
    store: SpanStore,
    pools: list[list[Any]],
) -> list[Span]:
    """Append every span of `done` to `store`; return those whose events lie after the newest
    anchor of their device (they resolve at a later flush)."""
    later: list[Span] = []
    to_epoch = clock.to_epoch
    for s in done:
        track = s.track
        assert track is not None
        dev = track.device
        if dev is None:
            start, end = to_epoch(s.t0), to_epoch(s.t1)
        else:
            tl = timelines[dev]
            a = tl.locate(s.t0, s.gen)
            b = tl.locate(s.t1, a[0]) if a is not None else None
            if a is None or b is None:
                later.append(s)
                continue
            start, end = tl.to_host_ns(*a), tl.to_host_ns(*b)
            pools[dev].append(s.t0)
            pools[dev].append(s.t1)
            s.t0 = s.t1 = 0  # the events are the pool's again
        args = s.args
        error = getattr(s, "error", None)
        if error is not None:
            args = {**(args or {}), "error": error}
        parent = s.parent
        store.add(
            s.name, track.index, start, end, store.id_of(s), store.id_of(parent) if parent is not None else 0, args
        )
        if s.owner is not None:
            s.owner.add_ns(end - start)
    return later


def nest_rounding(store: SpanStore, device_tracks: set[int], tolerance_ns: int = 1_000) -> int:
    """On device tracks, pull a child's ends inside its parent where they stick out by no more
    than rounding (float32 steps, anchor segments meeting; CUDA events resolve ~0.5 us anyway).
    Host spans are exact, and a real misnest is left for the exporter's overflow tracks.
    Returns how many ends moved."""
    if not device_tracks:
        return 0
    where = {id_: i for i, id_ in enumerate(store.id)}
    children: dict[int, list[int]] = {}
    for i in range(len(store)):
        p = where.get(store.parent[i])
        if p is not None and store.track[p] == store.track[i] and store.track[i] in device_tracks:
            children.setdefault(p, []).append(i)
    moved = 0
    todo = [i for i in range(len(store)) if where.get(store.parent[i]) is None]
    order: list[tuple[int, int]] = []  # (parent, child), parents before their children
    while todo:
        p = todo.pop()
        for c in children.get(p, ()):
            order.append((p, c))
            todo.append(c)
    for p, i in order:
        if 0 < store.start[p] - store.start[i] <= tolerance_ns:
            store.start[i] = store.start[p]
            moved += 1
        if 0 < store.end[i] - store.end[p] <= tolerance_ns:
            store.end[i] = store.end[p]
            moved += 1
        if store.end[i] < store.start[i]:
            store.end[i] = store.start[i]
    return moved
