"""Why steps were slow, in words: the step breakdown turned into short sentences.

Takes: a summary's `Steps` (with the breakdown, `gputrace.breakdown`), its `Collectives` and
how times are written (`stats.fmt_ns`).
Gives: sentences (`causes`), e.g. "rank 2 slowest in steps 40-44: 30.0 ms idle outside any span
a step (the others 0.1 ms)" and "every rank: all_reduce transfer +18.0 ms a step in steps
20-29", most time first. Two kinds:

- a rank called slowest in a run of consecutive steps, by more than the noise: what its busy
  time went to beyond the other ranks' in those steps: idle outside any span, or work inside
  spans, and the launch lag when it grew too;
- a run of consecutive steps in which every rank spent more than usual (beyond its own median
  step) on one part of the step: collective transfer (named by the collective whose transfer
  grew most), waiting in collectives, idle, or work inside spans.

"More than the noise": above RAISED_PCT of the median step time, and above NOISE_MADS times the
part's own spread from step to step (its median absolute deviation, the median over ranks), so
that a loaded machine's jitter is not called a cause.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import repeat
from operator import sub
from statistics import median
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # stats calls this module: it imports nothing of stats at run time
    from gputrace.stats import Collectives, Steps

#: A part of the step is raised on every rank when each rank's excess over its own median is
#: more than this share of the median step time (and than NOISE_MADS spreads).
RAISED_PCT = 5.0
NOISE_MADS = 4


def _mad(v: Sequence[int]) -> float:
    """The median absolute deviation of v from its median."""
    s = sorted(v)
    return _mad_sorted(s, median(s))


def _mad_sorted(s: Sequence[int], m: float) -> float:
    """`_mad` of `s`, ascending, whose median is `m`. Its deviations from m fall then rise, two
    runs that median's sort merges in one pass, where deviations in step order take a full sort
    (64 ranks x 10k steps x 4 parts). C-level maps."""
    return float(median(map(abs, map(sub, s, repeat(m)))))


def _runs(ks: Sequence[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for k in ks:
        if out and out[-1][1] == k - 1:
            out[-1] = (out[-1][0], k)
        else:
            out.append((k, k))
    return out


def _steps_text(st: Steps, a: int, b: int) -> str:
    return f"step {st.number(a)}" if a == b else f"steps {st.number(a)}-{st.number(b)}"


def _known(v: Sequence[int | None]) -> list[int]:
    return [x for x in v if x is not None]


def causes(st: Steps, co: Collectives | None, fmt_ns: Callable[[float], str]) -> list[str]:
    """The causes in words, the largest first (each sentence once); times as `fmt_ns` writes
    them."""
    found: list[tuple[int, str]] = []
    ranks = st.ranks
    if not ranks or not st.count:
        return []
    # Work inside spans: busy time that is not idle (None where idle is not known).
    work: dict[int, list[int | None]] = {
        r: [None if i is None else b - i for b, i in zip(st.busy_ns[r], st.idle_ns[r])] for r in ranks
    }

    lengths = sorted(e - s for r in ranks for s, e in zip(st.start_ns[r], st.end_ns[r]))
    floor = lengths[len(lengths) // 2] * RAISED_PCT / 100

    # A rank slowest in consecutive steps, by more than the noise of busy times.
    busy_noise = max(floor, NOISE_MADS * median(_mad(st.busy_ns[r]) for r in ranks))
    by_rank: dict[int, list[int]] = {}
    for k, v in enumerate(st.verdicts):
        if v.called and v.margin_ns > busy_noise:
            by_rank.setdefault(v.rank, []).append(k)

    def why(r: int, span: Sequence[int], margin: int) -> str:
        """Where rank r's extra time went in steps `span`, against the other ranks' median."""
        others = [q for q in ranks if q != r]
        parts = []
        for label, col in (("idle outside any span", st.idle_ns), ("work inside spans", work)):
            mine = _known([col[r][k] for k in span])
            theirs = [_known([col[q][k] for q in others]) for k in span]
            if len(mine) != len(span) or not others or not all(theirs):
                continue
            m_mine = sum(mine) / len(mine)
            m_theirs = sum(median(v) for v in theirs) / len(theirs)
            if m_mine - m_theirs > margin / 4:
                text = f"{fmt_ns(m_mine)} {label} a step (the others {fmt_ns(m_theirs)})"
                parts.append((int(m_mine - m_theirs), text))
        lag = _known([st.launch_lag_ns[r][k] for k in span])
        lag_others = _known([x for q in others for k in span for x in [st.launch_lag_ns[q][k]] if x is not None])
        if lag and lag_others and len(lag) == len(span):
            ex = sum(lag) // len(lag) - int(median(lag_others))
            if ex > margin // 4:
                parts.append(
                    (ex, f"launch lag {fmt_ns(sum(lag) / len(lag))} (the others {fmt_ns(median(lag_others))})")
                )
        parts.sort(key=lambda p: -p[0])
        return ", ".join(p[1] for p in parts) if parts else f"{fmt_ns(margin)} more busy time a step than the median"

    said: set[int] = set()
    for r, ks in by_rank.items():
        for a, b in _runs(ks):
            span = range(a, b + 1)
            margin = sum(st.verdicts[k].margin_ns for k in span) // len(span)
            found.append((margin * len(span), f"rank {r} slowest in {_steps_text(st, a, b)}: {why(r, span, margin)}"))
            said.add(r)

    # A rank slowest in most steps (three in four) by margins that vary less than the steps do:
    # the busy times' noise above is the steps', common to every rank, which margins cancel out.
    # What must stand out is the mean margin, against its own noise (over sqrt(n) steps).
    steady: dict[int, list[int]] = {}
    for k, v in enumerate(st.verdicts):
        if v.called and v.margin_ns > floor:
            steady.setdefault(v.rank, []).append(k)
    for r, ks in steady.items():
        if r in said or len(ks) < max(3, (3 * st.count + 3) // 4):
            continue
        margins = [st.verdicts[k].margin_ns for k in ks]
        margin = sum(margins) // len(ks)
        if margin <= NOISE_MADS * _mad(margins) / len(ks) ** 0.5:
            continue
        found.append((margin * len(ks), f"rank {r} slowest in {len(ks)} of {st.count} steps: {why(r, ks, margin)}"))

    # Every rank spending more on one part of the step in consecutive steps.
    transfer_name = _transfer_names(st, co)
    parts_of: list[tuple[dict[int, list[int]] | dict[int, list[int | None]], Callable[[int, int], str]]] = [
        (st.collective_transfer_ns, lambda a, b: f"{transfer_name(a, b)} transfer"),
        (st.collective_wait_ns, lambda a, b: "waiting in collectives"),
        (st.idle_ns, lambda a, b: "idle outside any span"),
        (work, lambda a, b: "work inside spans"),
    ]
    for column, say in parts_of:
        cols = {r: _known(column[r]) for r in ranks}
        if any(len(v) != st.count for v in cols.values()):
            continue  # not known on some rank
        ascending = {r: sorted(v) for r, v in cols.items()}  # one sort a column, for both medians
        base = {r: median(v) for r, v in ascending.items()}
        threshold = max(floor, NOISE_MADS * median(_mad_sorted(v, base[r]) for r, v in ascending.items()))
        # Per step, the least excess over the ranks (whole columns at a time).
        excess = [map(sub, cols[r], repeat(base[r])) for r in ranks]
        least = excess[0] if len(excess) == 1 else map(min, *excess)
        raised = [k for k, x in enumerate(least) if x > threshold]
        for a, b in _runs(raised):
            n = b - a + 1
            if n < 2 and st.count > 2:
                continue  # one step is noise unless it is all there is
            mean = sum(cols[r][k] - base[r] for r in ranks for k in range(a, b + 1)) / (n * len(ranks))
            found.append((int(mean * n), f"every rank: {say(a, b)} +{fmt_ns(mean)} a step in {_steps_text(st, a, b)}"))
    found.sort(key=lambda x: -x[0])
    return list(dict.fromkeys(text for _, text in found))


def _transfer_names(st: Steps, co: Collectives | None) -> Callable[[int, int], str]:
    """The collective whose transfer (end less the last arrival, over ranks) grew most in steps
    a..b against the other steps; "collective" when there is no telling."""

    def name(a: int, b: int) -> str:
        if co is None:
            return "collective"
        inside: dict[str, list[int]] = {}
        outside: dict[str, list[int]] = {}
        lo, hi = st.number(a), st.number(b)
        for o in co.occurrences:
            if o.step is None or len(o.ends) == 0:
                continue
            last = o.arrivals[o.last_rank]
            t = sum(e - max(last, o.arrivals[r]) for r, e in o.ends.items()) // len(o.ends)
            (inside if lo <= o.step <= hi else outside).setdefault(o.name, []).append(t)
        best, grew = "collective", 0.0
        for n, v in inside.items():
            d = sum(v) / len(v) - (median(outside[n]) if n in outside else 0)
            if d > grew:
                best, grew = n, d
        return best

    return name
