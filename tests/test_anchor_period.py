"""What reads the recorder in the process (timers, a timer's reset, the live straggler report)
sees what has finished whatever the anchor period (`anchor_every_ms`) left pending: each test runs
with every flush anchoring (0) and with a period longer than the test (60 s stands for steps
shorter than the period: sub-millisecond steps at the 5 ms default)."""

from __future__ import annotations

import pytest

import gputrace
from gputrace import session

from .conftest import install
from .fakes import FakeDevice

MS = 1_000_000
PERIODS = [0, 60_000]


def _anchored(every: float) -> FakeDevice:
    """A fake device's recorder with the period `every`, one span resolved and an anchor just taken."""
    fake = FakeDevice()
    install(fake, anchor_every_ms=every)
    with gputrace.span("warm"):
        fake.work(MS)
    fake.advance(2 * MS)
    gputrace.flush()  # anchors
    return fake


@pytest.mark.parametrize("every", PERIODS)
def test_a_cpu_timer_read_after_a_flush_does_not_drain_the_gpu(every: float) -> None:
    fake = _anchored(every)
    for _ in range(3):
        with gputrace.timer("data", "cpu"):
            fake.advance(100_000)
        fake.work(50 * MS)  # the step's kernels: the GPU runs 50 ms ahead of the host
        gputrace.flush()
        before = fake.device_syncs
        assert gputrace.timer("data").elapsed > 0
        assert fake.device_syncs == before, "reading a CPU timer after flush() drained the GPU"


@pytest.mark.parametrize("every", PERIODS)
def test_a_timer_reset_forgets_the_calls_before_it(every: float) -> None:
    fake = _anchored(every)
    t = gputrace.timer("data", "cpu")
    with t:
        fake.advance(7 * MS)  # a slow first call
    gputrace.flush()
    t.reset()  # e.g. a new epoch / logging window
    with t:
        fake.advance(1 * MS)
    gputrace.flush()
    assert t.call_count == 1
    assert t.total_time == pytest.approx(0.001, rel=0.01), "the call before reset() leaked into the totals"


@pytest.mark.parametrize("every", PERIODS)
def test_each_straggler_report_covers_the_steps_of_its_window(every: float) -> None:
    fake = FakeDevice()
    install(fake, anchor_every_ms=every, report_every=2)
    session.SESSION._set_reporter(session.SESSION.config)
    lines = []
    for _ in range(6):
        with gputrace.span("step"):
            fake.work(MS // 2)
        fake.advance(MS)  # the GPU has finished the step by its flush
        gputrace.flush()
        rep = gputrace.last_report()
        if rep is not None and (not lines or lines[-1] != rep["line"]):
            lines.append(rep["line"])
            assert rep["ranks"]["0"]["steps"] == 2, rep["line"]
    assert len(lines) == 3
