"""What the viewer says in words, from the statistics and the trace: each rank's busy time against
the other ranks, the worst steps, the phases in which a rank stayed slowest, and warm-up steps
that are outliers.

Takes: a `stats.Steps` (from `gputrace.stats.summarize`, the code behind `gputrace summary`) and,
for naming the span that grew in a phase, the `Trace` it came from. Gives JSON-ready lists for
`data.document`. Nothing here prints or draws; the page only shows these lists.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from itertools import repeat
from operator import add, floordiv, gt, itemgetter, mul, sub
from types import ModuleType
from typing import Any

from gputrace import native, stats, stats_columns
from gputrace.trace.model import Trace

#: Steps shown in the worst-steps list (the same choice as `gputrace summary`: called steps by margin).
WORST = 20
#: A phase: at least this many steps in which the same rank was called slowest, with gaps of at
#: most PHASE_GAP steps between them (one step of noise does not end a phase).
PHASE_MIN = 3
PHASE_GAP = 2
#: The first steps are warm-up when each takes more than WARMUP_FACTOR x the median step time of
#: the rest (on the slowest rank); at most WARMUP_MAX of them, and at most half the steps, are left
#: out, and only from runs of at least WARMUP_MIN_STEPS steps.
WARMUP_FACTOR = 1.5
WARMUP_MAX = 5
WARMUP_MIN_STEPS = 4


_hot: ModuleType | None = None


def _bind(hot: ModuleType | None) -> None:
    global _hot
    _hot = hot if hot is not None and hasattr(hot, "first_others_median") else None


native.on_switch(_bind)


def others_median(busy: Sequence[Sequence[int]]) -> list[list[int]]:
    """Per rank and step: the median busy time of the *other* ranks in that step. With two ranks
    that is the other rank's time, so a rank 49% slower shows +49%, not the half of it a median
    taken over both would leave (the midpoint). One rank: its own time."""
    n = len(busy)
    if n == 0:
        return []
    if n == 1:
        return [list(busy[0])]
    count = min(map(len, busy))
    if _hot is not None and type(busy) is list and all(len(row) == count for row in busy):
        try:
            return _hot.first_others_median(busy, count)  # type: ignore[no-any-return]
        except OverflowError:
            pass  # a time past 64 bits: the twin takes Python's ints
    return _others_median_py(busy)


def _others_median_py(busy: Sequence[Sequence[int]]) -> list[list[int]]:
    """`others_median` of two or more rows (`_hot.first_others_median`, csrc/first.c, is the C
    twin)."""
    n = len(busy)
    m = n - 1  # the others
    cols = [sorted(col) for col in zip(*busy)]
    # Whole rows at a time (C-level maps; 64 ranks x 10k steps stay cheap): a choice between two
    # values by a comparison is the second less the difference times the comparison's 0 or 1.
    if m % 2:
        j = m // 2
        lo = list(map(itemgetter(j), cols))
        hi = list(map(itemgetter(j + 1), cols))
        gap = list(map(sub, hi, lo))
        # Without x, the j-th of the others is v[j] when x sorts after it, else v[j + 1].
        return [list(map(sub, hi, map(mul, gap, map(gt, row, lo)))) for row in busy]
    j = m // 2 - 1
    a = list(map(itemgetter(j), cols))
    b = list(map(itemgetter(j + 1), cols))
    c = list(map(itemgetter(j + 2), cols))
    ab, bc = list(map(sub, b, a)), list(map(sub, c, b))
    out = []
    for row in busy:
        first = map(sub, b, map(mul, ab, map(gt, row, a)))  # a if x > a else b
        second = map(sub, c, map(mul, bc, map(gt, row, b)))  # b if x > b else c
        out.append(list(map(floordiv, map(add, first, second), repeat(2))))
    return out


def warmup_steps(st: stats.Steps) -> tuple[int, float]:
    """How many of the first steps are warm-up outliers (their step time, the slowest rank's,
    above WARMUP_FACTOR x the median of the steps after them), and the first one's factor."""
    if st.count < WARMUP_MIN_STEPS or not st.start_ns:
        return 0, 0.0
    most = min(WARMUP_MAX, st.count // 2)
    # Per step, the longest step time over ranks (whole columns at a time: C-level maps).
    cols = [list(map(sub, st.end_ns[r][: st.count], st.start_ns[r][: st.count])) for r in st.start_ns]
    times = stats_columns.columns(cols, st.count)[0]
    rest = sorted(times[most:])
    med = rest[len(rest) // 2]
    if med <= 0:
        return 0, 0.0
    k = 0
    while k < most and times[k] > WARMUP_FACTOR * med:
        k += 1
    return k, (times[0] / med if k else 0.0)


def worst_steps(st: stats.Steps, limit: int = WORST) -> list[dict[str, Any]]:
    """The steps in which a rank was called slowest, by margin, largest first (as `gputrace
    summary` lists them), with each step's index `k` for the page."""
    called = [(k, v) for k, v in enumerate(st.verdicts[: st.count]) if v.called]
    called.sort(key=lambda kv: (-kv[1].margin_ns, kv[0]))
    return [
        {
            "k": k,
            "step": v.step,
            "rank": v.rank,
            "busy_ns": v.busy_ns,
            "median_ns": v.median_ns,
            "margin_ns": v.margin_ns,
            "margin_pct": v.margin_pct if v.margin_pct != float("inf") else None,
        }
        for k, v in called[:limit]
    ]


def _runs(ks: list[int]) -> list[tuple[int, int]]:
    """Sorted step indices -> [first, last] runs, bridging gaps of at most PHASE_GAP steps."""
    runs: list[tuple[int, int]] = []
    for k in ks:
        if runs and k - runs[-1][1] <= PHASE_GAP + 1:
            runs[-1] = (runs[-1][0], k)
        else:
            runs.append((k, k))
    return runs


def phases(st: stats.Steps, trace: Trace | None = None) -> list[dict[str, Any]]:
    """Per rank, the runs of steps in which it stayed slowest (at least PHASE_MIN called steps),
    with how much busier it was than the other ranks and, when the trace holds the spans, the
    span name whose time grew most: "rank 5: steps 80-119 and 200-214, +24% in backward"."""
    by_rank: dict[int, list[int]] = defaultdict(list)
    for k, v in enumerate(st.verdicts[: st.count]):
        if v.called:
            by_rank[v.rank].append(k)
    found: list[tuple[int, list[tuple[int, int]], list[int]]] = []
    for r, ks in by_rank.items():
        runs = []
        for a, b in _runs(ks):
            inside = [k for k in ks if a <= k <= b]
            if len(inside) >= PHASE_MIN:
                runs.append((a, b))
        if runs:
            found.append((r, runs, [k for a, b in runs for k in range(a, b + 1)]))
    if not found:
        return []
    grown = _grown_names(st, trace, {r: ks for r, _, ks in found}) if trace is not None else {}
    ranks = [r for r in st.ranks if r in st.busy_ns]
    out: list[dict[str, Any]] = []
    for r, runs, ks in found:
        others = [q for q in ranks if q != r]
        mine = sum(st.busy_ns[r][k] for k in ks)
        ref = sum(_median([st.busy_ns[q][k] for q in others]) for k in ks) if others else mine
        pct = 100.0 * (mine - ref) / ref if ref else None
        steps_text = _steps_text([(st.number(a), st.number(b)) for a, b in runs])
        name, name_pct, name_ns = grown.get(r, (None, None, 0))
        if name is not None and name_pct is not None:
            words = f"rank {r}: {steps_text}, {name_pct:+.0f}% in {name}"
        elif pct is not None:
            words = f"rank {r}: {steps_text}, {pct:+.0f}% busy"
        else:
            words = f"rank {r}: {steps_text}"
        out.append(
            {
                "rank": r,
                "runs": [[a, b] for a, b in runs],  # step indices k, inclusive
                "steps": len(ks),
                "busy_pct": pct,
                "name": name,
                "name_pct": name_pct,
                "name_excess_ns": name_ns,
                "words": words,
            }
        )
    out.sort(key=lambda p: (-p["steps"], p["rank"]))
    return out


def _median(v: list[int]) -> int:
    s = sorted(v)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) // 2


def _steps_text(runs: list[tuple[int, int]]) -> str:
    parts = [f"{a}-{b}" if b > a else str(a) for a, b in runs]
    word = "steps" if len(runs) > 1 or runs[0][1] > runs[0][0] else "step"
    if len(parts) == 1:
        return f"{word} {parts[0]}"
    return f"{word} {', '.join(parts[:-1])} and {parts[-1]}"


def _grown_names(
    st: stats.Steps, trace: Trace, wanted: dict[int, list[int]]
) -> dict[int, tuple[str | None, float | None, int]]:
    """Per rank of `wanted`: the span name whose time in the given steps exceeds the other ranks'
    median time of that name the most (its name, the excess in % of the others' time, in ns).
    Names nested in one another share an excess: the most specific one within 80% of the largest
    excess (the least total time) is named, so a slow `block` inside `forward` is called `block`."""
    ranks = [r for r in st.ranks if r in st.start_ns]
    slot = {r: i for i, r in enumerate(ranks)}
    track_rank = trace.track_rank()
    starts = {r: st.start_ns[r][: st.count] for r in ranks}
    ends = {r: st.end_ns[r][: st.count] for r in ranks}
    keep = {k for ks in wanted.values() for k in ks}
    step_name = trace._name_index.get(st.name)
    # (rank slot, step k, name) -> ns inside the step.
    per: dict[tuple[int, int, int], int] = defaultdict(int)
    from bisect import bisect_right

    sp = trace.spans
    for i in range(len(sp)):
        r = track_rank[sp.track[i]]
        if r is None or r not in slot:
            continue
        nm = sp.name[i]
        if nm == step_name:
            continue
        a = sp.start[i]
        k = bisect_right(starts[r], a) - 1
        if k < 0 or k not in keep or a >= ends[r][k]:
            continue
        per[slot[r], k, nm] += min(sp.end[i], ends[r][k]) - a
    names = {nm for (_, _, nm) in per}
    out: dict[int, tuple[str | None, float | None, int]] = {}
    for r, ks in wanted.items():
        if r not in slot:
            continue
        s = slot[r]
        best: list[tuple[int, int, int, int]] = []  # (excess, mine, ref, name)
        for nm in names:
            mine = sum(per.get((s, k, nm), 0) for k in ks)
            ref = sum(_median([per.get((q, k, nm), 0) for q in range(len(ranks)) if q != s]) for k in ks)
            if mine > ref:
                best.append((mine - ref, mine, ref, nm))
        if not best:
            continue
        top = max(b[0] for b in best)
        close = [b for b in best if b[0] >= 0.8 * top]
        excess, mine, ref, nm = min(close, key=lambda b: (b[1], -b[0]))
        out[r] = (trace.names[nm], (100.0 * excess / ref) if ref else None, excess)
    return out
