"""The live straggler report: every `report_every` steps, who is slow now, in one log line.

Takes: the rank's resolved spans as each flush resolves them (`Reporter.flushed`, called by the
session after it resolves and before it writes), the spans still waiting for the GPU, and the
job's process group. Gives: at the first flush after every N-th step span has closed, one
all_gather of ten integers a rank (the rank's step digest over the window: its median step,
busy and collective-wait time, its own best window) through a gloo side group of its own; then
on every rank the report as a dict (`last_report()`), and on rank 0 one record of the logger
`gputrace.straggler` (INFO): the slowest rank, by how much, and the cause where the spans show
it, with the dict as the record's `gputrace_report` attribute (`extra`). The library never prints.

What the numbers mean (DESIGN.md, "Why a step is slow"): a step's *busy* time is the step minus
its time inside collectives (spans marked `collective=True`, or named like one, as
`stats.WAIT_NAMES` says; a span marked `collective=False` never is). In a synchronous job every
rank's step lasts as long as the slowest rank's work, the others wait in collectives: so the
ranks are compared on busy time where there are collectives, on step time where there are none.
Per rank, over the steps resolved since the last report: the median. *Relative* score: the
fastest rank's median over this rank's (1.0 for the fastest); *individual* score: the rank's own
best window's median over this one's (1.0 when it is as fast as it ever was). A rank is called
the straggler only when its margin over the median rank exceeds `stats.MARGIN_PCT` percent.

Why at a flush and not inside the step span's exit: the span exit is the hot path, and a step's
CUDA times are known only once the GPU has finished it; a flush (once a step, as the API asks)
is where gputrace already does its slow work. The decision to report is made from the step
ordinal alone (the step spans closed on this rank: resolved plus still pending), which is the
same on every rank that ran the same steps and flushes at the same places.

Deadlocks: the all_gather is a collective; a rank that never reaches a report (it ran fewer
steps, or it is stuck) would hold the others in it. So the report runs in a gloo group of its
own, made for it (its collectives never pair with the job's), with a timeout of
`report_timeout` seconds: past it, or when a rank has gone away (gloo fails at once then), the
rank gives one warning, stops reporting, and the job goes on. Each rank sends its step ordinal
and report number, so a report where ranks disagree says so rather than comparing unlike windows.
"""

from __future__ import annotations

import logging
import warnings
from bisect import bisect_left, bisect_right
from datetime import timedelta
from itertools import compress
from typing import Any

from gputrace.errors import GputraceWarning
from gputrace.stats import MARGIN_PCT, WAIT_NAMES, fmt_ns

LOG = logging.getLogger("gputrace.straggler")

#: What each rank sends, in this order (int64 each).
FIELDS = (
    "report",  # the report's number, 1 for the first
    "step",  # step spans closed on the rank (its step ordinal) when it reported
    "steps",  # steps in the window (resolved since the last report)
    "step_ns",  # the window's median step time
    "busy_ns",  # ... busy time (step minus time inside collectives)
    "wait_ns",  # ... time inside collectives
    "collectives",  # 1: the rank has collective spans, so busy and wait mean something
    "best_step_ns",  # the least window median of step time over this rank's reports so far
    "best_busy_ns",  # ... of busy time
    "resolved",  # step spans resolved on the rank so far (the window ends at this ordinal)
)
_NONE = -1  # a median of no steps
# Collective spans kept for steps that have not yet resolved (or a run without step spans).
_MAX_COLLS = 1 << 16


class Reporter:
    """One rank's straggler reports (see the module's docstring). `every`: steps between two
    reports; `step_name`: the step span's name; `timeout_s`: how long a report waits for the
    other ranks. The session makes one when `report_every` is set, and calls `flushed` at each
    flush under its lock."""

    def __init__(self, every: int, step_name: str, timeout_s: int) -> None:
        self.every = every
        self.step_name = step_name
        self.timeout_s = timeout_s
        self.done = 0  # reports made
        self.off = False  # a report failed: no more
        self.last: dict[str, Any] | None = None
        self.resolved = 0  # step spans resolved so far
        self._steps: list[tuple[int, int]] = []  # resolved since the last report: (start, end)
        self._colls: list[tuple[int, int]] = []  # collective spans that may meet those steps
        self._has_colls = False
        self._best = [_NONE, _NONE]  # least window median: step, busy
        self._kinds: list[int] = []  # per name of the store: 1 the step, 2 named like a collective, 0 other
        self._rows: Any = None  # the store's name column last seen, and how far it was read
        self._mark = 0
        self._group: Any = None

    # ---- fed by the session ------------------------------------------------------------------

    def flushed(self, rec: Any) -> None:
        """The flush has resolved what it could into `rec.store`: take in the new rows, and
        report if another `every` step spans have closed."""
        if self.off:
            return
        with rec._lock:
            self._take(rec.store)
            pending = rec.pending
            waiting = sum(1 for s in pending if s.name == self.step_name) if pending else 0
        closed = self.resolved + waiting
        if closed // self.every > self.done:
            # The window's steps: what the GPU has finished, whatever the anchor period left
            # pending (a flush within anchor_every_ms resolves nothing).
            rec.flush(force=True)
            with rec._lock:
                self._take(rec.store)
            self.done = closed // self.every
            self._report(closed)

    def _take(self, store: Any) -> None:
        """The rows resolved since the last call (a store taken or cleared meanwhile starts
        again from its first row)."""
        names = store.name
        if names is not self._rows or len(names) < self._mark:
            self._rows, self._mark = names, 0
        lo, hi = self._mark, len(names)
        self._mark = hi
        if lo == hi:
            return
        kinds = self._kinds
        for n in store.names[len(kinds) :]:
            kinds.append(1 if n == self.step_name else 2 if WAIT_NAMES.search(n) else 0)
        start, end = store.start, store.end
        marked: dict[int, bool] = {}
        args = store.args[lo:hi]
        if args.count(None) != len(args):
            for i in compress(range(lo, hi), args):
                c = store.args[i].get("collective")
                if c is not None:
                    marked[i] = bool(c)
        steps, colls = self._steps, self._colls
        for i in range(lo, hi):
            k = kinds[names[i]]
            if k == 1:
                if start[i] <= end[i]:
                    steps.append((start[i], end[i]))
                    self.resolved += 1
            elif marked.get(i, k == 2):
                colls.append((start[i], end[i]))
                self._has_colls = True
        if len(colls) > _MAX_COLLS:
            del colls[: len(colls) - _MAX_COLLS]

    # ---- one report ----------------------------------------------------------------------------

    def _window(self) -> tuple[int, int, int, int]:
        """This window's steps, medians of step, busy and wait time; then the window is over."""
        steps, self._steps = self._steps, []
        if not steps:
            return 0, _NONE, _NONE, _NONE
        colls = sorted(self._colls)
        us: list[int] = []
        ue: list[int] = []
        for a, b in colls:  # the collectives as disjoint intervals
            if us and a <= ue[-1]:
                ue[-1] = max(ue[-1], b)
            else:
                us.append(a)
                ue.append(b)
        durs, busy, wait = [], [], []
        for a, b in steps:
            w = 0
            for j in range(bisect_right(ue, a), bisect_left(us, b)):
                w += min(ue[j], b) - max(us[j], a)
            durs.append(b - a)
            wait.append(w)
            busy.append(b - a - w)
        last = max(b for _, b in steps)
        self._colls = [c for c in self._colls if c[1] > last]  # what later steps may still meet
        return len(steps), _median(durs), _median(busy), _median(wait)

    def _report(self, closed: int) -> None:
        n, step_ns, busy_ns, wait_ns = self._window()
        for i, v in enumerate((step_ns, busy_ns)):
            if v != _NONE and (self._best[i] == _NONE or v < self._best[i]):
                self._best[i] = v
        mine = [self.done, closed, n, step_ns, busy_ns, wait_ns, int(self._has_colls), *self._best, self.resolved]
        try:
            table, ranks, me = self._gather(mine)
        except Exception as e:  # noqa: BLE001 - a report never costs the user the job
            self.off = True
            why = str(e).splitlines()[0] if str(e) else ""
            warnings.warn(
                f"gputrace's straggler report {self.done} failed ({type(e).__name__}: {why}); "
                "reports are off for the rest of the run (another rank may have run a different number of steps, "
                "or stopped)",
                GputraceWarning,
                stacklevel=2,
            )
            return
        report = build(table, ranks)
        self.last = report
        if me == ranks[0]:
            LOG.info(report["line"], extra={"gputrace_report": report})

    def _gather(self, mine: list[int]) -> tuple[list[list[int]], list[int], int]:
        """Every rank's fields (one all_gather on the report's own gloo group), the ranks in
        order, and this rank. Without torch.distributed: this rank's alone."""
        from gputrace.dist import _dist, rank_info

        dist = _dist()
        if dist is None:
            return [mine], [rank_info().rank], rank_info().rank
        import torch

        if self._group is None:
            # Collective: every rank reaches its first report at the same flush.
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
        ranks = list(range(dist.get_world_size()))
        box = torch.tensor(mine, dtype=torch.int64)
        out = [torch.empty_like(box) for _ in ranks]
        dist.all_gather(out, box, group=self._group)
        return [[int(v) for v in t.tolist()] for t in out], ranks, dist.get_rank()


def build(table: list[list[int]], ranks: list[int]) -> dict[str, Any]:
    """The report from every rank's fields (`table[i]` is rank `ranks[i]`'s, as `FIELDS`
    says): JSON-ready, with its one line under "line"."""
    rows = {r: dict(zip(FIELDS, t)) for r, t in zip(ranks, table)}
    have = [r for r in ranks if rows[r]["steps"] > 0]
    metric = "busy" if any(rows[r]["collectives"] for r in have) else "step"
    key, best = f"{metric}_ns", f"best_{metric}_ns"
    first = rows[ranks[0]]
    report: dict[str, Any] = {
        "report": first["report"],
        "step": first["step"],
        "window": [first["resolved"] - first["steps"], first["resolved"]],
        "metric": metric,
        "ranks": {},
        "slowest": None,
        "cause": None,
        "disagree": None,
    }
    values = {r: rows[r][key] for r in have}
    fastest = min(values.values()) if values else 0
    for r in ranks:
        row = rows[r]
        v = values.get(r)
        report["ranks"][str(r)] = {
            "step": row["step"],
            "steps": row["steps"],
            "step_ns": _opt(row["step_ns"]),
            "busy_ns": _opt(row["busy_ns"]) if row["collectives"] else None,
            "wait_ns": _opt(row["wait_ns"]) if row["collectives"] else None,
            "relative": None if v is None else (round(fastest / v, 4) if v > 0 else 1.0),
            "individual": None if v is None or row[best] == _NONE else (round(row[best] / v, 4) if v > 0 else 1.0),
        }
    if len({(rows[r]["step"], rows[r]["report"]) for r in ranks}) > 1:
        report["disagree"] = {str(r): {"step": rows[r]["step"], "report": rows[r]["report"]} for r in ranks}
    where = _window_words(report["window"], len(ranks))
    if not values:
        report["line"] = f"gputrace: {where}: no step resolved since the last report"
        return report
    slow = max(have, key=lambda r: (values[r], -r))
    med = _median(sorted(values.values()))
    margin = values[slow] - med
    pct = 100.0 * margin / med if med > 0 else 0.0
    called = len(have) > 1 and pct > MARGIN_PCT
    report["slowest"] = {
        "rank": slow,
        "value_ns": values[slow],
        "median_ns": med,
        "by_ns": margin,
        "by_pct": round(pct, 2),
        "fastest_ns": fastest,
        "called": called,
    }
    what = "busy" if metric == "busy" else "step time"
    if not called:
        line = (
            f"gputrace: {where}: no straggler; the slowest, rank {slow}, is within {MARGIN_PCT:g}% of the median "
            f"({what} {fmt_ns(values[slow])} a step, {_signed(margin)})"
        )
    else:
        rel = report["ranks"][str(slow)]["relative"]
        line = (
            f"gputrace: {where}: rank {slow} is slowest: {what} {fmt_ns(values[slow])} a step, "
            f"{_signed(margin)} ({pct:+.0f}%) over the median rank (relative score {rel:.2f})"
        )
        if metric == "busy":
            others = [r for r in have if r != slow]
            waits = sorted(rows[r]["wait_ns"] for r in others if rows[r]["wait_ns"] != _NONE)
            if waits:
                w = _median(waits)
                cause = (
                    f"rank {slow} works {fmt_ns(margin)} a step longer outside collectives than the median rank; "
                    f"the others wait in collectives {fmt_ns(w)} a step"
                )
                report["cause"] = cause
                line += f"; {_rank_words(others)} wait in collectives {fmt_ns(w)} a step"
    if report["disagree"]:
        steps = ", ".join(f"{r}: {rows[r]['step']}" for r in ranks)
        line += f" (ranks at different steps: {steps})"
    report["line"] = line
    return report


def _window_words(window: list[int], n: int) -> str:
    lo, hi = window
    steps = f"step {lo}" if hi - lo == 1 else f"steps {lo}-{hi - 1}"
    return f"{steps} on {n} rank{'s' if n != 1 else ''}"


def _rank_words(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _signed(ns: int) -> str:
    return ("+" if ns >= 0 else "-") + fmt_ns(abs(ns))


def _median(values: list[int]) -> int:
    if not values:
        return _NONE
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) // 2


def _opt(v: int) -> int | None:
    return None if v == _NONE else v
