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
per-name aggregates), in one pass over the parsed columns that checks them and picks the steps
and the collectives by either rule (`_hot.first_rows`, csrc/first.c; `_rows_py` its twin), and
does none of the cross-rank work of `stats.summarize` (the breakdown, matching collectives, the
names' statistics).
None where that shortcut does not hold (a rank without a fresh digest of these steps, no steps,
a skip that leaves none): the caller computes the full document at once, which says what is
wrong where something is.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from itertools import accumulate, compress, islice, repeat
from operator import add, eq, le
from types import ModuleType
from typing import Any

from gputrace import native, stats
from gputrace.errors import GputraceError
from gputrace.trace import digestfile

from . import data, findings

_EMPTY_SPANS: dict[str, list[Any]] = {"name": [], "track": [], "start": [], "dur": [], "flags": []}
_EMPTY_COVER: dict[str, list[Any]] = {"track": [], "start": [], "dur": []}
_EMPTY_STATS: dict[str, list[Any]] = {
    k: [] for k in ("name", "bucket", "count", "total", "min", "max", "max_start", "max_track", "hist", "self")
}


#: A name's kind in a digest's rows (`_rows_py`'s `kinds`): the step, a name that waits (a
#: collective by its name, `stats.WAIT_NAMES`), another.
_OTHER, _STEP, _WAITING = 0, 1, 2

_hot: ModuleType | None = None
#: What `_rows_py` gives.
_RowsRead = tuple[int, bool, bytes, bytes, bytes, tuple[tuple[bytes, bytes, bytes], ...]]


def _bind(hot: ModuleType | None) -> None:
    global _hot
    _hot = hot if hot is not None and hasattr(hot, "first_rows") else None


native.on_switch(_bind)


def _rows_py(
    name: list[int],
    track: list[int],
    start: list[int],
    dur: list[int],
    flags: list[int],
    base: int,
    kinds: bytes,
    n_tracks: int,
) -> _RowsRead:
    """A digest's span columns (as the parsed file gives them: lists of ints, `start` as deltas
    from `base`, the first from `base`) read once: the flags or-ed; whether the rows are in start
    order; per track (of `n_tracks`) its rows' least start and largest end and whether it has
    rows (bytes of int64, int64, a byte each); and the finished rows of three kinds, in row
    order, each as (start, end, track) bytes of int64: the steps (`kinds[name]` is _STEP), the
    rows marked collective=True, and the rows of a waiting name (_WAITING) not marked
    collective at all. ValueError for columns the digest's reader would refuse (`_hot.first_rows`
    is the C twin)."""
    cols = (name, track, start, dur, flags)
    n = len(name)
    if not all(type(c) is list for c in cols) or any(len(c) != n for c in cols):
        raise ValueError("first_rows: span columns of different lengths")
    lo64, hi64 = -(2**63), 2**63 - 1
    for c in cols:
        if c and (set(map(type, c)) != {int} or min(c) < lo64 or max(c) > hi64):
            raise ValueError("first_rows: a column holds something other than a 64-bit integer")
    if n and (min(flags) < 0 or max(flags) > 7):
        raise ValueError("first_rows: a span's flags out of range")
    if n and (min(track) < 0 or max(track) >= n_tracks or min(name) < 0 or max(name) >= len(kinds) or min(dur) < 0):
        raise ValueError("first_rows: a span out of range")
    starts = list(accumulate(start, initial=base))
    del starts[0]
    ends = list(map(add, starts, dur))
    if n and (min(starts) < lo64 or max(starts) > hi64 or max(ends) > hi64):
        raise ValueError("first_rows: a time past 64 bits")
    in_order = n < 2 or min(islice(start, 1, None)) >= 0
    flags_or = 0
    for f in set(flags):
        flags_or |= f
    n_tracks = max(n_tracks, 0)
    lo, hi, has = [0] * n_tracks, [0] * n_tracks, bytearray(n_tracks)
    for t in set(track):
        on = list(map(eq, track, repeat(t)))
        lo[t], hi[t], has[t] = min(compress(starts, on)), max(compress(ends, on)), 1
    finished = [not f & digestfile.UNFINISHED for f in flags]
    picks = (
        [i for i in range(n) if finished[i] and kinds[name[i]] == _STEP],
        [i for i in range(n) if finished[i] and flags[i] & digestfile.COLL_TRUE],
        [i for i in range(n) if finished[i] and kinds[name[i]] == _WAITING and not flags[i] & digestfile.COLL],
    )
    gathered = [(_gather(starts, idx), _gather(ends, idx), _gather(track, idx)) for idx in picks]
    return (
        flags_or,
        in_order,
        array("q", lo).tobytes(),
        array("q", hi).tobytes(),
        bytes(has),
        tuple(gathered),
    )


def _gather(col: list[int], idx: list[int]) -> bytes:
    return array("q", [col[i] for i in idx]).tobytes()


def _int64s(b: bytes) -> array[int]:
    out = array("q")
    out.frombytes(b)
    return out


class _Picked:
    """Rows of one kind of a rank's digest (`_rows_py`): their starts, ends and tracks."""

    def __init__(self, got: tuple[bytes, bytes, bytes]) -> None:
        self.start, self.end, self.track = (_int64s(b) for b in got)


class _Rank:
    """One rank's digest as the first document reads it: its header (a `RankDigest` whose trace
    holds the process and tracks, no spans) and, read from its span rows (`_rows_py`), what the
    page draws: its time range per track, its steps and its collectives by either rule."""

    def __init__(self, digest: digestfile.RankDigest, names: list[str], spans: dict[str, Any], step: str) -> None:
        self.digest = digest
        trace = digest.trace
        assert trace is not None
        kinds = bytes(_STEP if x == step else _WAITING if stats.WAIT_NAMES.search(x) else _OTHER for x in names)
        cols = [spans[k] for k in ("name", "track", "start", "dur", "flags")]
        base = trace.metadata["base_ns"]
        rows: Callable[..., _RowsRead] = _hot.first_rows if _hot is not None else _rows_py
        got = rows(*cols, base, kinds, len(trace.tracks))
        self.flags_or, self.in_order, lo, hi, has, groups = got
        self.n = len(cols[0])
        self.lo, self.hi = _int64s(lo), _int64s(hi)
        self.tracks = [t for t, h in enumerate(has) if h]
        self.steps, self.marked, self.waits = (_Picked(g) for g in groups)


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
        return _Rank(d, names, spans, step)
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
    marked_true = any(r.flags_or & digestfile.COLL_TRUE for r in ranks_read)
    lo: list[int] = []
    hi: list[int] = []
    for slot, rank in enumerate(ranks):
        rows.add(slot, by_rank[rank], maps.host.get(rank), maps.device.get(rank), marked_true)
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

    def add(self, slot: int, r: _Rank, host: Any, device: Any, marked_true: bool) -> None:
        trace = r.digest.trace
        assert trace is not None
        self.anchor.append(stats._anchor_uncertainty(trace.metadata))
        # Each track's map: the device's for a rank's CUDA tracks where its syncs were refined.
        fns = [device if (t.kind == "cuda" and device is not None) else host for t in trace.tracks]
        if not r.n:
            self.lo.append(None)
            self.hi.append(None)
            return
        # The time range of all its rows (the full document's base and duration): the maps are
        # monotone, so each track's first start and last end, placed.
        self.lo.append(min(_place(fns[t], [r.lo[t]])[0] for t in r.tracks))
        self.hi.append(max(_place(fns[t], [r.hi[t]])[0] for t in r.tracks))
        # The collective rule of `stats.summarize` (over every rank's rows): the spans marked
        # collective=True where any is (the step span too, were it marked); else the finished
        # spans of a waiting name, but those marked collective=False where any span is marked.
        one_map = len({id(f) for f in fns}) == 1
        for picked in (r.steps, r.marked if marked_true else r.waits):
            at = len(self.start)
            _append(self.start, _placed(fns, picked.track, picked.start))
            _append(self.end, _placed(fns, picked.track, picked.end))
            rows = list(range(at, len(self.start)))
            # In start order (the order `stats.summarize` takes them in, ties in trace order): as
            # they are where the digest's rows are and one map placed them all.
            rows = rows if r.in_order and one_map else _by_start(rows, self.start)
            if picked is r.steps:
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


def _placed(fns: list[Any], tracks: array[int], times: array[int]) -> Sequence[int]:
    """`times` (of rows on `tracks`), each through its row's track's map (one call per map)."""
    if len({id(f) for f in fns}) <= 1:
        return _place(fns[0] if fns else None, times)
    out = array("q", bytes(8 * len(times)))
    by_fn: dict[int, list[int]] = {}
    for j, t in enumerate(tracks):
        by_fn.setdefault(id(fns[t]), []).append(j)
    for js in by_fn.values():
        fn = fns[tracks[js[0]]]
        for j, v in zip(js, _place(fn, [times[j] for j in js])):
            out[j] = v
    return out
