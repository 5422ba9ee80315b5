"""Merge's selections: which ranks, steps and time window to keep.

Takes: what a user asks for, as values (`Selection.make`) or as the CLI's text (`parse_ranks`
"0-3,7", `parse_steps` "10:20", `parse_window` "2s:3.5s"). Gives: a checked, immutable
`Selection` (its absolute window once the merged trace's start is known, and its record for the
merged metadata), and after placement, the checks of what the step selection found
(`step_notes`). Every bad selection is a `MergeError` that says how to write it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any

from gputrace.errors import MergeError

#: Window bounds at or above this are epoch ns (1973 onwards); smaller ones are ns after the
#: merged trace's start.
EPOCH_MIN_NS = 10**17


@dataclasses.dataclass(frozen=True)
class Selection:
    """What to keep: `ranks` (None: all), `steps` ([first, stop) indices of each rank's
    `step_name` spans, either end open), `window` ([t0, t1) ns; a bound >= EPOCH_MIN_NS is an
    epoch time, a smaller one is relative to the merged trace's start)."""

    ranks: frozenset[int] | None = None
    steps: tuple[int | None, int | None] | None = None
    window: tuple[int | None, int | None] | None = None
    step_name: str = "step"

    @classmethod
    def make(
        cls,
        ranks: Iterable[int] | None = None,
        steps: range | tuple[int | None, int | None] | int | None = None,
        window: tuple[int | None, int | None] | None = None,
        step_name: str = "step",
    ) -> Selection:
        bounds: tuple[int | None, int | None] | None
        if isinstance(steps, range):
            if steps.step != 1:
                raise MergeError("steps: a range with step 1 (every step from first to last)")
            bounds = (steps.start, steps.stop)
        elif isinstance(steps, int):
            bounds = (steps, steps + 1)
        else:
            bounds = steps
        if bounds is not None:
            a, b = bounds
            if (a is not None and a < 0) or (b is not None and b < 0):
                raise MergeError("steps: indices count from 0 (the first step is 0)")
            if a is not None and b is not None and b <= a:
                raise MergeError(f"steps {a}:{b} select nothing: the end is exclusive (e.g. {a}:{a + 1})")
        if window is not None:
            lo, hi = window
            if lo is not None and hi is not None and (lo >= EPOCH_MIN_NS) == (hi >= EPOCH_MIN_NS) and hi <= lo:
                raise MergeError(f"window {lo}:{hi} selects nothing: its end is not after its start")
        return cls(frozenset(ranks) if ranks is not None else None, bounds, window, step_name)

    @property
    def by_time(self) -> bool:
        return self.steps is not None or self.window is not None

    def absolute(self, start_ns: int) -> tuple[int | None, int | None] | None:
        if self.window is None:
            return None
        return tuple(None if t is None else t if t >= EPOCH_MIN_NS else start_ns + t for t in self.window)  # type: ignore[return-value]

    def metadata(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.ranks is not None:
            out["ranks"] = sorted(self.ranks)
        if self.steps is not None:
            out["steps"] = list(self.steps)
            out["step_name"] = self.step_name
        if self.window is not None:
            out["window_ns"] = list(self.window)
        return out


def parse_ranks(text: str) -> frozenset[int]:
    """ "0-3,7" -> {0, 1, 2, 3, 7}."""
    out: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if m is None:
            raise MergeError(f"--ranks {text!r}: use ranks and ranges such as 0-3,7")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise MergeError(f"--ranks {text!r}: the range {part} runs backwards")
        out.update(range(lo, hi + 1))
    if not out:
        raise MergeError(f"--ranks {text!r}: no ranks in it")
    return frozenset(out)


def parse_steps(text: str) -> tuple[int | None, int | None]:
    """ "A:B" (B exclusive; either may be left out) or "N" (that step alone)."""
    m = re.fullmatch(r"\s*(\d*)\s*(:?)\s*(\d*)\s*", text)
    if m is None or (not m.group(2) and not m.group(1)):
        raise MergeError(f"--steps {text!r}: use FIRST:STOP (stop exclusive, e.g. 10:20) or one step index")
    a = int(m.group(1)) if m.group(1) else None
    if not m.group(2):
        return (a, a + 1) if a is not None else (None, None)
    return a, int(m.group(3)) if m.group(3) else None


_UNITS = {"ns": 1, "us": 1_000, "ms": 1_000_000, "s": 1_000_000_000}


def parse_window(text: str) -> tuple[int | None, int | None]:
    """ "T0:T1" with units (ns, us, ms, s; plain numbers are ns): "2s:3.5s" is relative to the
    trace's start, an epoch time in ns is absolute."""

    def one(part: str) -> int | None:
        part = part.strip()
        if not part:
            return None
        m = re.fullmatch(r"(\d+(?:\.\d*)?)(ns|us|ms|s)?", part)
        if m is None:
            raise MergeError(f"--window {text!r}: use T0:T1 with units ns, us, ms or s (e.g. 2s:3.5s)")
        unit = _UNITS[m.group(2) or "ns"]
        num = m.group(1)
        if "." in num:
            whole, frac = num.split(".")
            frac = (frac + "000000000")[:9]
            return int(whole or 0) * unit + int(frac) * unit // 1_000_000_000
        return int(num) * unit

    if ":" not in text:
        raise MergeError(f"--window {text!r}: use T0:T1 (either may be left out)")
    lo, hi = text.split(":", 1)
    return one(lo), one(hi)


def format_ranks(ranks: Iterable[int]) -> str:
    """{0, 1, 2, 3, 7} -> "0-3,7" (the inverse of `parse_ranks`, for messages)."""
    rs = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(parts)


def step_notes(sel: Selection, found: dict[int, int], names: set[str], any_steps: bool) -> list[str]:
    """What a step selection found, checked once every rank was placed: `found` (rank -> its
    step spans), `names` (span names seen where no step span was). Nothing found at all is a
    `MergeError`; ranks too short for it are a note."""
    notes: list[str] = []
    if sel.steps is None:
        return notes
    if not any_steps:
        shown = ", ".join(sorted(names)[:12]) + (", ..." if len(names) > 12 else "")
        raise MergeError(
            f"--steps: no span is named {sel.step_name!r} in these traces; name the step span with --step"
            + (f" (spans there: {shown})" if names else "")
        )
    a, b = sel.steps
    short = sorted(r for r, k in found.items() if k <= (a or 0))
    if short and len(short) == len(found):
        raise MergeError(
            f"--steps {a}:{'' if b is None else b}: no rank has that many {sel.step_name!r} spans "
            f"(most: {max(found.values())})"
        )
    if short:
        notes.append(f"ranks {format_ranks(short)} have no {sel.step_name!r} step {a or 0}: left out")
    return notes
