"""The statistics' per-span work as columns: `stats.summarize` groups a trace's spans here, and
takes each group's sorted durations from here, rather than holding Python lists per span.

Takes: a trace's span columns (`SpanColumns`: name, track, start, end as arrays, args a list),
the rank slot of each track and the stride of the group keys (`name * stride + slot`). Gives:
- `groups`: `Groups`, every span's group as one index column: the groups in order of first
  sight, each its spans in trace order (what a dict of lists appended span by span holds), the
  unfinished spans in groups `-1 - slot`, a digest's cover spans in `-1 - stride - slot`; each
  span's `collective` argument as one byte (`MARKED_*`); and each rank slot's finished spans
  (not cover, not another process's), in trace order;
- `sorted_durations`: end - start of a set of spans, ascending, as an int64 array.
Columns take 8 bytes a span where lists took ~36 (a pointer and an int object).

The loops are C (`_hot.stats_groups`, `_hot.stats_sorted_durations`, csrc/stats.c); `_groups_py`
and `_sorted_durations_py` are their references and the fallback (`gputrace.native`).
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from gputrace import native

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
