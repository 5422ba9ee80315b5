"""The page's first document: the heatmap of a run of many ranks, from their digests' step rows,
in a second or two, while the full document is computed behind it (`viewer.background`).

Takes: the ranks' traces and digests (`summary.Inputs`, as `data.digest_inputs` gives them) and
the options of the document (`data.DigestJob`). Gives: `document()`, a viewer document with
`"partial": true` that holds what the page's first view draws: the ranks and their labels, the
base time and the timeline's first window, and the steps as the heatmap needs them (per rank
and step: start, end, busy and wait; per step the median and the verdict; each cell's
reference; the worst steps). It holds no breakdown, collectives, span statistics, phases or
causes (those keys are null): the page says they are being computed.

Its numbers are those of the full document (`data.step_times` over `stats._steps`, on times
placed by merge's own clock maps): from each digest it reads only the span rows (no cover, no
per-name aggregates), decodes only the steps and collectives, and does none of the cross-rank
work of `stats.summarize` (the breakdown, matching collectives, the names' statistics).
None where that shortcut does not hold (a rank without a fresh digest of these steps, no steps,
a skip that leaves none): the caller computes the full document at once, which says what is
wrong where something is.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import accumulate, compress, islice, repeat
from operator import and_, eq, itemgetter, le
from typing import Any

from gputrace import stats
from gputrace.errors import GputraceError
from gputrace.trace import digestfile

from . import data, findings

_EMPTY_SPANS: dict[str, list[Any]] = {"name": [], "track": [], "start": [], "dur": [], "flags": []}
_EMPTY_COVER: dict[str, list[Any]] = {"track": [], "start": [], "dur": []}
_EMPTY_STATS: dict[str, list[Any]] = {
    k: [] for k in ("name", "bucket", "count", "total", "min", "max", "max_start", "max_track", "hist", "self")
}


_SMALL = bytes(range(256))
#: Flags -> 1 for a finished row (bytes.translate tables), and for a finished row marked
#: collective=True.
_FINISHED = bytes(0 if f & digestfile.UNFINISHED else 1 for f in range(256))
_MARKED_FINISHED = bytes(
    1 if f & (digestfile.COLL_TRUE | digestfile.UNFINISHED) == digestfile.COLL_TRUE else 0 for f in range(256)
)


def _within(col: list[int], count: int) -> bool:
    """Are all of `col` in [0, count)?"""
    if count <= 256:
        try:
            return not bytes(col).translate(None, _SMALL[:count])
        except ValueError:  # a value outside 0-255
            return False
    return 0 <= min(col) <= max(col) < count


class _Rank:
    """One rank's digest as the first document reads it: its header (a `RankDigest` whose trace
    holds the process and tracks, no spans) and its span rows as the file's columns."""

    def __init__(self, digest: digestfile.RankDigest, names: list[str], spans: dict[str, Any]) -> None:
        self.digest = digest
        self.names = names
        self.name: list[int] = spans["name"]
        self.track: list[int] = spans["track"]
        self.dur: list[int] = spans["dur"]
        self.flags: list[int] = spans["flags"]
        deltas = spans["start"]
        self.start = list(accumulate(deltas, initial=digest.trace.metadata["base_ns"]))  # type: ignore[union-attr]
        del self.start[0]
        # The rows in start order (the recorder writes them so): no deltas below zero.
        self.in_order = len(deltas) < 2 or min(islice(deltas, 1, None)) >= 0
        n = len(self.name)
        tracks = len(digest.trace.tracks)  # type: ignore[union-attr]
        # What the digest's reader checks of these columns (C-level passes): a digest it would
        # refuse is not read here either.
        if not len(self.track) == len(self.dur) == len(self.flags) == len(self.start) == n:
            raise ValueError("span columns of different lengths")
        # Flags (0-7), and tracks and names where they are fewer than 256, as bytes: checked and
        # picked from at C speed (bytes() refuses any other value).
        self.flag_bytes = bytes(self.flags)
        if self.flag_bytes.translate(None, _SMALL[:8]):
            raise ValueError("a span's flags out of range")
        if n and not (_within(self.track, tracks) and _within(self.name, len(names)) and min(self.dur) >= 0):
            raise ValueError("a span out of range")
        # Each row's end (the time range, and the rows' ends).
        self.end = list(map(int.__add__, self.start, self.dur))


def _read(trace_path: str, digest_path: str, step: str) -> _Rank | None:
    """The rank's digest, when it is one that `summary.collect` would read as it is (fresh, of
    these steps, of the current version), else None."""
    try:
        doc = digestfile.read_document(digest_path)
        if not isinstance(doc, dict):
            return None
        spans = doc.get("spans")
        # The header alone goes through the digest's own reader (its checks, its Trace).
        head = {**doc, "spans": _EMPTY_SPANS, "cover": _EMPTY_COVER, "stats": _EMPTY_STATS, "launch_lag": []}
        d = digestfile.from_document(head, digest_path)
        if d.version < 2 or d.step_name != step or not digestfile.fresh(d, trace_path) or not isinstance(spans, dict):
            return None
        names = [x if type(x) is str else str(x) for x in doc["names"]]
        return _Rank(d, names, spans)
    except (GputraceError, KeyError, TypeError, ValueError, IndexError, OverflowError, AttributeError):
        return None  # whatever is wrong, the full document's reader says it


def document(job: data.DigestJob) -> dict[str, Any] | None:
    """The first document of the view `job` describes, or None (see the module's docstring)."""
    from gputrace.merge.run import no_cycle_collection

    # The cycle collector off meanwhile (as merge reads traces): the digests' parsed columns are
    # millions of objects with no cycles among them, and the collections that the lists made
    # here set off walked them all (a quarter of the time, measured).
    with no_cycle_collection():
        return _document(job)


def _document(job: data.DigestJob) -> dict[str, Any] | None:
    from gputrace import merge as m

    found = job.found
    if found.lone or not found.complete:
        return None
    ranks_read: list[_Rank] = []
    for t in found.traces:
        got = _read(t, found.digests[t], job.step)
        if got is None:
            return None
        ranks_read.append(got)
    # Placed on the common timeline by merge's own maps (from each rank's metadata), as
    # `summary.load` places the digests' spans for the full document.
    sources = [m.describe_trace(r.digest.path, r.digest.trace) for r in ranks_read]  # type: ignore[arg-type]
    plan = m.plan(sources, False, None)
    maps = m.alignment(plan, "clock", None, 1, m.read_source)
    by_rank = {r.digest.rank: r for r in ranks_read}
    ranks = sorted(by_rank)
    if len(by_rank) != len(ranks_read):
        return None  # two files of one rank: the full document's merge says what to do
    rows = _Rows()
    # The collective rule of `stats.summarize`, over every rank's rows.
    marked_true = any(f & digestfile.COLL_TRUE for r in ranks_read for f in set(r.flag_bytes))
    any_marked = any(f & digestfile.COLL for r in ranks_read for f in set(r.flag_bytes))
    lo: list[int] = []
    hi: list[int] = []
    for slot, rank in enumerate(ranks):
        rows.add(slot, by_rank[rank], job.step, maps.host.get(rank), maps.device.get(rank), marked_true, any_marked)
        a, b = rows.lo[slot], rows.hi[slot]
        if a is not None and b is not None:
            lo.append(a)
            hi.append(b)
    if not rows.step_idx or not lo:
        return None  # no steps: the full document says so, or draws what there is
    skip = job.skip_steps or 0
    fewest = min(len(v) for v in rows.step_idx.values())
    if skip >= fewest:
        return None  # the full document's error says how many there are
    notes: list[str] = []
    st = rows.steps(job.step, skip, ranks, notes)
    warmup_note = None
    if job.skip_steps is None:
        k, factor = findings.warmup_steps(st)
        job.warmup = (k, factor)  # the full document's, as its own summary would find them
        if k:
            st = rows.steps(job.step, k, ranks, [])
            warmup_note = data._warmup_note(k, factor)
    base = min(lo)
    slot_of = {r: i for i, r in enumerate(ranks)}
    refs = data._refs(st)
    inputs = [data.shown_text(str(p)) for p in job.inputs]
    labels = [by_rank[r].digest.trace.processes[0].label for r in ranks]  # type: ignore[union-attr]
    last = min(st.count, 3) - 1
    t_lo = min(v[0] for v in st.start_ns.values()) - base
    t_hi = max(v[last] for v in st.end_ns.values()) - base
    meta = m.merged_metadata(plan, maps, m.Selection.make(), m.merged_start(plan, maps), list(plan.notes))
    alignment_of = _Meta(meta)
    return {
        "format": data.FORMAT,
        "partial": True,
        "title": data._title(inputs, ranks),
        "inputs": inputs,
        "ranks": ranks,
        "labels": labels,
        "base_ns": base,
        "duration_ns": max(hi) - base,
        "spans": None,
        "step_name": job.step,
        "steps": data.step_times(st, slot_of, base, refs),
        "collectives": None,
        "stats": None,
        "counts": None,
        "notes": [
            f"read from the ranks' step digests ({len(ranks)} ranks); the timeline reads the trace files one "
            "window at a time",
            *([warmup_note] if warmup_note else []),
            *[data.shown_text(n) for n in notes],
        ],
        "warmup_auto": warmup_note is not None,
        "alignment": data._alignment(alignment_of, ranks),  # type: ignore[arg-type]
        "timeline": {
            "base_ns": base,
            "whole": False,
            "limit": data.TIMELINE_SPANS,
            "initial": [max(t_lo, 0), max(t_hi, t_lo + 1)],
        },
        "pids": [r + 1 for r in ranks],
        "worst": data._worst(st, slot_of, refs),
        "phases": None,
        "causes": None,
    }


class _Meta:
    """What `data._alignment` reads of a trace: its metadata."""

    def __init__(self, metadata: dict[str, Any]) -> None:
        self.metadata = metadata


class _Rows:
    """Every rank's step and collective spans, their times placed, in two columns (`start`,
    `end`) that `stats._steps` reads by index, as it reads a merged trace's."""

    def __init__(self) -> None:
        self.start: array[int] = array("q")
        self.end: array[int] = array("q")
        self.step_idx: dict[int, list[int]] = {}
        self.coll: dict[int, list[int]] = {}
        self.lo: list[int | None] = []
        self.hi: list[int | None] = []
        self.anchor: list[int] = []

    def add(
        self,
        slot: int,
        r: _Rank,
        step: str,
        host: Any,
        device: Any,
        marked_true: bool,
        any_marked: bool,
    ) -> None:
        trace = r.digest.trace
        assert trace is not None
        self.anchor.append(stats._anchor_uncertainty(trace.metadata))
        # Each track's map: the device's for a rank's CUDA tracks where its syncs were refined.
        fns = [device if (t.kind == "cuda" and device is not None) else host for t in trace.tracks]
        n = len(r.name)
        if not n:
            self.lo.append(None)
            self.hi.append(None)
            return
        # The time range of all its rows (the full document's base and duration): the maps are
        # monotone, so each map's first start and last end, placed.
        los, his = [], []
        if len({id(f) for f in fns}) == 1:
            los.append(_place(fns[0], [r.start[0] if r.in_order else min(r.start)])[0])
            his.append(_place(fns[0], [max(r.end)])[0])
        else:
            for ti in set(r.track):
                on = list(map(eq, r.track, repeat(ti)))
                los.append(_place(fns[ti], [min(compress(r.start, on))])[0])
                his.append(_place(fns[ti], [max(compress(r.end, on))])[0])
        self.lo.append(min(los))
        self.hi.append(max(his))
        # Finished spans only (C-level passes; none to look for where no flag says unfinished).
        unfinished = max(r.flag_bytes) >= digestfile.UNFINISHED  # flags are 0-7: the bit set
        finished: Any = r.flag_bytes.translate(_FINISHED) if unfinished else None
        step_ids = [k for k, x in enumerate(r.names) if x == step]
        if len(step_ids) == 1:
            is_step = map(eq, r.name, repeat(step_ids[0]))
            steps = list(compress(range(n), is_step if finished is None else map(and_, is_step, finished)))
        else:  # names the digest's cleaning made equal
            steps = [i for i in range(n) if (finished is None or finished[i]) and r.name[i] in step_ids]
        if marked_true:
            # The spans marked collective=True (the step span too, were it marked).
            colls = list(compress(range(n), r.flag_bytes.translate(_MARKED_FINISHED)))
        else:
            waits = {k for k, x in enumerate(r.names) if x != step and stats.WAIT_NAMES.search(x)}
            colls = [
                i
                for i in range(n)
                if (finished is None or finished[i])
                and r.name[i] in waits
                and not (any_marked and r.flags[i] & digestfile.COLL and not r.flags[i] & digestfile.COLL_TRUE)
            ]
        in_order = r.in_order
        for idx in (steps, colls):
            at = len(self.start)
            _append(self.start, _placed(fns, r.track, idx, _at(r.start, idx)))
            _append(self.end, _placed(fns, r.track, idx, _at(r.end, idx)))
            rows = list(range(at, at + len(idx)))
            # In start order (the order `stats.summarize` takes them in, ties in trace order): as
            # they are where the digest's rows are and one map placed them all.
            rows = rows if in_order and len(set(map(id, fns))) == 1 else _by_start(rows, self.start)
            if idx is steps:
                if rows:
                    self.step_idx[slot] = rows
            else:
                self.coll[slot] = rows

    def steps(self, step: str, skip: int, ranks: list[int], notes: list[str]) -> stats.Steps:
        """`stats._steps` over these rows, the first `skip` steps left out (and the collectives
        that start before the first kept step, as `stats.summarize` leaves them out)."""
        start = self.start
        coll_idx: dict[int, list[int]] = {}
        for s in range(len(ranks)):
            got = self.coll.get(s, [])
            if skip and s in self.step_idx:
                cut = start[self.step_idx[s][skip]]
                got = [i for i in got if start[i] >= cut]
            coll_idx[s] = got  # a part of rows in start order
        return stats._steps(step, skip, self.step_idx, coll_idx, ranks, start, self.end, self.anchor, notes)


def _by_start(rows: list[int], start: array[int]) -> list[int]:
    """Rows (consecutive) in start order, ties in their order (`sorted`'s); most come so
    already (one C-level look then)."""
    if len(rows) < 2:
        return rows
    times = start[rows[0] : rows[0] + len(rows)]
    if all(map(le, times, times[1:])):
        return rows
    return sorted(rows, key=start.__getitem__)


def _place(fn: Any, values: Sequence[int]) -> Sequence[int]:
    # A map that moves nothing (no clock sync recorded) leaves the values as they are.
    return values if fn is None or not fn.knots else fn.column(values)


def _append(col: array[int], values: Sequence[int]) -> None:
    """`values` appended to `col` (from a list, twice as fast as `extend` from a tuple)."""
    if isinstance(values, array):
        col.extend(values)
    else:
        col.fromlist(values if isinstance(values, list) else list(values))


def _at(values: list[int], idx: list[int]) -> Sequence[int]:
    """values[i] for i in idx, gathered at C speed."""
    if len(idx) > 1:
        return itemgetter(*idx)(values)  # type: ignore[no-any-return]
    return [values[i] for i in idx]


def _placed(fns: list[Any], track: list[int], idx: list[int], times: Sequence[int]) -> Sequence[int]:
    """`times` (of rows `idx`, in that order), each through its row's track's map (one call per
    map)."""
    if len({id(f) for f in fns}) <= 1:
        return _place(fns[0] if fns else None, times)
    out = array("q", bytes(8 * len(idx)))
    by_fn: dict[int, list[int]] = {}
    for j, i in enumerate(idx):
        by_fn.setdefault(id(fns[track[i]]), []).append(j)
    for js in by_fn.values():
        fn = fns[track[idx[js[0]]]]
        for j, v in zip(js, _place(fn, [times[j] for j in js])):
            out[j] = v
    return out
