"""The anchoring math, exactly, against a fake device clock (drift, offset, float32 rounding)."""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import pytest

import gputrace
from gputrace.clock import HostClock

from .conftest import EPOCH, install, spans_of
from .fakes import FakeDevice, f32

MS = 1_000_000


def truth(events: list) -> list[tuple[int, int]]:
    return [(EPOCH + a, EPOCH + b) for a, b, _ in events]


def record_spans(fake: FakeDevice, n: int, work_ns: int, gap_ns: int, flush_every: int = 1) -> list:
    """n spans around `work_ns` of kernels each; returns when each start and end truly ran
    (events go back to the pool once resolved, so the times are copied now)."""
    events = []
    for i in range(n):
        s = gputrace.span("k", i=i).start()
        fake.work(work_ns)
        s.end()
        events.append((s.t0.host_ns, s.t1.host_ns, s.t0.device_ns))
        fake.advance(gap_ns)
        if (i + 1) % flush_every == 0:
            gputrace.flush()
    return events


def resolved(events: list) -> list[tuple[int, int]]:
    spans = sorted(spans_of(gputrace.trace_dict()), key=lambda e: e["args"]["i"])
    return [(e["start"], e["end"]) for e in spans]


def test_host_clock_offset_is_exact_with_a_fake_clock() -> None:
    t = [5_000]
    clock = HostClock(monotonic_ns=lambda: t[0], realtime_ns=lambda: t[0] + EPOCH)
    assert clock.epoch_offset_ns == EPOCH
    assert clock.now() == 5_000 + EPOCH
    shifted = HostClock(monotonic_ns=lambda: t[0], realtime_ns=lambda: t[0] + EPOCH, shift_ns=-3_000_000)
    assert shifted.now() == 5_000 + EPOCH - 3_000_000


def test_exact_nanoseconds_with_drift_and_offset() -> None:
    # 50 ppm drift, a device clock 7 s off the host's; symmetric launch/wake latency makes each
    # anchor exact, and events within a few ms of an anchor survive float32 exactly.
    fake = FakeDevice(rate=Fraction(1_000_050, 1_000_000), offset_ns=7_000_000_123, launch_ns=3_000, wake_ns=3_000)
    install(fake)
    events = record_spans(fake, 20, work_ns=1 * MS + 777, gap_ns=2 * MS)
    got = resolved(events)
    assert got == truth(events)
    durations = [e - s for s, e in got]
    assert all(d == 1 * MS + 777 for d in durations)


def test_interpolation_between_distant_anchors_stays_within_float32_steps() -> None:
    # Spans 0.4 s from the anchors on either side: the only error left is float32's step, once
    # in the offset from the anchor and once in the segment's length.
    fake = FakeDevice(rate=Fraction(1_000_002, 1_000_000), launch_ns=2_000, wake_ns=2_000)
    install(fake)
    events = record_spans(fake, 10, work_ns=5 * MS, gap_ns=400 * MS)
    for (gs, ge), (ts, te) in zip(resolved(events), truth(events)):
        bound = 2 * half_ulp_ns(400)
        assert abs(gs - ts) <= bound and abs(ge - te) <= bound


def half_ulp_ns(ms: float) -> float:
    return 2.0 ** (math.floor(math.log2(ms)) - 23) * MS / 2 + 1


def test_reanchoring_removes_drift_that_a_single_anchor_accumulates() -> None:
    # 2 ppm over a minute is 120 us; an anchor at every flush keeps the error at float32's step.
    fake = FakeDevice(rate=Fraction(1_000_002, 1_000_000), launch_ns=5_000, wake_ns=5_000)
    rec = install(fake)
    events = record_spans(fake, 60, work_ns=2 * MS, gap_ns=1_000 * MS)
    got = resolved(events)
    want = truth(events)
    ours = max(max(abs(g[0] - w[0]), abs(g[1] - w[1])) for g, w in zip(got, want))
    first = rec.timelines[0].anchors[0]
    single = [first.host_ns + round(f32(float(dev - first.event.device_ns) / 1e6) * MS) for _, _, dev in events]
    theirs = max(abs(s - w[0]) for s, w in zip(single, want))
    assert ours <= 2 * half_ulp_ns(1000)  # float32 steps 1 s from an anchor: tens of ns
    assert theirs > 100_000  # what a fixed anchor would have written after a minute


def test_anchor_error_is_within_its_reported_uncertainty() -> None:
    # Launch slower than wake-up: the midpoint is biased, and the bias is inside the error bar.
    fake = FakeDevice(launch_ns=9_000, wake_ns=1_000)
    rec = install(fake)
    events = record_spans(fake, 5, work_ns=MS, gap_ns=MS)
    u = max(a.uncertainty_ns for a in rec.timelines[0].anchors)
    assert u == 5_000
    for (gs, ge), (ts, te) in zip(resolved(events), truth(events)):
        assert abs(gs - ts) <= u and abs(ge - te) <= u
    meta = gputrace.trace_dict()["metadata"]["clock"]["device_anchors"][0]
    assert meta["uncertainty_ns_max"] == 5_000


def test_anchoring_does_not_wait_for_a_busy_compute_stream() -> None:
    fake = FakeDevice(launch_ns=4_000, wake_ns=4_000)
    rec = install(fake, anchor_tries=3)
    with gputrace.span("busy"):
        fake.work(56 * MS)
    t0 = fake.now
    assert gputrace.flush() == 0  # nothing finished: nothing resolved, nothing drained
    assert fake.now - t0 < 100_000 and fake.device_syncs == 0
    assert len(rec.pending) == 1
    fake.advance(60 * MS)
    assert gputrace.flush() == 1
    assert fake.device_syncs == 0


def test_far_from_any_anchor_the_error_is_float32s_step() -> None:
    # No flush for an hour: the span is measured against the anchor taken at flush, an hour
    # away. The error is float32's step there, not drift.
    fake = FakeDevice(rate=Fraction(1_000_002, 1_000_000))
    install(fake)
    events = record_spans(fake, 1, work_ns=MS, gap_ns=3600 * 1000 * MS)
    (gs, ge), (ts, te) = resolved(events)[0], truth(events)[0]
    bound = 2 * half_ulp_ns(3600 * 1000)
    assert abs(gs - ts) <= bound and abs(ge - te) <= bound


def test_events_after_the_newest_anchor_wait_for_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeDevice()
    rec = install(fake)
    with gputrace.span("a"):
        fake.work(MS)
    fake.advance(2 * MS)
    # Pretend the span finished after the anchor that flush takes: it must stay pending.
    done_span = rec.pending[0]
    real_record = fake.record

    def late_anchor(ev, stream):  # type: ignore[no-untyped-def]
        real_record(ev, stream)
        if stream is fake.side_stream(0):
            ev.host_ns = done_span.t1.host_ns - 1
            ev.device_ns = fake.device_time(ev.host_ns)

    monkeypatch.setattr(fake, "record", late_anchor)
    rec._record = late_anchor
    assert gputrace.flush() == 0 and len(rec.pending) == 1
    rec._record = real_record
    assert gputrace.flush() == 1


def test_float32_helper_matches_ieee_single() -> None:
    assert f32(0.1) != 0.1 and abs(f32(0.1) - 0.1) < 1e-8


def test_an_anchor_stops_trying_once_a_round_trip_is_good_enough() -> None:
    from gputrace.clock import take_anchor

    fake = FakeDevice(wake_ns=4_000)
    clock = HostClock(monotonic_ns=fake.monotonic_ns, realtime_ns=lambda: fake.now)
    side = fake.side_stream(0)
    before = fake.syncs
    take_anchor(fake.new_event, fake.record, side, clock, tries=5)
    assert fake.syncs - before == 5  # no bar yet: every try
    before = fake.syncs
    a = take_anchor(fake.new_event, fake.record, side, clock, tries=5, good_ns=3 * 4_000)
    assert fake.syncs - before == 1  # the first try was within the bar
    assert a.uncertainty_ns <= 6_000


def _spans_then_flush(fake: FakeDevice, n: int) -> int:
    for i in range(n):
        with gputrace.span("k", i=i):
            fake.work(MS // 10)
    fake.advance(MS)  # the GPU has finished them
    return gputrace.flush()


def test_a_flush_soon_after_an_anchor_leaves_its_spans_for_the_next_one() -> None:
    fake = FakeDevice()
    rec = install(fake, anchor_every_ms=60_000)  # a minute: every flush below is "soon"
    anchors = len(rec.timelines[0].anchors)
    assert _spans_then_flush(fake, 3) == 3  # the first flush anchors
    assert len(rec.timelines[0].anchors) == anchors + 1
    assert _spans_then_flush(fake, 4) == 0  # anchored moments ago: nothing resolved, no round trip
    assert _spans_then_flush(fake, 2) == 0
    assert len(rec.timelines[0].anchors) == anchors + 1 and len(rec.pending) == 6
    assert rec.flush(wait=True) == 6  # a waiting flush (a save's, a timer's read) resolves all
    assert len(rec.pending) == 0
    # Every span is placed exactly, whichever flush resolved it.
    spans = spans_of(gputrace.trace_dict())
    assert len(spans) == 9 and all(e["end"] - e["start"] == MS // 10 for e in spans)


def test_a_flush_once_the_period_is_over_anchors_and_resolves_again() -> None:
    fake = FakeDevice()  # the period is counted on the recorder's host clock: the fake's here
    rec = install(fake, anchor_every_ms=5)
    anchors = len(rec.timelines[0].anchors)
    assert _spans_then_flush(fake, 2) == 2  # 1 ms after: anchors (the first flush)
    assert _spans_then_flush(fake, 2) == 0  # 1.2 ms after that anchor: too soon
    assert _spans_then_flush(fake, 2) == 0
    assert len(rec.timelines[0].anchors) == anchors + 1
    fake.advance(3 * MS)  # the anchor is now over 5 ms old
    assert _spans_then_flush(fake, 3) == 7 and not rec.pending
    assert len(rec.timelines[0].anchors) == anchors + 2
    assert _spans_then_flush(fake, 1) == 0  # and the period starts again


def test_every_flush_anchors_with_the_period_off_or_while_streaming(tmp_path: Path) -> None:
    for options in ({"anchor_every_ms": 0}, {"anchor_every_ms": 60_000, "out_dir": str(tmp_path)}):
        fake = FakeDevice()
        rec = install(fake, **options)
        for n in (2, 3, 1):
            assert _spans_then_flush(fake, n) == n, options  # a streamed file has what finished at each
        assert not rec.pending
        gputrace.reset()


def test_a_full_pending_list_resolves_within_the_period() -> None:
    fake = FakeDevice()
    rec = install(fake, anchor_every_ms=60_000, max_pending=64)
    assert _spans_then_flush(fake, 1) == 1  # anchored now: plain flushes are "soon" from here on
    for i in range(300):
        with gputrace.span("k", i=i):
            fake.work(1_000)
        fake.advance(1_000)  # each finished before the next: the automatic resolve can place them
    # Resolved by span exits that found the list full, no flush among them: the list stays short.
    assert len(rec.pending) <= 64 and len(rec.store) == 301 - len(rec.pending)
    assert len(spans_of(gputrace.trace_dict())) == 301
