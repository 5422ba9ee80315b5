"""Statistics: per span name and per rank, from one or more traces.

Takes: Chrome trace dicts (per-rank files or one merged file; a span's rank is its pid - 1,
gputrace's convention). Gives: `NameStats` rows sorted by total time, with each name's least
and largest per-rank totals and their imbalance; `StepStats` naming the slowest rank of each
step; and tables for people.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from gputrace.traceio import us_to_ns


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
    ranks: int
    min_rank: int  # the rank with the least total of this name
    min_rank_total_ns: int
    max_rank: int
    max_rank_total_ns: int
    imbalance: float  # largest per-rank total / least


# Spans whose time is waiting for other ranks, not work: a straggler's peers spend its extra
# time in them, so a step's length alone cannot tell who was slow.
WAIT_NAMES = re.compile(
    r"all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|broadcast|barrier|wait|nccl|gloo", re.IGNORECASE
)


@dataclass(frozen=True)
class StepStats:
    """The slowest rank of each step: the one that worked longest before it waited (step time
    minus time inside collective/wait spans), since collectives make every rank's step end
    together."""

    name: str
    steps: int  # steps seen on every rank
    slowest: list[tuple[int, int, int]]  # per step: (step index, slowest rank, its busy ns)
    times_slowest: dict[int, int]  # rank -> how many steps it was slowest in


def spans_by_rank(traces: list[dict[str, Any]]) -> dict[int, dict[str, list[tuple[int, int]]]]:
    """rank -> name -> [(start ns relative to the trace's base, duration ns)] in start order."""
    out: dict[int, dict[str, list[tuple[int, int]]]] = {}
    for trace in traces:
        base = trace.get("baseTimeNanoseconds", 0) if isinstance(trace.get("baseTimeNanoseconds"), int) else 0
        for ev in trace["traceEvents"]:
            if not isinstance(ev, dict) or ev.get("ph") != "X":
                continue
            pid = ev.get("pid", 1)
            rank = pid - 1 if isinstance(pid, int) and pid > 0 else 0
            start = base + us_to_ns(ev.get("ts", 0))
            out.setdefault(rank, {}).setdefault(str(ev.get("name")), []).append((start, us_to_ns(ev.get("dur", 0))))
    for names in out.values():
        for spans in names.values():
            spans.sort()
    return out


def percentile(sorted_values: list[int], q: float) -> int:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_values:
        return 0
    k = max(0, min(len(sorted_values) - 1, -(-len(sorted_values) * q // 100) - 1))
    return sorted_values[int(k)]


def name_stats(by_rank: dict[int, dict[str, list[tuple[int, int]]]]) -> list[NameStats]:
    names = sorted({n for names in by_rank.values() for n in names})
    rows = []
    for name in names:
        totals = {r: sum(d for _, d in by_rank[r].get(name, ())) for r in by_rank if name in by_rank[r]}
        ds = sorted(d for r in by_rank for _, d in by_rank[r].get(name, ()))
        total = sum(ds)
        lo = min(totals, key=lambda r: (totals[r], r))
        hi = max(totals, key=lambda r: (totals[r], -r))
        rows.append(
            NameStats(
                name,
                len(ds),
                total,
                total / len(ds),
                percentile(ds, 50),
                percentile(ds, 90),
                percentile(ds, 99),
                ds[-1],
                len(totals),
                lo,
                totals[lo],
                hi,
                totals[hi],
                totals[hi] / totals[lo] if totals[lo] else float("inf") if totals[hi] else 1.0,
            )
        )
    return sorted(rows, key=lambda r: (-r.total_ns, r.name))


def busy_ns(start: int, dur: int, waits: list[tuple[int, int]]) -> int:
    """`dur` minus the union of the wait intervals (sorted by start) inside [start, start+dur)."""
    end, covered, reach = start + dur, 0, start
    for ws, wd in waits:
        if ws >= end:
            break
        a, b = max(ws, reach), min(ws + wd, end)
        if b > a:
            covered += b - a
            reach = b
    return dur - covered


def step_stats(
    by_rank: dict[int, dict[str, list[tuple[int, int]]]], step: str = "step", wait: re.Pattern[str] = WAIT_NAMES
) -> StepStats | None:
    """The k-th `step` span of each rank is step k; None when no rank has any."""
    per_rank = {r: names[step] for r, names in by_rank.items() if step in names}
    if not per_rank:
        return None
    waits = {
        r: sorted(x for name, spans in by_rank[r].items() if name != step and wait.search(name) for x in spans)
        for r in per_rank
    }
    n = min(len(v) for v in per_rank.values())
    slowest = []
    for k in range(n):
        busy = {r: busy_ns(*per_rank[r][k], waits[r]) for r in per_rank}
        rank = max(busy, key=lambda r: (busy[r], -r))
        slowest.append((k, rank, busy[rank]))
    counts = Counter(r for _, r, _ in slowest)
    return StepStats(step, n, slowest, {r: counts.get(r, 0) for r in sorted(per_rank)})


def fmt_ns(ns: float) -> str:
    if ns >= 1e9:
        return f"{ns / 1e9:.3f} s"
    if ns >= 1e6:
        return f"{ns / 1e6:.3f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.1f} us"
    return f"{ns:.0f} ns"


def _grid(head: list[str], body: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body)]
    return "\n".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in [head] + body
    )


def table(rows: list[NameStats], steps: StepStats | None = None) -> str:
    multi = any(r.ranks > 1 for r in rows)
    head = ["name", "count", "total", "mean", "p50", "p90", "p99", "max"]
    if multi:
        head += ["least rank total", "largest rank total", "imbalance"]
    body = []
    for r in rows:
        line = [r.name, str(r.count)] + [
            fmt_ns(v) for v in (r.total_ns, r.mean_ns, r.p50_ns, r.p90_ns, r.p99_ns, r.max_ns)
        ]
        if multi:
            line += [
                f"{fmt_ns(r.min_rank_total_ns)} (r{r.min_rank})",
                f"{fmt_ns(r.max_rank_total_ns)} (r{r.max_rank})",
                f"{r.imbalance:.2f}x",
            ]
        body.append(line)
    text = _grid(head, body)
    if steps is not None and len(steps.times_slowest) > 1:
        worst = max(steps.times_slowest, key=lambda r: (steps.times_slowest[r], -r))
        text += (
            f"\n\nslowest rank per {steps.name!r} (longest work before waiting in collectives; {steps.steps} steps): "
            + ", ".join(f"rank {r}: {c}x" for r, c in sorted(steps.times_slowest.items()))
            + f"; rank {worst} was slowest most often"
        )
    return text


def to_json(rows: list[NameStats], steps: StepStats | None) -> dict[str, Any]:
    return {"names": [asdict(r) for r in rows], "steps": asdict(steps) if steps is not None else None}
