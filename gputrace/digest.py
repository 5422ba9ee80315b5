"""Per-rank step digests: what the step and collective analysis needs, computed on the rank.

Takes: a rank's spans as it resolves them (each flushed chunk, a `Trace` of one process), or a
whole trace. Gives: the rank's digest (`Builder`, `from_trace`), and the two sinks the session
feeds (`gputrace.sinks.Sink`): `StreamDigest`, fed chunk by chunk beside a streamed trace, and
`TraceDigest`, fed a trace saved whole; each writes the digest beside its trace as
`digest_rank{R}.digest` (the file format: `gputrace.trace.digestfile`). The summary from many
digests, without reading the traces, is `gputrace.summary`'s.

Why: at thousands of ranks the traces hold billions of spans, and no one machine should read
them all to say which rank was slow. The straggler and collective analysis needs only each
rank's step spans and collective spans (a few per step) and its clock metadata; the table of
span names needs per-name aggregates. Both fit in memory O(steps + collectives + names), so the
recorder keeps them as it flushes, and the summary reads a few hundred KB per rank instead of
its whole trace.

What a digest holds (columnar JSON: arrays of ints parse fast):
- every span named like the step (the `step_name` option, default "step"), every span named
  like a collective (`stats.WAIT_NAMES`) and every span marked `collective=True`: name, track,
  start, end and flags (its `collective` argument, unfinished). These are exactly the spans
  `stats.summarize` reads for steps and collectives under either of its collective rules, so a
  summary made from digests has the same steps, verdicts, arrivals and waits as one made from
  the full traces: the spans go through the same merge alignment and the same code;
- per span name and warm-up bucket (the spans that start before the rank's first step, within
  step 0, ..., within step WARMUP_STEPS - 1, and after): count, total, least, longest (and where
  the longest one lies), and a histogram of durations in buckets 2^(1/16) wide, from which
  percentiles are estimated within HIST_ERROR; the buckets make `--skip-steps` up to
  WARMUP_STEPS exact for counts, totals and maxima;
- the rank's trace metadata (rank, world size, run id, clock syncs, device refinement, anchor
  uncertainties, drop counts), so merge's checks and alignment apply to digests unchanged; the
  spans left unfinished and those that end before they start; the trace file's name and size,
  so a digest older than its trace is recognised.
"""

from __future__ import annotations

import math
import os
import warnings
from array import array
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Sequence
from itertools import compress, repeat
from typing import Any

from gputrace import native, stats
from gputrace.digest_breakdown import Local, int_deltas
from gputrace.errors import GputraceError, GputraceWarning
from gputrace.trace import digestfile
from gputrace.trace.digestfile import COLL, COLL_TRUE, FORMAT, UNFINISHED, digest_path
from gputrace.trace.model import Trace, Track

#: Name statistics leave out the warm-up exactly for `skip_steps` up to this many steps.
WARMUP_STEPS = 16
_NB = WARMUP_STEPS + 2  # warm-up buckets: before step 0, in steps 0..WARMUP_STEPS-1, the rest
_REST = _NB - 1
#: Histogram buckets per factor of two of a duration.
HIST_PER_OCTAVE = 16
#: A percentile estimated from the histogram (its bucket's geometric middle) is within this
#: share of the true one.
HIST_ERROR = 2 ** (0.5 / HIST_PER_OCTAVE) - 1
#: Until the first WARMUP_STEPS + 1 steps are known, spans wait in a buffer to be put in their
#: warm-up bucket; past this many the split is given up (a run without steps), not the memory.
BUFFER_SPANS = 1 << 18
#: Chunks wait to be worked through until this many spans have come (a few MB of columns). Each
#: batch passes the spans carried for the self time (up to digest_breakdown.CARRY_SPANS, all of a
#: flat run's) through again: a batch as large as the carry keeps that under one pass a span.
BATCH_SPANS = 1 << 16
#: `gputrace summary` reads digests rather than full traces from this many ranks on, even where
#: Histogram bucket b holds the durations d with _BOUND[b] <= d < _BOUND[b + 1], i.e. 2^(b/16)
#: <= d < 2^((b+1)/16) rounded up to whole ns; bucket -1 holds 0.
_BOUND = [math.ceil(2 ** (b / HIST_PER_OCTAVE)) for b in range(62 * HIST_PER_OCTAVE + 1)]  # to 2^62 ns


def hist_middle(b: int) -> int:
    """The geometric middle of histogram bucket `b` (a duration it stands for)."""
    return 0 if b < 0 else round(math.sqrt(_BOUND[b] * (_BOUND[b + 1] - 1)))


# ---- building, on the rank ---------------------------------------------------------------------


class Builder:
    """One rank's digest, fed chunk by chunk (`add`) in the order the spans are written.
    Memory: the step and collective spans, one aggregate per (name, warm-up bucket), the spans
    of the first WARMUP_STEPS + 1 steps until those steps are known, and up to BATCH_SPANS
    spans not yet worked through.

    Cost: it runs in the training process at every flush, so the per-span work is two C loops
    over the columns (`_hot.digest_rows`, `_hot.digest_fold`; `_rows_py` and `_fold_py` are
    their references and the fallback); Python runs per name and per histogram cell a batch
    touches, and per span only for spans with args."""

    def __init__(self, step_name: str = "step") -> None:
        self.step_name = step_name
        self.names: list[str] = []
        self._name_index: dict[str, int] = {}
        self._row_name: list[bool] = []  # per name: every span of it is kept as a row
        self.tracks: list[tuple[Any, str, str, int | None, int]] = []  # (tid, name, kind, device, ordinal)
        self._track_index: dict[tuple[Any, str, str, int | None, int], int] = {}
        # The rows: name, track, start, end, flags.
        self.rows = (array("l"), array("l"), array("q"), array("q"), array("b"))
        self.unfinished = 0
        self.negative = 0
        self.step_starts: list[int] = []  # the least WARMUP_STEPS + 1 finished step starts
        self.split: int | None = None  # step_starts[-1] once all WARMUP_STEPS + 1 are known
        self.warmup_exact = True
        # Batches waiting for the warm-up split: name, track, start, end (kept spans only).
        self._buffer: list[tuple[array[int], array[int], array[int], array[int]]] = []
        self._buffered = 0
        # name * _NB + warm-up bucket -> [count, total, min, max, start of the max, its track, histogram]
        self.aggs: dict[int, list[Any]] = {}
        # Chunks not yet worked through: name, track (-1: not the rank's), start, end, args.
        self._batch: tuple[array[int], array[int], array[int], array[int], list[Any]] = (
            array("l"),
            array("l"),
            array("q"),
            array("q"),
            [],
        )
        # Their host entry times, once a chunk had them (0: not known).
        self._entry: array[int] | None = None
        # The step breakdown's and self time's part (`gputrace.digest_breakdown`).
        self.local = Local()

    # names and tracks of the digest (chunks come with their own indices)

    def _intern(self, name: str) -> int:
        i = self._name_index.get(name)
        if i is None:
            i = self._name_index[name] = len(self.names)
            self.names.append(name)
            self._row_name.append(name == self.step_name or stats.WAIT_NAMES.search(name) is not None)
        return i

    def _track(self, t: Track) -> int:
        key = (t.tid, t.name, t.kind, t.device, t.ordinal)
        i = self._track_index.get(key)
        if i is None:
            i = self._track_index[key] = len(self.tracks)
            self.tracks.append(key)
        return i

    def add(self, trace: Trace, lo: int = 0, hi: int | None = None) -> None:
        """Take in one chunk: the spans of the rank's own process in `trace` (other tools'
        processes are left out, as the summary leaves them out). The chunk's columns are copied
        into a batch, worked through BATCH_SPANS at a time: a flush of a few spans then costs a
        copy, and the work per batch is C loops over many spans."""
        sp = trace.spans
        hi = len(sp) if hi is None else min(hi, len(sp))
        if hi <= lo:
            return
        whole = lo == 0 and hi == len(sp)
        remap = [self._intern(x) for x in trace.names]
        procs = trace.processes
        own = [procs[t.process].rank is not None and not procs[t.process].foreign for t in trace.tracks]
        tmap = [self._track(t) if ok else -1 for t, ok in zip(trace.tracks, own)]
        b = self._batch
        if sp.entry is not None or self._entry is not None:
            if self._entry is None:
                self._entry = array("q", bytes(8 * len(b[0])))
            self._entry.extend(sp.entry[lo:hi] if sp.entry is not None else array("q", bytes(8 * (hi - lo))))
        same = remap == list(range(len(remap))) and tmap == list(range(len(tmap)))
        if same and not whole and not len(b[0]) and hi - lo >= BATCH_SPANS:
            # A whole batch of a trace read in batches: its slices (copies already) are the batch.
            self._batch = (sp.name[lo:hi], sp.track[lo:hi], sp.start[lo:hi], sp.end[lo:hi], sp.args[lo:hi])
            self._work()
            return
        name, track = (sp.name, sp.track) if whole else (sp.name[lo:hi], sp.track[lo:hi])
        b[0].extend(name if remap == list(range(len(remap))) else map(remap.__getitem__, name))
        b[1].extend(track if tmap == list(range(len(tmap))) else map(tmap.__getitem__, track))
        b[2].extend(sp.start if whole else sp.start[lo:hi])
        b[3].extend(sp.end if whole else sp.end[lo:hi])
        b[4].extend(sp.args if whole else sp.args[lo:hi])
        if len(b[0]) >= BATCH_SPANS:
            self._work()

    def _work(self) -> None:
        """The batch into the rows and the aggregates: C loops over the columns where the C
        build is in use (`_rows_py` and `_fold_py` are their references); Python runs per
        span only for the few spans with args."""
        names, tracks, start, end, args = self._batch
        self._batch = (array("l"), array("l"), array("q"), array("q"), [])
        entry, self._entry = self._entry, None
        n = len(names)
        if not n:
            return
        # Flags from args (rare, so found by skipping the Nones in C): the `collective`
        # argument, and the unfinished spans, which the statistics leave out (the summary counts
        # them apart). Other tools' spans (track -1) and inverted ones (merge drops them) are
        # left out everywhere, by the loops themselves.
        flags: dict[int, int] = {}
        skip: bytearray | None = None
        for i in compress(range(n), args) if args.count(None) != n else ():
            if tracks[i] < 0 or end[i] < start[i]:
                continue
            a = args[i]
            f = 0
            c = a.get("collective")
            if c is not None:
                f = COLL | (COLL_TRUE if c else 0)
            if a.get("unfinished"):
                f |= UNFINISHED
                self.unfinished += 1
                if skip is None:
                    skip = bytearray(n)
                skip[i] = 1
            if f:
                flags[i] = f
        skipped = bytes(skip) if skip is not None else None

        # The rows: spans of row names, and the ones marked collective, in the order written
        # (ties between equal starts then break as they do in the trace).
        row_name = self._row_name
        rows, negative, foreign = _rows(names, tracks, start, end, bytes(row_name))
        self.negative += negative
        marked = [i for i, f in flags.items() if f & COLL_TRUE and not row_name[names[i]]]
        if marked:
            rows = sorted(rows + marked)
        if rows:
            r = self.rows
            r[0].extend(map(names.__getitem__, rows))
            r[1].extend(map(tracks.__getitem__, rows))
            r[2].extend(map(start.__getitem__, rows))
            r[3].extend(map(end.__getitem__, rows))
            r[4].extend([flags.get(i, 0) for i in rows] if flags else repeat(0, len(rows)))
        step_id = self._name_index.get(self.step_name)
        if step_id is not None:
            done = [i for i in rows if names[i] == step_id and not (skip and skip[i])]
            steps = [start[i] for i in done]
            if steps:
                self.local.steps(steps, [end[i] for i in done], [tracks[i] for i in done])
                self._steps_seen(steps)
        # The cover leaves out the rows (the marked collectives among them) and the unfinished.
        cover_skip = skipped
        if marked:
            cs = bytearray(skipped) if skipped is not None else bytearray(n)
            for i in marked:
                cs[i] = 1
            cover_skip = bytes(cs)
        cuda = [t[2] == "cuda" for t in self.tracks]
        self.local.work(names, tracks, start, end, cover_skip, bytes(row_name), entry, cuda)
        if self.split is None:
            # The batch waits whole (its columns are the builder's own now); spans the statistics
            # leave out are dropped from it first, so only kept spans count towards BUFFER_SPANS.
            if skip is not None or negative or foreign:
                kept = [i for i in range(n) if tracks[i] >= 0 and end[i] >= start[i] and not (skip and skip[i])]
                names = array("l", map(names.__getitem__, kept))
                tracks = array("l", map(tracks.__getitem__, kept))
                start = array("q", map(start.__getitem__, kept))
                end = array("q", map(end.__getitem__, kept))
            self._buffer.append((names, tracks, start, end))
            self._buffered += len(names)
            if self._buffered > BUFFER_SPANS:
                # No steps to split at (or steps too long to wait for): the warm-up is not
                # told apart; everything goes into the last bucket.
                self.warmup_exact = False
                self.split = -(1 << 62)
                self._drain(self.aggs, _REST)
            return
        self._fold(self.aggs, names, tracks, start, end, skipped, None)

    def _steps_seen(self, starts: list[int]) -> None:
        if self.split is not None:
            if self.warmup_exact and min(starts) < self.split:
                self.warmup_exact = False  # a step older than the ones split at came late
            return
        self.step_starts = sorted(self.step_starts + starts)[: WARMUP_STEPS + 1]
        if len(self.step_starts) == WARMUP_STEPS + 1:
            self.split = self.step_starts[-1]
            self._drain(self.aggs, None)

    def _drain(self, aggs: dict[int, list[Any]], bucket: int | None, local: Local | None = None) -> None:
        """The buffered spans into `aggs` (and `local`), each in its warm-up bucket (or all in
        `bucket`), batch by batch in the order they came."""
        for names, tracks, starts, ends in self._buffer:
            self._fold(aggs, names, tracks, starts, ends, None, bucket, local)
        if aggs is self.aggs:
            self._buffer = []
            self._buffered = 0

    def _fold(
        self,
        aggs: dict[int, list[Any]],
        names: array[int],
        tracks: array[int],
        starts: array[int],
        ends: array[int],
        skip: bytes | None,
        bucket: int | None,
        local: Local | None = None,
    ) -> None:
        """Spans into `aggs` and their children's time into `local` (default: the builder's):
        each in its warm-up bucket by the step starts known (past the split: the last bucket),
        or all in `bucket`. The loop gives one partial aggregate per key; Python runs per key
        and per histogram cell, not per span."""
        if bucket is None:
            bucket = -1 if self.warmup_exact else _REST
        steps = array("q", self.step_starts)
        (local or self.local).nest(names, tracks, starts, ends, skip, steps, bucket, _NB)
        keys, counts, totals, least, longest, at, on, hkey, hbucket, hcount = _fold_spans(
            names, tracks, starts, ends, skip, steps, bucket, _NB, _BOUND_COLUMN
        )
        entries = []
        for key, count, total, lo, hi, hs, ht in zip(keys, counts, totals, least, longest, at, on):
            a = aggs.get(key)
            if a is None:
                a = aggs[key] = [0, 0, lo, -1, 0, 0, Counter()]
            a[0] += count
            a[1] += total
            if lo < a[2]:
                a[2] = lo
            if hi > a[3]:  # the first of the longest, in the order written
                a[3], a[4], a[5] = hi, hs, ht
            entries.append(a[6])
        for k, b, c in zip(hkey, hbucket, hcount):
            entries[k][b] += c

    def document(
        self,
        metadata: dict[str, Any],
        base_ns: int,
        label: str,
        trace_path: str | None = None,
    ) -> dict[str, Any]:
        """The digest as JSON-ready data. `metadata`: the rank's trace metadata as the trace's
        header carries it (rank, world_size, run_id, clock, ...). Building may go on after."""
        self._work()
        aggs = self.aggs
        local = self.local
        if self._buffered:  # fewer steps than the split needs: bucket by the ones known
            aggs = {k: [*v[:6], Counter(v[6])] for k, v in aggs.items()}
            local = local.copy()
            self._drain(aggs, None if self.warmup_exact else _REST, local)
        r_name, r_track, r_start, r_end, r_flags = self.rows
        deltas = int_deltas(r_start, None, base_ns)
        keys = sorted(aggs)
        entries = [aggs[k] for k in keys]
        size = None
        if trace_path is not None:
            try:
                size = os.path.getsize(trace_path)
            except OSError:
                size = None
        return {
            "format": FORMAT,
            "rank": metadata.get("rank"),
            "world_size": metadata.get("world_size"),
            "run_id": metadata.get("run_id"),
            "trace": os.path.basename(trace_path) if trace_path else None,
            "trace_bytes": size,
            "step_name": self.step_name,
            "base_ns": base_ns,
            "label": label,
            "unfinished": self.unfinished,
            "negative": self.negative,
            "warmup": {"steps": len(self.step_starts), "exact": self.warmup_exact},
            "names": self.names,
            "tracks": {
                "tid": [t[0] for t in self.tracks],
                "name": [t[1] for t in self.tracks],
                "kind": [t[2] for t in self.tracks],
                "device": [t[3] for t in self.tracks],
                "ordinal": [t[4] for t in self.tracks],
            },
            "spans": {
                "name": list(r_name),
                "track": list(r_track),
                "start": deltas,  # each from the one before (the first from base_ns)
                "dur": int_deltas(r_end, r_start),
                "flags": list(r_flags),
            },
            "stats": {
                "name": [k // _NB for k in keys],
                "bucket": [k % _NB for k in keys],
                "count": [a[0] for a in entries],
                "total": [a[1] for a in entries],
                "min": [a[2] for a in entries],
                "max": [a[3] for a in entries],
                "max_start": [a[4] - base_ns for a in entries],
                "max_track": [a[5] for a in entries],
                "hist": [[x for b in sorted(a[6]) for x in (b, a[6][b])] for a in entries],
                "self": local.self_column(keys, [a[1] for a in entries], _NB),
            },
            **local.document(base_ns),
            "metadata": metadata,
        }


_BOUND_COLUMN = array("q", _BOUND)


def _rows_py(
    names: Sequence[int], tracks: Sequence[int], starts: Sequence[int], ends: Sequence[int], row_mask: bytes
) -> tuple[list[int], int, int]:
    """The indices of the spans whose name is a row name, leaving out other tools' (track < 0)
    and inverted spans; the number of inverted spans on the rank's own tracks; the number of
    other tools' spans."""
    rows: list[int] = []
    negative = foreign = 0
    for i, (k, t, s, e) in enumerate(zip(names, tracks, starts, ends)):
        if t < 0:
            foreign += 1
            continue
        if e < s:
            negative += 1
        elif 0 <= k < len(row_mask) and row_mask[k]:
            rows.append(i)
    return rows, negative, foreign


def _fold_py(
    names: Sequence[int],
    tracks: Sequence[int],
    starts: Sequence[int],
    ends: Sequence[int],
    skip: bytes | None,
    steps: Sequence[int],
    bucket: int,
    nb: int,
    bounds: Sequence[int],
) -> tuple[list[int], ...]:
    """Per key name * nb + warm-up bucket (`bucket`, or where it is < 0 the span's place among
    the step starts): count, total, least, longest, the longest's start and track (the first of
    the longest); and the histogram cells (key index, histogram bucket, count). Keys and cells
    in the order first met. Spans set in `skip`, other tools' and inverted ones are left out."""
    index: dict[int, int] = {}
    agg: list[list[int]] = []
    cells: dict[tuple[int, int], int] = {}
    top = len(bounds) - 1
    for i, (k, t, s, e) in enumerate(zip(names, tracks, starts, ends)):
        d = e - s
        if t < 0 or d < 0 or (skip is not None and skip[i]):
            continue
        key = k * nb + min(bisect_right(steps, s) if bucket < 0 else bucket, nb - 1)
        j = index.get(key)
        if j is None:
            j = index[key] = len(agg)
            agg.append([key, 0, 0, d, -1, 0, 0])
        a = agg[j]
        a[1] += 1
        a[2] += d
        if d < a[3]:
            a[3] = d
        if d > a[4]:
            a[4], a[5], a[6] = d, s, t
        cell = (j, min(bisect_right(bounds, d), top) - 1)
        cells[cell] = cells.get(cell, 0) + 1
    columns = [[a[f] for a in agg] for f in range(7)]
    return (*columns, [c[0] for c in cells], [c[1] for c in cells], list(cells.values()))


def _c_loops(hot: Any) -> None:
    """Bind the C build's loops (None, None where gputrace.native has the Python twins in use)."""
    global _rows_c, _fold_c
    _rows_c, _fold_c = (
        (getattr(hot, "digest_rows", None), getattr(hot, "digest_fold", None)) if hot is not None else (None, None)
    )


_rows_c: Any = None
_fold_c: Any = None
native.on_switch(_c_loops)


def _rows(*a: Any) -> tuple[list[int], int, int]:
    return (_rows_c or _rows_py)(*a)


def _fold_spans(*a: Any) -> tuple[list[int], ...]:
    if _fold_c is not None:
        got = _fold_c(*a)
        if got is not NotImplemented:  # totals past 2^63 ns are Python's
            return got  # type: ignore[no-any-return]
    return _fold_py(*a)


def from_trace(trace: Trace, step_name: str = "step", trace_path: str | None = None) -> dict[str, Any]:
    """The digest of a whole one-rank trace (a file read back, or a trace saved whole)."""
    own = [p for p in trace.processes if p.rank is not None and not p.foreign]
    if len({p.rank for p in own}) != 1:
        where = trace_path or "the trace"
        raise GputraceError(f"{where} is not one rank's gputrace trace, so it has no digest; summarize it with --full")
    b = Builder(step_name)
    for lo in range(0, len(trace.spans), BATCH_SPANS):  # in batches: memory stays a batch's
        b.add(trace, lo, lo + BATCH_SPANS)
    meta = dict(own[0].metadata or {k: v for k, v in trace.metadata.items() if k != "base_ns"})
    meta.setdefault("rank", own[0].rank)
    if "world_size" not in meta and isinstance(trace.metadata.get("world_size"), int):
        meta["world_size"] = trace.metadata["world_size"]
    base = trace.metadata.get("base_ns")
    if not isinstance(base, int) or isinstance(base, bool):
        rng = trace.time_range()
        base = rng[0] if rng else 0
    return b.document(meta, base, own[0].label, trace_path)


# ---- the sinks ----------------------------------------------------------------------------------
# A digest must never cost the user a flush or a trace: failures become one warning, and a rank
# whose digest failed writes none (the summary then reads its trace).


class _DigestSink:
    """What the two digest sinks share: the trace they are the digest of, the step name, and
    where the digest went (`written`, and `on_written` told of it)."""

    def __init__(self, trace_path: str, step_name: str, on_written: Callable[[str], object] | None) -> None:
        self.trace_path = trace_path
        self.step_name = step_name
        self.on_written = on_written
        self.written: str | None = None

    def _write(self, make: Callable[[], dict[str, Any]]) -> None:
        """Write the document `make` gives beside the trace; a failure removes any old digest
        there and becomes a warning."""
        path = digest_path(self.trace_path)
        self.written = None
        try:
            digestfile.write(make(), path)
        except Exception as e:  # noqa: BLE001
            _remove(path)
            warnings.warn(f"gputrace could not write the step digest {path}: {e}", GputraceWarning, stacklevel=3)
            return
        self.written = path
        if self.on_written is not None:
            self.on_written(path)


class StreamDigest(_DigestSink):
    """The digest of a streamed trace, as a sink (`gputrace.sinks.Sink`): fed each chunk the
    stream is (`add`), written beside the stream's file `trace_path` when it is finished
    (`finish`, with the stream's final header; building goes on after, for a stream resumed).
    `base_ns` and `label`: the stream's base and process label. `on_written`: told the path of
    each digest written."""

    def __init__(
        self,
        trace_path: str,
        step_name: str,
        base_ns: int,
        label: str,
        on_written: Callable[[str], object] | None = None,
    ) -> None:
        super().__init__(trace_path, step_name, on_written)
        self.base_ns = base_ns
        self.label = label
        # None until the first chunk; False once building failed (then no digest is written).
        self.builder: Builder | None | bool = None

    def add(self, chunk: Trace, update: dict[str, Any] | None = None) -> None:
        """Take in a chunk just appended to the stream (`update`, the stream's header update, is
        not the digest's)."""
        if self.builder is None:
            self.builder = Builder(self.step_name)
        if not isinstance(self.builder, Builder):
            return
        try:
            self.builder.add(chunk)
        except Exception as e:  # noqa: BLE001 - see above
            self.builder = False
            warnings.warn(f"gputrace could not keep the step digest: {e}", GputraceWarning, stacklevel=2)

    def finish(self, header: dict[str, Any]) -> None:
        """Write the digest beside the finished stream (the rank and world size from `header`
        where its metadata lacks them)."""
        b = self.builder
        if b is False:
            self.written = None
            _remove(digest_path(self.trace_path))
            return
        built = b if isinstance(b, Builder) else Builder()  # nothing appended: an empty digest still says the rank ran

        def document() -> dict[str, Any]:
            meta = dict(header.get("metadata") or {})
            info = header.get("distributedInfo") or {}
            meta.setdefault("rank", info.get("rank"))
            meta.setdefault("world_size", info.get("world_size"))
            return built.document(meta, self.base_ns, self.label, self.trace_path)

        self._write(document)

    def abandon(self) -> None:
        """The stream was dropped: no digest of it will be written."""
        self.builder = None


class TraceDigest(_DigestSink):
    """The digest of a trace saved whole to `trace_path`, as a sink: `add` the whole trace
    (while it reaches the disk: the digest is made meanwhile), `finish` once the trace file is
    in place (its size is then known; the header, the trace's own metadata, is not needed)."""

    def __init__(self, trace_path: str, step_name: str, on_written: Callable[[str], object] | None = None) -> None:
        super().__init__(trace_path, step_name, on_written)
        self.prepared: dict[str, Any] | Exception | None = None

    def add(self, chunk: Trace, update: dict[str, Any] | None = None) -> None:
        try:
            self.prepared = from_trace(chunk, self.step_name, self.trace_path)
        except Exception as e:  # noqa: BLE001 - a digest never costs the user a trace
            self.prepared = e

    def finish(self, header: dict[str, Any]) -> None:
        prepared = self.prepared

        def document() -> dict[str, Any]:
            if prepared is None:
                raise GputraceError("no trace was given to the digest")
            if isinstance(prepared, Exception):
                raise prepared
            prepared["trace_bytes"] = os.path.getsize(self.trace_path)  # the trace as it now lies there
            return prepared

        self._write(document)

    def abandon(self) -> None:
        self.prepared = None


def write_for_trace(trace: Trace, trace_path: str, step_name: str) -> str | None:
    """Write the digest of `trace`, saved whole to `trace_path`, beside it: the digest's path,
    or None (with a warning saying why)."""
    sink = TraceDigest(trace_path, step_name)
    sink.add(trace)
    sink.finish({"metadata": trace.metadata})
    return sink.written


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
