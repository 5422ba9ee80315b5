"""The summary from the ranks' step digests, and the choice `gputrace summary` makes between
digests and full traces.

Takes: trace files, digests and directories the user named. Gives: the `stats.Summary` that
`gputrace summary` prints and the viewer shows (`summary_of_files`): from the digests when
every rank has one (or the ranks are many: DIGEST_MIN_RANKS), else from the full traces. From
digests (`summarize`): steps and collectives by `stats.summarize` itself on the digests' spans,
merged and aligned by merge's own functions (the same numbers as from the full traces), and the
span names from the digests' aggregates (counts, totals and maxima exact; percentiles within
`digest.HIST_ERROR`). A rank whose digest is missing or older than its trace has one computed
from its trace (`collect`), one rank at a time.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import warnings
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from itertools import compress
from typing import Any

from gputrace import stats, stats_columns
from gputrace.digest import HIST_ERROR, WARMUP_STEPS, from_trace, hist_middle
from gputrace.errors import GputraceError, GputraceWarning, TraceFormatError
from gputrace.trace import digestfile, registry
from gputrace.trace.digestfile import (
    TRACE_NAME,
    DamagedDigest,
    RankDigest,
    digest_path,
    fresh,
    from_document,
    is_digest_path,
    looks_current,
    read,
    step_name_of,
)
from gputrace.trace.model import SpanColumns, SparseArgs, Trace, _NoCats

#: `gputrace summary` reads digests rather than full traces from this many ranks on, even where
#: some ranks wrote none (theirs are computed from their traces, one rank at a time).
DIGEST_MIN_RANKS = 65


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
            found = sorted(f for pattern in registry.rank_file_globs() for f in glob.glob(os.path.join(p, pattern)))
            found_digests = sorted(f for f in glob.glob(os.path.join(p, digestfile.RANK_GLOB)) if os.path.isfile(f))
            if not found and not found_digests:
                raise GputraceError(
                    f"{p}: no {', '.join(registry.rank_file_globs())} or {digestfile.RANK_GLOB} files here"
                )
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


def collect(inputs: Inputs, step_name: str) -> list[RankDigest]:
    """Every rank's digest: read from its file when there is a fresh one, else computed from its
    trace (one rank at a time)."""
    out: list[RankDigest] = []
    for t in inputs.traces:
        d = None
        if t in inputs.digests:
            try:
                d = read(inputs.digests[t])
            except DamagedDigest as e:  # whole, but wrong inside: not what a crash leaves, so say so
                warnings.warn(f"{e}: read its trace instead", GputraceWarning, stacklevel=2)
                d = None
            except TraceFormatError:  # cut short (digests are not fsynced): its trace has it all
                d = None
            if d is not None and (not fresh(d, t) or d.step_name != step_name or d.version < 2):
                d = None  # stale, or of an older version whose breakdown the trace can give
        if d is None:
            d = from_document(from_trace(registry.read(t), step_name, t), t)
            d.computed = True
        out.append(d)
    out += [read(p) for p in inputs.lone]
    return out


def _digest_beside(task: tuple[str, str]) -> bool:
    """(A worker's task) the digest of the trace at `task[0]`, steps marked by `task[1]`,
    written beside it; False where it is not written: the folder cannot take it, the trace
    changed while it was read (a run still writing it: the digest would hold part of it and look
    current), or a current digest appeared there meanwhile (the recorder's, kept)."""
    path, step_name = task
    before = _identity(path)
    doc = from_trace(registry.read(path), step_name, path)
    if _identity(path) != before:
        return False
    target = digest_path(path)
    if os.path.exists(target) and looks_current(target, path, step_name):
        return False
    try:
        digestfile.write(doc, target)
    except (OSError, GputraceError):  # the atomic writer says a failed write as GputraceError
        return False
    return True


def _identity(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino


def make_digests(
    inputs: Inputs, step_name: str, workers: int | Callable[[list[str]], int | None] | None = None
) -> Inputs:
    """The digests of the per-rank trace files that have none beside them that a summary with
    these steps would read (none, another step name, an older format, or written for the trace
    as it was before), made from the traces and written beside them as the recorder would have
    (the next summary or view reads them, not the traces); the inputs found again. Ranks are
    made in parallel worker processes as merge reads (`merge.run.workers_for`: only on idle
    cores, at most 8, each holding one trace; `workers` a function: its answer for the traces to
    digest, asked only where there are some). A folder that cannot take a digest, a worker that
    dies (out of memory?) or a trace that changes meanwhile leave their traces to `collect`,
    one rank at a time."""
    from gputrace.merge import pool
    from gputrace.merge.run import workers_for

    todo = [
        t
        for t in inputs.traces
        if TRACE_NAME.match(os.path.basename(t))
        and os.access(os.path.dirname(os.path.abspath(t)), os.W_OK)
        and not (t in inputs.digests and looks_current(inputs.digests[t], t, step_name))
    ]
    if not todo:
        return inputs
    tasks = [(t, step_name) for t in todo]
    n = min(workers_for(todo, workers(todo) if callable(workers) else workers), len(todo))
    try:
        if n <= 1:
            for task in tasks:
                _digest_beside(task)
        else:
            for _ in pool.ordered(_digest_beside, tasks, n, 2 * n):
                pass
    except TraceFormatError:
        raise  # not a trace this can read: the caller says so
    except GputraceError:
        pass  # a worker that died: what was written stays, `collect` reads the rest one by one
    return find(inputs.traces + inputs.lone)


def step_names(inputs: Inputs) -> set[str]:
    """The step names the digests were written with (read from the files' first bytes)."""
    found = (step_name_of(p) for p in [*inputs.digests.values(), *inputs.lone])
    return {name for name in found if name is not None}


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
    old = {d.rank for d in digests if d.version < 2}
    lags = {d.rank: d.launch_lag for d in digests}
    trace, maps = load(digests, allow_mixed)
    s = stats.summarize(trace, step, skip_steps, unknown_breakdown=old)
    _drop_cover(trace)
    if s.steps is not None:
        st = s.steps
        # Launch lags were found on the rank (a digest keeps no host entry times).
        launch: dict[int, list[int | None]] = {}
        for r in st.ranks:
            got = (lags[r] or [])[st.skipped : st.skipped + st.count]
            launch[r] = got if r not in old and len(got) == st.count else [None] * st.count
        s = dataclasses.replace(s, steps=dataclasses.replace(st, launch_lag_ns=launch))
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
    if old:
        notes.append(
            f"the digests of ranks {_ranges(sorted(old))} are of an older version, without their traces: their idle, "
            "exposed collective and launch lag times and self times are not known (--full reads the traces)"
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


def _drop_cover(trace: Trace) -> None:
    """The digests' cover spans out of the merged trace: they were for the breakdown only, not
    spans of the run (the trace returned is the step and collective spans)."""
    sp = trace.spans
    keep = [not (a and a.get("cover")) for a in sp.args]
    if all(keep):
        return
    out = SpanColumns()
    # Whole columns at a time: array(compress(...)) builds no list of the kept values.
    out.name = array("l", compress(sp.name, keep))
    out.track = array("l", compress(sp.track, keep))
    out.start = array("q", compress(sp.start, keep))
    out.end = array("q", compress(sp.end, keep))
    out.args = list(compress(sp.args, keep))
    out.cat = (
        list(compress(sp.cat, keep)) if type(sp.cat) is list else [sp.cat[0] if len(sp) else None] * len(out.start)
    )
    trace.spans = out


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
                a = by_name[name][r] = [0, 0, st["min"][k], -1, 0, 0, Counter(), 0]
            a[0] += n
            a[1] += st["total"][k]
            own = st["self"][k] if st["self"] is not None else None
            a[7] = None if own is None or a[7] is None else a[7] + own
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
                # Exact but for self time: a digest's spans are not all the rank's.
                by_rank[r].append(dataclasses.replace(ex, self_total_ns=a[7]))
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
            rows.append(dataclasses.replace(exact_all[name], self_total_ns=_self_sum(ranks)))
        else:
            longest = max(ranks, key=lambda r: (ranks[r][3], -r))
            rows.append(_row(name, ranks, insts[longest]))
    order = lambda x: (-x.total_ns, x.name)  # noqa: E731
    rows.sort(key=order)
    for v in by_rank.values():
        v.sort(key=order)
    return rows, by_rank, kept, warm


def _self_sum(ranks: dict[int, list[Any]]) -> int | None:
    own = [a[7] for a in ranks.values()]
    return None if any(x is None for x in own) else sum(own)


def _row(name: str, ranks: dict[int, list[Any]], slowest: stats.Instance) -> stats.NameStats:
    totals = {r: a[1] for r, a in ranks.items()}
    count = sum(a[0] for a in ranks.values())
    hist: Counter[int] = Counter()
    for a in ranks.values():
        hist.update(a[6])
    lo_v = min(a[2] for a in ranks.values())
    hi_v = max(a[3] for a in ranks.values())
    p50, p90, p99 = (_percentile(hist, count, q, lo_v, hi_v) for q in (50, 90, 99))
    return stats.name_row(name, count, (p50, p90, p99), hi_v, totals, slowest, _self_sum(ranks))


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
            mid = hist_middle(b)
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
        by_name = {t: TRACE_NAME.match(os.path.basename(t)) for t in files}
        if all(by_name.values()) and len({m.group(1) for m in by_name.values() if m}) == len(files):
            # Files named by rank: only the selected ones are opened.
            files = [t for t, m in by_name.items() if m and int(m.group(1)) in wanted] or files
    trace = load_for_statistics(files, allow_mixed=allow_mixed, ranks=ranks, steps=steps, step_name=step_name)
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


def load_for_statistics(files: Sequence[str], **options: Any) -> Trace:
    """`merge.load(files, **options)`, each file read for the statistics alone: of a span's
    arguments only those they look at (`stats_columns.ARGS`), kept for the spans that have them
    alone (`SparseArgs`), and no categories, a column that then takes no memory. The statistics
    of such a trace are those of the whole one; its spans' arguments are not (not for a timeline
    or a written trace). The CLI's commands also have large blocks freed on the way given back
    to the system at once (`heap.map_large_blocks`): a process-wide setting, which the library
    leaves to the process that reads (a training process calling this keeps its own)."""
    from gputrace import merge

    with registry.only_args(stats_columns.ARGS):
        trace = merge.load(files, **options)
    sp = trace.spans
    if type(sp.cat) is list and sp.cat.count(None) == len(sp.cat):
        sp.cat = _NoCats(len(sp.cat))
    if type(sp.args) is list:  # a pointer a span, where most are None
        sp.args = SparseArgs(sp.args)
    return trace


def _ranges(ranks: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for r in sorted(set(ranks)):
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
