"""Alignment: how each rank's clock maps onto the reference rank's, as typed values (pure).

Takes: what the ranks measured (the clock syncs each rank's metadata carries: rank 0's time =
ours + offset, +- error, at one of our instants) or what a collective shows (the end of its n-th
occurrence on every rank). Gives: a `RankAlignment` per rank, whose `ClockMap` turns that rank's
epoch ns into the reference timeline's, and the metadata a merged trace records about it.

Why a piecewise-linear map and not one offset: host clocks drift apart (a few ppm, i.e. tens of
microseconds a minute), so syncs taken at two or more times give a line, or a polyline, rather
than a point. Why start and end go through the same map: a map that is monotone (every piece's
slope above -1) keeps `a <= b` as `map(a) <= map(b)`, so spans that nested before still nest
after, to the nanosecond.
"""

from __future__ import annotations

import bisect
import dataclasses
from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gputrace.errors import GputraceError

#: Syncs closer together than this are one measurement (the best of them is kept): a slope
#: between two points a few milliseconds apart would be all noise.
MIN_SYNC_SPACING_NS = 1_000_000_000


@dataclasses.dataclass(frozen=True)
class Sync:
    """One clock measurement: the reference time = this rank's time + `offset_ns` at `at_ns`
    (this rank's epoch ns), within +- `error_ns`."""

    at_ns: int
    offset_ns: int
    error_ns: int


#: Values `ClockMap.column` maps through a Python list at a time.
COLUMN_SLICE = 65536


@dataclasses.dataclass(frozen=True)
class ClockMap:
    """t -> t + offset(t), the offset interpolated linearly between knots (at_ns, offset_ns) and
    extended beyond the first and last knot along the nearest piece. No knots: identity."""

    knots: tuple[tuple[int, int], ...] = ()

    @property
    def constant(self) -> bool:
        return len(self.knots) < 2

    @property
    def offset_ns(self) -> int:
        """The offset at the first knot (the whole offset when constant)."""
        return self.knots[0][1] if self.knots else 0

    @property
    def drift_ppm(self) -> float | None:
        """The mean rate at which the offset changes, from the first knot to the last (ppm)."""
        if self.constant:
            return None
        (a0, o0), (a1, o1) = self.knots[0], self.knots[-1]
        return (o1 - o0) / (a1 - a0) * 1e6

    def _piece(self, t: int) -> tuple[int, int, float]:
        k = self.knots
        i = bisect.bisect_right([a for a, _ in k], t) - 1
        i = min(max(i, 0), len(k) - 2)
        (a0, o0), (a1, o1) = k[i], k[i + 1]
        return a0, o0, (o1 - o0) / (a1 - a0)

    def __call__(self, t: int) -> int:
        if not self.knots:
            return t
        if self.constant:
            return t + self.knots[0][1]
        a, o, slope = self._piece(t)
        return t + o + round(slope * (t - a))

    def column(self, values: Sequence[int]) -> array[int]:
        """The map over a column of times, as a new array('q'). A time mapped past 64 bits of ns
        (a file's base or clock syncs at the edge of the range) raises GputraceError."""
        try:
            return self._column(values)
        except OverflowError:
            raise GputraceError(
                "clock alignment puts times past 64-bit nanoseconds: a base time or clock syncs are out of range"
            ) from None

    def _column(self, values: Sequence[int]) -> array[int]:
        if not self.knots:
            return array("q", values)
        if self.constant:
            return array("q", map(self.knots[0][1].__add__, values))
        k = self.knots
        out = array("q")
        # A slice at a time: a list of Python ints for a whole column of millions would cost
        # ~40 bytes a value beside the 8 of the array.
        if len(k) == 2:
            (a, o), (a1, o1) = k
            slope = (o1 - o) / (a1 - a)
            for lo in range(0, len(values), COLUMN_SLICE):
                out.extend(array("q", [t + o + round(slope * (t - a)) for t in values[lo : lo + COLUMN_SLICE]]))
            return out
        for lo in range(0, len(values), COLUMN_SLICE):
            out.extend(array("q", [self(t) for t in values[lo : lo + COLUMN_SLICE]]))
        return out


@dataclasses.dataclass(frozen=True)
class RankAlignment:
    """How one rank was placed on the common timeline. `device_map`, when the rank's syncs were
    refined on its GPU, places the spans of its CUDA streams (its host spans keep `map`)."""

    rank: int
    map: ClockMap
    error_ns: int
    file: str = ""
    notes: tuple[str, ...] = ()
    device_map: ClockMap | None = None
    device_error_ns: int | None = None
    measured: bool = True  # False: no offset was measured (no clock sync, --align none): error unknown

    @property
    def offset_ns(self) -> int:
        return self.map.offset_ns

    @property
    def drift_ppm(self) -> float | None:
        return self.map.drift_ppm

    def metadata(self) -> dict[str, Any]:
        out: dict[str, Any] = {"offset_ns": self.offset_ns, "error_ns": self.error_ns}
        if self.drift_ppm is not None:
            out["drift_ppm"] = self.drift_ppm
        if self.device_map is not None:
            dev: dict[str, Any] = {"offset_ns": self.device_map.offset_ns, "error_ns": self.device_error_ns}
            if self.device_map.drift_ppm is not None:
                dev["drift_ppm"] = self.device_map.drift_ppm
            out["device"] = dev
        if self.file:
            out["file"] = self.file
        if self.notes:
            out["notes"] = list(self.notes)
        if not self.measured:
            out["measured"] = False  # its error_ns of 0 is no error bar: nothing was measured
        return out

    def with_notes(self, *notes: str) -> RankAlignment:
        return dataclasses.replace(self, notes=self.notes + tuple(notes))


@dataclasses.dataclass(frozen=True)
class Alignment:
    """The alignment applied to a merged trace: the method and each rank's placement."""

    method: str  # "clock", "none", "align-on", or "as merged" (a merged file kept as it was)
    per_rank: Mapping[int, RankAlignment]
    name: str | None = None  # the span aligned on, for "align-on"
    occurrence: int | None = None

    def metadata(self) -> dict[str, Any]:
        out: dict[str, Any] = {"method": self.method}
        if self.name is not None:
            out["name"] = self.name
            out["occurrence"] = self.occurrence
        out["per_rank"] = {r: a.metadata() for r, a in sorted(self.per_rank.items())}
        return out


# ---- from what the ranks measured ----------------------------------------------------------------


def syncs_from_metadata(metadata: Mapping[str, Any], device: bool = False) -> list[Sync]:
    """The clock syncs a rank's metadata carries (`clock.sync_to_rank0`), well-formed ones only,
    in time order; with `device`, the refinements measured on the rank's GPU (each sync's
    `device` entry) instead."""
    clock = metadata.get("clock")
    raw = clock.get("sync_to_rank0") if isinstance(clock, Mapping) else None
    out = []
    for s in raw if isinstance(raw, list) else ():
        if device:
            s = s.get("device") if isinstance(s, Mapping) else None
        if not isinstance(s, Mapping):
            continue
        try:
            out.append(Sync(int(s["at_ns"]), int(s["offset_ns"]), int(s["error_ns"])))
        except (KeyError, TypeError, ValueError):
            continue
    return sorted(out, key=lambda s: s.at_ns)


def from_metadata(rank: int, metadata: Mapping[str, Any], file: str = "") -> RankAlignment:
    """A rank's placement from the syncs its metadata carries: the host map, and the device map
    where the syncs were refined on the GPU."""
    host = from_syncs(rank, syncs_from_metadata(metadata), file)
    dev_syncs = syncs_from_metadata(metadata, device=True)
    if not dev_syncs:
        return host
    dev = from_syncs(rank, dev_syncs)
    if dev.error_ns > host.error_ns:
        # The refinement is bounded by how long a tiny all-reduce takes once the last rank
        # arrives (microseconds); a host offset can be tighter (exact between ranks of one host,
        # or a fast network's round trip). The tighter bound places the device spans.
        return host.with_notes(f"device refinement (+-{dev.error_ns} ns) not tighter than the host offset: not used")
    return dataclasses.replace(
        host,
        device_map=dev.map,
        device_error_ns=dev.error_ns,
        notes=host.notes + tuple(f"device: {n}" for n in dev.notes),
    )


def from_syncs(rank: int, syncs: Iterable[Sync], file: str = "") -> RankAlignment:
    """A rank's map from its clock syncs. One sync (or several within a second): the offset of
    the one with the least error (NTP's rule). Syncs spread over time: a polyline through the
    best sync of each second, so drift between them is followed."""
    best: list[Sync] = []
    for s in sorted(syncs, key=lambda s: s.at_ns):
        if best and s.at_ns - best[-1].at_ns < MIN_SYNC_SPACING_NS:
            if s.error_ns < best[-1].error_ns:
                best[-1] = s
            continue
        best.append(s)
    if not best:
        return RankAlignment(
            rank,
            ClockMap(),
            0,
            file,
            ("no clock sync recorded: host clocks taken as they are (NTP)",),
            measured=False,
        )
    knots = tuple((s.at_ns, s.offset_ns) for s in best)
    notes: tuple[str, ...] = ()
    if len(knots) > 1:
        slopes = [(o1 - o0) / (a1 - a0) for (a0, o0), (a1, o1) in zip(knots, knots[1:])]
        if min(slopes) <= -0.5:
            # Not a clock drifting but a clock stepped (or a bad measurement): a map this steep
            # would fold time back on itself. The best single sync is the honest answer.
            one = min(best, key=lambda s: s.error_ns)
            return RankAlignment(
                rank,
                ClockMap(((one.at_ns, one.offset_ns),)),
                one.error_ns,
                file,
                ("clock syncs disagree by more than drift can explain: the best one is used alone",),
            )
    return RankAlignment(rank, ClockMap(knots), max(s.error_ns for s in best), file, notes)


def from_collective_ends(ends: Mapping[int, int], name: str, occurrence: int) -> dict[int, RankAlignment]:
    """Offsets that put the end of the n-th `name` span of every rank where the lowest rank's
    is (for traces recorded without clock syncs): a collective ends on all ranks together."""
    ref = ends[min(ends)]
    note = f"aligned on the end of {name!r} #{occurrence}"
    return {r: RankAlignment(r, ClockMap(((e, ref - e),)), 0, notes=(note,)) for r, e in ends.items()}


def identity(rank: int, file: str = "", note: str | None = None) -> RankAlignment:
    return RankAlignment(rank, ClockMap(), 0, file, (note,) if note else (), measured=False)
