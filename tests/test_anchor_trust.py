"""An anchor whose round trip a shared GPU stretched (time-slicing: ~1 ms where the others take
microseconds) is not trusted for its host time while trusted anchors are near: its host time comes
from the line through them, so no span near it lands before its host entry. On the fake device
clock, exactly, through both resolve twins."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest

import gputrace
from gputrace import clock, native, record

from .conftest import EPOCH, TWINS, install, spans_of
from .fakes import FakeDevice

MS = 1_000_000
US = 1_000


def run(
    bad_steps: set[int], steps: int = 12, gaps: dict[int, int] | None = None
) -> tuple[list[tuple[int, int]], list[int], list[Any]]:
    """A span of 1 ms of kernels a step, 2 ms apart (or `gaps[step]`), a flush a step; at
    `bad_steps` the flush's anchor runs 1.8 ms after it is recorded (another process holds the
    GPU), and its host wakes 3 us after it ran. Returns each span's error against the truth
    (start, end), each span's start less its host entry (its launch lag), and the anchors."""
    fake = FakeDevice(rate=Fraction(1_000_050, 1_000_000), offset_ns=7_000_000_123, launch_ns=3 * US, wake_ns=3 * US)
    rec = install(fake)
    truth = []
    for step in range(steps):
        s = gputrace.span("k", i=step).start()
        fake.work(1 * MS)
        s.end()
        truth.append((EPOCH + s.t0.host_ns, EPOCH + s.t1.host_ns))
        fake.advance((gaps or {}).get(step, 2 * MS))
        if step in bad_steps:
            fake.launch_ns = 1_800 * US
        gputrace.flush()
        fake.launch_ns = 3 * US
    spans = sorted(spans_of(gputrace.trace_dict()), key=lambda e: e["args"]["i"])
    errors = [(e["start"] - ts, e["end"] - te) for e, (ts, te) in zip(spans, truth)]
    order = [rec.store.start.index(e["start"]) for e in spans]
    lags = [rec.store.start[j] - rec.store.entry[j] for j in order]
    return errors, lags, list(rec.timelines[0].anchors)


@pytest.mark.parametrize("c", TWINS)
def test_a_stretched_anchor_takes_its_host_time_from_the_trusted_ones(c: bool, twins_restored: None) -> None:
    native.use(c)
    errors, lags, anchors = run({5, 6})
    bad = [a for a in anchors if a.measured_uncertainty_ns]
    assert len(bad) == 2 and all(a.measured_uncertainty_ns > 800 * US for a in bad)
    assert all(a.uncertainty_ns < 10 * US for a in anchors)  # what the map's anchors are now good to
    # 50 ppm of drift over a few ms between anchors, and float32: well under a microsecond.
    assert max(abs(x) for pair in errors for x in pair) < 1 * US, errors
    assert min(lags) > 0  # every span starts after its host entry


def test_trusting_every_anchor_puts_spans_a_millisecond_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same run with every anchor trusted (the map before): the spans beside the stretched
    anchors are off by up to half its round trip, some before the moment they truly started."""
    monkeypatch.setattr(clock, "TRUST_FACTOR", 10**9)
    monkeypatch.setattr(clock, "TRUSTED_NS", 10**12)
    errors, lags, anchors = run({5, 6})
    assert not any(a.measured_uncertainty_ns for a in anchors)
    assert max(abs(x) for pair in errors for x in pair) > 500 * US
    assert min(lags) < 0  # a span placed before its own host entry: a negative launch lag


def test_with_no_trusted_anchor_near_the_measurement_stands() -> None:
    """The trusted anchors a few ms apart, then an hour to the stretched one: the line through
    them could be off there by more than the measurement (the clocks' drift bound over an hour),
    so the measured host time is kept."""
    errors, _, anchors = run({2}, steps=3, gaps={2: 3600 * 1000 * MS})
    assert not any(a.measured_uncertainty_ns for a in anchors)
    assert max(a.uncertainty_ns for a in anchors) > 800 * US


def test_the_recorder_measures_anchors_as_before_when_all_are_good() -> None:
    errors, _, anchors = run(set())
    assert all(e == (0, 0) for e in errors) and not any(a.measured_uncertainty_ns for a in anchors)
    assert record.ACTIVE is not None and len(anchors) == 13
