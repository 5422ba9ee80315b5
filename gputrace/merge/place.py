"""Merge's placement: every file's spans moved onto the merged timeline.

Takes: a checked `Plan` (from `merge.sources`), how to align (`clock`: the offsets the ranks
measured, with drift; `none`; or the ends of the n-th occurrence of a named collective span) and
a `Selection`. Gives: the clock maps of every rank (`alignment`: host, and device for CUDA
tracks, and the alignment's record), the merged trace's first instant (`merged_start`), each
file's kept processes, tracks, spans, counters and other events appended to the output `Trace`
through its rank's maps and the selection's windows (`take`, which returns what it found:
`Taken`; `Tally` adds those up into notes), a trace built in another process appended
(`append_part`), and the merged metadata (`merged_metadata`, `string_keys`, `json_metadata`).
The maps are monotone per track, so spans that nested in a file still nest.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gputrace import align as al
from gputrace.errors import MergeError
from gputrace.merge.select import Selection, step_notes
from gputrace.merge.sources import SORT_SLOTS, Plan, Source, merged_ranks
from gputrace.trace.model import PackedArgs, Process, SpanColumns, Trace, _NoCats
from gputrace.version import __version__

# ---- alignment ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Maps:
    """The maps to apply now, per rank (host, and device for CUDA tracks), and the alignment
    metadata to record."""

    host: dict[int, al.ClockMap]
    device: dict[int, al.ClockMap]
    metadata: dict[str, Any]


def alignment(p: Plan, align: str, align_on: str | None, occurrence: int, read: Callable[[Source], Trace]) -> Maps:
    """Each rank's maps onto the merged timeline, and the alignment's record (`read` gives a
    source's trace, for `align_on`)."""
    if align not in ("clock", "none"):
        raise MergeError(f"unknown alignment {align!r}: use clock or none")
    if occurrence < 1:
        raise MergeError("--occurrence counts from 1")
    ident = al.ClockMap()
    merged = p.sources[0] if p.sources and p.sources[0].kind == "merged" else None
    files = {r: s.path for s in p.sources for r in (s.ranks or ([s.rank] if s.rank is not None else []))}
    per: dict[int, al.RankAlignment] = {}
    host: dict[int, al.ClockMap] = {}
    device: dict[int, al.ClockMap] = {}
    if align_on is not None:
        ends = _collective_ends(p, align_on, occurrence, read)
        per = al.from_collective_ends(ends, align_on, occurrence)
        per = {r: dataclasses.replace(a, file=files.get(r, "")) for r, a in per.items()}
        host = {r: a.map for r, a in per.items()}
        meta = al.Alignment("align-on", per, align_on, occurrence).metadata()
        if merged is not None:
            meta["before"] = _merged_alignment(merged)
        return Maps(host, device, meta)
    if merged is not None:
        # Its alignment was applied when it was merged: its times stay as they are.
        recorded = _merged_alignment(merged)
        host = {r: ident for r in p.all_ranks}
        recorded["per_rank"] = {r: v for r, v in recorded.get("per_rank", {}).items() if r in p.all_ranks}
        return Maps(host, device, recorded)
    own = {s.rank: s for s in p.sources if s.kind == "rank"}
    for r in p.all_ranks:
        src = own.get(r)
        if align == "none":
            per[r] = al.identity(r, files.get(r, ""))
        elif src is None:
            per[r] = al.identity(r, files.get(r, ""), "no gputrace trace of this rank: its times are taken as they are")
        else:
            per[r] = al.from_metadata(r, src.rank_meta.get(r, {}), src.path)
        host[r] = per[r].map
        if per[r].device_map is not None:
            device[r] = per[r].device_map  # type: ignore[assignment]
    return Maps(host, device, al.Alignment(align, per).metadata())


def _merged_alignment(src: Source) -> dict[str, Any]:
    meta = dict((src.merged_meta or {}).get("alignment") or {})
    meta["per_rank"] = {int(k): v for k, v in (meta.get("per_rank") or {}).items()}
    return meta


def _collective_ends(p: Plan, name: str, occurrence: int, read: Callable[[Source], Trace]) -> dict[int, int]:
    """Each rank's end of the n-th `name` span (by start), from its own process, else from the
    other tool's trace of that rank."""
    found: dict[int, tuple[int, list[tuple[int, int]]]] = {}  # rank -> (priority, [(start, end)])
    for s in p.sources:
        trace = read(s)
        try:
            idx = trace.names.index(name)
        except ValueError:
            idx = -1
        if s.kind == "merged":
            proc_rank = [(r, 1 if f else 0) for r, f in merged_ranks(trace)]
        else:
            proc_rank = [(s.rank, 0 if (not q.foreign and s.kind != "foreign") else 1) for q in trace.processes]
        track_info = [proc_rank[t.process] for t in trace.tracks]
        hits: dict[tuple[int, int], list[tuple[int, int]]] = {}
        if idx >= 0:
            sp = trace.spans
            for i, n in enumerate(sp.name):
                if n == idx:
                    r, prio = track_info[sp.track[i]]
                    if r is not None:
                        hits.setdefault((r, prio), []).append((sp.start[i], sp.end[i]))
        for (r, prio), spans in hits.items():
            if r not in p.all_ranks:
                continue
            have = found.get(r)
            if have is None or prio < have[0]:
                found[r] = (prio, spans)
            elif prio == have[0]:
                have[1].extend(spans)
    ends: dict[int, int] = {}
    for r in p.all_ranks:
        spans = sorted(found.get(r, (0, []))[1])
        if len(spans) < occurrence:
            where = next((s.path for s in p.sources if r in s.ranks or s.rank == r), f"rank {r}")
            raise MergeError(
                f"{where}: --align-on {name!r}: rank {r} has {len(spans)} such spans, occurrence {occurrence} asked"
            )
        ends[r] = spans[occurrence - 1][1]
    return ends


# ---- moving one file's spans onto the merged timeline -------------------------------------------


@dataclasses.dataclass
class Context:
    """Everything `take` needs besides the file itself: what the plan decided, cut down to the
    files at hand (`for_group`) so that handing it to a worker process costs little."""

    keep_ranks: frozenset[int]
    rank_sort: dict[int, int]
    pids: dict[tuple[str, Any], int]
    sorts: dict[tuple[str, Any], int]
    spare: dict[str, int]
    maps: Maps
    selection: Selection
    window: tuple[int | None, int | None] | None  # absolute

    @classmethod
    def make(cls, p: Plan, maps: Maps, sel: Selection, window: tuple[int | None, int | None] | None) -> Context:
        return cls(frozenset(p.all_ranks), p.rank_sort, p.pids, p.sorts, p.spare, maps, sel, window)

    def for_group(self, group: list[Source]) -> Context:
        if any(s.kind == "merged" for s in group):
            return self
        ranks = {s.rank for s in group}
        paths = {s.path for s in group}
        m = self.maps
        return Context(
            frozenset(r for r in ranks if r in self.keep_ranks),
            {r: v for r, v in self.rank_sort.items() if r in ranks},
            {k: v for k, v in self.pids.items() if k[0] in paths},
            {k: v for k, v in self.sorts.items() if k[0] in paths},
            {k: v for k, v in self.spare.items() if k in paths},
            Maps(
                {r: v for r, v in m.host.items() if r in ranks},
                {r: v for r, v in m.device.items() if r in ranks},
                {},
            ),
            self.selection,
            self.window,
        )


@dataclasses.dataclass
class Taken:
    spans: int = 0
    step_names: set[str] = dataclasses.field(default_factory=set)  # names seen, when no step span was
    steps_found: dict[int, int] = dataclasses.field(default_factory=dict)  # rank -> steps it has
    negative: int = 0
    windows: dict[int, tuple[int, int] | None] = dataclasses.field(default_factory=dict)
    nested: list[int] = dataclasses.field(default_factory=list)  # processes whose spans nest as written
    cut: list[str] = dataclasses.field(default_factory=list)  # files read only up to where they were cut


def take(
    out: Trace,
    src: Source,
    trace: Trace,
    ctx: Context,
    windows: dict[int, tuple[int, int] | None],
    consume: bool = False,
) -> Taken:
    """Append `trace` (the file `src`) to `out`: its kept processes, tracks and spans, times
    mapped onto the merged timeline and selected. `windows` carries each rank's step window
    from its own file to the other tools' files of that rank (filled in as ranks are taken).
    `consume`: the caller drops `trace` afterwards, so its columns may become `out`'s where
    `out` has no spans yet (moved, not copied: a rank's columns are its largest part)."""
    sel = ctx.selection
    keep_ranks = ctx.keep_ranks
    res = Taken()
    if trace.metadata.get("file_cut"):
        res.cut.append(src.path)
    # Processes.
    proc_map: list[int] = []
    proc_rank: list[int | None] = []
    spare = ctx.spare.get(src.path, 1 << 24)
    ranks_of = merged_ranks(trace) if src.kind == "merged" else []
    for k, q in enumerate(trace.processes):
        if src.kind == "merged":
            rank, foreign = ranks_of[k]
        else:
            rank, foreign = src.rank, q.foreign or src.kind == "foreign"
        if (rank is not None and rank not in keep_ranks) or (rank is None and sel.ranks is not None):
            proc_map.append(-1)
            proc_rank.append(rank)
            continue
        if not foreign:
            assert rank is not None
            meta = src.rank_meta.get(rank, q.metadata)
            new = Process(rank + 1, rank, q.label, ctx.rank_sort.get(rank, rank), meta, False)
        else:
            pid = ctx.pids.get((src.path, q.pid))
            sort = ctx.sorts.get((src.path, q.pid))
            if pid is None:  # not planned (a gputrace file described by its header alone)
                pid, spare = spare, spare + 1
                sort = (ctx.rank_sort.get(rank, 0) if rank is not None else 1 << 30) + SORT_SLOTS - 1
            label = q.label if rank is None or f"rank {rank}" in q.label else f"{q.label} [rank {rank}]"
            new = Process(pid, rank, label, sort if sort is not None else 0, q.metadata, True)
        proc_map.append(out.add_process(new))
        proc_rank.append(rank)
        if src.kind != "foreign":
            # gputrace's writer laid these out so that every track nests, and the maps are
            # monotone per track: they still nest, no need to check again.
            res.nested.append(proc_map[-1])
    # Tracks, and the map each track's times go through.
    track_map = array("l")
    track_fn: list[al.ClockMap | None] = []
    host_fn: list[al.ClockMap | None] = []  # the map of each track's host times (spans' entries)
    for t in trace.tracks:
        np_ = proc_map[t.process]
        if np_ < 0:
            track_map.append(-1)
            track_fn.append(None)
            host_fn.append(None)
            continue
        track_map.append(out.add_track(dataclasses.replace(t, process=np_)))
        r = proc_rank[t.process]
        fn = ctx.maps.host.get(r) if r is not None else None
        host_fn.append(fn or _IDENTITY)
        if t.kind == "cuda" and r is not None and r in ctx.maps.device and not out.processes[np_].foreign:
            fn = ctx.maps.device[r]
        track_fn.append(fn or _IDENTITY)
    sp = trace.spans
    n = len(sp)
    starts, ends = _map_columns(sp.start, sp.end, sp.track, track_fn)
    # Which rows to keep.
    dropped_tracks = any(m < 0 for m in track_map)
    rows: Sequence[int] | None = None
    # Perfetto drops a span that ends before it starts (and the writer refuses one): `map` over
    # the two arrays finds any at C speed, the per-row loop runs only then.
    inverted = n > 0 and min(map(int.__sub__, ends, starts)) < 0
    negative = [i for i in range(n) if ends[i] < starts[i]] if inverted else []
    if sel.by_time:
        track_rank = [proc_rank[t.process] for t in trace.tracks]
        own_track = [proc_map[t.process] >= 0 and not out.processes[proc_map[t.process]].foreign for t in trace.tracks]
        if sel.steps is not None:
            _step_windows(trace, sp, starts, ends, track_rank, own_track, sel, res, windows)
        rank_window: dict[int | None, tuple[int, int] | None] = {}
        for r in set(track_rank):
            rank_window[r] = _intersect(windows.get(r) if sel.steps is not None else (None, None), ctx.window)  # type: ignore[arg-type]
        win = [rank_window[r] if track_map[ti] >= 0 else None for ti, r in enumerate(track_rank)]
        rows = [
            i
            for i in range(n)
            if (w := win[sp.track[i]]) is not None
            and starts[i] < w[1]
            and (ends[i] > w[0] or starts[i] >= w[0])
            and ends[i] >= starts[i]
        ]
    elif dropped_tracks or negative:
        bad = set(negative)
        rows = [i for i in range(n) if track_map[sp.track[i]] >= 0 and i not in bad]
    res.negative = len(negative)
    # Columns.
    remap = [out.intern(nm) for nm in trace.names]
    o = out.spans
    before = len(o)
    if rows is None:
        # Ranks of one program intern their names in the same order: then no remapping at all.
        same_names = remap == list(range(len(remap)))
        names_col = (
            sp.name if same_names and isinstance(sp.name, array) else array("l", map(remap.__getitem__, sp.name))
        )
        first = track_map[0] if len(track_map) else 0
        same_tracks = first == 0 and list(track_map) == list(range(len(track_map)))
        tracks_col = (
            sp.track
            if same_tracks and isinstance(sp.track, array)
            else array("l", map(track_map.__getitem__, sp.track))
        )
        if consume and before == 0 and _movable(o, names_col, tracks_col, starts, ends, sp):
            o.name, o.track, o.start, o.end = names_col, tracks_col, starts, ends
            o.args, o.cat = sp.args, sp.cat
        else:
            o.name.extend(names_col)
            o.track.extend(tracks_col)
            o.start.extend(starts)
            o.end.extend(ends)
            o.args.extend(sp.args if isinstance(sp.args, list) else [sp.args[i] for i in range(n)])
            _extend_cat(o, sp.cat)
        del names_col, tracks_col
        res.spans = n
    else:
        names, tracks, args, cats = sp.name, sp.track, sp.args, sp.cat
        o.name.extend(array("l", [remap[names[i]] for i in rows]))
        o.track.extend(array("l", [track_map[tracks[i]] for i in rows]))
        o.start.extend(array("q", [starts[i] for i in rows]))
        o.end.extend(array("q", [ends[i] for i in rows]))
        o.args.extend([args[i] for i in rows])
        _extend_cat(o, [cats[i] for i in rows])
        res.spans = len(rows)
    take_entry(o, before, sp, rows, host_fn)
    _take_counters(out, trace, track_map, track_fn, sel, ctx, windows, proc_rank)
    _take_extra(out, trace, proc_map, proc_rank, sel, ctx, windows)
    return res


_IDENTITY = al.ClockMap()


def _movable(o: SpanColumns, *columns: Any) -> bool:
    """Can these columns become `o`'s as they are: arrays of `o`'s own typecodes, and `sp`'s
    args and cat columns that `o` can extend later (plain lists, packed arguments, categories of
    None that `_extend_cat` makes a list when others come)?"""
    *arrays, sp = columns
    same = all(
        isinstance(c, array) and c.typecode == mine.typecode
        for c, mine in zip(arrays, (o.name, o.track, o.start, o.end))
    )
    return same and type(sp.args) in (list, PackedArgs) and type(sp.cat) in (list, _NoCats)


def _extend_cat(o: SpanColumns, cats: Sequence[str | None]) -> None:
    """`cats` after `o`'s categories: `o`'s stay a column of no memory while they are all None."""
    if type(o.cat) is _NoCats:
        if type(cats) is _NoCats or (type(cats) is list and cats.count(None) == len(cats)):
            o.cat.extend(cats)
            return
        o.cat = o.cat.dense()
    o.cat.extend(cats if type(cats) is list else [cats[i] for i in range(len(cats))])


def take_entry(
    o: SpanColumns, before: int, sp: SpanColumns, rows: Sequence[int] | None, fns: Sequence[al.ClockMap | None]
) -> None:
    """The `entry` column for the spans just taken into `o` (rows `before` on; `rows` of `sp`, or
    all): each host entry through its track's host map (`fns`, per track of `sp`), as the rank's
    host spans go, 0 kept as unknown. A column neither side has stays None."""
    if sp.entry is None and o.entry is None:
        return
    n = len(o) - before
    if o.entry is None:
        o.entry = array("q", bytes(8 * before))
    if sp.entry is None:
        o.entry.extend(array("q", bytes(8 * n)))
        return
    picked = range(len(sp)) if rows is None else rows
    entry, track = sp.entry, sp.track
    # A slice of rows at a time: the per-row lists stay small whatever the rank's size.
    for lo in range(0, n, al.COLUMN_SLICE):
        part = picked[lo : lo + al.COLUMN_SLICE]
        moved = array("q", bytes(8 * len(part)))
        by_fn: dict[int, tuple[al.ClockMap, list[int]]] = {}
        for k, i in enumerate(part):
            if entry[i] > 0:
                f = fns[track[i]] or _IDENTITY
                by_fn.setdefault(id(f), (f, []))[1].append(k)
        for f, ks in by_fn.values():
            values = [entry[part[k]] for k in ks]
            for k, v in zip(ks, f.column(values) if f.knots else values):
                moved[k] = v
        o.entry.extend(moved)


def _map_columns(
    start: Sequence[int], end: Sequence[int], track: Sequence[int], fns: list[al.ClockMap | None]
) -> tuple[array[int], array[int]]:
    used = {id(f): f for f in fns if f is not None}
    if len(used) <= 1:
        only = next(iter(used.values()), _IDENTITY)
        if not only.knots:
            return (start if isinstance(start, array) else array("q", start)), (
                end if isinstance(end, array) else array("q", end)
            )
        return only.column(start), only.column(end)
    # Tracks that go through different maps (a rank's device spans, another rank's process):
    # each group of rows through its own map, in one pass per map.
    # A slice of rows at a time, so the per-row lists stay small whatever the rank's size.
    s_out, e_out = array("q", start), array("q", end)
    fid = [id(f) if f is not None else 0 for f in fns]
    for lo in range(0, len(track), al.COLUMN_SLICE):
        groups: dict[int, list[int]] = {}
        for i in range(lo, min(lo + al.COLUMN_SLICE, len(track))):
            groups.setdefault(fid[track[i]], []).append(i)
        for key, idx in groups.items():
            f = used.get(key)
            if f is None or not f.knots:
                continue
            ms = f.column([start[i] for i in idx])
            me = f.column([end[i] for i in idx])
            for k, i in enumerate(idx):
                s_out[i] = ms[k]
                e_out[i] = me[k]
    return s_out, e_out


def _intersect(
    a: tuple[int | None, int | None] | None, b: tuple[int | None, int | None] | None
) -> tuple[int, int] | None:
    if a is None:
        return None
    lo, hi = a
    if b is not None:
        lo = b[0] if lo is None else (lo if b[0] is None else max(lo, b[0]))
        hi = b[1] if hi is None else (hi if b[1] is None else min(hi, b[1]))
    lo = -(1 << 62) if lo is None else lo
    hi = 1 << 62 if hi is None else hi
    return (lo, hi) if hi > lo else None


def _step_windows(
    trace: Trace,
    sp: Any,
    starts: Sequence[int],
    ends: Sequence[int],
    track_rank: list[int | None],
    own_track: list[bool],
    sel: Selection,
    res: Taken,
    windows: dict[int, tuple[int, int] | None],
) -> None:
    """Each rank's [start of step first, end of step stop - 1], from its own `step_name` spans."""
    assert sel.steps is not None
    ranks_here = {r for r, own in zip(track_rank, own_track) if own and r is not None}
    try:
        idx = trace.names.index(sel.step_name)
    except ValueError:
        idx = -1
    per: dict[int, list[tuple[int, int]]] = {r: [] for r in ranks_here}
    if idx >= 0:
        for i, nm in enumerate(sp.name):
            if nm == idx:
                t = sp.track[i]
                r = track_rank[t]
                if own_track[t] and r is not None:
                    per[r].append((starts[i], ends[i]))
    if idx < 0 and ranks_here:
        res.step_names.update(trace.names)
    a, b = sel.steps
    for r, steps in per.items():
        steps.sort()
        res.steps_found[r] = len(steps)
        chosen = steps[a or 0 : b]
        windows[r] = (chosen[0][0], max(e for _, e in chosen)) if chosen else None


def _take_counters(
    out: Trace,
    trace: Trace,
    track_map: array[int],
    track_fn: list[al.ClockMap | None],
    sel: Selection,
    ctx: Context,
    windows: dict[int, tuple[int, int] | None],
    proc_rank: list[int | None],
) -> None:
    c = trace.counters
    if not len(c):
        return
    last_before: dict[int, tuple[int, float]] = {}
    for i in range(len(c)):
        t = c.track[i]
        nt = track_map[t]
        if nt < 0:
            continue
        fn = track_fn[t] or _IDENTITY
        ts = fn(c.ts[i])
        if sel.by_time:
            r = proc_rank[trace.tracks[t].process]
            w = _intersect(windows.get(r) if sel.steps is not None else (None, None), ctx.window)  # type: ignore[arg-type]
            if w is None or ts >= w[1]:
                continue
            if ts < w[0]:
                # The value in force when the window opens: restated at its start.
                last_before[nt] = (w[0], c.value[i])
                continue
            if nt in last_before:
                out.counters.append(nt, *last_before.pop(nt))
        out.counters.append(nt, ts, c.value[i])
    for nt, (ts, v) in last_before.items():
        out.counters.append(nt, ts, v)


def _take_extra(
    out: Trace,
    trace: Trace,
    proc_map: list[int],
    proc_rank: list[int | None],
    sel: Selection,
    ctx: Context,
    windows: dict[int, tuple[int, int] | None],
) -> None:
    for e in trace.extra:
        pi = e.get("process")
        if not isinstance(pi, int) or proc_map[pi] < 0:
            continue
        r = proc_rank[pi]
        fn = ctx.maps.host.get(r, _IDENTITY) if r is not None else _IDENTITY
        ts = fn(e["ts_ns"])
        if sel.by_time:
            w = _intersect(windows.get(r) if sel.steps is not None else (None, None), ctx.window)  # type: ignore[arg-type]
            if w is None or not (w[0] <= ts < w[1]):
                continue
        moved = dict(e)
        moved["ts_ns"] = ts
        if "dur_ns" in e:
            moved["dur_ns"] = max(0, fn(e["ts_ns"] + e["dur_ns"]) - ts)
        moved["process"] = proc_map[pi]
        out.extra.append(moved)


# ---- the merged trace's metadata -----------------------------------------------------------------


def merged_metadata(p: Plan, maps: Maps, sel: Selection, base_ns: int, notes: list[str]) -> dict[str, Any]:
    """The merged trace's metadata (rank keys as ints; see `merge.load`)."""
    files = {r: s.path for s in p.sources for r in s.ranks}
    align = dict(maps.metadata)
    per = align.get("per_rank") or {}
    for r, entry in per.items():
        if isinstance(entry, dict) and "file" not in entry and r in files:
            entry["file"] = files[r]
    meta: dict[str, Any] = {
        "merged": True,
        "gputrace_version": __version__,
        "ranks": p.ranks,
        "world_size": p.world_size if p.world_size is not None else (max(p.all_ranks) + 1 if p.all_ranks else 0),
        "alignment": align,
        "rank_metadata": {r: s.rank_meta[r] for s in p.sources for r in s.ranks if r in s.rank_meta and r in p.ranks},
        "base_ns": base_ns,
    }
    if p.run_id is not None:
        meta["run_id"] = p.run_id
    if sel.ranks is not None or sel.by_time:
        meta["selection"] = sel.metadata()
    if notes:
        meta["notes"] = notes
    return meta


def merged_start(p: Plan, maps: Maps) -> int:
    """The merged trace's first instant: each file's start through every map its times use (the
    maps are monotone, so nothing of the file maps before)."""
    firsts = []
    for s in p.sources:
        if s.start_ns is None:
            continue
        rs = s.ranks or ([s.rank] if s.rank is not None else [])
        fns = [maps.host.get(r, _IDENTITY) for r in rs] + [maps.device[r] for r in rs if r in maps.device]
        if s.kind == "merged" or not fns:
            fns.append(_IDENTITY)
        firsts += [f(s.start_ns) for f in fns]
    return min(firsts) if firsts else 0


def string_keys(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The metadata as JSON holds it: rank keys as strings."""
    out = {k: v for k, v in meta.items() if k != "base_ns"}
    align = dict(out.get("alignment") or {})
    align["per_rank"] = {str(r): v for r, v in align.get("per_rank", {}).items()}
    out["alignment"] = align
    out["rank_metadata"] = {str(r): v for r, v in (out.get("rank_metadata") or {}).items()}
    return out


def json_metadata(meta: dict[str, Any], p: Plan) -> dict[str, Any]:
    """The metadata as written into a merged JSON file, with which pid is which rank (the
    reader needs it before it sees any event)."""
    out = string_keys(meta)
    pid_rank = {str(r + 1): r for r in p.all_ranks if r in p.ranks}
    by_path = {s.path: s for s in p.sources}
    for (path, pid), new in p.pids.items():
        r = next((rr for pp, rr in by_path[path].foreign if pp == pid), None)
        if r is not None:
            pid_rank[str(new)] = r
    out["pid_rank"] = pid_rank
    out["foreign_pids"] = sorted(p.pids.values())
    return out


def append_part(out: Trace, part: Trace) -> None:
    """Append a trace built elsewhere (a worker's rank) to `out`: indices moved, names re-interned."""
    procs = [out.add_process(q) for q in part.processes]
    t0 = len(out.tracks)
    for t in part.tracks:
        out.add_track(dataclasses.replace(t, process=procs[t.process]))
    remap = [out.intern(nm) for nm in part.names]
    sp, o = part.spans, out.spans
    before = len(o)
    o.name.extend(sp.name if remap == list(range(len(remap))) else array("l", map(remap.__getitem__, sp.name)))
    o.track.extend(sp.track if t0 == 0 else array("l", map(t0.__add__, sp.track)))
    o.start.extend(sp.start)
    o.end.extend(sp.end)
    o.args.extend(sp.args)
    _extend_cat(o, sp.cat)
    take_entry(o, before, sp, None, [None] * len(part.tracks))  # already moved by the worker's `take`
    c = part.counters
    out.counters.track.extend(array("l", map(t0.__add__, c.track)))
    out.counters.ts.extend(c.ts)
    out.counters.value.extend(c.value)
    p0 = procs[0] if procs else 0
    for e in part.extra:
        e["process"] += p0
        out.extra.append(e)


class Tally:
    """What `take` found over every file, added up: the step checks and the notes it makes."""

    def __init__(self) -> None:
        self.found: dict[int, int] = {}
        self.names: set[str] = set()
        self.negative = 0
        self.cut: list[str] = []

    def add(self, results: list[Taken]) -> None:
        for r in results:
            self.found.update(r.steps_found)
            self.names |= r.step_names
            self.negative += r.negative
            self.cut += r.cut

    def notes(self, sel: Selection) -> list[str]:
        notes = step_notes(sel, self.found, self.names, any(self.found.values()))
        if self.negative:
            notes.append(f"{self.negative} spans that end before they start were left out (Perfetto drops them too)")
        if self.cut:
            shown = ", ".join(self.cut[:3]) + (f" and {len(self.cut) - 3} more" if len(self.cut) > 3 else "")
            notes.append(
                f"{shown}: not finished (the recording was killed, or the file was cut): read up to the last "
                "complete event"
            )
        return notes
