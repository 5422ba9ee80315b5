"""Statistics: per span name, from a trace.

Takes: a Chrome trace dict (one rank's or a merged one). Gives: `NameStats` rows sorted by
total time, and a table for people.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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


def durations_by_name(trace: dict[str, Any]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for ev in trace["traceEvents"]:
        if ev.get("ph") == "X":
            out.setdefault(str(ev.get("name")), []).append(round(float(ev.get("dur", 0)) * 1000))
    return out


def percentile(sorted_values: list[int], q: float) -> int:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_values:
        return 0
    k = max(0, min(len(sorted_values) - 1, -(-len(sorted_values) * q // 100) - 1))
    return sorted_values[int(k)]


def name_stats(durations: dict[str, list[int]]) -> list[NameStats]:
    rows = []
    for name, ds in durations.items():
        ds = sorted(ds)
        total = sum(ds)
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
            )
        )
    return sorted(rows, key=lambda r: (-r.total_ns, r.name))


def fmt_ns(ns: float) -> str:
    if ns >= 1e9:
        return f"{ns / 1e9:.3f} s"
    if ns >= 1e6:
        return f"{ns / 1e6:.3f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.1f} us"
    return f"{ns:.0f} ns"


def table(rows: list[NameStats]) -> str:
    head = ["name", "count", "total", "mean", "p50", "p90", "p99", "max"]
    body = [
        [r.name, str(r.count)] + [fmt_ns(v) for v in (r.total_ns, r.mean_ns, r.p50_ns, r.p90_ns, r.p99_ns, r.max_ns)]
        for r in rows
    ]
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body)]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in [head] + body
    ]
    return "\n".join(lines)
