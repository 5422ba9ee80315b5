"""What a rank's digest keeps for the step breakdown and self time, built as the rank flushes.

Takes: the digest builder's batches (`gputrace.digest.Builder`): columns of name, track, start,
end (and the host entry times, where the chunks have them), the rank's finished steps so far,
and each span's aggregate key. Gives, for the digest document (`Local.document`):

- `cover`: per track, the union of the rank's spans that are neither step, collective nor other
  rows of the digest, nor a step's ancestor (`breakdown.is_ancestor`), as disjoint intervals;
  with the rows the digest keeps, it is all `stats` needs for idle and exposed collective time,
  and it goes through merge's alignment like any span (so the numbers are those of the full
  trace on the merged timeline). Memory: one interval per gap between spans on a track;
- `self`: per aggregate key, the time of its spans' children (`breakdown.nest`, batch after
  batch: the spans of a track not yet taken by a parent are carried to the next batch, at most
  CARRY_SPANS of them; older ones are summed up per track, and a parent that takes only some of
  those makes its name's self time unknown rather than wrong);
- `launch_lag`: per finished step (in start order), device start minus host entry of the CUDA
  span that started first in the step (`breakdown.launch_lags`), or None.

The per-span work is C loops (`_hot.digest_cover`, `_hot.digest_nest`, `_hot.digest_entries`,
`_hot.digest_lags`); `_cover_py`, `_nest_py`, `_entries_py` and `_lags_py` are their references
and the fallback. Work per batch stays per span of the batch: the cover of a batch after the
track's is appended, and the waiting host entries are placed again only once new steps came.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from itertools import accumulate, compress, repeat
from operator import and_, ge, gt, itemgetter, le, lt, sub
from typing import Any

from gputrace import native
from gputrace.breakdown import is_ancestor

#: Spans not yet taken by a parent, carried from batch to batch (all tracks together); past this
#: many the oldest are summed per track.
CARRY_SPANS = 1 << 16
_NONE = -(1 << 63)  # no summed-up spans on a track


def _cover_py(
    names: Sequence[int],
    tracks: Sequence[int],
    starts: Sequence[int],
    ends: Sequence[int],
    skip: bytes | None,
    row_mask: bytes,
    step_starts: Sequence[int],
    step_ends: Sequence[int],
    step_tracks: Sequence[int],
) -> tuple[list[int], list[int], list[int]]:
    """The union per track of the spans that are not set in `skip`, not of a name set in
    `row_mask`, not other tools' (track < 0), not empty or inverted, and not a step's ancestor:
    (track, start, end) of disjoint intervals, by track then start."""
    # Column operations where they do (this runs in the recording process without the C build):
    # a mask only where some span must be left out, the ancestor lookup only for spans as long as
    # the shortest step, the union from running maxima of the ends.
    n = len(starts)
    keep: Sequence[bool] | None = None
    if (
        skip is not None
        or (n and min(tracks) < 0)
        or any(map(le, ends, starts))
        or any(map(row_mask.__getitem__, (k for k in set(names) if 0 <= k < len(row_mask))))
    ):
        keep = [
            t >= 0 and e > s and not (skip is not None and skip[i]) and not (0 <= k < len(row_mask) and row_mask[k])
            for i, (k, t, s, e) in enumerate(zip(names, tracks, starts, ends))
        ]
    least = min(map(sub, step_ends, step_starts), default=None)
    if least is not None:
        long = map(ge, map(sub, ends, starts), repeat(least))
        candidates = compress(range(n), long if keep is None else map(and_, keep, long))
        ancestors = {
            i for i in candidates if is_ancestor(starts[i], ends[i], tracks[i], step_starts, step_ends, step_tracks)
        }
        if ancestors:
            keep = [(keep is None or keep[i]) and i not in ancestors for i in range(n)]
    picked = zip(tracks, starts, ends) if keep is None else compress(zip(tracks, starts, ends), keep)
    pieces = sorted(picked)
    ot: list[int] = []
    os_: list[int] = []
    oe: list[int] = []
    lo = 0
    while lo < len(pieces):
        t = pieces[lo][0]
        hi = bisect_left(pieces, (t + 1,), lo)
        ss = list(map(itemgetter(1), pieces[lo:hi]))
        reach = list(accumulate(map(itemgetter(2), pieces[lo:hi]), max))
        # A new interval where a start is past every end before it.
        breaks = list(map(gt, ss[1:], reach[:-1]))
        os_ += [ss[0], *compress(ss[1:], breaks)]
        oe += [*compress(reach[:-1], breaks), reach[-1]]
        ot += repeat(t, len(os_) - len(ot))
        lo = hi
    return ot, os_, oe


def _nest_py(
    names: Sequence[int],
    tracks: Sequence[int],
    starts: Sequence[int],
    ends: Sequence[int],
    skip: bytes | None,
    steps: Sequence[int],
    bucket: int,
    nb: int,
    carry_tracks: Sequence[int],
    carry_starts: Sequence[int],
    carry_ends: Sequence[int],
    floor: Sequence[int],
) -> tuple[list[int], ...]:
    """`breakdown.nest` over a batch, with the spans not yet taken from the batches before
    (`carry_*`, by track then start). Each span's key is name * nb + its warm-up bucket (as
    `digest._fold_py` gives it). Returns: the keys and the time their spans' children took
    (keys in the order first met); the spans not yet taken after the batch (track, start, end, by
    track then start); and the spans that took every carried span of their track whose start is
    at or before `floor[track]` (the latest start summed up there; a track past the end of
    `floor` has none) as key, track, start."""
    if skip is None and (not tracks or min(tracks) >= 0) and not any(map(gt, starts, ends)):
        taken: Sequence[int] = range(len(starts))
    else:
        taken = [
            i
            for i, (t, s, e) in enumerate(zip(tracks, starts, ends))
            if t >= 0 and e >= s and not (skip is not None and skip[i])
        ]
    # By track (stable), then by end and start descending: a track's spans written in end order
    # (children before parents, as recorded) are in that order already.
    by_track = sorted(taken, key=tracks.__getitem__)
    order: list[int] = []
    lo = 0
    while lo < len(by_track):
        t = tracks[by_track[lo]]
        hi = lo + 1
        while hi < len(by_track) and tracks[by_track[hi]] == t:
            hi += 1
        part = by_track[lo:hi]
        part_ends = list(map(ends.__getitem__, part))
        if all(map(lt, part_ends, part_ends[1:])):
            order += part
        else:
            order += sorted(part, key=lambda i: (ends[i], -starts[i]))
        lo = hi
    stacks: dict[int, list[tuple[int, int]]] = {}
    for t, s, e in zip(carry_tracks, carry_starts, carry_ends):
        stacks.setdefault(t, []).append((s, e))
    index: dict[int, int] = {}
    ck: list[int] = []
    cn: list[int] = []
    bk: list[int] = []
    bt: list[int] = []
    bs: list[int] = []
    track = None
    st: list[tuple[int, int]] = []
    for i in order:
        t, s = tracks[i], starts[i]
        if t != track:
            track = t
            st = stacks.setdefault(t, [])
        if st and st[-1][0] >= s:
            c = 0
            while st and st[-1][0] >= s:
                a, b = st.pop()
                c += b - a
            key = names[i] * nb + min(bisect_right(steps, s) if bucket < 0 else bucket, nb - 1)
            if c:
                j = index.get(key)
                if j is None:
                    j = index[key] = len(ck)
                    ck.append(key)
                    cn.append(0)
                cn[j] += c
        if not st and t < len(floor) and s <= floor[t]:
            bk.append(names[i] * nb + min(bisect_right(steps, s) if bucket < 0 else bucket, nb - 1))
            bt.append(t)
            bs.append(s)
        st.append((s, ends[i]))
    ot: list[int] = []
    os_: list[int] = []
    oe: list[int] = []
    for t in sorted(stacks):
        for s, e in stacks[t]:
            ot.append(t)
            os_.append(s)
            oe.append(e)
    return ck, cn, ot, os_, oe, bk, bt, bs


def _c_loops(hot: Any) -> None:
    """Bind the C build's loops (None where gputrace.native has the Python twins in use)."""
    global _cover_c, _nest_c, _entries_c, _lags_c, _deltas_c, _span_total_c
    _deltas_c = getattr(hot, "int_deltas", None) if hot is not None else None
    _span_total_c = getattr(hot, "int_span_total", None) if hot is not None else None
    _cover_c = getattr(hot, "digest_cover", None) if hot is not None else None
    _nest_c = getattr(hot, "digest_nest", None) if hot is not None else None
    _entries_c = getattr(hot, "digest_entries", None) if hot is not None else None
    _lags_c = getattr(hot, "digest_lags", None) if hot is not None else None


_deltas_c: Any = None
_span_total_c: Any = None
_cover_c: Any = None
_nest_c: Any = None
_entries_c: Any = None
_lags_c: Any = None
native.on_switch(_c_loops)


def cover_spans(*a: Any) -> tuple[list[int], list[int], list[int]]:
    return (_cover_c or _cover_py)(*a)


def nest_spans(*a: Any) -> tuple[list[int], ...]:
    if _nest_c is not None:
        got = _nest_c(*a)
        if got is not NotImplemented:  # sums past 2^63 ns are Python's
            return got  # type: ignore[no-any-return]
    return _nest_py(*a)


def _entries_py(
    entry: Sequence[int],
    tracks: Sequence[int],
    starts: Sequence[int],
    ends: Sequence[int],
    skip: bytes | None,
    cuda_mask: bytes,
) -> tuple[array[int], array[int]]:
    """(host entry, device start) of the spans with a host entry on a CUDA track (a byte a track
    in `cuda_mask`), not inverted, not set in `skip`, in span order."""
    xs, ss = array("q"), array("q")
    for i, (x, t, s) in enumerate(zip(entry, tracks, starts)):
        if x > 0 and 0 <= t < len(cuda_mask) and cuda_mask[t] and ends[i] >= s and not (skip is not None and skip[i]):
            xs.append(x)
            ss.append(s)
    return xs, ss


def _lags_py(
    xs: Sequence[int], ss: Sequence[int], step_starts: Sequence[int], step_ends: Sequence[int], final: bool
) -> tuple[list[int], list[int], list[int], array[int], array[int]]:
    """Entries placed in the steps by device start, as `breakdown.launch_lags` places them: per
    step that got one (ascending), its index and the entry and start of its least (start,
    entry); then the entries that wait (unless `final`: no steps yet, or past the last end)."""
    last_end = max(step_ends) if step_ends else None
    best: dict[int, tuple[int, int]] = {}
    wx, ws = array("q"), array("q")
    for x, s in zip(xs, ss):
        j = bisect_right(step_starts, s) - 1
        if j >= 0 and s < step_ends[j]:
            got = best.get(j)
            if got is None or (s, x) < got:
                best[j] = (s, x)
        elif not final and (last_end is None or s >= last_end):
            wx.append(x)
            ws.append(s)
    idx = sorted(best)
    return idx, [best[j][1] for j in idx], [best[j][0] for j in idx], wx, ws


def _deltas_py(a: Sequence[int], b: Sequence[int] | None, base: int) -> list[int]:
    if b is None:
        return list(map(sub, a, [base, *a[:-1]]))
    return list(map(sub, a, b))


def int_deltas(a: Sequence[int], b: Sequence[int] | None = None, base: int = 0) -> list[int]:
    """[a[i] - b[i]]; with no `b`, each of `a` less the one before it (the first less `base`): a
    digest document's columns, a list of ints (a million-interval cover in C: no Python call an
    item, which cost ~0.3 us a span of a save where every span is its own interval)."""
    if _deltas_c is not None:
        got = _deltas_c(a, b, base)
        if got is not NotImplemented:
            return got  # type: ignore[no-any-return]
    return _deltas_py(a, b, base)


def _span_total_py(ends: Sequence[int], starts: Sequence[int], lo: int, hi: int) -> int:
    return sum(ends[lo:hi]) - sum(starts[lo:hi])


def span_total(ends: array[int], starts: array[int], lo: int, hi: int) -> int:
    """The summed durations of rows lo:hi (`sum(ends[lo:hi]) - sum(starts[lo:hi])`): in C, the
    carried spans summed up without a Python int each (tens of thousands a batch in a flat run)."""
    if _span_total_c is not None:
        got = _span_total_c(ends, starts, lo, hi)
        if got is not NotImplemented:
            return got  # type: ignore[no-any-return]
    return _span_total_py(ends, starts, lo, hi)


def entries(*a: Any) -> tuple[array[int], array[int]]:
    if _entries_c is None:
        return _entries_py(*a)
    bx, bs = _entries_c(*a)
    return _array_of(bx), _array_of(bs)


def lags_of(*a: Any) -> tuple[list[int], list[int], list[int], array[int], array[int]]:
    if _lags_c is None:
        return _lags_py(*a)
    idx, px, ps, bx, bs = _lags_c(*a)
    return idx, px, ps, _array_of(bx), _array_of(bs)


def _array_of(b: bytes) -> array[int]:
    col = array("q")
    col.frombytes(b)
    return col


def nest_carried(*a: Any) -> tuple[Any, ...]:
    """`nest_spans` with the spans left untaken as int64 arrays (they pass through every batch)."""
    if _nest_c is not None:
        got = _nest_c(*a, False, True)
        if got is not NotImplemented:
            return (*got[:2], *map(_array_of, got[2:5]), *got[5:])
    got = _nest_py(*a)
    return (*got[:2], *(array("q", x) for x in got[2:5]), *got[5:])


def cover_columns(*a: Any) -> tuple[array[int], array[int], array[int]]:
    """`cover_spans` as int64 columns (arrays): 8 bytes an interval, where lists take ~36 (`stats`
    on a whole rank of millions of spans, a digest's cover)."""
    if _cover_c is not None:
        got = list(_cover_c(*a, True))
        cols = []
        for j in range(3):  # one column's bytes and array alive at a time
            col = array("q")
            col.frombytes(got[j])
            got[j] = b""
            cols.append(col)
        return cols[0], cols[1], cols[2]
    t, s, e = _cover_py(*a)
    return array("q", t), array("q", s), array("q", e)


def nest_keys(*a: Any) -> tuple[list[int], list[int]]:
    """`nest_spans`' keys and their spans' children's time alone, with nothing carried to a next
    batch (`stats`, which reads a whole rank at once, keeps no list of its untaken spans)."""
    if _nest_c is not None:
        got = _nest_c(*a, True)
        if got is not NotImplemented:
            return got[0], got[1]
    got = _nest_py(*a)
    return got[0], got[1]


class Local:
    """One rank's cover, children's time per key and launch lags, fed batch by batch."""

    def __init__(self) -> None:
        # The rank's finished steps so far, in start order.
        self.step_starts: list[int] = []
        self.step_ends: list[int] = []
        self.step_tracks: list[int] = []
        # track -> its cover's starts and ends (int64 columns: 16 bytes an interval, and no
        # Python int an interval on the way to the document, where a run with idle gaps has one
        # a span)
        self.cover: dict[int, tuple[array[int], array[int]]] = {}
        self.children: dict[int, int] = {}  # key -> its spans' children's time
        self.unknown_names: set[int] = set()  # names whose self time cannot be told
        self.carry: tuple[array[int], array[int], array[int]] = (array("q"), array("q"), array("q"))
        # track -> [least start, latest start, time, 1 once a parent took some] of the spans summed up
        self.summed: dict[int, list[int]] = {}
        self.lags: dict[int, tuple[int, int]] = {}  # step start -> (host entry, device start)
        # Host entries and device starts past the steps known, placed again once steps change.
        self.pending: tuple[array[int], array[int]] = (array("q"), array("q"))
        self._steps_changed = 0  # counts the calls of `steps`
        self._placed_at = 0  # the count the pending entries were last placed at

    def steps(self, starts: Sequence[int], ends: Sequence[int], tracks: Sequence[int]) -> None:
        """Finished step spans of a batch (before the batch's other work)."""
        self._steps_changed += 1
        if not self.step_starts or min(starts) >= self.step_starts[-1]:
            order = sorted(range(len(starts)), key=starts.__getitem__)  # the usual case: after the ones known
            self.step_starts.extend(map(starts.__getitem__, order))
            self.step_ends.extend(map(ends.__getitem__, order))
            self.step_tracks.extend(map(tracks.__getitem__, order))
            return
        for s, e, t in zip(starts, ends, tracks):
            j = bisect_right(self.step_starts, s)
            self.step_starts.insert(j, s)
            self.step_ends.insert(j, e)
            self.step_tracks.insert(j, t)

    def work(
        self,
        names: Sequence[int],
        tracks: Sequence[int],
        starts: Sequence[int],
        ends: Sequence[int],
        skip: bytes | None,
        row_mask: bytes,
        entry: Sequence[int] | None,
        cuda: Sequence[bool],
    ) -> None:
        """A batch's cover and host entries (`skip`: its unfinished spans and marked rows)."""
        ct, cs, ce = cover_columns(
            names,
            tracks,
            starts,
            ends,
            skip,
            row_mask,
            array("q", self.step_starts),
            array("q", self.step_ends),
            array("q", self.step_tracks),
        )
        lo = 0
        n = len(ct)
        while lo < n:
            t = ct[lo]
            hi = bisect_right(ct, t, lo)  # the intervals come by track
            self._merge(t, cs[lo:hi], ce[lo:hi])
            lo = hi
        xs, ss = (array("q"), array("q"))
        if entry is not None:
            xs, ss = entries(entry, tracks, starts, ends, skip, bytes(cuda))
        if self._placed_at != self._steps_changed and len(self.pending[0]):
            # New steps: the waiting entries are placed again with this batch's. Otherwise they
            # would wait again, so only the batch's are placed.
            xs, ss = self.pending[0] + xs, self.pending[1] + ss
            self.pending = (array("q"), array("q"))
        self._placed_at = self._steps_changed
        if len(xs):
            wx, ws = self._place(self.lags, xs, ss, final=False)
            self.pending[0].extend(wx)
            self.pending[1].extend(ws)

    def _merge(self, t: int, xs: array[int], xe: array[int]) -> None:
        """Disjoint intervals (sorted) into track t's cover: they mostly come after it, so only
        its tail from the first they touch is merged again."""
        have = self.cover.get(t)
        if have is None:
            self.cover[t] = (xs, xe)
            return
        us, ue = have
        if xs[0] > ue[-1]:  # all after it (a flush's spans, after the last): appended as they are
            us += xs
            ue += xe
            return
        j = bisect_left(ue, xs[0])  # the first interval ending at or after the batch's first start
        pairs = sorted(zip(us[j:] + xs, ue[j:] + xe))
        del us[j:], ue[j:]
        for a, b in pairs:
            if us and a <= ue[-1]:
                if b > ue[-1]:
                    ue[-1] = b
            else:
                us.append(a)
                ue.append(b)

    def _place(
        self, lags: dict[int, tuple[int, int]], xs: array[int], ss: array[int], final: bool
    ) -> tuple[array[int], array[int]]:
        """Host entries `xs` at device starts `ss` into `lags` by the known steps: the first started
        of each step is kept; those starting past the last step known are returned to wait
        (unless `final`); others (between steps) are dropped."""
        st = array("q", self.step_starts)
        idx, px, ps, wx, ws = lags_of(xs, ss, st, array("q", self.step_ends), final)
        for j, x, s in zip(idx, px, ps):
            got = lags.get(st[j])
            if got is None or (s, x) < (got[1], got[0]):
                lags[st[j]] = (x, s)
        return wx, ws

    def nest(
        self,
        names: Sequence[int],
        tracks: Sequence[int],
        starts: Sequence[int],
        ends: Sequence[int],
        skip: bytes | None,
        steps: Sequence[int],
        bucket: int,
        nb: int,
    ) -> None:
        """A batch's children's time per key (the batches in the order written)."""
        floor = array("q", [_NONE]) * (max(self.summed, default=-1) + 1)
        for t, got in self.summed.items():
            floor[t] = got[1]
        ck, cn, ot, os_, oe, bk, bt, bs = nest_carried(
            names, tracks, starts, ends, skip, steps, bucket, nb, *self.carry, floor
        )
        ch = self.children
        for k, c in zip(ck, cn):
            ch[k] = ch.get(k, 0) + c
        for k, t, s in zip(bk, bt, bs):
            v = self.summed.get(t)
            if v is None:
                continue
            if s <= v[0] and not v[3]:  # it encloses every span summed up: they are its children
                ch[k] = ch.get(k, 0) + v[2]
                del self.summed[t]
            else:
                # It takes some of them (or the sum holds spans taken already): which, and so
                # how much, is not known.
                self.unknown_names.add(k // nb)
                if s <= v[0]:
                    del self.summed[t]
                else:
                    v[3] = 1
        self.carry = (ot, os_, oe)
        if len(ot) > CARRY_SPANS:
            self._sum_up()

    def _sum_up(self) -> None:
        """Keep the newest half of the carried spans of each track; sum up the others."""
        ct, cs, ce = self.carry
        n = len(ct)
        tracks, lo = 0, 0
        while lo < n:  # the carried spans come by track (a set of the column: a Python int a span)
            lo = bisect_right(ct, ct[lo], lo)
            tracks += 1
        keep_each = max(1, CARRY_SPANS // 2 // tracks)
        ot, os_, oe = array("q"), array("q"), array("q")
        lo = 0
        while lo < n:
            t = ct[lo]
            hi = bisect_right(ct, t, lo)  # the carried spans come by track
            cut = max(lo, hi - keep_each)
            if cut > lo:
                v = self.summed.setdefault(t, [cs[lo], cs[lo], 0, 0])
                v[0] = min(v[0], cs[lo])
                v[1] = max(v[1], cs[cut - 1])
                v[2] += span_total(ce, cs, lo, cut)
            ot.extend(ct[cut:hi])
            os_.extend(cs[cut:hi])
            oe.extend(ce[cut:hi])
            lo = hi
        self.carry = (ot, os_, oe)

    def copy(self) -> Local:
        """A copy that can be finished (`nest` on the buffered batches) without changing this one."""
        c = Local()
        c.__dict__.update(self.__dict__)
        c.children = dict(self.children)
        c.unknown_names = set(self.unknown_names)
        c.carry = (array("q", self.carry[0]), array("q", self.carry[1]), array("q", self.carry[2]))
        c.summed = {t: list(v) for t, v in self.summed.items()}
        c.pending = (array("q", self.pending[0]), array("q", self.pending[1]))
        c.lags = dict(self.lags)
        return c

    def document(self, base_ns: int) -> dict[str, Any]:
        """`cover` (track, start as deltas from the one before, the first from base_ns, dur) and
        `launch_lag` (per finished step in start order: an int or None). Building may go on."""
        ct: list[int] = []
        starts = array("q")
        cd: list[int] = []
        for t in sorted(self.cover):
            us, ue = self.cover[t]
            ct += repeat(t, len(us))
            starts += us
            cd += int_deltas(ue, us)
        cs = int_deltas(starts, None, base_ns)
        lags: list[int | None] = [None] * len(self.step_starts)
        if self.lags or len(self.pending[0]):
            placed = dict(self.lags)
            self._place(placed, *self.pending, final=True)
            for k, s in enumerate(self.step_starts):
                got = placed.get(s)
                if got is not None:
                    lags[k] = got[1] - got[0]
        return {"cover": {"track": ct, "start": cs, "dur": cd}, "launch_lag": lags}

    def self_column(self, keys: Sequence[int], totals: Sequence[int], nb: int) -> list[int | None]:
        """Per aggregate key: its self time (its total less its spans' children's), or None."""
        return [None if k // nb in self.unknown_names else t - self.children.get(k, 0) for k, t in zip(keys, totals)]
