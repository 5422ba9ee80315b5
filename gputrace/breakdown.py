"""Why a step is slow: each rank's step broken down, and self time per span.

Takes: one rank's spans (intervals in integer ns with their tracks), its step windows and its
collective occurrences (from `stats`). Gives, per step of the rank (DESIGN.md "Why a step is
slow"; all on the timeline the spans are on, the merged and aligned one in `stats`):

- idle: time in the step when no span of the rank is open on any of its tracks, leaving out the
  step spans themselves and the spans that enclose a step on its own track (its ancestors, such
  as an `epoch` span): those are open the whole step by construction;
- collective transfer: time inside collectives after the last rank arrived (arrival: the
  collective span's start), and collective wait: the rest of the time inside collectives, so
  that wait + transfer is the step's time inside collectives (`Steps.wait_ns`);
- exposed collective: collective time during which no work (a span that is not a collective, a
  step or a step's ancestor) is open on another track of the rank (another stream or thread);
- launch lag: of the step's first CUDA span (the one that started first on the GPU inside the
  step window: for a step timed on a CUDA stream, the step span itself), device start minus host
  entry: how far the GPU ran behind the host as the step's work began; None where no CUDA span
  with a known entry time started in the step;

and per span, its self time: its duration less the time of its children, the spans that lie
inside it on its own track that no span between them encloses (`self_times`).

The digest builder (`gputrace.digest`) computes the same quantities as the rank flushes, with
the same rules (`is_ancestor`, `nest`): these functions are its reference.

Cost: sorting the rank's spans once per track; the rest is linear, with two bisections a step.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from itertools import accumulate, compress
from operator import sub, truth
from typing import Any

from gputrace import native, stats_columns

Intervals = tuple[list[int], list[int]]  # sorted, disjoint [start, end) pairs as two columns


def _union_py(starts: Sequence[int], ends: Sequence[int]) -> Intervals:
    """The union of [start, end) intervals as sorted, disjoint intervals (touching ones joined)."""
    us: list[int] = []
    ue: list[int] = []
    for a, b in sorted(zip(starts, ends)):
        if b <= a:
            continue
        if us and a <= ue[-1]:
            if b > ue[-1]:
                ue[-1] = b
        else:
            us.append(a)
            ue.append(b)
    return us, ue


def _minus_py(xs: Sequence[int], xe: Sequence[int], ys: Sequence[int], ye: Sequence[int]) -> Intervals:
    """x less y, both sorted and disjoint."""
    us: list[int] = []
    ue: list[int] = []
    j = 0
    for a, b in zip(xs, xe):
        while j < len(ys) and ye[j] <= a:
            j += 1
        k = j
        while a < b and k < len(ys) and ys[k] < b:
            if ys[k] > a:
                us.append(a)
                ue.append(ys[k])
            a = max(a, ye[k])
            k += 1
        if a < b:
            us.append(a)
            ue.append(b)
    return us, ue


def _within_py(us: Sequence[int], ue: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> list[int]:
    """For each window [starts[k], ends[k]): the length of (us, ue), sorted and disjoint, inside it."""
    prefix = list(accumulate(map(sub, ue, us), initial=0))
    out = []
    for a, b in zip(starts, ends):
        # The intervals [i, j) meet [a, b): i the first ending after a, j the first starting at
        # or after b; their lengths from the prefix sums, less what lies outside.
        i = bisect_right(ue, a)
        j = bisect_left(us, b)
        if i >= j:
            out.append(0)
            continue
        out.append(prefix[j] - prefix[i] - (a - us[i] if us[i] < a else 0) - (ue[j - 1] - b if ue[j - 1] > b else 0))
    return out


def _covered_py(starts: Sequence[int], ends: Sequence[int], ws: Sequence[int], we: Sequence[int]) -> list[int]:
    """For each window [ws[k], we[k]): the length of the union of the intervals inside it."""
    return _within_py(*_union_py(starts, ends), ws, we)


def _c_loops(hot: Any) -> None:
    """Bind the C build's interval loops (None where gputrace.native has the Python twins in use)."""
    global _union_c, _minus_c, _within_c, _covered_c
    got = [
        getattr(hot, f"interval_{x}", None) if hot is not None else None
        for x in ("union", "minus", "within", "covered")
    ]
    _union_c, _minus_c, _within_c, _covered_c = got


_union_c: Any = None
_minus_c: Any = None
_within_c: Any = None
_covered_c: Any = None
native.on_switch(_c_loops)


def _q(v: Sequence[int]) -> array[int]:
    return v if isinstance(v, array) and v.typecode == "q" else array("q", v)


def union(starts: Sequence[int], ends: Sequence[int]) -> Intervals:
    if _union_c is not None:
        return _union_c(_q(starts), _q(ends))  # type: ignore[no-any-return]
    return _union_py(starts, ends)


def union_columns(starts: Sequence[int], ends: Sequence[int]) -> tuple[array[int], array[int]]:
    """`union` as two int64 arrays: 8 bytes an interval, where lists take ~36 (a rank of millions
    of spans that do not overlap has as many intervals)."""
    if _union_c is not None:
        us, ue = array("q"), array("q")
        bs, be = _union_c(_q(starts), _q(ends), True)
        us.frombytes(bs)
        del bs  # one column's bytes alive at a time
        ue.frombytes(be)
        return us, ue
    a, b = _union_py(starts, ends)
    return array("q", a), array("q", b)


def minus(xs: Sequence[int], xe: Sequence[int], ys: Sequence[int], ye: Sequence[int]) -> Intervals:
    if _minus_c is not None:
        return _minus_c(_q(xs), _q(xe), _q(ys), _q(ye))  # type: ignore[no-any-return]
    return _minus_py(xs, xe, ys, ye)


def within(us: Sequence[int], ue: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> list[int]:
    if _within_c is not None:
        return _within_c(_q(us), _q(ue), _q(starts), _q(ends))  # type: ignore[no-any-return]
    return _within_py(us, ue, starts, ends)


def covered(starts: Sequence[int], ends: Sequence[int], ws: Sequence[int], we: Sequence[int]) -> list[int]:
    """`within(*union(starts, ends), ws, we)` without the union's columns: the C loop merges the
    intervals in one buffer (16 bytes an interval) and reads each window off it; a rank of
    millions of spans that do not overlap has as many intervals."""
    if _covered_c is not None:
        return _covered_c(_q(starts), _q(ends), _q(ws), _q(we))  # type: ignore[no-any-return]
    return _covered_py(starts, ends, ws, we)


def is_ancestor(
    s: int, e: int, t: int, step_starts: Sequence[int], step_ends: Sequence[int], step_tracks: Sequence[int]
) -> bool:
    """Does the span [s, e) on track t enclose a step on its own track (and is longer: a span of
    the step's very times is taken for its child)? Looked up in the rank's steps sorted by
    start: the first that starts at or after s."""
    j = bisect_left(step_starts, s)
    return (
        j < len(step_starts) and step_ends[j] <= e and step_tracks[j] == t and (step_starts[j] > s or step_ends[j] < e)
    )


def nest(order: Sequence[int], tracks: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> list[int]:
    """The time of each span's children: `order` lists span indices by (track, end, start
    descending), a child before a parent of the same times as written; each span takes as its
    children the spans of its track not yet taken that start at or after it (they end no later:
    they came first), the top of a stack sorted by start."""
    children = [0] * len(starts)
    stack: list[int] = []
    track = None
    for i in order:
        if tracks[i] != track:
            track = tracks[i]
            stack = []
        s = starts[i]
        c = 0
        while stack and starts[stack[-1]] >= s:
            j = stack.pop()
            c += ends[j] - starts[j]
        children[i] = c
        stack.append(i)
    return children


def nest_order(indices: Iterable[int], tracks: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> list[int]:
    """`indices` in the order `nest` takes (stable: ties keep their order)."""
    return sorted(indices, key=lambda i: (tracks[i], ends[i], -starts[i]))


def self_times(
    indices: Sequence[int], tracks: Sequence[int], starts: Sequence[int], ends: Sequence[int]
) -> dict[int, int]:
    """Span index -> its self time (its duration less its children's), for the spans `indices`
    of one rank."""
    order = nest_order(indices, tracks, starts, ends)
    children = nest(order, tracks, starts, ends)
    return {i: ends[i] - starts[i] - children[i] for i in indices}


def rank_breakdown(
    step_starts: Sequence[int],
    step_ends: Sequence[int],
    starts: Sequence[int],
    ends: Sequence[int],
    tracks: Sequence[int],
    colls: Sequence[bool] | bytes,
    transfers: tuple[Sequence[int], Sequence[int]],
    wait_ns: Sequence[int],
) -> tuple[list[int], list[int], list[int], list[int]]:
    """One rank's idle, collective wait, collective transfer and exposed collective time in each
    step window. The spans (`starts`, `ends`, `tracks`, and whether each is a collective): the
    rank's spans other than steps and their ancestors (`tracks` may be empty where none is a
    collective: they serve the exposed collective time alone); `transfers`: each of its
    collectives' time after the last rank arrived (starts, ends); `wait_ns`: each step's time
    inside collectives."""
    # The step windows and the picked spans as int64 arrays once, not at every loop's call.
    step_starts, step_ends = _q(step_starts), _q(step_ends)
    idle = [b - a - x for a, b, x in zip(step_starts, step_ends, covered(starts, ends, step_starts, step_ends))]
    # Unions as int64 columns: `within` reads them in place, where lists would be converted.
    transfer = within(*union_columns(*transfers), step_starts, step_ends)
    wait = [w - x for w, x in zip(wait_ns, transfer)]
    coll_tracks = sorted(set(compress(tracks, colls)))
    xs: list[int] = []
    xe: list[int] = []
    is_coll = bytes(map(truth, colls)) if coll_tracks else b""  # one byte a span, once for every track
    for t in coll_tracks:
        # The track's collectives less the time of spans elsewhere that are not collectives.
        ms, me, os_, oe = stats_columns.track_split(starts, ends, tracks, is_coll, t)
        a, b = minus(*union_columns(ms, me), *union_columns(os_, oe))
        xs += a
        xe += b
    exposed = within(*union_columns(xs, xe), step_starts, step_ends)
    return idle, wait, transfer, exposed


def launch_lags(
    step_starts: Sequence[int], step_ends: Sequence[int], entries: Sequence[tuple[int, int]]
) -> list[int | None]:
    """Per step window: device start - host entry of the CUDA span that started first in it
    (the first entered among equal starts), or None. `entries`: (host entry, device start) of
    the rank's CUDA spans whose entry is known, in the order written. Placed by device start, not
    by entry: the host enters the spans of a CUDA step before the step starts on the GPU."""
    firsts = sorted(range(len(entries)), key=lambda k: (entries[k][1], entries[k][0]))
    es = [entries[k][1] for k in firsts]
    out: list[int | None] = []
    for a, b in zip(step_starts, step_ends):
        j = bisect_left(es, a)
        if j < len(es) and es[j] < b:
            e, s = entries[firsts[j]]
            out.append(s - e)
        else:
            out.append(None)
    return out
