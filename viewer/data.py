"""Traces -> the viewer's document, and the trace its timeline shows.

Takes: trace files (merged on the fly with the same alignment as `gputrace merge`) or a `Trace`
already in memory. Gives: `document()`, one JSON-ready dict that the page only draws:
- the rank x step heatmap: per rank, arrays indexed by step of start, end, busy and wait ns, the
  step's median busy time and the verdict on its slowest rank (rank, margin, called or not);
- the collectives: every occurrence matched across ranks, in columns (step, name, ordinal, last
  arrival and its margin), each rank's arrival, end and wait, and per rank the times it was last,
  the wait it caused and the wait it suffered;
- the span statistics, all ranks and per rank, each row with its slowest instance;
- the notes and rules the numbers come with.
Every number is computed by `gputrace.stats.summarize`, the code behind `gputrace summary`; the
page does no statistics. Times are integer ns relative to `base_ns`, the instant the timeline's
trace counts from (Perfetto's trace time in seconds is `(ns - base_ns) / 1e9`), so the page can
turn any of them into a zoom of the embedded timeline.

`timeline_trace()` encodes the trace for the Perfetto UI on that same base: whole when it is
small enough for the UI to load, else the spans of a time window.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import compress, repeat
from operator import add, and_, ge, gt, lt, or_, sub
from typing import Any

import orjson

from gputrace import stats
from gputrace.causes import causes
from gputrace.cpus import usable_cpus
from gputrace.trace import chrome
from gputrace.trace.model import Trace

from . import findings

FORMAT = "gputrace-view/1"
#: Above this many spans the Perfetto UI gets a time window of the trace, not the whole of it:
#: ~120 bytes of JSON a span, and the UI struggles with JSON of a few hundred MB.
TIMELINE_SPANS = 500_000
#: From this many bytes of trace files on, a view of ranks that each have a digest is drawn from
#: the digests (a second or two), not the traces (~4 s a GB to read and align).
DIGEST_VIEW_BYTES = 64 << 20

STAT_COLUMNS = (
    "name",
    "count",
    "total_ns",
    "mean_ns",
    "p50_ns",
    "p90_ns",
    "p99_ns",
    "max_ns",
    "ranks",
    "min_rank",
    "min_rank_total_ns",
    "max_rank",
    "max_rank_total_ns",
    "imbalance",
    "slowest_rank",
    "slowest_start_ns",
    "slowest_end_ns",
    "self_total_ns",
)


def load(
    paths: Sequence[str],
    *,
    align: str = "clock",
    ranks: Iterable[int] | None = None,
    steps: tuple[int | None, int | None] | None = None,
    window: tuple[int | None, int | None] | None = None,
    step_name: str = "step",
    rank_from_filename: bool = False,
) -> Trace:
    """The named traces (files, directories, globs; per-rank or merged) as one `Trace`, aligned
    as `gputrace merge` aligns them, restricted to a selection when one is given."""
    from gputrace import merge

    return merge.load(
        list(paths),
        align=align,
        rank_from_filename=rank_from_filename,
        ranks=ranks,
        steps=steps,
        window=window,
        step_name=step_name,
    )


def document(
    trace: Trace,
    summary: stats.Summary | None = None,
    *,
    step: str = "step",
    skip_steps: int | None = None,
    require_step: bool = False,
    title: str | None = None,
    inputs: Iterable[str] = (),
) -> dict[str, Any]:
    """The viewer's document for `trace` (its summary computed here unless given; with
    `require_step`, a trace without `step` spans is an error that lists the names present).
    `skip_steps` None: the first steps are left out when they are warm-up outliers
    (`findings.warmup_steps`), and a note says so; a number: exactly that many."""
    warmup_note = None
    if summary is None:
        summary = stats.summarize(trace, step=step, skip_steps=skip_steps or 0, require_step=require_step)
        if skip_steps is None and summary.steps is not None:
            k, factor = findings.warmup_steps(summary.steps)
            if k:
                summary = stats.summarize(trace, step=step, skip_steps=k, require_step=require_step)
                warmup_note = _warmup_note(k, factor)
    rng = trace.time_range()
    base = rng[0] if rng else 0
    ranks = list(summary.ranks)
    slot = {r: i for i, r in enumerate(ranks)}
    labels = []
    for r in ranks:
        try:
            labels.append(trace.rank_process(r).label)
        except KeyError:
            labels.append(f"rank {r}")
    inputs = [shown_text(str(p)) for p in inputs]
    refs = _refs(summary.steps)
    return {
        "format": FORMAT,
        "title": title or _title(inputs, ranks),
        "inputs": inputs,
        "ranks": ranks,
        "labels": labels,
        "base_ns": base,
        "duration_ns": (rng[1] - rng[0]) if rng else 0,
        "spans": len(trace.spans),
        "step_name": step,
        "steps": _steps(summary.steps, slot, base, refs),
        "collectives": _collectives(summary.collectives, slot, base),
        "stats": {
            "columns": list(STAT_COLUMNS),
            "names": [_stat_row(r, base) for r in summary.names],
            "by_rank": [[_stat_row(x, base) for x in summary.by_rank.get(r, ())] for r in ranks],
        },
        "counts": [_counts(summary.counts.get(r)) for r in ranks],
        "notes": ([warmup_note] if warmup_note else []) + [shown_text(n) for n in summary.notes],  # may quote a path
        "warmup_auto": warmup_note is not None,
        "alignment": _alignment(trace, ranks),
        "timeline": _timeline(trace, summary.steps, base),
        "pids": [_pid(trace, r) for r in ranks],
        "worst": _worst(summary.steps, slot, refs),
        "phases": findings.phases(summary.steps, trace if len(trace.spans) else None)
        if summary.steps is not None
        else [],
        "causes": causes(summary.steps, summary.collectives, stats.fmt_ns) if summary.steps is not None else [],
    }


def _refs(st: stats.Steps | None) -> dict[int, list[int]]:
    """Per rank (with busy times) and step, the other ranks' median busy time (what the heatmap
    compares a cell with), computed once for the steps and the worst steps."""
    if st is None:
        return {}
    ranks = [r for r in st.ranks if r in st.busy_ns]
    return dict(zip(ranks, findings.others_median([st.busy_ns[r][: st.count] for r in ranks])))


def _worst(st: stats.Steps | None, slot: dict[int, int], refs: dict[int, list[int]]) -> list[dict[str, Any]]:
    """The worst steps, each also against the other ranks' median (`ref_ns`, `ref_pct`): the
    number the heatmap shows, which a median over two ranks would halve."""
    if st is None:
        return []
    out = findings.worst_steps(st)
    for w in out:
        v = refs[w["rank"]][w["k"]] if w["rank"] in refs else w["median_ns"]
        w["ref_ns"] = v
        w["ref_pct"] = 100.0 * (w["busy_ns"] - v) / v if v else None
    return out


def _warmup_note(k: int, factor: float) -> str:
    if k == 1:
        return (
            f"the first step is left out as warm-up (it took {factor:.1f}x the median step time); "
            "--skip-steps 0 keeps it"
        )
    return (
        f"the first {k} steps are left out as warm-up (the first took {factor:.1f}x the median step time); "
        "--skip-steps 0 keeps them"
    )


def _pid(trace: Trace, rank: int) -> int | str | None:
    """The pid the rank's process is written with in the timeline's trace (how the page finds it
    in the Perfetto UI)."""
    try:
        return trace.rank_process(rank).pid
    except KeyError:
        return None


def from_digests(
    paths: Sequence[str],
    *,
    step: str = "step",
    skip_steps: int | None = None,
    require_step: bool = False,
    inputs: Iterable[str] = (),
) -> dict[str, Any] | None:
    """The document from the ranks' step digests, when the ranks are as many as `gputrace
    summary` reads digests for, or every trace has its digest and the traces are large
    (DIGEST_VIEW_BYTES); else None: read the traces. Its heatmap, collectives and statistics
    come from the digests; the timeline reads trace files one window at a time
    (`server.WindowedViewer`), starting with the first steps."""
    got = digest_view(paths, step=step, skip_steps=skip_steps, require_step=require_step, inputs=inputs)
    return None if got is None else join(*got)


def digest_view(
    paths: Sequence[str],
    *,
    step: str = "step",
    skip_steps: int | None = None,
    require_step: bool = False,
    inputs: Iterable[str] = (),
) -> tuple[dict[str, Any], bytes] | None:
    """`from_digests`'s document as `split` gives it (its small keys, the rest encoded), ready to
    serve. It is kept beside the digests (`cache`): the next view of the same files reads it
    back, neither digests nor traces."""
    found = digest_inputs(paths, step)
    if found is None:
        return None
    job = DigestJob(found, step, skip_steps, require_step, [str(p) for p in inputs])
    return job.kept() or job.compute()


def digest_inputs(paths: Sequence[str], step: str = "step") -> Any:
    """The ranks' traces and digests (`summary.Inputs`) when the page is to be drawn from the
    digests (as many ranks as `gputrace summary` reads digests for, or every trace with its
    digest and the traces large), else None: read the traces. Large traces of many ranks without
    digests get theirs first (`summary.make_digests`)."""
    from gputrace.errors import GputraceError
    from gputrace.summary import DIGEST_MIN_RANKS, find, make_digests

    found = find(paths)
    if not found.traces:
        return None
    if len(found.traces) > 1 and _large(found.traces):
        # Large traces of many ranks without digests this view can read (copied without them,
        # written by an older gputrace, or with other steps): each rank's digest is made from its
        # trace, ranks in parallel, and written beside it; this view and the next are drawn from
        # them. Where they already are, this is a look at each digest's first bytes.
        try:
            found = make_digests(found, step, digest_workers)  # asked only where digests are to be made
        except GputraceError:
            return None  # not per-rank gputrace traces: read them whole (which says what is wrong)
    if not (found.ranks >= DIGEST_MIN_RANKS or (found.complete and _large(found.traces))):
        return None
    return found


#: How long `idle_cpus` watches the CPUs (the kernel counts their time in 10 ms ticks).
IDLE_SAMPLE_S = 0.1


def idle_cpus(sample_s: float = IDLE_SAMPLE_S) -> float | None:
    """How many of this machine's CPUs were idle over the next `sample_s` seconds (from
    /proc/stat; None where it cannot be read)."""
    import time

    def ticks() -> tuple[int, int]:
        with open("/proc/stat", "rb") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        return fields[3] + fields[4], sum(fields)

    try:
        idle0, all0 = ticks()
        time.sleep(sample_s)
        idle1, all1 = ticks()
    except (OSError, ValueError, IndexError):
        return None
    cpus = os.cpu_count() or 1
    return cpus * (idle1 - idle0) / (all1 - all0) if all1 > all0 else None


def digest_workers(traces: Sequence[str]) -> int | None:
    """Worker processes for making the digests of `traces` (`summary.make_digests`): one per CPU
    idle now (at most 8), and two at least on a machine of two CPUs or more, however busy; None
    (merge's rule, `merge.run.workers_for`) for inputs too small for workers to pay. A digest's
    worker sends back no trace, only whether it wrote the digest, so workers cost only their
    start (~0.3 s) and win wherever a second CPU gives them any time: on a busy machine each
    process gets its share, and two get twice one's. Idle now, measured, not by the load
    average: that is a minute's mean, and the view run just before leaves it high while the CPUs
    idle."""
    from gputrace.merge.run import PARALLEL_MIN_BYTES

    if len(traces) < 4 or sum(os.path.getsize(t) for t in traces if os.path.isfile(t)) < PARALLEL_MIN_BYTES:
        return None
    cpus = usable_cpus()
    if cpus < 2:
        return 1
    idle = idle_cpus()
    return max(2, min(round(idle or 0), cpus, 8))


@dataclasses.dataclass
class DigestJob:
    """The document of a view drawn from digests: the files (`summary.Inputs`) and the options
    that shape it. Picklable: a worker process computes it (`viewer.background`)."""

    found: Any  # summary.Inputs
    step: str
    skip_steps: int | None
    require_step: bool
    inputs: list[str]
    # The warm-up steps found where `skip_steps` was not given, and the first one's factor, once
    # known (the first document finds them: `viewer.first`): the full document then summarises
    # once, with them left out, rather than twice.
    warmup: tuple[int, float] | None = None

    def key(self) -> str | None:
        from . import cache

        options = {
            "step": self.step,
            "skip_steps": self.skip_steps,
            "require_step": self.require_step,
            "format": FORMAT,
        }
        return cache.key(self.found, options, self.inputs)

    def kept(self) -> tuple[dict[str, Any], bytes] | None:
        """The document kept beside the digests for these files and options, or None."""
        from . import cache

        k = self.key()
        return cache.load(self.found, k) if k is not None else None

    def compute(self, warmup: Callable[[], tuple[int, float] | None] | None = None) -> tuple[dict[str, Any], bytes]:
        """The document computed from the digests (`split`'s two parts), and kept beside them.
        `warmup`: asked once the digests are read, for the warm-up steps where they are not
        `self.warmup` (a worker's parent sends them when its first document has found them)."""
        from gputrace.summary import collect

        from . import cache

        k = self.key()  # before the digests are read: a file that changes meanwhile gives another key

        def read() -> list[Any]:
            return collect(self.found, self.step)

        digests = read()
        found = self.warmup if warmup is None else warmup()
        doc = _from_digests(digests, self.step, self.skip_steps, self.require_step, self.inputs, read, found)
        head, body = split(doc)
        if k is not None:
            cache.store(self.found, k, head, body)
        return head, body


#: The document's keys that `split` keeps as data: what the server and the CLI read of it.
HEAD_KEYS = ("format", "title", "inputs", "ranks", "base_ns", "duration_ns", "spans", "step_name", "timeline")


def split(doc: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """`doc` as its small keys (HEAD_KEYS) and the rest as one encoded JSON object."""
    head = {k: doc[k] for k in HEAD_KEYS if k in doc}
    return head, orjson.dumps({k: v for k, v in doc.items() if k not in head})


def join(head: dict[str, Any], body: bytes) -> dict[str, Any]:
    """The document `split` gave."""
    return {**orjson.loads(body), **head}


def encode_joined(head: dict[str, Any], body: bytes) -> bytes:
    """The document `split` gave, encoded, without decoding `body` again: two JSON objects with
    no key in common made one."""
    tail = orjson.dumps(head)
    if body == b"{}":
        return tail
    return body[:-1] + (b"," + tail[1:] if tail != b"{}" else b"}")


def _large(traces: Sequence[str]) -> bool:
    """Are the trace files together at least DIGEST_VIEW_BYTES (the page then comes from their
    digests)?"""
    total = 0
    for t in traces:
        try:
            total += os.path.getsize(t)
        except OSError:
            return False
    return total >= DIGEST_VIEW_BYTES


def _from_digests(
    digests: list[Any],
    step: str,
    skip_steps: int | None,
    require_step: bool,
    inputs: Iterable[str],
    again: Callable[[], list[Any]] | None = None,
    known: tuple[int, float] | None = None,
) -> dict[str, Any]:
    """`again`: the digests read anew, for a second summary once warm-up steps are found (a
    summary takes the digests' spans); None: a copy of each is kept aside for it. `known`: the
    warm-up steps and the first one's factor, found already: one summary, with them left out."""
    from gputrace.summary import summarize

    if skip_steps is None and known is not None:
        warmup, factor = known
        trace, summary = summarize(digests, step, warmup, require_step=require_step)
        return _digest_document(trace, summary, step, skip_steps, require_step, inputs, warmup, factor, len(digests))
    spare = [dataclasses.replace(d) for d in digests] if skip_steps is None and again is None else None
    trace, summary = summarize(digests, step, skip_steps or 0, require_step=require_step)
    warmup, factor = 0, 0.0
    if skip_steps is None and summary.steps is not None:
        warmup, factor = findings.warmup_steps(summary.steps)
        if warmup:
            fresh = again() if again is not None else spare
            assert fresh is not None
            trace, summary = summarize(fresh, step, warmup, require_step=require_step)
    del spare
    return _digest_document(trace, summary, step, skip_steps, require_step, inputs, warmup, factor, len(digests))


def _digest_document(
    trace: Any,
    summary: Any,
    step: str,
    skip_steps: int | None,
    require_step: bool,
    inputs: Iterable[str],
    warmup: int,
    factor: float,
    n_digests: int,
) -> dict[str, Any]:
    """The document of a summary of `n_digests` digests, `warmup` steps left out as warm-up."""
    doc = document(trace, summary, step=step, skip_steps=skip_steps, require_step=require_step, inputs=inputs)
    if warmup:
        doc["notes"] = [_warmup_note(warmup, factor), *doc["notes"]]
        doc["warmup_auto"] = True
    doc["spans"] = sum(r.count for r in summary.names)
    st = summary.steps
    base = doc["base_ns"]
    if st is not None and st.count and st.start_ns:
        last = min(st.count, 3) - 1
        lo = min(v[0] for v in st.start_ns.values()) - base
        hi = max(v[last] for v in st.end_ns.values()) - base
    else:
        lo, hi = 0, doc["duration_ns"] + 1
    doc["timeline"] = {**doc["timeline"], "whole": False, "initial": [max(lo, 0), max(hi, lo + 1)]}
    doc["notes"] = [
        f"read from the ranks' step digests ({n_digests} ranks); the timeline reads the trace files one "
        "window at a time",
        *doc["notes"],
    ]
    return doc


def compare(
    a_paths: Sequence[str],
    b_paths: Sequence[str],
    *,
    step: str | None = None,
    skip_steps: int = 0,
    ranks: Iterable[int] | None = None,
    steps: tuple[int | None, int | None] | None = None,
) -> dict[str, Any]:
    """The page's `compare` part (`view A --compare B`): the diff of run A (the page's) with run
    B, computed by `gputrace.diff` from both runs read as `gputrace diff` reads them, so the tab
    shows the numbers the command prints (`diff.to_json`; paths and notes as the page shows text)."""
    from gputrace import diff

    d = diff.to_json(
        diff.read(a_paths, b_paths, step, skip_steps, ranks=sorted(ranks) if ranks is not None else None, steps=steps)
    )
    for side in ("a", "b"):
        d[side]["paths"] = [shown_text(str(p)) for p in d[side]["paths"]]
        d[side]["notes"] = [shown_text(n) for n in d[side]["notes"]]
    return d


def open_section(paths: Iterable[str]) -> dict[str, Any] | None:
    """Where each rank is now, from the open files among and beside `paths` (`gputrace.live`):
    per rank (as `summary --json`'s `open`) and the verdict in words; None when there are none."""
    from gputrace import live

    states = live.read_all(paths)
    if not states:
        return None
    return {"ranks": live.as_json(states), "verdict": [shown_text(v) for v in live.verdict(states)]}


def _timeline(trace: Trace, st: stats.Steps | None, base: int) -> dict[str, Any]:
    """What the timeline loads first: the whole trace when the UI can hold it, else a window (the
    first steps, or the first spans) that it can."""
    whole = len(trace.spans) <= TIMELINE_SPANS
    out: dict[str, Any] = {"base_ns": base, "whole": whole, "limit": TIMELINE_SPANS, "initial": None}
    if whole or not len(trace.spans):
        return out
    if st is not None and st.count and st.start_ns:
        last = min(st.count, 3) - 1
        lo = min(v[0] for v in st.start_ns.values())
        hi = max(v[last] for v in st.end_ns.values())
    else:
        rng = trace.time_range()
        lo, hi = base, rng[1] if rng else base + 1
    lo, hi = fit_window(trace, lo, max(hi, lo + 1))
    out["initial"] = [lo - base, hi - base]
    return out


def shown_text(text: str) -> str:
    """`text` as the page can show it: a path's bytes that are not UTF-8 (which Python carries
    as lone surrogates, and JSON cannot hold) become U+FFFD."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # a surrogate that stands for no byte
        return text.encode("utf-8", "replace").decode()


def _title(inputs: list[str], ranks: list[int]) -> str:
    where = os.path.commonpath([os.path.abspath(p) for p in inputs]) if inputs else ""
    shown = os.path.basename(where) if where else "trace"
    return f"{shown}: {len(ranks)} rank{'s' if len(ranks) != 1 else ''}"


def _num(x: float) -> float | None:
    # JSON has no infinity: an imbalance against a zero total is written as null ("no least").
    return x if math.isfinite(x) else None


def _rel(values: Sequence[int], base: int) -> list[int]:
    return list(map(sub, values, repeat(base)))  # C-level: 64 ranks x 10k steps stay cheap


def _steps(
    st: stats.Steps | None, slot: dict[int, int], base: int, refs: dict[int, list[int]]
) -> dict[str, Any] | None:
    if st is None:
        return None
    out = step_times(st, slot, base, refs)

    def per_slot(d: Mapping[int, Sequence[Any]]) -> list[Any]:
        got: list[list[Any] | None] = [None] * len(slot)
        for r, v in d.items():
            if r in slot:
                got[slot[r]] = list(v[: st.count])
        return got

    out.update(
        {
            # The breakdown (gputrace.breakdown), per rank and step, None where not known.
            "idle": per_slot(st.idle_ns),
            "coll_wait": per_slot(st.collective_wait_ns),
            "coll_transfer": per_slot(st.collective_transfer_ns),
            "trend": _trend(st),
            "totals": {
                "idle_ns": [_total(st.idle_ns.get(r), st.count) for r in slot],
                "exposed_collective_ns": [_total(st.exposed_collective_ns.get(r), st.count) for r in slot],
                "collective_wait_ns": [_total(st.collective_wait_ns.get(r), st.count) for r in slot],
                "collective_transfer_ns": [_total(st.collective_transfer_ns.get(r), st.count) for r in slot],
                "launch_lag_ns": [_mean(st.launch_lag_ns.get(r), st.count) for r in slot],
            },
        }
    )
    return out


def step_times(st: stats.Steps, slot: dict[int, int], base: int, refs: dict[int, list[int]]) -> dict[str, Any]:
    """The document's steps without the breakdown: per rank slot and step, start and end (ns from
    `base`), busy and wait; per step the median busy time and the verdict; each cell's reference
    (`refs`, the other ranks' median). What the heatmap draws, and all that the page's first
    document (`viewer.first`) holds of the steps."""
    n = len(slot)

    def per_slot(d: Mapping[int, Sequence[Any]], rel: bool) -> list[Any]:
        out: list[list[Any] | None] = [None] * n
        for r, v in d.items():
            if r in slot:
                out[slot[r]] = _rel(v[: st.count], base) if rel else list(v[: st.count])
        return out

    verdicts = st.verdicts[: st.count]
    return {
        "name": st.name,
        "skipped": st.skipped,
        "count": st.count,
        "first": st.number(0),  # the number of step index 0 (skipped steps counted)
        "rule": st.rule,
        "start": per_slot(st.start_ns, True),
        "end": per_slot(st.end_ns, True),
        "busy": per_slot(st.busy_ns, False),
        "wait": per_slot(st.wait_ns, False),
        "median": list(st.median_busy_ns[: st.count]),
        # What each cell is compared with: the median of the other ranks (with two ranks, the
        # other one), so a rank's own time does not pull its reference towards it.
        "ref": _per_slot_lists(list(refs.values()), list(refs), slot),
        "verdict": {
            "slot": [slot.get(v.rank, -1) for v in verdicts],
            "margin_ns": [v.margin_ns for v in verdicts],
            "margin_pct": [_num(v.margin_pct) for v in verdicts],
            "noise_ns": [v.noise_ns for v in verdicts],
            "called": [1 if v.called else 0 for v in verdicts],
        },
        "times_slowest": [st.times_slowest.get(r, 0) for r in slot],
    }


def _total(v: Sequence[int | None] | None, count: int) -> int | None:
    """The sum over the steps, None when no step's value is known."""
    known = [x for x in (v or ())[:count] if x is not None]
    return sum(known) if known else None


def _mean(v: Sequence[int | None] | None, count: int) -> int | None:
    known = [x for x in (v or ())[:count] if x is not None]
    return sum(known) // len(known) if known else None


def _trend(st: stats.Steps) -> dict[str, list[int]]:
    """Per step, the mean over ranks of each part of the step: work inside spans (busy less idle),
    idle outside any span, collective transfer and waiting for the last rank. The parts add up to
    the mean step time, so a step every rank took longer stands out, and by which part."""
    ranks = [r for r in st.ranks if r in st.busy_ns]
    n = max(1, len(ranks))
    count = st.count
    work = [0] * count
    idle = [0] * count
    transfer = [0] * count
    wait = [0] * count
    for r in ranks:  # whole columns at a time (C-level maps): 64 ranks x 10k steps stay cheap
        busy = st.busy_ns[r][:count]
        i = [x or 0 for x in st.idle_ns.get(r, [0] * count)[:count]]
        c = st.wait_ns[r][:count]
        # The collective time that is not waiting is transfer (unmatched collectives too), so
        # the parts add up to the step.
        w = list(map(min, st.collective_wait_ns.get(r, [0] * count)[:count], c))
        idle = list(map(add, idle, i))
        work = list(map(add, work, map(sub, busy, i)))
        wait = list(map(add, wait, w))
        transfer = list(map(add, transfer, map(sub, c, w)))
    return {
        "work": [x // n for x in work],
        "idle": [x // n for x in idle],
        "transfer": [x // n for x in transfer],
        "wait": [x // n for x in wait],
    }


def _per_slot_lists(values: list[list[int]], ranks: list[int], slot: dict[int, int]) -> list[list[int] | None]:
    out: list[list[int] | None] = [None] * len(slot)
    for r, v in zip(ranks, values):
        if r in slot:
            out[slot[r]] = v
    return out


def _collectives(co: stats.Collectives | None, slot: dict[int, int], base: int) -> dict[str, Any] | None:
    if co is None:
        return None
    occ = co.occurrences
    names = list(dict.fromkeys(o.name for o in occ))
    name_index = {n: i for i, n in enumerate(names)}

    by_field = {per: [getattr(o, per) for o in occ] for per in ("arrivals", "ends", "waits_ns")}

    def column(per: str, r: int, shift: int) -> list[int | None]:
        # One rank's value in every occurrence (None where it did not take part).
        got = map(dict.get, by_field[per], repeat(r))  # C-level: 64 ranks x 10k occurrences stay cheap
        if not shift:
            return list(got)
        return [None if t is None else t - shift for t in got]

    per = {r: co.per_rank.get(r) for r in slot}
    return {
        "rule": co.rule,
        "names": names,
        "count": len(occ),
        "name": [name_index[o.name] for o in occ],
        "step": [o.step for o in occ],
        "ordinal": [o.ordinal for o in occ],
        "last_slot": [slot.get(o.last_rank, -1) for o in occ],
        "last_margin_ns": [o.last_margin_ns for o in occ],
        "last_called": [1 if o.last_called else 0 for o in occ],
        "first": [min(o.arrivals.values()) - base for o in occ],
        "last": [max(o.ends.values()) - base for o in occ],
        "max_wait": [max(o.waits_ns.values(), default=0) for o in occ],
        "arrival": [column("arrivals", r, base) for r in slot],
        "end": [column("ends", r, base) for r in slot],
        "wait": [column("waits_ns", r, 0) for r in slot],
        "per_rank": {
            "times_last": [c.times_last if c else 0 for c in per.values()],
            "times_last_within_noise": [c.times_last_within_noise if c else 0 for c in per.values()],
            "wait_caused_ns": [c.wait_caused_ns if c else 0 for c in per.values()],
            "wait_suffered_ns": [c.wait_suffered_ns if c else 0 for c in per.values()],
        },
    }


def _stat_row(r: stats.NameStats, base: int) -> list[Any]:
    return [
        r.name,
        r.count,
        r.total_ns,
        r.mean_ns,
        r.p50_ns,
        r.p90_ns,
        r.p99_ns,
        r.max_ns,
        r.ranks,
        r.min_rank,
        r.min_rank_total_ns,
        r.max_rank,
        r.max_rank_total_ns,
        _num(r.imbalance),
        r.slowest.rank,
        r.slowest.start_ns - base,
        r.slowest.end_ns - base,
        r.self_total_ns,
    ]


def _counts(c: Any) -> dict[str, Any] | None:
    if c is None:
        return None
    return {
        "spans": c.spans,
        "unfinished": c.unfinished,
        "dropped": c.dropped,
        "skipped_in_capture": c.skipped_in_capture,
        "warmup": c.warmup,
    }


def _alignment(trace: Trace, ranks: list[int]) -> dict[str, Any] | None:
    al = trace.metadata.get("alignment")
    if not isinstance(al, dict):
        return None
    per: dict[Any, Any] = al["per_rank"] if isinstance(al.get("per_rank"), dict) else {}
    out: list[dict[str, Any] | None] = []
    for r in ranks:
        a = per.get(str(r), per.get(r))
        if isinstance(a, dict):
            out.append(
                {
                    "offset_ns": a.get("offset_ns"),
                    "error_ns": a.get("error_ns"),
                    "measured": a.get("measured") is not False,  # False: no clock sync, error unknown
                    "notes": a.get("notes") or [],
                }
            )
        else:
            out.append(None)
    return {"method": al.get("method"), "per_rank": out}


# ---- the timeline's trace ---------------------------------------------------------------------


def timeline_trace(trace: Trace, base_ns: int, start_ns: int | None = None, end_ns: int | None = None) -> bytes:
    """The trace as Chrome JSON for the Perfetto UI, its `ts` counted from `base_ns`: the whole
    trace, or the spans and samples that meet [start_ns, end_ns) (absolute ns)."""
    if start_ns is None and end_ns is None:
        return chrome.encode(numbered(trace), base_ns)
    lo = base_ns if start_ns is None else max(start_ns, base_ns)
    hi = (1 << 62) if end_ns is None else end_ns
    return chrome.encode(numbered(window(trace, lo, hi)), base_ns)


def numbered(trace: Trace) -> Trace:
    """`trace` with its ranks' process names padded to one width ("rank 07" of 64), sharing its
    columns. The Perfetto UI orders processes of equal size by name, as text: "rank 10" would come
    before "rank 2"."""
    width = len(str(max((p.rank for p in trace.processes if p.rank is not None), default=0)))
    if width < 2:
        return trace
    procs = []
    for p in trace.processes:
        m = _RANK_LABEL.match(p.label)
        if p.rank is not None and m:
            p = dataclasses.replace(p, label=f"{m.group(1)}{int(m.group(2)):0{width}d}{m.group(3)}")
        procs.append(p)
    out = Trace(trace.metadata)
    out.processes = procs
    out.tracks = trace.tracks
    out.names = trace.names
    out._name_index = trace._name_index
    out.spans = trace.spans
    out.counters = trace.counters
    out.extra = trace.extra
    return out


_RANK_LABEL = re.compile(r"^(rank )(\d+)(\b.*)$", re.S)


def iter_timeline_trace(trace: Trace, base_ns: int) -> Iterator[bytes]:
    """The whole trace in pieces (a download of any size without holding it all in memory)."""
    pieces = chrome.iter_encode(numbered(trace), base_ns)
    last = b""
    for piece in pieces:
        if last:
            yield last
        last = piece
    # Every event line ends with ",\n": the last one's comma makes way for the closing bracket.
    yield last[:-2] + b"\n]}" if last.endswith(b",\n") else last + b"]}"


def window(trace: Trace, start_ns: int, end_ns: int) -> Trace:
    """The spans and counter samples of `trace` that meet [start_ns, end_ns), with every process
    and track kept (so the timeline's tracks stay where they were)."""
    out = Trace(dict(trace.metadata))
    for p in trace.processes:
        out.add_process(p)
    for t in trace.tracks:
        out.add_track(t)
    out.names.extend(trace.names)
    out._name_index.update(trace._name_index)
    sp, dst = trace.spans, out.spans
    rows = list(compress(range(len(sp)), _meeting(trace, start_ns, end_ns)))
    dst.extend(
        [sp.name[i] for i in rows],
        [sp.track[i] for i in rows],
        [sp.start[i] for i in rows],
        [sp.end[i] for i in rows],
        [sp.args[i] for i in rows],
        [sp.cat[i] for i in rows],
    )
    if sp.entry is not None:  # the launch arrows of the spans kept
        dst.entry = array("q", [sp.entry[i] for i in rows])
    c = trace.counters
    for i, ts in enumerate(c.ts):
        if start_ns <= ts < end_ns:
            out.counters.append(c.track[i], ts, c.value[i])
    return out


def _meeting(trace: Trace, start_ns: int, end_ns: int) -> Iterator[bool]:
    """Per span: does [start, end) meet [start_ns, end_ns)? (A zero-length span counts where it
    stands.) Built from C-level maps: a window of a trace of millions of spans costs a fraction of
    a second, not seconds."""
    sp = trace.spans
    before_end = map(lt, sp.start, repeat(end_ns))
    after_start = map(or_, map(gt, sp.end, repeat(start_ns)), map(ge, sp.start, repeat(start_ns)))
    return map(and_, before_end, after_start)


def spans_in(trace: Trace, start_ns: int, end_ns: int) -> int:
    """How many spans meet [start_ns, end_ns)."""
    return sum(_meeting(trace, start_ns, end_ns))


def fit_window(trace: Trace, start_ns: int, end_ns: int, limit: int | None = None) -> tuple[int, int]:
    """[start_ns, end_ns) narrowed, keeping its start, until at most `limit` (TIMELINE_SPANS) spans
    meet it (a click on a whole-run span of a huge trace still gets a timeline the UI can load)."""
    if limit is None:
        limit = TIMELINE_SPANS
    starts = list(compress(trace.spans.start, _meeting(trace, start_ns, end_ns)))
    if len(starts) <= limit:
        return start_ns, end_ns
    starts.sort()
    return start_ns, max(starts[limit], start_ns + 1)
