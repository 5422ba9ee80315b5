"""Two runs compared: which span names got slower or faster, and whether beyond the runs' noise.

Takes: two runs, each as the `stats.Summary` that `gputrace summary` computes for it (`read`
gets it the same way, `summary.summary_of_files`: from the ranks' step digests when present,
else from the traces). Gives: a `Diff`: per span name found in both runs the median duration
per occurrence in each (`a_ns`, `b_ns`, all ranks pooled), the change in ns and percent, each
run's own spread and whether the change lies inside it (`noise`); the step time the same way;
the names only one run has. Names are sorted with the largest regression first: first the
changes beyond the noise (largest `delta_pct` first, so improvements come last), then those
within it. `to_json` labels every value; `table` is text that fits a terminal.

Noise, defined (RULE says it in one line): a run's own spread for a name is the larger of
- the range of its ranks' medians (largest minus least): ranks running the same code differ by
  about that much by chance, so a change of the pooled median smaller than that is no evidence;
- half its interquartile range, how much one occurrence differs from the next: for the step
  computed from its step durations (every rank, every step); for a span name estimated as half
  the distance from its median to its 90th percentile (the summary keeps p50 and p90, not the
  quartiles; for a symmetric spread the two agree), which also gives a one-rank run a spread.
A change is noise when |b - a| is at most the larger of the two runs' spreads, or at most
FLOOR_PCT of the larger median (the precision of a median read from a digest's histogram,
applied whatever was read, so a run gives the same verdicts from its digests and its traces).

`regressed(diff, pct)` lists the names (the step included) slower by more than `pct` percent and
beyond the noise: `gputrace diff --fail-above` fails on those only, since a gate that fails on
noise fails at random.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gputrace import stats
from gputrace.digest import HIST_ERROR
from gputrace.errors import GputraceError

#: A change of at most this share of the larger median is never called (a digest's histogram
#: gives a median within HIST_ERROR; the summary's verdicts use MARGIN_PCT).
FLOOR_PCT = 100 * max(HIST_ERROR, stats.MARGIN_PCT / 100)

RULE = (
    "a change is noise when it is within the larger of the two runs' spreads (a run's spread: the range of "
    "its ranks' medians, or half its interquartile range if larger, estimated for a span name as half its "
    f"p90 - p50) or within {FLOOR_PCT:.1f}% of the larger median"
)


@dataclass(frozen=True)
class Change:
    """One span name (or the step) in both runs: medians per occurrence, the change, the noise."""

    name: str
    a_ns: int  # median duration per occurrence in A, all ranks pooled
    b_ns: int
    delta_ns: int  # b_ns - a_ns: positive is slower in B
    delta_pct: float  # delta_ns / a_ns in percent (inf when a_ns is 0 and b_ns is not)
    a_count: int  # occurrences in A
    b_count: int
    a_spread_ns: int  # A's own spread (see the module's docstring)
    b_spread_ns: int
    noise_ns: int  # the band |delta_ns| must exceed to be called a change
    noise: bool  # the change lies within the band

    @property
    def regressed(self) -> bool:
        return not self.noise and self.delta_ns > 0


@dataclass(frozen=True)
class Run:
    """What a side of the diff was read from."""

    label: str  # "A" or "B"
    paths: list[str]
    ranks: list[int]
    notes: list[str]  # its summary's notes; the first says whether digests or traces were read


@dataclass(frozen=True)
class Diff:
    a: Run
    b: Run
    step: Change | None  # None: neither run has step spans
    names: list[Change]  # every name in both runs but the step's, the largest regression first
    only_a: list[str]  # names that only A has
    only_b: list[str]
    rule: str = RULE
    notes: list[str] = field(default_factory=list)


def check(paths: Sequence[str], label: str) -> None:
    """Fail early, before anything is read, when `paths` name no run (missing, or no trace or
    digest files there): the error says which run."""
    from gputrace.summary import find

    try:
        find(paths)
    except GputraceError as e:
        raise GputraceError(f"run {label}: {e}") from None


def read(
    a_paths: Sequence[str],
    b_paths: Sequence[str],
    step: str | None = None,
    skip_steps: int = 0,
    *,
    allow_mixed: bool = False,
    full: bool = False,
    ranks: Sequence[int] | None = None,
    steps: tuple[int | None, int | None] | None = None,
) -> Diff:
    """The diff of two runs, each read as `gputrace summary` reads it (the same selection and
    choice of digests or traces for both)."""
    from gputrace.summary import summary_of_files

    check(a_paths, "A")
    check(b_paths, "B")
    summaries = []
    for label, paths in (("A", a_paths), ("B", b_paths)):
        try:
            s = summary_of_files(
                list(paths), step, skip_steps, allow_mixed=allow_mixed, full=full, ranks=ranks, steps=steps
            )
        except GputraceError as e:
            raise GputraceError(f"run {label}: {e}") from None
        summaries.append(s)
    return compare(summaries[0], summaries[1], list(a_paths), list(b_paths))


def compare(a: stats.Summary, b: stats.Summary, a_paths: Sequence[str] = (), b_paths: Sequence[str] = ()) -> Diff:
    """The diff of two runs' summaries (pure)."""
    ra = Run("A", list(a_paths), list(a.ranks), list(a.notes))
    rb = Run("B", list(b_paths), list(b.ranks), list(b.notes))
    sa, sb = a.steps, b.steps
    if (sa is None) != (sb is None) or (sa is not None and sb is not None and sa.name != sb.name):

        def what(s: stats.Steps | None) -> str:
            return f"steps marked by {s.name!r}" if s is not None else "no step spans"

        raise GputraceError(
            f"run A has {what(sa)}, run B {what(sb)}: both need the same step span (pass --step NAME, "
            "one both runs have)"
        )
    step_name = sa.name if sa is not None else None
    in_a = {x.name: x for x in a.names if x.name != step_name}
    in_b = {x.name: x for x in b.names if x.name != step_name}
    common = [n for n in in_a if n in in_b]
    if not common and step_name is None:
        raise GputraceError(
            "the runs have no span name in common: nothing to compare "
            f"(A has {_some(list(in_a))}; B has {_some(list(in_b))})"
        )
    medians_a, medians_b = _rank_medians(a), _rank_medians(b)
    changes = [
        _change(
            n,
            in_a[n].p50_ns,
            in_b[n].p50_ns,
            in_a[n].count,
            in_b[n].count,
            max(_range(medians_a.get(n, [])), (in_a[n].p90_ns - in_a[n].p50_ns) // 2),
            max(_range(medians_b.get(n, [])), (in_b[n].p90_ns - in_b[n].p50_ns) // 2),
        )
        for n in common
    ]
    changes.sort(key=lambda c: (c.noise, -c.delta_pct, c.name))
    step_change = None
    if sa is not None and sb is not None:
        da, db = _step_durations(sa), _step_durations(sb)
        if not da or not db:
            raise GputraceError(
                f"run {'A' if not da else 'B'} has no step {step_name!r} on every rank after the skipped ones: "
                "no step time to compare"
            )
        step_change = _change(
            sa.name,
            stats.percentile(da, 50),
            stats.percentile(db, 50),
            len(da),
            len(db),
            max(_range(_step_medians(sa)), _half_iqr(da)),
            max(_range(_step_medians(sb)), _half_iqr(db)),
        )
    notes = [] if step_change is not None else ["neither run has step spans: no step time compared (--step NAME)"]
    for run in (ra, rb):
        if len(run.ranks) == 1:
            notes.append(
                f"run {run.label} has one rank: its spread is only how much one occurrence differs from the next"
            )
    return Diff(
        a=ra,
        b=rb,
        step=step_change,
        names=changes,
        only_a=sorted(n for n in in_a if n not in in_b),
        only_b=sorted(n for n in in_b if n not in in_a),
        notes=notes,
    )


def regressed(diff: Diff, pct: float) -> list[Change]:
    """The step and names slower in B by more than `pct` percent, beyond the noise."""
    found = ([diff.step] if diff.step is not None else []) + diff.names
    return [c for c in found if c.regressed and c.delta_pct > pct]


def _some(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:6])
    return (shown + f" and {len(names) - 6} more" if len(names) > 6 else shown) or "none"


def _rank_medians(s: stats.Summary) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for rows in s.by_rank.values():
        for x in rows:
            out.setdefault(x.name, []).append(x.p50_ns)
    return out


def _range(values: list[int]) -> int:
    return max(values) - min(values) if values else 0


def _step_durations(st: stats.Steps) -> list[int]:
    return sorted(e - s for r in st.ranks for s, e in zip(st.start_ns[r][: st.count], st.end_ns[r][: st.count]))


def _step_medians(st: stats.Steps) -> list[int]:
    return [
        stats.percentile(sorted(e - s for s, e in zip(st.start_ns[r][: st.count], st.end_ns[r][: st.count])), 50)
        for r in st.ranks
    ]


def _half_iqr(ascending: list[int]) -> int:
    return (stats.percentile(ascending, 75) - stats.percentile(ascending, 25)) // 2


def _change(name: str, a: int, b: int, na: int, nb: int, spread_a: int, spread_b: int) -> Change:
    delta = b - a
    pct = 100.0 * delta / a if a else (math.inf if delta > 0 else -math.inf if delta < 0 else 0.0)
    band = max(spread_a, spread_b, math.ceil(FLOOR_PCT / 100 * max(a, b)))
    return Change(name, a, b, delta, pct, na, nb, spread_a, spread_b, band, abs(delta) <= band)


# ---- output -------------------------------------------------------------------------------------


def _num(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _change_json(c: Change) -> dict[str, Any]:
    return {
        "name": c.name,
        "a_ns": c.a_ns,
        "b_ns": c.b_ns,
        "delta_ns": c.delta_ns,
        "delta_pct": _num(c.delta_pct),
        "noise": c.noise,
        "noise_ns": c.noise_ns,
        "a_spread_ns": c.a_spread_ns,
        "b_spread_ns": c.b_spread_ns,
        "a_count": c.a_count,
        "b_count": c.b_count,
    }


def _run_json(r: Run) -> dict[str, Any]:
    return {"paths": r.paths, "ranks": r.ranks, "notes": r.notes}


def to_json(diff: Diff, fail_above: float | None = None) -> dict[str, Any]:
    """The diff as JSON-ready objects, times in ns; with `fail_above`, the names that exceed it."""
    out: dict[str, Any] = {
        "a": _run_json(diff.a),
        "b": _run_json(diff.b),
        "step": _change_json(diff.step) if diff.step is not None else None,
        "names": [_change_json(c) for c in diff.names],
        "only_a": diff.only_a,
        "only_b": diff.only_b,
        "rule": diff.rule,
        "notes": diff.notes,
    }
    if fail_above is not None:
        out["fail_above"] = {"pct": fail_above, "regressed": [c.name for c in regressed(diff, fail_above)]}
    return out


def _verdict(c: Change) -> str:
    if c.noise:
        return "noise"
    return "slower" if c.delta_ns > 0 else "faster"


def table(diff: Diff, width: int | None = None) -> str:
    """The diff as text no wider than `width` (default: as `gputrace summary`)."""
    w = max(width if width is not None else stats.terminal_width(), 40)
    wrap = stats._wrap
    out: list[str] = []
    for run in (diff.a, diff.b):
        where = " ".join(run.paths) or "?"
        how = "; " + re.split("[:;]", run.notes[0])[0] if run.notes else ""  # the whole note is below
        out += wrap(f"{run.label}: {where} ({len(run.ranks)} rank{'s' if len(run.ranks) != 1 else ''}{how})", w)
    out.append("")
    st = diff.step
    if st is not None:
        out += wrap(
            f"step {stats._printable(st.name)!r}: {stats.fmt_ns(st.a_ns)} -> {stats.fmt_ns(st.b_ns)}, "
            f"{stats._signed(st.delta_ns)} ({stats._pct(st.delta_pct)}): "
            + (
                f"within the noise (±{stats.fmt_ns(st.noise_ns)})"
                if st.noise
                else f"{_verdict(st)}, beyond the noise (±{stats.fmt_ns(st.noise_ns)})"
            ),
            w,
        )
        out.append("")
    dropped: list[str] = []
    rows = diff.names
    if rows:
        C = stats._Col
        cols = [
            C("name", [stats._printable(c.name) for c in rows], right=False, shrink=16),
            C("A", [stats.fmt_ns(c.a_ns) for c in rows]),
            C("B", [stats.fmt_ns(c.b_ns) for c in rows]),
            C("delta", [stats._signed(c.delta_ns) for c in rows], keep=2),
            C("delta %", [stats._pct(c.delta_pct) for c in rows]),
            C("verdict", [_verdict(c) for c in rows]),
            C("noise", [f"±{stats.fmt_ns(c.noise_ns)}" for c in rows], keep=1),
            C("count A", [f"{c.a_count:,}" for c in rows], keep=3),
            C("count B", [f"{c.b_count:,}" for c in rows], keep=3),
        ]
        out += stats._grid(cols, w, dropped)
        out += wrap("(medians per occurrence, all ranks; the largest regression beyond the noise first)", w)
    else:
        out.append("no span name besides the step in both runs")
    for label, names in (("A", diff.only_a), ("B", diff.only_b)):
        if names:
            out += wrap(f"only in {label}: {', '.join(stats._printable(n) for n in names)}", w)
    out.append("")
    out += wrap("rule: " + diff.rule, w)
    for n in diff.notes:
        out += wrap("note: " + n, w)
    for n in diff.a.notes:  # a note both runs have is said once
        out += wrap(f"note ({'A, B' if n in diff.b.notes else 'A'}): {n}", w)
    for n in diff.b.notes:
        if n not in diff.a.notes:
            out += wrap(f"note (B): {n}", w)
    if dropped:
        out += wrap(
            f"note: left out to fit {w} columns: {', '.join(dropped)}; a wider terminal or COLUMNS=N shows them, "
            "--json gives every number",
            w,
        )
    return "\n".join(stats._clip(line, w) for line in out)
