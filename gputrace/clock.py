"""Clocks: host time in epoch nanoseconds, and the map from device events to it.

Takes: a host clock (monotonic inside, one realtime offset measured once), and reference
events recorded on an idle side stream of each device, with the host clock read around each.
Gives: `Anchor`s and `DeviceTimeline.locate()` / `.to_host_ns()`, a piecewise-linear map from a
device event to epoch nanoseconds between consecutive anchors.

Why this shape:
- `elapsed_time` is float32 milliseconds: its step is ~60 ns one second from the reference and
  ~0.25 ms an hour away. So every event is measured against the anchors on either side of it,
  never against one global reference.
- Device and host clocks drift (~2 ppm). Interpolating linearly between the two anchors that
  bracket an event keeps its error within the larger of their two uncertainties, however far
  apart they are; an offset from a single anchor grows with the distance.
- A reference event on an idle side stream runs at once even while the compute stream is busy,
  so anchoring blocks the host for a round trip (microseconds) and never drains the GPU.
- An anchor's device time is exact; only its host time is uncertain (half its round trip). When
  processes share a GPU, time-slicing can stretch a round trip to a millisecond or more, which
  would put the spans near that anchor up to that far off (before their own host entry). Such an
  anchor's host time is taken from the line through the good anchors before it, where that line
  is clearly more certain there (`DeviceTimeline.add`): both resolve twins read the anchors.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

NS_PER_MS = 1_000_000

# An anchor is trusted for its host time when its uncertainty is at most this many times the least
# of the last TRUST_WINDOW trusted ones, or at most TRUSTED_NS (a few round trips on a busy VM).
TRUST_FACTOR = 8
TRUSTED_NS = 100_000
TRUST_WINDOW = 64
# Host ns per device ns by which the two clocks may differ (clock drift is ~1-50 ppm), used while
# the trusted anchors span less than SLOPE_BASELINE_MS: their own measured slope is then noisier.
DRIFT_BOUND = 1e-4
SLOPE_BASELINE_MS = 1_000.0


class HostClock:
    """CLOCK_MONOTONIC inside the process, so NTP steps cannot tear a timeline; epoch ns outside
    through one realtime-minus-monotonic offset, so ranks on different hosts land near each other.

    `shift_ns` is a test seam: it moves this process's epoch by a known amount, as a host whose
    clock is off would."""

    def __init__(
        self,
        monotonic_ns: Callable[[], int] = time.monotonic_ns,
        realtime_ns: Callable[[], int] = time.time_ns,
        shift_ns: int = 0,
    ) -> None:
        self.monotonic_ns = monotonic_ns
        self.realtime_ns = realtime_ns
        self.shift_ns = shift_ns
        self.epoch_offset_ns = self._measure_offset() + shift_ns

    def _measure_offset(self, tries: int = 7) -> int:
        best: tuple[int, int] | None = None
        for _ in range(tries):
            m0 = self.monotonic_ns()
            r = self.realtime_ns()
            m1 = self.monotonic_ns()
            if best is None or m1 - m0 < best[0]:
                best = (m1 - m0, r - (m0 + m1) // 2)
        assert best is not None
        return best[1]

    def now(self) -> int:
        """Epoch nanoseconds, from the monotonic clock."""
        return self.monotonic_ns() + self.epoch_offset_ns

    def to_epoch(self, monotonic: int) -> int:
        return monotonic + self.epoch_offset_ns


@dataclasses.dataclass(frozen=True)
class Anchor:
    """A reference event and the host time (epoch ns) at which it ran, +- `uncertainty_ns`."""

    event: Any
    host_ns: int
    uncertainty_ns: int
    # Non-zero where the measured host time was too uncertain and was replaced by the line through
    # the trusted anchors before it (`DeviceTimeline.add`): the measurement's own uncertainty.
    measured_uncertainty_ns: int = 0


def take_anchor(
    new_event: Callable[[], Any],
    record: Callable[[Any, Any], None],
    side_stream: Any,
    clock: HostClock,
    tries: int,
    release: Callable[[Any], None] = lambda ev: None,
    wait: Callable[[Any], None] = lambda ev: ev.synchronize(),
    good_ns: int = 0,
) -> Anchor:
    """Record a reference event on an idle side stream and wait for it, up to `tries` times; keep
    the try with the least round trip. The event ran between the two host readings, so the
    midpoint is off by at most half the round trip. A try whose round trip is within `good_ns`
    ends the search: more tries would cost the host more than they could gain."""
    best: tuple[int, int, Any] | None = None
    for _ in range(max(1, tries)):
        if best is not None and best[1] - best[0] <= good_ns:
            break
        ev = new_event()
        t0 = clock.monotonic_ns()
        record(ev, side_stream)
        wait(ev)
        t1 = clock.monotonic_ns()
        if best is None or t1 - t0 < best[1] - best[0]:
            if best is not None:
                release(best[2])
            best = (t0, t1, ev)
        else:
            release(ev)
    assert best is not None
    t0, t1, ev = best
    return Anchor(ev, clock.to_epoch((t0 + t1) // 2), (t1 - t0 + 1) // 2)


class DeviceTimeline:
    """The anchors of one device, in the order they were taken, and the map between them.

    An event enqueued after anchor k-1 was taken runs after it; `locate` walks forward from
    there to the first anchor at or after the event. Events after the newest anchor wait for
    the next one, so every mapped event is interpolated, never extrapolated."""

    def __init__(self, elapsed: Callable[[Any, Any], float] | None = None) -> None:
        # elapsed(a, b): ms from event a to event b (the device's raw call where it has one).
        self._elapsed = elapsed or _elapsed_method
        self.anchors: list[Anchor] = []
        self.segment_ms: list[float] = []  # segment_ms[k] = elapsed(anchor k-1, anchor k); [0] unused
        self.device_ms: list[float] = []  # each anchor's device time after the first's (sums of segments)
        self._trusted: list[int] = []  # the anchors whose measured host times are kept and trusted

    def add(self, anchor: Anchor) -> int:
        """Append an anchor (its host time settled by `settle`); returns its index."""
        k = len(self.anchors)
        if self.anchors:
            seg = self._elapsed(self.anchors[-1].event, anchor.event)
            self.segment_ms.append(seg)
            self.device_ms.append(self.device_ms[-1] + seg)
        else:
            self.segment_ms.append(0.0)
            self.device_ms.append(0.0)
        self.anchors.append(self.settle(k, anchor))
        return k

    def settle(self, k: int, anchor: Anchor) -> Anchor:
        """Anchor k as the map should use it. A trusted one (its uncertainty near the least seen)
        as measured. Otherwise its host time from the line through the trusted anchors before it,
        where that line's own uncertainty there is under half the measurement's (the trusted
        anchors are near), kept inside the measured round trip (the event ran within it); else
        as measured, and not trusted as a reference for later ones."""
        trusted = self._trusted
        u = anchor.uncertainty_ns
        if not trusted or u <= TRUSTED_NS or u <= self._trusted_ns():  # the first test settles nearly all
            trusted.append(k)
            return anchor
        last = self.anchors[trusted[-1]]
        gap_ns = (self.device_ms[k] - self.device_ms[trusted[-1]]) * NS_PER_MS
        slope, slope_err = self._slope()
        unc = last.uncertainty_ns + math.ceil(gap_ns * slope_err)
        if not (gap_ns > 0 and 2 * unc <= anchor.uncertainty_ns):
            return anchor  # no trusted anchor near enough: the measurement is the best there is
        lo, hi = anchor.host_ns - anchor.uncertainty_ns, anchor.host_ns + anchor.uncertainty_ns
        host = min(max(last.host_ns + round(gap_ns * slope), lo), hi)
        return Anchor(anchor.event, host, unc, anchor.uncertainty_ns)

    def _trusted_ns(self) -> int:
        least = min(self.anchors[i].uncertainty_ns for i in self._trusted[-TRUST_WINDOW:])
        return max(TRUST_FACTOR * least, TRUSTED_NS)

    def _slope(self) -> tuple[float, float]:
        """Host ns per device ns through the trusted anchors (the oldest of the recent window and
        the newest), and the bound on its error; 1 and DRIFT_BOUND over a short baseline."""
        first = self._trusted[max(0, len(self._trusted) - TRUST_WINDOW)]
        last = self._trusted[-1]
        base_ns = (self.device_ms[last] - self.device_ms[first]) * NS_PER_MS
        if base_ns < SLOPE_BASELINE_MS * NS_PER_MS:
            return 1.0, DRIFT_BOUND
        a, b = self.anchors[first], self.anchors[last]
        return (b.host_ns - a.host_ns) / base_ns, (a.uncertainty_ns + b.uncertainty_ns) / base_ns

    def locate(self, event: Any, first: int) -> tuple[int, float] | None:
        """(k, d): the first anchor k >= `first` with the event at or before it, and the event's
        offset from it in float32 ms (d <= 0). None while the event is after the newest anchor."""
        k = max(first, 0)
        anchors = self.anchors
        elapsed = self._elapsed
        while k < len(anchors):
            d = elapsed(anchors[k].event, event)
            if d <= 0.0:
                return k, d
            k += 1
        return None

    def to_host_ns(self, k: int, d_ms: float) -> int:
        return interpolate(self.anchors, self.segment_ms, k, d_ms)


def _elapsed_method(a: Any, b: Any) -> float:
    return float(a.elapsed_time(b))


def interpolate(anchors: list[Anchor], segment_ms: list[float], k: int, d_ms: float) -> int:
    """Host epoch ns of an event `d_ms` (<= 0) from anchor k, on the line through anchors k-1
    and k: host(k) + d * (host(k) - host(k-1)) / gpu(k - (k-1)). Before the first anchor the
    slope is 1."""
    h1 = anchors[k].host_ns
    if k == 0 or segment_ms[k] <= 0.0:
        return h1 + round(d_ms * NS_PER_MS)
    h0 = anchors[k - 1].host_ns
    gpu_ns = segment_ms[k] * NS_PER_MS
    return h1 + round(d_ms * NS_PER_MS * (h1 - h0) / gpu_ns)
