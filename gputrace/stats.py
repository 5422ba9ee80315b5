"""Statistics of a trace: where the time goes, which rank was slow in which step, and who waited
for whom in each collective.

Takes: one `Trace` (one rank's, or every rank merged onto one aligned timeline). Gives: a
`Summary`: per span name (all ranks, and each rank alone) count, total, percentiles, the
slowest instance and the imbalance between ranks; per step and rank the busy time (work before
waiting) with an honest verdict on the slowest rank; every collective occurrence matched across
ranks with its arrival order and waits; and per rank the spans left out or lost. `to_json`
turns it into labelled JSON objects, `table` into text that fits a terminal.

Cost: linear in spans plus sorting. Spans are grouped once by (name, rank); a step's time inside
collectives comes from prefix sums over the rank's merged collective intervals (two bisections a
step), and a collective finds its step by bisection, so nothing is rescanned per step.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import sys
import textwrap
import unicodedata
from array import array
from bisect import bisect_left
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from itertools import chain, compress, repeat
from operator import contains, ge, getitem, sub
from typing import Any

from gputrace import breakdown as bd
from gputrace import digest_breakdown as dbk
from gputrace import stats_columns as columns
from gputrace.causes import causes
from gputrace.errors import GputraceError
from gputrace.trace.model import Trace

# Spans whose time is waiting for other ranks, not work: a straggler's peers spend its extra
# time in them, so a step's length alone cannot tell who was slow. The fallback for traces in
# which no span is marked `collective=True`.
WAIT_NAMES = re.compile(
    r"all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|broadcast|barrier|wait|nccl|gloo", re.IGNORECASE
)

#: A rank is called slowest in a step only when its margin over the step's median busy time is
#: more than this share of the median (and more than its clock error).
MARGIN_PCT = 2.0


@dataclass(frozen=True)
class Instance:
    """One span: where to show it in the timeline."""

    rank: int
    start_ns: int
    end_ns: int


@dataclass(frozen=True)
class NameStats:
    name: str
    count: int
    total_ns: int
    mean_ns: float
    p50_ns: int
    p90_ns: int
    p99_ns: int
    max_ns: int
    ranks: int  # ranks that have this name
    min_rank: int  # the rank with the least total of this name
    min_rank_total_ns: int
    max_rank: int
    max_rank_total_ns: int
    imbalance: float  # largest per-rank total / least
    slowest: Instance  # the longest single span of this name
    # The total less the time of each span's children on its own track (see `self_times`); None
    # where the source cannot say (a digest of an older version without its trace).
    self_total_ns: int | None = None


@dataclass(frozen=True)
class StepVerdict:
    """The rank that worked longest in one step, and whether that is beyond the noise."""

    step: int  # the step's number on every rank: its step spans counted from 0, skipped ones included
    rank: int
    busy_ns: int
    median_ns: int  # the step's median busy time over ranks
    margin_ns: int  # busy_ns - median_ns
    margin_pct: float
    noise_ns: int  # the rank's clock error on a busy time, which the margin must exceed
    called: bool  # margin above MARGIN_PCT of the median and above noise_ns


@dataclass(frozen=True)
class Steps:
    """Per rank and step: lists indexed by k, the step numbered `skipped + k`."""

    name: str
    skipped: int
    count: int  # steps present on every rank in `ranks`, after the skipped ones
    ranks: list[int]  # ranks with step spans
    start_ns: dict[int, list[int]]
    end_ns: dict[int, list[int]]
    busy_ns: dict[int, list[int]]  # step time minus time inside the rank's collective spans
    wait_ns: dict[int, list[int]]  # step time inside collective spans
    median_busy_ns: list[int]
    verdicts: list[StepVerdict]  # one per step
    rule: str
    times_slowest: dict[int, int]  # rank -> steps in which it was called slowest
    # The breakdown (DESIGN.md "Why a step is slow"), in the same shape. None: not known for
    # that rank and step (a digest of an older version without its trace; for launch lag also a
    # step with no CUDA span whose host entry time was recorded).
    idle_ns: dict[int, list[int | None]]  # no span of the rank open on any track but the step and its ancestors
    collective_wait_ns: dict[int, list[int]]  # inside collectives, before the last rank arrived
    collective_transfer_ns: dict[int, list[int]]  # inside collectives, after the last rank arrived
    exposed_collective_ns: dict[int, list[int | None]]  # collective time no span on another track overlaps
    launch_lag_ns: dict[int, list[int | None]]  # the step's first CUDA span: device start - host entry

    def number(self, k: int) -> int:
        return self.skipped + k


@dataclass(frozen=True)
class Occurrence:
    """One collective as every rank ran it, matched by (step, name, ordinal within the step on
    each rank)."""

    step: int | None  # None: outside every step (matched by name and ordinal over the trace)
    name: str
    ordinal: int
    arrivals: dict[int, int]  # rank -> start ns
    ends: dict[int, int]  # rank -> end ns
    last_rank: int  # the latest arrival
    waits_ns: dict[int, int]  # rank -> last arrival - its arrival
    last_margin_ns: int  # the last arrival - the one before it
    last_called: bool  # last_margin_ns above the two ranks' clock error (their arrival order is known)


@dataclass(frozen=True)
class CollectiveRank:
    times_last: int  # occurrences it arrived last in, beyond the clock error
    wait_caused_ns: int  # the others' waits in occurrences it arrived last in
    wait_suffered_ns: int  # its own waits
    times_last_within_noise: int  # last, but by less than the clock error


@dataclass(frozen=True)
class Collectives:
    rule: str  # which spans count as collectives, and when a last arrival is called
    occurrences: list[Occurrence]  # in order of first arrival
    per_rank: dict[int, CollectiveRank]


@dataclass(frozen=True)
class RankCounts:
    spans: int  # finished spans in the statistics
    unfinished: int  # still open when the trace was written: counted, left out of the statistics
    dropped: int | None  # lost by the recorder (its span limit); None when the trace does not say
    skipped_in_capture: int | None  # not recorded inside CUDA graph capture; None when not said
    warmup: int  # left out by skip_steps (they start before the rank's first kept step)
    unwritten: int | None = None  # recorded, but the stream's file could not take them (a full disk)


@dataclass(frozen=True)
class Summary:
    ranks: list[int]
    names: list[NameStats]  # all ranks, by total descending
    by_rank: dict[int, list[NameStats]]
    steps: Steps | None
    collectives: Collectives | None
    counts: dict[int, RankCounts]
    notes: list[str]


class UnknownStepError(GputraceError):
    """The span name asked to mark steps is not in the trace."""


# ---- computing ----------------------------------------------------------------------------------


def percentile(sorted_values: Sequence[int], q: int) -> int:
    """Nearest-rank percentile (q in 1..100) of an ascending sequence, in integers."""
    n = len(sorted_values)
    if not n:
        return 0
    return sorted_values[max(0, min(n - 1, (n * q + 99) // 100 - 1))]


def summarize(
    trace: Trace,
    step: str = "step",
    skip_steps: int = 0,
    *,
    require_step: bool = False,
    unknown_breakdown: Collection[int] = (),
) -> Summary:
    """The summary of `trace` (times already aligned across ranks). `step` names the span that
    marks one training step; the first `skip_steps` steps of every rank, and everything the rank
    did before them, are left out (warm-up). Without any `step` span, step analysis is omitted,
    unless `require_step`: then a trace with spans but none named `step` is an error that lists
    the names present.

    The step breakdown (`gputrace.breakdown`) is computed from every span of each rank, or, for
    the spans of a digest (`gputrace.summary`), from its step and collective spans and its
    cover: spans whose args say `cover` (the union of the rank's other spans on one track, as
    the digest keeps it), which are nothing else here. The ranks in `unknown_breakdown` have
    neither (digests of an older version): their idle, exposed collective and launch lag are
    None."""
    if skip_steps < 0:
        raise GputraceError(f"skip_steps must be 0 or more, not {skip_steps}")
    sp = trace.spans
    names = trace.names
    ranks = trace.ranks
    nr = len(ranks)
    rank_meta: dict[int, Any] = {}
    for p in trace.processes:
        if p.rank is not None and not p.foreign:
            rank_meta.setdefault(p.rank, p.metadata or {})
    slot_of_rank = {r: k for k, r in enumerate(ranks)}
    stride = nr + 1  # slot nr: spans of processes that are not ranks
    slot_of_track = [
        slot_of_rank[p.rank] if p.rank is not None and not p.foreign else nr
        for p in (trace.processes[t.process] for t in trace.tracks)
    ]
    # What merging found (mixed runs allowed, spans left out) stays in view.
    notes: list[str] = [str(n) for n in trace.metadata.get("notes") or () if isinstance(n, str)]

    # Group every span by (name, rank slot) in one pass, as one index column (`stats_columns`);
    # unfinished spans go to group -1 - slot, a digest's cover spans to -1 - stride - slot.
    grouped = columns.groups(sp.name, sp.track, sp.args, array("q", slot_of_track), stride)
    marked = grouped.marked  # per span: its `collective` argument (columns.MARKED_*)
    any_marked = marked.count(columns.MARKED_NONE) != len(marked)
    groups: dict[int, Sequence[int]] = grouped.groups()
    unfinished = [len(groups.pop(-1 - s, ())) for s in range(nr)]
    cover = [list(groups.pop(-1 - stride - s, ())) for s in range(stride)]
    foreign = len(groups.pop(-1 - nr, ())) + sum(len(v) for k, v in list(groups.items()) if k % stride == nr)
    groups = {k: v for k, v in groups.items() if k % stride != nr}
    if foreign:
        notes.append(f"{foreign:,} spans of processes that are not gputrace ranks (other tools') are left out")
    if sum(unfinished):
        notes.append(unfinished_note(sum(unfinished)))

    start, end = sp.start, sp.end

    # Steps: each rank's finished step spans in start order.
    step_id = names.index(step) if step in names else None
    step_idx: dict[int, list[int]] = {}
    if step_id is not None:
        for s in range(nr):
            g = groups.get(step_id * stride + s)
            if g:
                step_idx[s] = sorted(g, key=start.__getitem__)
    if not step_idx and require_step and groups:
        raise UnknownStepError(_unknown_step_message(step, step_id is not None, groups, names, stride, sp))
    if skip_steps and step_idx:
        fewest = min(len(v) for v in step_idx.values())
        if skip_steps >= fewest:
            raise GputraceError(
                f"skipping {skip_steps} steps leaves none: the rank with the fewest has {fewest} {step!r} spans; "
                "skip fewer"
            )

    # Every finished span of each rank, warm-up included: the breakdown looks at all that was
    # open in a kept step, and a span's children may lie in the warm-up.
    own = grouped.own_spans(nr)  # in trace order (ranges where a rank's spans lie together)
    # ... and those a digest keeps as rows: named like the step or a collective, or marked one.
    row_names = {n for n, x in enumerate(names) if n == step_id or WAIT_NAMES.search(x)}
    marked_true_names = set(compress(sp.name, marked.translate(columns.TRUE_MASK)))
    rows_of: list[list[int]] = [[] for _ in range(nr)]
    for k, g in groups.items():
        if k // stride == step_id:
            continue  # the breakdown's spans are the step's content
        if k // stride in row_names:
            rows_of[k % stride].extend(g)
        elif k // stride in marked_true_names:
            rows_of[k % stride].extend(i for i in g if marked[i] == columns.MARKED_TRUE)

    # Warm-up: spans of a rank that start before its first kept step.
    warmup = [0] * nr
    if skip_steps and step_idx:
        cut = [start[step_idx[s][skip_steps]] if s in step_idx else None for s in range(nr)]
        for k in list(groups):
            c = cut[k % stride]
            if c is None:
                continue
            g = groups[k]
            kept = [i for i in g if start[i] >= c]
            if len(kept) != len(g):
                warmup[k % stride] += len(g) - len(kept)
                if kept:
                    groups[k] = kept
                else:
                    del groups[k]
        notes.append(warmup_note(skip_steps, step, sum(warmup)))

    row_mask = bytes(n in row_names for n in range(len(names)))
    children = {
        k: c for s in range(nr) for k, c in _children(trace, own[s], step_idx.get(s, []), skip_steps, stride, s)
    }
    dur = array("q", map(sub, end, start))
    by_rank, all_rows = _name_stats(groups, names, ranks, stride, dur, start, end, children)
    del dur  # 8 bytes a span, not needed past the names' rows

    # Collectives: spans the user marked, else spans named like one (never the step span).
    marked_names = marked_true_names
    coll_idx: dict[int, list[int]] = {s: [] for s in range(nr)}
    if marked_names:
        for k, g in groups.items():
            if k // stride in marked_names:
                coll_idx[k % stride].extend(i for i in g if marked[i] == columns.MARKED_TRUE)
        coll_rule = "collectives are the spans marked collective=True"
    else:
        wait_names = {n for n, name in enumerate(names) if n != step_id and WAIT_NAMES.search(name)}
        for k, g in groups.items():
            if k // stride in wait_names:
                # A span the user marked collective=False is not one, whatever its name.
                coll_idx[k % stride].extend((i for i in g if marked[i] != columns.MARKED_FALSE) if any_marked else g)
        coll_rule = (
            "collectives are the spans named like one (all_reduce, all_gather, reduce_scatter, all_to_all, "
            "broadcast, barrier, wait, nccl, gloo), as no span is marked collective=True"
        )
    for s in range(nr):
        coll_idx[s].sort(key=start.__getitem__)

    anchor = [_anchor_uncertainty(rank_meta[r]) for r in ranks]
    align_err, aligned = _alignment_errors(trace, ranks)

    steps = None
    if step_idx:
        steps = _steps(step, skip_steps, step_idx, coll_idx, ranks, start, end, anchor, notes)

    collectives = None
    if any(coll_idx.values()):
        collectives = _collectives(
            coll_idx, step_idx, skip_steps, ranks, names, sp.name, start, end, align_err, anchor, coll_rule
        )
        if sum(1 for v in coll_idx.values() if v) > 1:
            notes += _clock_notes(trace, ranks, rank_meta, aligned)
    elif nr > 1 and aligned:  # no arrival order to qualify, but unsynced clocks are said all the same
        notes += _clock_notes(trace, ranks, rank_meta, aligned)
    kept = [0] * nr
    for k, n in [(k, len(v)) for k, v in groups.items()]:
        kept[k % stride] += n
    # The index column (8 bytes a span) is let go before the breakdown's columns are made: no name
    # in this scope may hold a view of it past here.
    g = ()  # a loop above may have left it holding a view
    del groups
    grouped.order = array("q")
    if steps is not None:
        # Each rank's cover (24 bytes a span that does not overlap another on its track) made
        # only now, with the index column gone, and one rank's at a time.
        def cover_of(s: int) -> tuple[Sequence[int], Sequence[int], Sequence[int]]:
            return _cover(trace, own[s], rows_of[s], row_mask, step_idx.get(s, []))

        colls = {i for v in coll_idx.values() for i in v}
        steps = _breakdown(trace, steps, step_idx, rows_of, cover_of, cover, collectives, colls, set(unknown_breakdown))
        if trace.spans.entry is not None:
            steps = _launch_lags(trace, steps, own)

    counts = {}
    for s, r in enumerate(ranks):
        meta = rank_meta[r]
        counts[r] = RankCounts(
            kept[s],
            unfinished[s],
            _int_or_none(meta.get("spans_dropped")),
            _int_or_none(meta.get("spans_skipped_in_cuda_graph_capture")),
            warmup[s],
            _int_or_none(meta.get("spans_unwritten")),
        )
    dropped = sum(c.dropped or 0 for c in counts.values())
    if dropped:
        notes.append(f"{dropped:,} spans were dropped by the recorder (its span limit) and are not in the trace")
    unwritten = {r: c.unwritten for r, c in counts.items() if c.unwritten}
    if unwritten:
        notes.append(
            f"{sum(unwritten.values()):,} spans of ranks {_ranges(sorted(unwritten))} were recorded but their "
            "file could not take them (a full disk or a file size limit while streaming) and are not in the trace"
        )
    return Summary(ranks, all_rows, by_rank, steps, collectives, counts, notes)


def unfinished_note(n: int) -> str:
    """The note on `n` unfinished spans (also said of summaries made from digests)."""
    return f"{n:,} unfinished spans (open when the trace was written) are left out and counted"


def warmup_note(skip_steps: int, step: str, n: int) -> str:
    """The note on the warm-up left out: `n` spans in or before the first `skip_steps` steps."""
    return (
        f"the first {skip_steps} {step!r} steps of every rank, and what it did before them, are left out ({n:,} spans)"
    )


def _int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _unknown_step_message(
    step: str, exists: bool, groups: dict[int, Sequence[int]], names: list[str], stride: int, sp: Any
) -> str:
    # The names by total time, as the table lists them: a step span is usually among the first.
    totals: dict[int, int] = {}
    for k, g in groups.items():
        totals[k // stride] = totals.get(k // stride, 0) + sum(sp.end[i] - sp.start[i] for i in g)
    present = sorted(totals, key=lambda n: (-totals[n], names[n]))
    shown = ", ".join(repr(names[n]) for n in present[:12])
    more = f" and {len(present) - 12} more" if len(present) > 12 else ""
    what = f"no finished span of a rank is named {step!r}" if exists else f"no span is named {step!r}"
    return f"{what}, so it cannot mark steps; choose one of the span names present: {shown}{more}"


def _name_stats(
    groups: dict[int, Sequence[int]],
    names: list[str],
    ranks: list[int],
    stride: int,
    dur: Sequence[int],
    start: Sequence[int],
    end: Sequence[int],
    children: dict[int, int],
) -> tuple[dict[int, list[NameStats]], list[NameStats]]:
    by_name: dict[int, list[int]] = {}
    for k in groups:
        by_name.setdefault(k // stride, []).append(k)
    by_rank: dict[int, list[NameStats]] = {r: [] for r in ranks}
    rows: list[NameStats] = []
    dget = dur.__getitem__
    for n, ks in by_name.items():
        ks.sort()
        totals: dict[int, int] = {}
        parts: list[Sequence[int]] = []  # each rank's ascending durations
        slowest: Instance | None = None
        longest = -1
        self_total = 0
        for k in ks:
            g = groups[k]
            r = ranks[k % stride]
            ds = columns.sorted_durations(start, end, g)
            totals[r] = sum(ds)
            i = max(g, key=dget)
            inst = Instance(r, start[i], end[i])
            if ds[-1] > longest:
                slowest, longest = inst, ds[-1]
            own_self = totals[r] - children.get(k, 0)
            self_total += own_self
            by_rank[r].append(_row(names[n], ds, {r: totals[r]}, inst, own_self))
            parts.append(ds)
        # Sorted runs: a merge, not a full sort; one rank's are the name's.
        runs = parts[0] if len(parts) == 1 else sorted(chain.from_iterable(parts))
        assert slowest is not None
        rows.append(_row(names[n], runs, totals, slowest, self_total))
    order = lambda x: (-x.total_ns, x.name)  # noqa: E731
    rows.sort(key=order)
    for v in by_rank.values():
        v.sort(key=order)
    return by_rank, rows


def _row(name: str, ds: Sequence[int], totals: dict[int, int], slowest: Instance, self_total: int) -> NameStats:
    """One name's statistics from its ascending durations and its total on each rank."""
    pct = (percentile(ds, 50), percentile(ds, 90), percentile(ds, 99))
    return name_row(name, len(ds), pct, ds[-1], totals, slowest, self_total)


def name_row(
    name: str,
    count: int,
    pct: tuple[int, int, int],
    max_ns: int,
    totals: dict[int, int],
    slowest: Instance,
    self_total_ns: int | None = None,
) -> NameStats:
    """A name's row from its count, p50/p90/p99, longest, per-rank totals and self time: the
    ranks with the least and largest total, and the imbalance between them (any source of
    durations: the spans themselves, or a digest's histograms)."""
    total = sum(totals.values())
    lo = min(totals, key=lambda r: (totals[r], r))
    hi = max(totals, key=lambda r: (totals[r], -r))
    return NameStats(
        name=name,
        count=count,
        total_ns=total,
        mean_ns=total / count if count else 0.0,
        p50_ns=pct[0],
        p90_ns=pct[1],
        p99_ns=pct[2],
        max_ns=max_ns,
        ranks=len(totals),
        min_rank=lo,
        min_rank_total_ns=totals[lo],
        max_rank=hi,
        max_rank_total_ns=totals[hi],
        imbalance=totals[hi] / totals[lo] if totals[lo] else (math.inf if totals[hi] else 1.0),
        slowest=slowest,
        self_total_ns=self_total_ns,
    )


def _anchor_uncertainty(meta: Any) -> int:
    """The largest device anchor uncertainty the rank recorded (0 for host-only traces)."""
    try:
        anchors = meta.get("clock", {}).get("device_anchors") or []
        return max((int(a.get("uncertainty_ns_max", 0)) for a in anchors if isinstance(a, dict)), default=0)
    except (AttributeError, TypeError, ValueError):
        return 0


def _alignment_errors(trace: Trace, ranks: list[int]) -> tuple[list[int], bool]:
    per = (trace.metadata.get("alignment") or {}).get("per_rank") if isinstance(trace.metadata, dict) else None
    if not isinstance(per, dict):
        return [0] * len(ranks), False
    out = []
    for r in ranks:
        a = per.get(r, per.get(str(r)))  # int keys in memory (merge.load), strings in a file
        e = a.get("error_ns") if isinstance(a, dict) else None
        out.append(int(e) if isinstance(e, (int, float)) and not isinstance(e, bool) else 0)
    return out, True


def _clock_notes(trace: Trace, ranks: list[int], rank_meta: dict[int, Any], aligned: bool) -> list[str]:
    """What the arrival order across ranks rests on, when it rests on less than measured offsets."""
    if not aligned:
        return ["the trace carries no alignment error bars: arrival order trusts the clocks as written"]
    if (trace.metadata.get("alignment") or {}).get("method") == "align-on":
        return []
    unsynced = []
    hosts = set()
    for r in ranks:
        meta = rank_meta[r] if isinstance(rank_meta[r], dict) else {}
        clock: dict[str, Any] = meta["clock"] if isinstance(meta.get("clock"), dict) else {}
        if not clock.get("sync_to_rank0"):
            unsynced.append(r)
        hosts.add(meta.get("hostname"))
    # Ranks of one host read one realtime clock; across hosts, unsynced clocks are NTP's.
    if unsynced and (len(hosts) > 1 or None in hosts):
        return [
            f"ranks {_ranges(unsynced)} recorded no clock sync (gputrace.sync_clocks()) and the ranks may be on "
            "several hosts: their arrival order trusts the host clocks (NTP: often 0.1-10 ms apart)"
        ]
    if unsynced and len(ranks) > 1:  # said even so: an unsynced run must not pass for a measured one
        return [
            f"ranks {_ranges(unsynced)}: clocks not synced (no gputrace.sync_clocks()), so no error bar was "
            "measured (ranks on one host share its clock)"
        ]
    return []


def _steps(
    step: str,
    skip: int,
    step_idx: dict[int, list[int]],
    coll_idx: dict[int, list[int]],
    ranks: list[int],
    start: Sequence[int],
    end: Sequence[int],
    anchor: list[int],
    notes: list[str],
) -> Steps:
    slots = sorted(step_idx)
    lengths = [len(step_idx[s]) - skip for s in slots]
    count = min(lengths)
    if max(lengths) != count:
        notes.append(
            f"ranks have between {count + skip} and {max(lengths) + skip} {step!r} spans; steps beyond "
            f"{count + skip} are not on every rank and are left out of the step analysis"
        )
    missing = [ranks[s] for s in range(len(ranks)) if s not in step_idx]
    if missing:
        notes.append(f"ranks {_ranges(missing)} have no {step!r} spans and are left out of the step analysis")
    srank = [ranks[s] for s in slots]
    starts: dict[int, list[int]] = {}
    ends: dict[int, list[int]] = {}
    busy: dict[int, list[int]] = {}
    wait: dict[int, list[int]] = {}
    for s in slots:
        r = ranks[s]
        idx = step_idx[s][skip : skip + count]
        qs, qe = columns.take(idx, start, end)  # int64 columns (C gathers), read in place below
        ss, se = qs.tolist(), qe.tolist()
        coll = coll_idx[s]  # the step's time inside the union of the rank's collective spans
        w = bd.within(*bd.union_columns(*columns.take(coll, start, end)), qs, qe)
        starts[r], ends[r], wait[r] = ss, se, w
        busy[r] = list(map(sub, map(sub, se, ss), w))  # C-level maps: 64 ranks x 10k steps stay cheap
    noise = [2 * anchor[s] for s in slots]
    verdicts: list[StepVerdict] = []
    times = {r: 0 for r in srank}
    n = len(slots)
    # Per step: the largest busy time, the first rank with it, the median (C loop, one pass).
    tops, firsts, medians = columns.columns([busy[r] for r in srank], count)
    for k, (top, j, med) in enumerate(zip(tops, firsts, medians)):
        margin = top - med
        pct = 100.0 * margin / med if med else (0.0 if margin == 0 else math.inf)
        called = n > 1 and pct > MARGIN_PCT and margin > noise[j]
        if called:
            times[srank[j]] += 1
        verdicts.append(StepVerdict(skip + k, srank[j], top, med, margin, pct, noise[j], called))
    rule = (
        f"a rank is called slowest in a step only when its busy time (the step minus its time inside "
        f"collectives) exceeds the step's median over ranks by more than {MARGIN_PCT:g}% and by more than its "
        "clock error on a duration: twice its device anchor uncertainty, as a duration has two anchored ends "
        "(the offsets between ranks' clocks cancel out of a duration measured on one rank)"
    )
    # The breakdown's names and shapes; its numbers follow.
    zero: list[int] = [0] * count
    zero_or_none: list[int | None] = [0] * count
    unknown: list[int | None] = [None] * count
    return Steps(
        step,
        skip,
        count,
        srank,
        starts,
        ends,
        busy,
        wait,
        medians,
        verdicts,
        rule,
        times,
        idle_ns={r: list(zero_or_none) for r in srank},
        collective_wait_ns={r: list(zero) for r in srank},
        collective_transfer_ns={r: list(zero) for r in srank},
        exposed_collective_ns={r: list(zero_or_none) for r in srank},
        launch_lag_ns={r: list(unknown) for r in srank},
    )


def _rank_columns(trace: Trace, idx: Sequence[int]) -> tuple[Sequence[int], ...]:
    """The name, track, start and end columns of a rank's spans `idx` (ascending)."""
    sp = trace.spans
    if idx and idx[0] == 0 and len(idx) == len(sp):  # the trace's only rank: its columns as they are
        return sp.name, sp.track, sp.start, sp.end
    if idx and idx[-1] - idx[0] + 1 == len(idx):  # a rank's spans lie together (merge takes rank by rank)
        lo, hi = idx[0], idx[-1] + 1
        return (
            array("l", sp.name[lo:hi]),
            array("l", sp.track[lo:hi]),
            array("q", sp.start[lo:hi]),
            array("q", sp.end[lo:hi]),
        )
    return (
        array("l", map(sp.name.__getitem__, idx)),
        array("l", map(sp.track.__getitem__, idx)),
        array("q", map(sp.start.__getitem__, idx)),
        array("q", map(sp.end.__getitem__, idx)),
    )


def _children(
    trace: Trace, own: Sequence[int], steps: list[int], skip: int, stride: int, slot: int
) -> list[tuple[int, int]]:
    """One rank's kept spans' children's time per group key (name * stride + slot), by the
    digest's own loop (`gputrace.digest_breakdown`), over its spans `own` in the order written."""
    names, tracks, starts, ends = _rank_columns(trace, own)
    # Bucket 1: at or after the first kept step (bucket 0 holds all when none is skipped).
    cut = array("q", [trace.spans.start[steps[skip]]] if skip and len(steps) > skip else [])
    e = array("q")
    ck, cn = dbk.nest_keys(names, tracks, starts, ends, None, cut, -1, 2, e, e, e, e)
    kept = 1 if len(cut) else 0
    return [(n * stride + slot, c) for key, c in zip(ck, cn) for n, b in [divmod(key, 2)] if b == kept]


def _cover(
    trace: Trace, own: Sequence[int], rows: list[int], row_mask: bytes, steps: list[int]
) -> tuple[Sequence[int], Sequence[int], Sequence[int]]:
    """One rank's cover: the union per track of its spans `own` (ascending) that are not rows of
    a digest nor a step's ancestor, by the digest's own loop (`gputrace.digest_breakdown`)."""
    sp = trace.spans
    idx = own
    names, tracks, starts, ends = _rank_columns(trace, idx)
    skip_rows = None
    marked = [i for i in rows if not row_mask[sp.name[i]]]  # marked collective=True, not named like one
    if marked:
        b = bytearray(len(idx))
        for i in marked:
            b[bisect_left(idx, i)] = 1
        skip_rows = bytes(b)
    ss = array("q", (sp.start[i] for i in steps))
    se = array("q", (sp.end[i] for i in steps))
    st = array("q", (sp.track[i] for i in steps))
    return dbk.cover_columns(names, tracks, starts, ends, skip_rows, row_mask, ss, se, st)


def _breakdown(
    trace: Trace,
    steps: Steps,
    step_idx: dict[int, list[int]],
    rows: list[list[int]],
    cover_of: Callable[[int], tuple[Sequence[int], Sequence[int], Sequence[int]]],
    cover_spans: list[list[int]],
    collectives: Collectives | None,
    colls: set[int],
    unknown: set[int],
) -> Steps:
    """`steps` with each rank's breakdown (`gputrace.breakdown`) filled in: from its rows (its
    collective spans, others named like one, not its steps) and its cover, computed here
    (`cover_of` a rank slot) or a digest's (`cover_spans`). `colls`: the collective spans."""
    sp = trace.spans
    start, end, track = sp.start, sp.end, sp.track
    transfers: dict[int, tuple[Sequence[int], Sequence[int]]] = {r: ([], []) for r in steps.ranks}
    if collectives is not None:
        occ = collectives.occurrences
        arrs, ends_of = [o.arrivals for o in occ], [o.ends for o in occ]
        lasts = array("q", map(getitem, arrs, [o.last_rank for o in occ]))
        rest = []
        for r in transfers:
            if all(map(contains, arrs, repeat(r))):
                # In every occurrence: its transfers start at the last arrival (the latest of all,
                # so max(its own, last) is last), one int64 column shared by these ranks.
                transfers[r] = (lasts, array("q", map(getitem, ends_of, repeat(r))))
            else:
                rest.append(r)
        for r in rest:  # ranks that missed some occurrence: theirs one by one
            ts, te = [], []
            for a, last, e in zip(arrs, lasts, ends_of):
                if r in a:
                    ts.append(max(a[r], last))
                    te.append(e[r])
            transfers[r] = (ts, te)
    slot = {r: s for s, r in enumerate(trace.ranks)}
    idle: dict[int, list[int | None]] = {}
    cwait: dict[int, list[int]] = {}
    ctransfer: dict[int, list[int]] = {}
    exposed: dict[int, list[int | None]] = {}
    for r in steps.ranks:
        s = slot[r]
        ws, we = steps.start_ns[r], steps.end_ns[r]
        st = step_idx[s]  # the rank's finished steps in start order, warm-up included
        ss, se, strk = columns.take(st, start, end, track)
        # Only a span as long as a step can enclose one (be its ancestor).
        least = min(map(sub, se, ss), default=0)
        durs = map(sub, map(end.__getitem__, rows[s]), map(start.__getitem__, rows[s]))
        long = set(compress(rows[s], map(ge, durs, repeat(least))))
        ancestors = {i for i in long if bd.is_ancestor(start[i], end[i], track[i], ss, se, strk)}
        mine = [i for i in rows[s] if i not in ancestors] if ancestors else list(rows[s])
        mine += cover_spans[s]
        ct, cs, ce = cover_of(s)
        if mine:  # the picked spans' columns (one C gather each), then the cover's
            ms, me, mt = columns.take(mine, start, end, track)
            cs, ce, ct = _then(ms, cs), _then(me, ce), _then(mt, ct)
        is_coll = bytes(chain(map(colls.__contains__, mine), repeat(False, len(ct) - len(mine))))  # a byte a span
        if is_coll.count(0) == len(is_coll):
            ct = array("q")  # the tracks serve the exposed collective time alone: none here (8 bytes a span)
        i_, w_, t_, e_ = bd.rank_breakdown(
            ws,
            we,
            cs,  # the cover alone (a whole trace of one rank): its columns, not copies
            ce,
            ct,
            is_coll,
            (transfers[r][0], transfers[r][1]),
            steps.wait_ns[r],
        )
        cwait[r], ctransfer[r] = w_, t_
        known = r not in unknown
        idle[r] = list(i_) if known else [None] * len(ws)
        exposed[r] = list(e_) if known else [None] * len(ws)
    return dataclasses.replace(
        steps, idle_ns=idle, collective_wait_ns=cwait, collective_transfer_ns=ctransfer, exposed_collective_ns=exposed
    )


def _then(a: array[int], b: Sequence[int]) -> array[int]:
    """`a` followed by `b`, as one int64 array (`a` extended in place)."""
    if len(b):
        a.extend(b if isinstance(b, array) and b.typecode == "q" else array("q", b))
    return a


def _launch_lags(trace: Trace, steps: Steps, own: list[Sequence[int]]) -> Steps:
    """`steps` with each rank's launch lags, from the host entry times of its CUDA spans."""
    sp = trace.spans
    entry = sp.entry
    assert entry is not None
    cuda = [t.kind == "cuda" for t in trace.tracks]
    slot = {r: s for s, r in enumerate(trace.ranks)}
    lag: dict[int, list[int | None]] = {}
    for r in steps.ranks:
        idx = own[slot[r]]  # ascending
        pairs = [(entry[i], sp.start[i]) for i in idx if entry[i] > 0 and cuda[sp.track[i]]]
        lag[r] = bd.launch_lags(steps.start_ns[r], steps.end_ns[r], pairs)
    return dataclasses.replace(steps, launch_lag_ns=lag)


def _collectives(
    coll_idx: dict[int, list[int]],
    step_idx: dict[int, list[int]],
    skip: int,
    ranks: list[int],
    names: list[str],
    name_col: Sequence[int],
    start: Sequence[int],
    end: Sequence[int],
    align_err: list[int],
    anchor: list[int],
    coll_rule: str,
) -> Collectives:
    # Per rank, in start order: each collective's step (-1: outside every step), name, ordinal
    # among the rank's collectives of that name in that step, start and end.
    per: dict[int, tuple[Sequence[int], Sequence[int], list[int], Sequence[int], Sequence[int]]] = {}
    for s, idx in coll_idx.items():
        if not idx:
            continue
        st = step_idx.get(s, [])
        ss, se = columns.take(st, start, end)
        cs, ce, cn = columns.take(idx, start, end, name_col)
        ks = columns.step_of(ss, se, cs)
        if skip:  # collectives inside warm-up steps are left out
            keep = [not 0 <= k < skip for k in ks]
            if not all(keep):
                ks, cs, ce, cn = (array("q", compress(v, keep)) for v in (ks, cs, ce, cn))
        pairs = list(zip(ks, cn))
        if len(set(pairs)) == len(pairs):  # each name at most once a step: every ordinal 0
            ords = [0] * len(pairs)
        else:
            seen: dict[tuple[int, int], int] = {}
            ords = []
            for sk in pairs:
                o = seen.get(sk, 0)
                seen[sk] = o + 1
                ords.append(o)
        per[ranks[s]] = (ks, cn, ords, cs, ce)
    found: list[tuple[int, int, int, int, dict[int, int], dict[int, int]]] = []  # (first, step, name, ordinal, ...)
    ref = next(iter(per.values()))
    if all(v[0] == ref[0] and v[1] == ref[1] and v[2] == ref[2] for v in per.values()):
        # Every rank ran the same collectives in the same order (the usual case): match by position.
        rl = list(per)
        cols = [
            (min(col_s), k, n, o, col_s, col_e)
            for k, n, o, col_s, col_e in zip(
                ref[0], ref[1], ref[2], zip(*(v[3] for v in per.values())), zip(*(v[4] for v in per.values()))
            )
        ]
        cols.sort(key=_first)
        err = {r: align_err[s] + anchor[s] for s, r in enumerate(ranks)}  # one anchored end per arrival
        occurrences, per_rank = _calls_columns(cols, rl, ranks, names, err)
        return Collectives(_coll_rule(coll_rule), occurrences, per_rank)
    else:
        table: dict[tuple[int, int, int], tuple[dict[int, int], dict[int, int]]] = {}
        for r, (ks_, cn_, ords_, cs_, ce_) in per.items():
            for key, a, e in zip(zip(ks_, cn_, ords_), cs_, ce_):
                got = table.get(key)
                if got is None:
                    got = table[key] = ({}, {})
                got[0][r] = a
                got[1][r] = e
        found = [(min(arr.values()), k, n, o, arr, ends) for (k, n, o), (arr, ends) in table.items()]
    found.sort(key=_first)
    err = {r: align_err[s] + anchor[s] for s, r in enumerate(ranks)}  # one anchored end per arrival
    occurrences, per_rank = _calls_py(found, ranks, names, err)
    return Collectives(_coll_rule(coll_rule), occurrences, per_rank)


def _first(x: tuple[Any, ...]) -> Any:
    return x[0]


def _coll_rule(coll_rule: str) -> str:
    return (
        f"{coll_rule}; occurrences are matched across ranks by (step, name, order within the step); a rank is "
        "called last when it arrived after every other rank by more than their two clock errors (alignment "
        "error bar + device anchor uncertainty each)"
    )


def _calls_py(
    found: list[tuple[int, int, int, int, dict[int, int], dict[int, int]]],
    ranks: list[int],
    names: list[str],
    err: dict[int, int],
) -> tuple[list[Occurrence], dict[int, CollectiveRank]]:
    """The occurrences (`found`: (first arrival, step, name, ordinal, arrivals, ends), in order of
    first arrival), each with its last rank, waits and call, and each rank's counts: one Python
    loop per occurrence and rank. The reference of `_calls_columns`, and the path for ranks that
    did not all run the same collectives."""
    occurrences = []
    last_n = {r: 0 for r in ranks}
    noisy_n = {r: 0 for r in ranks}
    caused = {r: 0 for r in ranks}
    suffered = {r: 0 for r in ranks}
    for _, k, n, o, arr, ends in found:
        last = max(arr, key=arr.__getitem__)  # ties: the lowest rank (the first in rank order)
        t = arr[last]
        waits = {r: t - a for r, a in arr.items()}
        margin, called = 0, False
        if len(arr) > 1:
            runner = max((r for r in arr if r != last), key=arr.__getitem__)
            margin = t - arr[runner]
            called = margin > err[last] + err[runner]
            if called:
                last_n[last] += 1
            else:
                noisy_n[last] += 1
            caused[last] += sum(waits.values())
            for r, w in waits.items():
                suffered[r] += w
        occurrences.append(Occurrence(None if k < 0 else k, names[n], o, arr, ends, last, waits, margin, called))
    per_rank = {r: CollectiveRank(last_n[r], caused[r], suffered[r], noisy_n[r]) for r in ranks}
    return occurrences, per_rank


def _calls_columns(
    cols: list[tuple[int, int, int, int, tuple[int, ...], tuple[int, ...]]],
    rl: list[int],
    ranks: list[int],
    names: list[str],
    err: dict[int, int],
) -> tuple[list[Occurrence], dict[int, CollectiveRank]]:
    """`_calls_py` where every rank of `rl` ran every occurrence: each occurrence's arrivals and
    ends a tuple in `rl`'s order, so its last rank, runner-up and waits come from whole-tuple
    builtins (max, index, map) and each rank's waits from two column sums, not a loop per rank."""
    occurrences = []
    last_n = {r: 0 for r in ranks}
    noisy_n = {r: 0 for r in ranks}
    caused = {r: 0 for r in ranks}
    suffered = {r: 0 for r in ranks}
    m = len(rl)
    errs = [err[r] for r in rl]
    t_sum = 0
    for _, k, n, o, cs, ce in cols:
        t = max(cs)
        li = cs.index(t)  # ties: the first in `rl`'s order, as max over the dict gives
        last = rl[li]
        margin, called = 0, False
        if m > 1:
            try:  # the runner-up: the first other rank with the greatest arrival
                ri = cs.index(t, li + 1)
            except ValueError:
                ri = cs.index(max(cs[:li] + cs[li + 1 :]))
            margin = t - cs[ri]
            called = margin > errs[li] + errs[ri]
            if called:
                last_n[last] += 1
            else:
                noisy_n[last] += 1
            caused[last] += m * t - sum(cs)
            t_sum += t
        occurrences.append(
            Occurrence(
                None if k < 0 else k,
                names[n],
                o,
                dict(zip(rl, cs)),
                dict(zip(rl, ce)),
                last,
                dict(zip(rl, map(t.__sub__, cs))),
                margin,
                called,
            )
        )
    if m > 1:  # a rank's waits: the last arrivals' sum less its own arrivals' sum
        for r, own in zip(rl, zip(*(c[4] for c in cols))):
            suffered[r] = t_sum - sum(own)
    per_rank = {r: CollectiveRank(last_n[r], caused[r], suffered[r], noisy_n[r]) for r in ranks}
    return occurrences, per_rank


# ---- JSON ---------------------------------------------------------------------------------------


def _num(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _stats_json(r: NameStats) -> dict[str, Any]:
    return {
        "name": r.name,
        "count": r.count,
        "total_ns": r.total_ns,
        "mean_ns": r.mean_ns,
        "p50_ns": r.p50_ns,
        "p90_ns": r.p90_ns,
        "p99_ns": r.p99_ns,
        "max_ns": r.max_ns,
        "ranks": r.ranks,
        "min_rank": r.min_rank,
        "min_rank_total_ns": r.min_rank_total_ns,
        "max_rank": r.max_rank,
        "max_rank_total_ns": r.max_rank_total_ns,
        "imbalance": _num(r.imbalance),
        "slowest": {"rank": r.slowest.rank, "start_ns": r.slowest.start_ns, "end_ns": r.slowest.end_ns},
        "self_total_ns": r.self_total_ns,
    }


def _counts_json(c: RankCounts) -> dict[str, Any]:
    out: dict[str, Any] = {
        "spans": c.spans,
        "unfinished": c.unfinished,
        "dropped": c.dropped,
        "skipped_in_capture": c.skipped_in_capture,
        "warmup": c.warmup,
    }
    if c.unwritten is not None:  # traces that can say (streamed since unwritten spans were counted)
        out["unwritten"] = c.unwritten
    return out


def to_json(summary: Summary) -> dict[str, Any]:
    """The summary as JSON-ready objects: every value labelled, ranks as string keys, times in ns."""
    key = {r: str(r) for r in summary.ranks}

    def keyed(d: dict[int, Any]) -> dict[str, Any]:
        return {key[r]: v for r, v in d.items()}

    out: dict[str, Any] = {
        "ranks": summary.ranks,
        "names": [_stats_json(r) for r in summary.names],
        "by_rank": {key[r]: [_stats_json(x) for x in rows] for r, rows in summary.by_rank.items()},
        "counts": {key[r]: _counts_json(c) for r, c in summary.counts.items()},
        "steps": None,
        "collectives": None,
        "notes": summary.notes,
    }
    st = summary.steps
    if st is not None:
        out["steps"] = {
            "name": st.name,
            "skipped": st.skipped,
            "count": st.count,
            "ranks": st.ranks,
            "rule": st.rule,
            "start_ns": keyed(st.start_ns),
            "end_ns": keyed(st.end_ns),
            "busy_ns": keyed(st.busy_ns),
            "wait_ns": keyed(st.wait_ns),
            "idle_ns": keyed(st.idle_ns),
            "collective_wait_ns": keyed(st.collective_wait_ns),
            "collective_transfer_ns": keyed(st.collective_transfer_ns),
            "exposed_collective_ns": keyed(st.exposed_collective_ns),
            "launch_lag_ns": keyed(st.launch_lag_ns),
            "median_busy_ns": st.median_busy_ns,
            "verdicts": [
                {
                    "step": v.step,
                    "rank": v.rank,
                    "busy_ns": v.busy_ns,
                    "median_ns": v.median_ns,
                    "margin_ns": v.margin_ns,
                    "margin_pct": _num(v.margin_pct),
                    "noise_ns": v.noise_ns,
                    "called": v.called,
                }
                for v in st.verdicts
            ],
            "times_slowest": keyed(st.times_slowest),
            "causes": causes(st, summary.collectives, fmt_ns),
        }
    co = summary.collectives
    if co is not None:
        out["collectives"] = {
            "rule": co.rule,
            "occurrences": [
                {
                    "step": o.step,
                    "name": o.name,
                    "ordinal": o.ordinal,
                    "arrivals": keyed(o.arrivals),
                    "ends": keyed(o.ends),
                    "last_rank": o.last_rank,
                    "last_margin_ns": o.last_margin_ns,
                    "last_called": o.last_called,
                    "waits_ns": keyed(o.waits_ns),
                }
                for o in co.occurrences
            ],
            "per_rank": {
                key[r]: {
                    "times_last": c.times_last,
                    "times_last_within_noise": c.times_last_within_noise,
                    "wait_caused_ns": c.wait_caused_ns,
                    "wait_suffered_ns": c.wait_suffered_ns,
                }
                for r, c in co.per_rank.items()
            },
        }
    return out


# ---- text ---------------------------------------------------------------------------------------


def fmt_ns(ns: float) -> str:
    a = abs(ns)
    if a >= 1e9:
        return f"{ns / 1e9:.3f} s"
    if a >= 1e6:
        return f"{ns / 1e6:.3f} ms"
    if a >= 1e3:
        return f"{ns / 1e3:.1f} us"
    return f"{ns:.0f} ns"


def _signed(ns: int) -> str:
    return ("+" if ns >= 0 else "-") + fmt_ns(abs(ns))


def _pct(p: float) -> str:
    return f"{p:+.1f}%" if math.isfinite(p) else "+inf%"


def _cell_width(text: str) -> int:
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() else "?" for c in text)


def _clip(text: str, width: int) -> str:
    if _cell_width(text) <= width:
        return text
    out, w = [], 0
    for c in text:
        cw = _cell_width(c)
        if w + cw > width - 2:
            break
        out.append(c)
        w += cw
    return "".join(out) + ".." if width >= 2 else "".join(out)[:width]


@dataclass
class _Col:
    head: str
    cells: list[str]
    right: bool = True
    keep: int = 0  # columns with the highest `keep` are dropped first when the width runs out
    shrink: int = 0  # > 0: may be clipped down to this many columns


def _grid(cols: list[_Col], width: int, dropped: list[str] | None = None) -> list[str]:
    """Rows of aligned columns that fit `width`: optional columns are dropped (least important
    first; their heads added to `dropped`, so the table can say so) and clippable ones clipped
    until they do."""
    cols = list(cols)

    def widths() -> list[int]:
        return [max(_cell_width(c) for c in [col.head, *col.cells]) for col in cols]

    def total(ws: list[int]) -> int:
        return sum(ws) + 2 * (len(ws) - 1)

    ws = widths()
    floor = [min(w, c.shrink) if c.shrink else w for c, w in zip(cols, ws)]
    while total(floor) > width and any(c.keep for c in cols):
        worst = max(range(len(cols)), key=lambda k: (cols[k].keep, k))
        if dropped is not None and cols[worst].head not in dropped:
            dropped.append(cols[worst].head)
        del cols[worst], ws[worst], floor[worst]
    over = total(ws) - width
    for k, c in enumerate(cols):
        if over > 0 and c.shrink:
            cut = min(over, ws[k] - floor[k])
            ws[k] -= cut
            over -= cut
    lines = []
    for row in range(len(cols[0].cells) + 1):
        parts = []
        for c, w in zip(cols, ws):
            text = _clip(c.head if row == 0 else c.cells[row - 1], w)
            pad = " " * (w - _cell_width(text))
            parts.append(pad + text if c.right else text + pad)
        lines.append(_clip("  ".join(parts).rstrip(), width))
    return lines


def _wrap(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, width=max(width, 20), subsequent_indent="  ", break_on_hyphens=False)


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def terminal_width() -> int:
    """The terminal's width when output goes to one, else $COLUMNS, else 100 columns."""
    try:
        tty = sys.stdout.isatty()
    except (AttributeError, ValueError):
        tty = False
    if tty:
        return shutil.get_terminal_size((100, 24)).columns
    columns = os.environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() and int(columns) > 0 else 100


def _imbalance(r: NameStats, nranks: int) -> str:
    text = f"{r.imbalance:.2f}x" if math.isfinite(r.imbalance) else "inf"
    # The imbalance is among the ranks that have the name; say when some have none of it.
    return text if r.ranks >= nranks else f"{text} on {r.ranks}/{nranks}"


def _names_grid(rows: list[NameStats], width: int, nranks: int, dropped: list[str] | None = None) -> list[str]:
    multi = nranks > 1
    cols = [
        _Col("name", [_printable(r.name) for r in rows], right=False, shrink=16),
        _Col("count", [f"{r.count:,}" for r in rows]),
        _Col("total", [fmt_ns(r.total_ns) for r in rows]),
        _Col("self", ["?" if r.self_total_ns is None else fmt_ns(r.self_total_ns) for r in rows], keep=2),
        _Col("mean", [fmt_ns(r.mean_ns) for r in rows], keep=4),
        _Col("p50", [fmt_ns(r.p50_ns) for r in rows], keep=2),
        _Col("p90", [fmt_ns(r.p90_ns) for r in rows], keep=5),
        _Col("p99", [fmt_ns(r.p99_ns) for r in rows], keep=3),
        _Col("max", [fmt_ns(r.max_ns) for r in rows], keep=1),
    ]
    if multi:
        cols += [
            _Col("least rank", [f"{fmt_ns(r.min_rank_total_ns)} r{r.min_rank}" for r in rows], keep=7),
            _Col("most rank", [f"{fmt_ns(r.max_rank_total_ns)} r{r.max_rank}" for r in rows], keep=6),
            _Col("imbal", [_imbalance(r, nranks) for r in rows], keep=1),
        ]
    return _grid(cols, width, dropped)


def table(summary: Summary, width: int | None = None, by_rank: bool = False, top: int = 10) -> str:
    """The summary as text no wider than `width` (default: the terminal's, or $COLUMNS or 100
    columns when output is not a terminal). `by_rank` adds a name table per rank and lists every
    rank. Columns left out to fit are named in a last note."""
    if width is None:
        width = terminal_width()
    width = max(width, 40)
    dropped: list[str] = []
    s = summary
    multi = len(s.ranks) > 1
    out: list[str] = []
    if s.names:
        out += _names_grid(s.names, width, len(s.ranks), dropped)
    else:
        out.append("no finished spans")
    if by_rank and multi:
        for r, rows in s.by_rank.items():
            out += ["", f"rank {r}"]
            out += _names_grid(rows, width, 1, dropped) if rows else ["  no finished spans"]

    # Per rank: what was left out or lost, steps called slowest, collective attribution.
    co = s.collectives if s.collectives is not None and multi else None
    st = s.steps
    c = s.counts
    anomalies = [r for r in s.ranks if c[r].unfinished or c[r].dropped or c[r].skipped_in_capture or c[r].unwritten]
    show = list(s.ranks)
    hidden = 0
    if len(show) > 16 and not by_rank:
        keep = set(anomalies)
        if st is not None:
            keep |= {r for r, n in st.times_slowest.items() if n}
        if co is not None:
            keep |= set(sorted(s.ranks, key=lambda r: -co.per_rank[r].wait_caused_ns)[:8])
        show = [r for r in s.ranks if r in keep][: top + 8]
        hidden = len(s.ranks) - len(show)
    out += [""]
    total_spans = sum(x.spans for x in c.values())
    out += _wrap(
        f"{len(s.ranks)} rank{'s' if len(s.ranks) != 1 else ''}, {total_spans:,} finished spans"
        + (f"; unfinished, dropped or skipped spans on ranks {_ranges(anomalies)}" if anomalies else
           "; none unfinished, dropped or skipped in capture"),
        width,
    )  # fmt: skip
    if show and (anomalies or co is not None or (st is not None and multi) or by_rank):

        def opt(v: int | None) -> str:
            return "?" if v is None else f"{v:,}"

        cols = [
            _Col("rank", [str(r) for r in show]),
            _Col("spans", [f"{c[r].spans:,}" for r in show]),
            _Col("unfinished", [f"{c[r].unfinished:,}" for r in show], keep=2),
            _Col("dropped", [opt(c[r].dropped) for r in show], keep=2),
            _Col("skipped", [opt(c[r].skipped_in_capture) for r in show], keep=3),
        ]
        if any(c[r].warmup for r in show):
            cols.append(_Col("warm-up", [f"{c[r].warmup:,}" for r in show], keep=4))
        if st is not None and multi:
            cols.append(_Col("slowest", [f"{st.times_slowest.get(r, 0):,}" for r in show], keep=1))
        if co is not None:
            pr = co.per_rank
            cols += [
                _Col("last", [f"{pr[r].times_last:,}" for r in show], keep=1),
                _Col("last~", [f"{pr[r].times_last_within_noise:,}" for r in show], keep=5),
                _Col("wait caused", [fmt_ns(pr[r].wait_caused_ns) for r in show], keep=1),
                _Col("wait suffered", [fmt_ns(pr[r].wait_suffered_ns) for r in show], keep=1),
            ]
        out += _grid(cols, width, dropped)
        if hidden:
            out += _wrap(f"({hidden} more ranks with nothing to report; --by-rank lists every rank)", width)
        legend = "skipped: not recorded inside CUDA graph capture"
        if st is not None and multi:
            legend += "; slowest: steps called slowest"
        if co is not None:
            legend += "; last: collectives it arrived last in beyond the clock error (last~: within it)"
        out += _wrap(legend, width)

    if st is not None:
        out += [""]
        out += _wrap(
            f"steps ({st.name!r}): {st.count:,} on every rank of {_ranges(st.ranks)}"
            + (f", after {st.skipped} skipped" if st.skipped else ""),
            width,
        )
        if multi and len(st.ranks) > 1:
            out += _wrap("rule: " + st.rule, width)
            called = [v for v in st.verdicts if v.called]
            if called:
                worst = max(st.times_slowest, key=lambda r: (st.times_slowest[r], -r))
                out += _wrap(
                    f"rank {worst} was slowest most often: {st.times_slowest[worst]:,} of {st.count:,} steps; "
                    + "called slowest: "
                    + ", ".join(f"rank {r} {n:,}x" for r, n in sorted(st.times_slowest.items()) if n),
                    width,
                )
                shown = sorted(called, key=lambda v: (-v.margin_ns, v.step))[:top]
                out += _grid(_verdict_cols(shown), width, dropped)
                if len(called) > len(shown):
                    out += _wrap(f"({len(called) - len(shown):,} more steps with a rank called slowest)", width)
            elif st.verdicts:
                v = max(st.verdicts, key=lambda v: (v.margin_pct, v.margin_ns))
                out += _wrap(
                    f"no rank was slowest beyond the noise in any of the {st.count:,} steps "
                    f"(largest margin: rank {v.rank} in step {v.step}, {_signed(v.margin_ns)}, {_pct(v.margin_pct)}"
                    f" of {fmt_ns(v.median_ns)})",
                    width,
                )

    if st is not None:
        said = causes(st, s.collectives, fmt_ns)
        if said:
            out += _wrap("why:", width)
            for line in said[:top]:
                out += _wrap("  " + line, width)
            if len(said) > top:
                out += _wrap(f"  ({len(said) - top} more in --json: steps.causes)", width)

    if co is not None:
        out += [""]
        matched = [o for o in co.occurrences if len(o.arrivals) > 1]
        out += _wrap(
            f"collectives: {len(co.occurrences):,} occurrences, {len(matched):,} matched on two or more ranks",
            width,
        )
        out += _wrap("rule: " + co.rule, width)
        longest = sorted(matched, key=lambda o: -sum(o.waits_ns.values()))[: min(top, 5)]
        longest = [o for o in longest if sum(o.waits_ns.values()) > 0]
        if longest:
            out += _wrap("longest waits:", width)
            out += _grid(
                [
                    _Col("step", ["-" if o.step is None else str(o.step) for o in longest]),
                    _Col("name", [_printable(o.name) for o in longest], right=False, shrink=12),
                    _Col("#", [str(o.ordinal) for o in longest], keep=2),
                    _Col("last", [f"rank {o.last_rank}" for o in longest]),
                    _Col("by", [_signed(o.last_margin_ns) + ("" if o.last_called else " ~") for o in longest]),
                    _Col("others waited", [fmt_ns(sum(o.waits_ns.values())) for o in longest]),
                    _Col("longest wait", [_longest_wait(o) for o in longest], keep=1),
                ],
                width,
                dropped,
            )

    if s.notes or dropped:
        out += [""]
        for n in s.notes:
            out += _wrap("note: " + n, width)
    if dropped:  # never silently: a pipe or a file gets 100 columns unless COLUMNS says more
        out += _wrap(
            f"note: left out to fit {width} columns: {', '.join(dropped)}; a wider terminal or COLUMNS=N shows "
            "them, --json gives every number",
            width,
        )
    return "\n".join(_clip(line, width) for line in out)


def _longest_wait(o: Occurrence) -> str:
    r = max(o.waits_ns, key=lambda r: (o.waits_ns[r], -r))
    return f"{fmt_ns(o.waits_ns[r])} r{r}"


def _verdict_cols(vs: list[StepVerdict]) -> list[_Col]:
    return [
        _Col("step", [str(v.step) for v in vs]),
        _Col("slowest", [f"rank {v.rank}" for v in vs]),
        _Col("busy", [fmt_ns(v.busy_ns) for v in vs]),
        _Col("median", [fmt_ns(v.median_ns) for v in vs]),
        _Col("margin", [_signed(v.margin_ns) for v in vs]),
        _Col("margin %", [_pct(v.margin_pct) for v in vs]),
        _Col("clock error", [fmt_ns(v.noise_ns) for v in vs], keep=1),
    ]
