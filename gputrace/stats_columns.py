"""The statistics' per-span work as columns: `stats.summarize` groups a trace's spans here, and
takes each group's sorted durations from here, rather than holding Python lists per span.

Takes: a trace's span columns (`SpanColumns`: name, track, start, end as arrays, args a list),
the rank slot of each track and the stride of the group keys (`name * stride + slot`). Gives:
- `groups`: `Groups`, every span's group as one index column: the groups in order of first
  sight, each its spans in trace order (what a dict of lists appended span by span holds), the
  unfinished spans in groups `-1 - slot`, a digest's cover spans in `-1 - stride - slot`; each
  span's `collective` argument as one byte (`MARKED_*`); and each rank slot's finished spans
  (not cover, not another process's), in trace order;
- `sorted_durations`: end - start of a set of spans, ascending, as an int64 array;
- `take`: columns' items at a set of span indices, each as an int64 array (a gather);
- `step_of`: the step (in a rank's steps sorted by start) each of a set of times falls in;
- `track_split`: a rank's collectives on one track and its other spans off that track, as
  (starts, ends) columns (the breakdown's exposed collective time);
- `columns`: per step of the ranks' step table (a column of rows), its largest value, the first
  rank holding it and its median (`stats._steps`' verdicts, the warm-up test).
Columns take 8 bytes a span where lists took ~36 (a pointer and an int object).

The loops are C (`_hot.stats_groups`, `_hot.stats_sorted_durations`, `_hot.stats_take`,
`_hot.stats_step_of`, `_hot.stats_track_split`, csrc/stats.c); `_groups_py`,
`_sorted_durations_py`, `_take_py`, `_step_of_py` and `_track_split_py` are their references and
the fallback (`gputrace.native`); `columns` is `_hot.first_columns` (csrc/first.c, beside the
page's first document's loops), `_columns_py` its twin.
"""

from __future__ import annotations

import dataclasses
from array import array
from bisect import bisect_right
from collections.abc import Sequence
from itertools import compress, repeat
from operator import and_, eq, ne, truth
from types import ModuleType
from typing import Any

from gputrace import native

#: The span arguments the statistics read (`groups`); a trace read for them alone keeps no other
#: (`registry.only_args`).
ARGS = ("unfinished", "cover", "collective")
MARKED_NONE, MARKED_FALSE, MARKED_TRUE = 0, 1, 2  # a span's `collective` argument: absent, false, true
#: bytes.translate table: MARKED_TRUE -> 1, else 0 (a mask for itertools.compress)
TRUE_MASK = bytes(1 if b == MARKED_TRUE else 0 for b in range(256))


@dataclasses.dataclass
class Groups:
    """Spans grouped by key. `groups()` gives {key: its span indices} as views of `order`."""

    order: array[int] | memoryview  # span indices, group after group (or a view of int64 bytes)
    keys: list[int]  # the groups' keys, in order of first sight
    bounds: array[int]  # group j is order[bounds[j]:bounds[j + 1]]
    marked: bytes  # per span: MARKED_NONE, MARKED_FALSE or MARKED_TRUE
    own: array[int] | memoryview  # per rank slot, its finished spans in trace order, slot after slot
    own_bounds: array[int]  # slot s is own[own_bounds[s]:own_bounds[s + 1]]

    def groups(self) -> dict[int, Sequence[int]]:
        view = self.order if isinstance(self.order, memoryview) else memoryview(self.order)
        b = self.bounds
        return {k: view[b[j] : b[j + 1]] for j, k in enumerate(self.keys)}

    def own_spans(self, slots: int) -> list[Sequence[int]]:
        """`own_of` each of the first `slots` slots: ranges where each slot's spans lie together
        (as a merge leaves each rank's), and then `own` let go (8 bytes a span); else views."""
        got = [self.own_of(s) for s in range(slots)]
        spans: list[Sequence[int]] = []
        for v in got:
            if len(v) and v[-1] - v[0] + 1 != len(v):  # ascending: together when first to last is all
                return got
            spans.append(range(v[0], v[-1] + 1) if len(v) else range(0))
        del got
        self.own = array("q")
        return spans

    def own_of(self, slot: int) -> Sequence[int]:
        view = self.own if isinstance(self.own, memoryview) else memoryview(self.own)
        return view[self.own_bounds[slot] : self.own_bounds[slot + 1]]


def _groups_py(
    names: Sequence[int], tracks: Sequence[int], args: Sequence[Any], slot_of_track: Sequence[int], stride: int
) -> tuple[array[int], list[int], array[int], bytes, array[int], array[int]]:
    keys = [n * stride + slot_of_track[t] for n, t in zip(names, tracks)]
    marked = bytearray(len(keys))
    for i, a in enumerate(args):
        if a:
            if a.get("unfinished"):
                keys[i] = -1 - slot_of_track[tracks[i]]
            elif a.get("cover"):
                keys[i] = -1 - stride - slot_of_track[tracks[i]]
            c = a.get("collective")
            if c is not None:
                marked[i] = MARKED_TRUE if c else MARKED_FALSE
    groups: dict[int, list[int]] = {}
    get = groups.get
    for i, k in enumerate(keys):
        g = get(k)
        if g is None:
            groups[k] = [i]
        else:
            g.append(i)
    order = array("q")
    bounds = array("q", [0])
    for g in groups.values():
        order.extend(g)
        bounds.append(len(order))
    per_slot: list[list[int]] = [[] for _ in range(stride)]
    for i, k in enumerate(keys):
        if k >= 0 and k % stride != stride - 1:
            per_slot[k % stride].append(i)
    own = array("q")
    own_bounds = array("q", [0])
    for v in per_slot:
        own.extend(v)
        own_bounds.append(len(own))
    return order, list(groups), bounds, bytes(marked), own, own_bounds


def _sorted_durations_py(starts: Sequence[int], ends: Sequence[int], idx: Sequence[int]) -> array[int]:
    return array("q", sorted(ends[i] - starts[i] for i in idx))


def _take_py(idx: Sequence[int], *columns: Sequence[int]) -> tuple[array[int], ...]:
    for i in idx:
        if i < 0:  # as the C loop: a span index, never counted from the end
            raise IndexError("stats_take: a span index out of range")
    return tuple(array("q", map(c.__getitem__, idx)) for c in columns)


def _step_of_py(step_starts: Sequence[int], step_ends: Sequence[int], starts: Sequence[int]) -> array[int]:
    return array(
        "q",
        [
            j - 1 if j and a < step_ends[j - 1] else -1
            for j, a in zip(map(bisect_right, repeat(step_starts), starts), starts)
        ],
    )


def _track_split_py(
    starts: Sequence[int], ends: Sequence[int], tracks: Sequence[int], is_coll: bytes, track: int
) -> tuple[array[int], array[int], array[int], array[int]]:
    # Whole columns at a time (C-level maps), one byte a span.
    coll = bytes(map(truth, is_coll))
    mine = bytes(map(and_, coll, map(eq, tracks, repeat(track))))
    others = bytes(map(and_, coll.translate(_NOT), map(ne, tracks, repeat(track))))
    return (
        array("q", compress(starts, mine)),
        array("q", compress(ends, mine)),
        array("q", compress(starts, others)),
        array("q", compress(ends, others)),
    )


_NOT = bytes([1]) + bytes(255)  # bytes.translate table: 0 -> 1, else 0


def _from_bytes(b: bytes) -> array[int]:
    a = array("q")
    a.frombytes(b)
    return a


def int64s(b: bytes) -> memoryview:
    """The int64 items of `b` in place (a read-only view: no copy of a column of millions)."""
    return memoryview(b).cast("q")


_hot: ModuleType | None = None


def _bind(hot: ModuleType | None) -> None:
    global _hot
    _hot = hot if hot is not None and hasattr(hot, "stats_groups") else None


native.on_switch(_bind)


def groups(
    names: Sequence[int], tracks: Sequence[int], args: list[Any], slot_of_track: Sequence[int], stride: int
) -> Groups:
    """Every span's group (key `name * stride + slot`; see the module's docstring)."""
    if type(args) is not list and hasattr(args, "dense") and _hot is not None:
        args = args.dense()  # a column of no or sparse memory, as a list while grouped (8 bytes a span)
    if _hot is None or type(args) is not list:
        return Groups(*_groups_py(names, tracks, args, slot_of_track, stride))
    slots = slot_of_track if isinstance(slot_of_track, array) else array("q", slot_of_track)
    order, keys, bounds, marked, own, own_bounds = _hot.stats_groups(names, tracks, args, slots, stride)
    return Groups(
        int64s(order), _from_bytes(keys).tolist(), _from_bytes(bounds), marked, int64s(own), _from_bytes(own_bounds)
    )


def sorted_durations(starts: Sequence[int], ends: Sequence[int], idx: Sequence[int]) -> array[int]:
    """end - start of the spans `idx`, ascending."""
    if _hot is None:
        return _sorted_durations_py(starts, ends, idx)
    # Arrays are read in place, memoryviews copied once; a list becomes an array first.
    cols = idx if isinstance(idx, (array, memoryview)) else array("q", idx)
    return _from_bytes(_hot.stats_sorted_durations(starts, ends, cols))


def take(idx: Sequence[int], *columns: Sequence[int]) -> tuple[array[int], ...]:
    """For each column, its items at the span indices `idx` (non-negative), as int64 arrays."""
    if _hot is None or not hasattr(_hot, "stats_take"):
        return _take_py(idx, *columns)
    # Arrays are read in place, a list becomes an array first (the index column once for all).
    cols = [c if isinstance(c, (array, memoryview)) else array("q", c) for c in (idx, *columns)]
    return tuple(map(_from_bytes, _hot.stats_take(*cols)))


def step_of(step_starts: Sequence[int], step_ends: Sequence[int], starts: Sequence[int]) -> array[int]:
    """Per time in `starts`: the index of the last step (`step_starts` ascending) that starts at
    or before it, where that step has not ended by then (ends exclusive); else -1."""
    if _hot is None or not hasattr(_hot, "stats_step_of"):
        return _step_of_py(step_starts, step_ends, starts)
    cols = [c if isinstance(c, (array, memoryview)) else array("q", c) for c in (step_starts, step_ends, starts)]
    return _from_bytes(_hot.stats_step_of(*cols))


def track_split(
    starts: Sequence[int], ends: Sequence[int], tracks: Sequence[int], is_coll: bytes, track: int
) -> tuple[array[int], array[int], array[int], array[int]]:
    """(starts, ends) of the spans that are collectives (`is_coll`, one byte a span, not 0) on
    `track`, then (starts, ends) of those that are neither collectives nor on `track`."""
    if _hot is None or not hasattr(_hot, "stats_track_split"):
        return _track_split_py(starts, ends, tracks, is_coll, track)
    cols = [c if isinstance(c, (array, memoryview)) else array("q", c) for c in (starts, ends, tracks)]
    a, b, c, d = map(_from_bytes, _hot.stats_track_split(*cols, bytes(is_coll), track))
    return a, b, c, d


def _columns_py(rows: Sequence[Sequence[int]], count: int) -> tuple[list[int], list[int], list[int]]:
    n = len(rows)
    if n < 1:
        raise ValueError("first_columns: no rows")
    if any(len(r) < count for r in rows):
        raise ValueError("first: a row shorter than the count")
    maxes: list[int] = []
    first: list[int] = []
    medians: list[int] = []
    for col in zip(*(r[:count] for r in rows)):
        v = sorted(col)
        top = v[-1]
        maxes.append(top)
        first.append(col.index(top))  # the first largest
        medians.append(v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) // 2)
    return maxes, first, medians


def columns(rows: Sequence[Sequence[int]], count: int) -> tuple[list[int], list[int], list[int]]:
    """Per column k < `count` of `rows` (one or more rows of ints, one a rank), its largest
    value, the first row that holds it, and its median (the middle value, or the floor of the
    two middle ones' mean), as three lists."""
    if not rows:
        return [], [], []
    fn = getattr(_hot, "first_columns", None) if _hot is not None else None
    if fn is not None and type(rows) is list:
        try:
            return fn(rows, count)  # type: ignore[no-any-return]
        except OverflowError:
            pass  # a value past 64 bits: the twin takes Python's ints
    return _columns_py(rows, count)
