"""Per-rank step digests: what the step and collective analysis needs, computed on the rank.

Takes: a rank's spans as it resolves them (each flushed chunk, a `Trace` of one process), or a
whole trace file. Gives: the rank's digest, written atomically beside its trace as
`digest_rank{R}.digest`; and, from many digests, the `Summary` that `gputrace summary` prints,
without reading the traces.

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

import dataclasses
import glob
import math
import os
import re
import warnings
import zlib
from array import array
from bisect import bisect_right
from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import accumulate, compress, repeat
from operator import sub
from typing import Any

import orjson

from gputrace import stats
from gputrace.errors import GputraceError, GputraceWarning, TraceFormatError
from gputrace.trace import chrome
from gputrace.trace.files import TRACE_GLOBS, atomic_writer
from gputrace.trace.model import Process, SpanColumns, Trace, Track

FORMAT = "gputrace-digest/1"
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
#: Chunks wait to be worked through until this many spans have come.
BATCH_SPANS = 1 << 14
#: `gputrace summary` reads digests rather than full traces from this many ranks on, even where
#: some ranks wrote none (theirs are computed from their traces, one rank at a time).
DIGEST_MIN_RANKS = 65

_COLL = 1  # flags: the span has a `collective` argument
_COLL_TRUE = 2  # ... and it is true
_UNFINISHED = 4  # the span was open when the trace was written
_DIGEST_NAME = re.compile(r"^digest_rank(\d+)\.digest$|\.digest$")
_TRACE_NAME = re.compile(r"^trace_rank(\d+)\.")
#: Histogram bucket b holds the durations d with _BOUND[b] <= d < _BOUND[b + 1], i.e. 2^(b/16)
#: <= d < 2^((b+1)/16) rounded up to whole ns; bucket -1 holds 0.
_BOUND = [math.ceil(2 ** (b / HIST_PER_OCTAVE)) for b in range(62 * HIST_PER_OCTAVE + 1)]  # to 2^62 ns


def digest_path(trace_path: str) -> str:
    """Where the digest of `trace_path` lies: `trace_rank3.json` -> `digest_rank3.digest` beside
    it (a name that the `trace_rank*.json` globs of merge and summary do not pick up, nor tools
    that take every `*.json` of a directory for a trace, as HTA does), any other `x.json` ->
    `x.digest`."""
    directory, base = os.path.split(trace_path)
    m = _TRACE_NAME.match(base)
    if m:
        return os.path.join(directory, f"digest_rank{m.group(1)}.digest")
    return os.path.join(directory, os.path.splitext(base)[0] + ".digest")


def is_digest_path(path: str) -> bool:
    return _DIGEST_NAME.search(os.path.basename(path)) is not None


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
                f = _COLL | (_COLL_TRUE if c else 0)
            if a.get("unfinished"):
                f |= _UNFINISHED
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
        marked = [i for i, f in flags.items() if f & _COLL_TRUE and not row_name[names[i]]]
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
            steps = [start[i] for i in rows if names[i] == step_id and not (skip and skip[i])]
            if steps:
                self._steps_seen(steps)
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

    def _drain(self, aggs: dict[int, list[Any]], bucket: int | None) -> None:
        """The buffered spans into `aggs`, each in its warm-up bucket (or all in `bucket`),
        batch by batch in the order they came."""
        for names, tracks, starts, ends in self._buffer:
            self._fold(aggs, names, tracks, starts, ends, None, bucket)
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
    ) -> None:
        """Spans into `aggs`: each in its warm-up bucket by the step starts known (past the
        split: the last bucket), or all in `bucket`. The loop gives one partial aggregate per
        key; Python runs per key and per histogram cell, not per span."""
        if bucket is None:
            bucket = -1 if self.warmup_exact else _REST
        steps = array("q", self.step_starts)
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
        if self._buffered:  # fewer steps than the split needs: bucket by the ones known
            aggs = {k: [*v[:6], Counter(v[6])] for k, v in aggs.items()}
            self._drain(aggs, None if self.warmup_exact else _REST)
        r_name, r_track, r_start, r_end, r_flags = self.rows
        starts = list(r_start)
        deltas = list(map(sub, starts, [base_ns, *starts[:-1]]))
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
                "dur": list(map(sub, r_end, r_start)),
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
            },
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


def _c_loops() -> tuple[Any, Any]:
    """The C build's loops (None, None where it is not built or GPUTRACE_PURE_PYTHON is set)."""
    if os.environ.get("GPUTRACE_PURE_PYTHON", "") not in ("", "0"):
        return None, None
    try:
        from gputrace import _hot
    except ImportError:
        return None, None
    return getattr(_hot, "digest_rows", None), getattr(_hot, "digest_fold", None)


_rows_c, _fold_c = _c_loops()


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


def write(doc: dict[str, Any], path: str) -> None:
    # Not fsynced: a digest lost with the machine is made again from its trace by the summary.
    with atomic_writer(path, durable=False) as f:
        f.write(chrome.dumps(doc))  # names JSON cannot hold are cleaned as the trace writer cleans them


# ---- the recorder's hooks -------------------------------------------------------------------------
# A digest must never cost the user a flush or a trace: failures become one warning, and a rank
# whose digest failed writes none (the summary then reads its trace).


def feed(stream: Any, trace: Trace, step_name: str) -> None:
    """Take in a chunk just appended to `stream` (the builder lives on the stream: a new file, a
    new digest)."""
    b = getattr(stream, "digest", None)
    if b is None:
        b = stream.digest = Builder(step_name)
    if b is False:
        return
    try:
        b.add(trace)
    except Exception as e:  # noqa: BLE001 - see above
        stream.digest = False
        warnings.warn(f"gputrace could not keep the step digest: {e}", GputraceWarning, stacklevel=2)


def write_for_stream(stream: Any, header: dict[str, Any]) -> str | None:
    """Write the digest of the finished `stream` beside its file; the digest's path, or None."""
    path = digest_path(stream.path)
    b = getattr(stream, "digest", None)
    if not isinstance(b, Builder):
        b = Builder()  # nothing was appended: an empty digest still says the rank ran
        if getattr(stream, "digest", None) is False:
            _remove(path)
            return None
    try:
        meta = dict(header.get("metadata") or {})
        info = header.get("distributedInfo") or {}
        meta.setdefault("rank", info.get("rank"))
        meta.setdefault("world_size", info.get("world_size"))
        write(b.document(meta, stream.base_ns, stream.process.label, stream.path), path)
        return _written(path)
    except Exception as e:  # noqa: BLE001
        _remove(path)
        warnings.warn(f"gputrace could not write the step digest {path}: {e}", GputraceWarning, stacklevel=2)
        return None


def prepare_for_trace(trace: Trace, trace_path: str, step_name: str) -> dict[str, Any] | Exception:
    """The digest of a trace about to be saved whole to `trace_path` (made while the trace
    reaches the disk), or what went wrong: `write_for_trace` writes it, or says why not."""
    try:
        return from_trace(trace, step_name, trace_path)
    except Exception as e:  # noqa: BLE001 - a digest never costs the user a trace
        return e


def write_for_trace(
    trace: Trace, trace_path: str, step_name: str, prepared: dict[str, Any] | Exception | None = None
) -> str | None:
    """Write the digest of a trace saved whole to `trace_path` (`prepared` by
    `prepare_for_trace` before the trace was in place, else made now)."""
    path = digest_path(trace_path)
    try:
        if isinstance(prepared, Exception):
            raise prepared
        doc = prepared if prepared is not None else from_trace(trace, step_name, trace_path)
        doc["trace_bytes"] = os.path.getsize(trace_path)  # the trace as it now lies there
        write(doc, path)
        return _written(path)
    except Exception as e:  # noqa: BLE001
        _remove(path)
        warnings.warn(f"gputrace could not write the step digest {path}: {e}", GputraceWarning, stacklevel=2)
        return None


def _written(path: str) -> str:
    global LAST_WRITTEN
    LAST_WRITTEN = path
    return path


#: The digest this process wrote last (what `gather` sends).
LAST_WRITTEN: str | None = None


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# ---- reading ------------------------------------------------------------------------------------


@dataclasses.dataclass
class RankDigest:
    """One rank's digest, read: its step and collective spans as a one-rank `Trace` (with the
    rank's metadata, as its trace file would give it) and its per-name aggregates."""

    path: str
    rank: int
    step_name: str
    trace: Trace | None  # None once `load` has taken its spans
    stats: dict[str, Any]  # columns: name (str), bucket, count, total, min, max, max_start (epoch ns), max_track, hist
    unfinished: int
    negative: int
    warmup_steps: int
    warmup_exact: bool
    trace_file: str | None
    trace_bytes: int | None
    computed: bool = False  # made from the trace here, not read from a digest file


def read(path: str) -> RankDigest:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise TraceFormatError(path, "no such file") from None
    except OSError as e:
        raise TraceFormatError(path, e.strerror or str(e)) from None
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise TraceFormatError(path, "not a gputrace digest (not valid JSON); delete it, or pass --full") from None
    return from_document(doc, path)


def from_document(doc: Any, path: str) -> RankDigest:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise TraceFormatError(path, f"not a gputrace digest of this version ({FORMAT}); delete it, or pass --full")
    try:
        meta = dict(doc["metadata"])
        rank = int(doc["rank"])
        base = int(doc["base_ns"])
        trace = Trace(dict(meta))
        trace.metadata["base_ns"] = base
        if isinstance(doc.get("world_size"), int):
            trace.metadata.setdefault("world_size", doc["world_size"])
        p = trace.add_process(Process(rank + 1, rank, str(doc.get("label") or f"rank {rank}"), rank, meta))
        tr = doc["tracks"]
        for tid, name, kind, device, ordinal in zip(tr["tid"], tr["name"], tr["kind"], tr["device"], tr["ordinal"]):
            trace.add_track(Track(p, tid, name, kind, device, ordinal))
        names = [str(x) for x in doc["names"]]
        for x in names:
            trace.intern(x)  # names that cleaning made equal are one name, as in the trace read back
        s = doc["spans"]
        span_names = array("l", s["name"])
        if len(trace.names) != len(names):
            span_names = array("l", [trace._name_index[names[k]] for k in span_names])
        starts = array("q", accumulate(s["start"], initial=base))
        del starts[0]
        ends = array("q", map(int.__add__, starts, s["dur"]))
        args = [_ARGS[f] for f in s["flags"]]
        trace.spans = SpanColumns.wrap(span_names, array("l", s["track"]), starts, ends, args)
        trace.spans.cat = [None] * len(args)  # a list: merge copies it at C speed
        st = doc["stats"]
        cols = {
            "name": [names[k] for k in st["name"]],
            "bucket": st["bucket"],
            "count": st["count"],
            "total": st["total"],
            "min": st["min"],
            "max": st["max"],
            "max_start": [base + x for x in st["max_start"]],
            "max_track": st["max_track"],
            "hist": st["hist"],
        }
        if not (len(starts) == len(ends) == len(args) == len(trace.spans.name) == len(trace.spans.track)):
            raise ValueError("span columns of different lengths")
        sp = trace.spans
        if len(sp) and not (
            0 <= min(sp.track) <= max(sp.track) < len(trace.tracks)
            and 0 <= min(sp.name) <= max(sp.name) < len(trace.names)
        ):
            raise ValueError("a span refers to a name or track that is not there")
        warm = doc.get("warmup") or {}
        return RankDigest(
            path,
            rank,
            str(doc["step_name"]),
            trace,
            cols,
            int(doc.get("unfinished") or 0),
            int(doc.get("negative") or 0),
            int(warm.get("steps") or 0),
            bool(warm.get("exact", False)),
            doc.get("trace"),
            doc.get("trace_bytes"),
        )
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise TraceFormatError(path, f"a damaged gputrace digest ({e}); delete it, or pass --full") from None


# Shared argument dicts of digest rows, by flags (nothing mutates span arguments downstream).
_ARGS: dict[int, dict[str, Any] | None] = {
    f: (({"collective": bool(f & _COLL_TRUE)} if f & _COLL else {}) | ({"unfinished": True} if f & _UNFINISHED else {}))
    or None
    for f in range(8)
}


# ---- finding digests beside traces -------------------------------------------------------------


@dataclasses.dataclass
class Inputs:
    """What the user named: trace files, the digest on disk beside each (when there is one), and
    digests whose traces are not among the inputs (gathered to one machine)."""

    traces: list[str]
    digests: dict[str, str]  # trace file -> its digest file
    lone: list[str]

    @property
    def ranks(self) -> int:
        return len(self.traces) + len(self.lone)

    @property
    def complete(self) -> bool:
        return all(t in self.digests for t in self.traces)


def find(paths: Iterable[str]) -> Inputs:
    """Files, directories (their trace_rank* and digest_rank* files) and globs -> the trace files
    and digests they name, each once."""
    traces: list[str] = []
    digests: list[str] = []

    def one(f: str) -> None:
        (digests if is_digest_path(f) else traces).append(f)

    for p in paths:
        if os.path.isdir(p):
            found = sorted(f for pattern in TRACE_GLOBS for f in glob.glob(os.path.join(p, pattern)))
            found_digests = sorted(glob.glob(os.path.join(p, "digest_rank*.digest")))
            if not found and not found_digests:
                raise GputraceError(f"{p}: no trace_rank*.json, trace_rank*.pftrace or digest_rank*.digest files here")
            traces += found
            digests += found_digests
        elif any(c in p for c in "*?["):
            found = sorted(glob.glob(p))
            if not found:
                raise GputraceError(f"{p}: no files match")
            for f in found:
                one(f)
        elif os.path.exists(p):
            one(p)
        else:
            raise TraceFormatError(p, "no such file")
    traces = list(dict.fromkeys(traces))
    paired: dict[str, str] = {}
    for t in traces:
        d = digest_path(t)
        if os.path.isfile(d):
            paired[t] = d
    taken = {os.path.abspath(d) for d in paired.values()}
    lone = [d for d in dict.fromkeys(digests) if os.path.abspath(d) not in taken]
    return Inputs(traces, paired, lone)


def _fresh(d: RankDigest, trace_path: str) -> bool:
    """Was `d` written for the trace now at `trace_path` (the same size it had then)?"""
    try:
        return d.trace_bytes is not None and os.path.getsize(trace_path) == d.trace_bytes
    except OSError:
        return False


def collect(inputs: Inputs, step_name: str) -> list[RankDigest]:
    """Every rank's digest: read from its file when there is a fresh one, else computed from its
    trace (one rank at a time)."""
    from gputrace.merge import read_trace

    out: list[RankDigest] = []
    for t in inputs.traces:
        d = None
        if t in inputs.digests:
            try:
                d = read(inputs.digests[t])
            except TraceFormatError:  # cut short or damaged (digests are not fsynced): its trace has it all
                d = None
            if d is not None and (not _fresh(d, t) or d.step_name != step_name):
                d = None
        if d is None:
            d = from_document(from_trace(read_trace(t), step_name, t), t)
            d.computed = True
        out.append(d)
    out += [read(p) for p in inputs.lone]
    return out


def step_names(inputs: Inputs) -> set[str]:
    """The step names the digests were written with (read from the files' first bytes)."""
    found: set[str] = set()
    for p in [*inputs.digests.values(), *inputs.lone]:
        try:
            with open(p, "rb") as f:
                head = f.read(4096)
        except OSError:
            continue
        m = re.search(rb'"step_name":("(?:[^"\\]|\\.)*")', head)
        if m:
            found.add(orjson.loads(m.group(1)))
    return found


# ---- the summary from digests ------------------------------------------------------------------


def load(digests: list[RankDigest], allow_mixed: bool = False) -> tuple[Trace, dict[int, tuple[Any, Any]]]:
    """The digests' spans as one merged `Trace`, checked and aligned exactly as `merge.load`
    checks and aligns trace files (the same functions), and each rank's (host, device) clock
    maps for placing the aggregates' longest spans. The spans move out of the digests (their
    `trace` becomes None), so that memory holds them once."""
    from gputrace import merge as m

    sel = m.Selection.make()
    if any(d.trace is None for d in digests):
        raise GputraceError("these digests were summarized already (their spans are taken): read them again")
    sources = [m.describe_trace(d.path, d.trace) for d in digests]  # type: ignore[arg-type]
    for d in digests:
        d.trace = None  # the source holds it now, and `take` lets go of it rank by rank
    plan = m.plan(sources, allow_mixed, None)
    maps = m.alignment(plan, "clock", None, 1, m.read_source)
    start = m.merged_start(plan, maps)
    ctx = m.Context.make(plan, maps, sel, None)
    out = Trace()
    tally = m.Tally()
    for group in m.groups(plan):
        windows: dict[int, tuple[int, int] | None] = {}
        for s in group:
            trace, s.trace = s.trace, None
            assert trace is not None
            tally.add([m.take(out, s, trace, ctx, windows)])
            del trace
    out.metadata = m.merged_metadata(plan, maps, sel, start, plan.notes + tally.notes(sel))
    return out, {r: (maps.host.get(r), maps.device.get(r)) for r in plan.ranks}


def summarize(
    digests: list[RankDigest],
    step: str = "step",
    skip_steps: int = 0,
    *,
    require_step: bool = False,
    allow_mixed: bool = False,
) -> tuple[Trace, stats.Summary]:
    """The summary of the ranks' digests: steps and collectives by `stats.summarize` itself on
    the digests' spans (the same numbers as from the full traces), the span names from the
    aggregates. Also returns the merged trace of the digests' spans."""
    for d in digests:
        if d.step_name != step:
            raise GputraceError(
                f"{d.path} marks steps with {d.step_name!r}, not {step!r}; pass --step {d.step_name} "
                "or --full (reads the whole traces)"
            )
    per_rank = {d.rank: d for d in digests}
    if require_step and not any(_has_steps(d) for d in digests):
        raise stats.UnknownStepError(_unknown_step(step, digests))
    kept_tracks = {d.rank: [t.kind for t in d.trace.tracks] if d.trace is not None else [] for d in digests}
    trace, maps = load(digests, allow_mixed)
    s = stats.summarize(trace, step, skip_steps)
    # Which warm-up buckets each rank keeps: spans starting at or after its step `skip_steps`.
    notes = list(s.notes)
    cut: dict[int, int] = {}
    inexact: list[int] = []
    for r in s.ranks:
        d = per_rank[r]
        if not skip_steps or s.steps is None or r not in s.steps.ranks:
            cut[r] = 0
        elif d.warmup_exact and skip_steps < d.warmup_steps and skip_steps <= WARMUP_STEPS:
            cut[r] = skip_steps + 1
        else:
            cut[r] = 0
            inexact.append(r)
    names, by_rank, kept, warm = _name_stats(s, per_rank, cut, maps, kept_tracks)
    counts = {}
    for r, c in s.counts.items():
        counts[r] = dataclasses.replace(c, spans=kept[r], unfinished=per_rank[r].unfinished, warmup=warm[r])
    rows_unfinished = sum(c.unfinished for c in s.counts.values())
    all_unfinished = sum(c.unfinished for c in counts.values())
    _replace_note(notes, stats.unfinished_note(rows_unfinished) if rows_unfinished else None,
                  stats.unfinished_note(all_unfinished) if all_unfinished else None,
                  len(trace.metadata.get("notes") or ()))  # fmt: skip
    if skip_steps and s.steps is not None:
        rows_warm = sum(c.warmup for c in s.counts.values())
        _replace_note(
            notes,
            stats.warmup_note(skip_steps, step, rows_warm),
            stats.warmup_note(skip_steps, step, sum(warm.values())),
            len(notes),
        )
    if inexact:
        notes.append(
            f"the span statistics of ranks {_ranges(inexact)} include their warm-up: their digests tell "
            f"apart only the first {WARMUP_STEPS} steps (--full reads the whole traces)"
        )
    negative = sum(d.negative for d in digests)
    if negative:
        notes.append(f"{negative} spans that end before they start were left out (Perfetto drops them too)")
    return trace, dataclasses.replace(s, names=names, by_rank=by_rank, counts=counts, notes=notes)


def _has_steps(d: RankDigest) -> bool:
    if d.trace is None:
        return False
    try:
        k = d.trace.names.index(d.step_name)
    except ValueError:
        return False
    return any(n == k and not a for n, a in zip(d.trace.spans.name, d.trace.spans.args) if n == k)


def _unknown_step(step: str, digests: list[RankDigest]) -> str:
    totals: dict[str, int] = {}
    exists = False
    for d in digests:
        st = d.stats
        for name, total in zip(st["name"], st["total"]):
            totals[name] = totals.get(name, 0) + total
        exists = exists or (d.trace is not None and step in d.trace.names)
    present = sorted(totals, key=lambda n: (-totals[n], n))
    shown = ", ".join(repr(n) for n in present[:12])
    more = f" and {len(present) - 12} more" if len(present) > 12 else ""
    what = f"no finished span of a rank is named {step!r}" if exists else f"no span is named {step!r}"
    return f"{what}, so it cannot mark steps; choose one of the span names present: {shown}{more}"


def _replace_note(notes: list[str], old: str | None, new: str | None, at: int) -> None:
    if old is not None and old in notes:
        i = notes.index(old)
        if new is None:
            del notes[i]
        else:
            notes[i] = new
    elif new is not None:
        notes.insert(min(at, len(notes)), new)


def _name_stats(
    s: stats.Summary,
    per_rank: dict[int, RankDigest],
    cut: dict[int, int],
    maps: dict[int, tuple[Any, Any]],
    kinds: dict[int, list[str]],
) -> tuple[list[stats.NameStats], dict[int, list[stats.NameStats]], dict[int, int], dict[int, int]]:
    """Name statistics from the aggregates of the buckets each rank keeps; a name whose every
    span of a rank is a digest row keeps the exact statistics the summary computed from them."""
    # Per name: per rank [count, total, min, max, max start, max track, hist Counter].
    by_name: dict[str, dict[int, list[Any]]] = {}
    kept = {r: 0 for r in s.ranks}
    warm = {r: 0 for r in s.ranks}
    for r in s.ranks:
        st = per_rank[r].stats
        c = cut[r]
        for k, name in enumerate(st["name"]):
            n = st["count"][k]
            if st["bucket"][k] < c:
                warm[r] += n
                continue
            kept[r] += n
            a = by_name.setdefault(name, {}).get(r)
            if a is None:
                a = by_name[name][r] = [0, 0, st["min"][k], -1, 0, 0, Counter()]
            a[0] += n
            a[1] += st["total"][k]
            a[2] = min(a[2], st["min"][k])
            if st["max"][k] > a[3]:
                a[3], a[4], a[5] = st["max"][k], st["max_start"][k], st["max_track"][k]
            h = st["hist"][k]
            a[6].update(dict(zip(h[0::2], h[1::2])))
    exact_rank = {r: {x.name: x for x in rows} for r, rows in s.by_rank.items()}
    exact_all = {x.name: x for x in s.names}
    by_rank: dict[int, list[stats.NameStats]] = {r: [] for r in s.ranks}
    rows: list[stats.NameStats] = []
    for name, ranks in by_name.items():
        complete = True
        insts = {}
        for r, a in sorted(ranks.items()):
            ex = exact_rank[r].get(name)
            if ex is not None and ex.count == a[0]:
                by_rank[r].append(ex)
                insts[r] = ex.slowest
                continue
            complete = False
            host, device = maps.get(r, (None, None))
            fn = device if device is not None and kinds[r][a[5]] == "cuda" else host
            lo, hi = a[4], a[4] + a[3]
            inst = stats.Instance(r, fn(lo), fn(hi)) if fn is not None else stats.Instance(r, lo, hi)
            insts[r] = inst
            by_rank[r].append(_row(name, {r: a}, inst))
        if complete and name in exact_all:
            rows.append(exact_all[name])
        else:
            longest = max(ranks, key=lambda r: (ranks[r][3], -r))
            rows.append(_row(name, ranks, insts[longest]))
    order = lambda x: (-x.total_ns, x.name)  # noqa: E731
    rows.sort(key=order)
    for v in by_rank.values():
        v.sort(key=order)
    return rows, by_rank, kept, warm


def _row(name: str, ranks: dict[int, list[Any]], slowest: stats.Instance) -> stats.NameStats:
    totals = {r: a[1] for r, a in ranks.items()}
    count = sum(a[0] for a in ranks.values())
    hist: Counter[int] = Counter()
    for a in ranks.values():
        hist.update(a[6])
    lo_v = min(a[2] for a in ranks.values())
    hi_v = max(a[3] for a in ranks.values())
    p50, p90, p99 = (_percentile(hist, count, q, lo_v, hi_v) for q in (50, 90, 99))
    return stats.name_row(name, count, (p50, p90, p99), hi_v, totals, slowest)


def _percentile(hist: Counter[int], n: int, q: int, lo: int, hi: int) -> int:
    """The nearest-rank percentile (as `stats.percentile` takes it) estimated from the
    histogram: the geometric middle of the bucket it falls in, within the least and longest."""
    if not n:
        return 0
    want = max(0, min(n - 1, (n * q + 99) // 100 - 1))
    seen = 0
    for b in sorted(hist):
        seen += hist[b]
        if seen > want:
            mid = 0 if b < 0 else round(math.sqrt(_BOUND[b] * (_BOUND[b + 1] - 1)))
            return min(max(mid, lo), hi)
    return hi


# ---- the loading choice of `gputrace summary` -----------------------------------------------------


def summary_of_files(
    paths: Sequence[str],
    step: str | None = None,
    skip_steps: int = 0,
    *,
    allow_mixed: bool = False,
    full: bool = False,
    ranks: Iterable[int] | None = None,
    steps: tuple[int | None, int | None] | None = None,
) -> stats.Summary:
    """The summary `gputrace summary` prints for `paths`, from the digests when every rank has
    one (or when the ranks are many: DIGEST_MIN_RANKS), else from the full traces; `full`, or a
    selection of ranks or steps, reads the full traces (of the selection only). Its first note
    says which it read."""
    from gputrace import merge

    inputs = find(paths)
    selection = ranks is not None or steps is not None
    if (full or selection) and not inputs.traces:
        raise GputraceError("only digests here: --full, --ranks and --steps need the trace files")
    use_digests = (
        not full and not selection and (inputs.complete or bool(inputs.lone) or inputs.ranks >= DIGEST_MIN_RANKS)
    )
    recorded = step_names(inputs) if use_digests else set()
    if use_digests and step is None and len(recorded) == 1:
        step_name = recorded.pop()
    else:
        step_name = step or "step"
    why = ""
    if use_digests and recorded and recorded != {step_name}:
        if inputs.ranks < DIGEST_MIN_RANKS and inputs.traces and not inputs.lone:
            use_digests = False
            why = f" (the digests mark steps with {', '.join(map(repr, sorted(recorded)))}, not {step_name!r})"
        else:
            raise GputraceError(
                f"the digests mark steps with {', '.join(map(repr, sorted(recorded)))}, not {step_name!r}: pass "
                f"--step {sorted(recorded)[0]}, or --full to read every trace"
            )
    if use_digests:
        digests = collect(inputs, step_name)
        computed = sorted(d.rank for d in digests if d.computed)
        _, s = summarize(digests, step_name, skip_steps, require_step=step is not None, allow_mixed=allow_mixed)
        note = (
            f"read from the ranks' digests ({len(digests)} rank{'s' if len(digests) != 1 else ''}): steps and "
            f"collectives are exact; span percentiles are approximate (estimated from histograms, within "
            f"{HIST_ERROR:.1%}) but for step and collective spans; --full reads the whole traces"
        )
        if computed:
            note += f"; ranks {_ranges(computed)} had no digest as new as their trace: computed from the trace"
        return dataclasses.replace(s, notes=[note, *s.notes])
    files = inputs.traces
    if ranks is not None:
        wanted = set(ranks)
        by_name = {t: _TRACE_NAME.match(os.path.basename(t)) for t in files}
        if all(by_name.values()) and len({m.group(1) for m in by_name.values() if m}) == len(files):
            # Files named by rank: only the selected ones are opened.
            files = [t for t, m in by_name.items() if m and int(m.group(1)) in wanted] or files
    trace = merge.load(files, allow_mixed=allow_mixed, ranks=ranks, steps=steps, step_name=step_name)
    s = stats.summarize(trace, step_name, skip_steps, require_step=step is not None)
    what = "read from the full traces" + why
    if selection:
        parts = []
        if ranks is not None:
            parts.append(f"ranks {_ranges(sorted(set(ranks)))}")
        if steps is not None:
            a, b = steps
            parts.append(f"steps {a or 0}:{'' if b is None else b} (numbered from {a or 0} in the run, from 0 here)")
        what = f"read from the full traces of {' and '.join(parts)} only"
    if inputs.lone:
        what += f"; {len(inputs.lone)} digests without their traces here are left out"
    return dataclasses.replace(s, notes=[what, *s.notes])


# ---- gathering to rank 0 ------------------------------------------------------------------------


def gather(out_dir: str | None = None, group: Any = None, dst: int = 0) -> list[str]:
    """Collective (every rank of `group` calls it, after `gputrace.save()`): each rank's digest
    goes to rank `dst`, which writes them all into `out_dir` (default: its output directory) as
    `digest_rank{R}.digest`, so that `gputrace summary` there reads every rank without their
    traces. Returns the paths written (on `dst`; an empty list elsewhere)."""
    import torch.distributed as dist

    from gputrace import dist as gdist
    from gputrace import session

    sess = session.SESSION
    mine: bytes | None = None
    path = LAST_WRITTEN if LAST_WRITTEN is not None and os.path.isfile(LAST_WRITTEN) else None
    if path is not None:
        try:
            with open(path, "rb") as f:
                mine = zlib.compress(f.read(), 1)
        except OSError:
            mine = None
    g = gdist._gloo_group(dist, group)
    ranks = dist.get_process_group_ranks(g) if g is not None else list(range(dist.get_world_size()))
    target = ranks[dst] if g is not None else dst
    me = dist.get_rank()
    box: list[Any] = [None] * len(ranks) if me == target else []
    dist.gather_object(mine, box if me == target else None, dst=target, group=g)
    if me != target:
        return []
    directory = out_dir or sess.config.out_dir
    if not directory:
        raise GputraceError("gather_digests() needs out_dir on the receiving rank (or the out_dir option)")
    written = []
    for blob in box:
        if blob is None:
            continue
        data = zlib.decompress(blob)
        doc = orjson.loads(data)
        dest = os.path.join(directory, f"digest_rank{int(doc['rank'])}.digest")
        if os.path.abspath(dest) != os.path.abspath(path or ""):
            with atomic_writer(dest) as f:
                f.write(data)
        written.append(dest)
    return written


def _ranges(ranks: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for r in sorted(set(ranks)):
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
