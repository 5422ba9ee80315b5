"""The host entry time of CUDA spans (`trace.spans.entry`): one host clock read at enter, on the
host spans' clock and epoch, carried through resolve into the trace the session builds; exact on
the fake device clock, through both twins."""

from __future__ import annotations

from typing import Any

import pytest

import gputrace
from gputrace import native, record, session

from .conftest import TWINS, install
from .fakes import FakeDevice

pytestmark = pytest.mark.usefixtures("twins_restored")


def record_steps(fake: FakeDevice, steps: int = 6) -> tuple[list[int], Any]:
    """Steps whose device span is entered while the stream is busy with the previous step's work:
    the host runs ahead of the GPU, so each start lies after its entry by the queue. Returns the
    host moments (monotonic ns) at which each device span was entered, and the trace."""
    entered = []
    for step in range(steps):
        fake.advance(10_000)
        entered.append(fake.now)
        with gputrace.span("step", step=step):  # a device span
            fake.work(300_000)
            with gputrace.span("host", timer_type="cpu"):
                fake.advance(5_000)
    return entered, session.trace()


def columns(trace: Any, name: str) -> list[tuple[int, int, int]]:
    sp, i = trace.spans, trace.names.index(name)
    assert sp.entry is not None and len(sp.entry) == len(sp.start)
    return [(sp.entry[k], sp.start[k], sp.end[k]) for k in range(len(sp.start)) if sp.name[k] == i]


@pytest.mark.parametrize("c", TWINS)
def test_a_cuda_span_carries_the_host_moment_it_was_entered(c: bool) -> None:
    with native.using(c):
        fake = FakeDevice(rate=1.000002, read_ns=0)
        rec = install(fake)
        entered, trace = record_steps(fake)
        offset = rec.clock.epoch_offset_ns
        rows = columns(trace, "step")
        assert [e for e, _, _ in rows] == [t + offset for t in entered]  # exactly, in epoch ns
        for k, (entry, start, _) in enumerate(rows):
            assert entry <= start
            if k > 0:  # queued behind the previous step's 300 us: the launch lag shows
                assert start - entry > 200_000
        assert all(e == 0 for e, _, _ in columns(trace, "host"))  # a host span: not known, 0


@pytest.mark.parametrize("c", TWINS)
def test_entry_survives_flushes_a_take_and_an_open_span(c: bool) -> None:
    with native.using(c):
        fake = FakeDevice(read_ns=3)
        rec = install(fake)
        for _ in range(3):
            with gputrace.span("a"):
                fake.work(1_000)
            rec.flush(wait=True)
        taken = rec.take_resolved()
        assert len(taken.entry) == len(taken.start) == 3 and len(rec.store.entry) == 0
        assert all(e <= s for e, s in zip(taken.entry, taken.start))
        before = fake.now
        s = gputrace.span("open").start()
        trace = session.trace()  # the open span, closed now in a snapshot
        ((entry, start, _),) = columns(trace, "open")
        assert entry == before + rec.clock.epoch_offset_ns and entry <= start
        s.end()


def test_the_twins_give_the_same_entries() -> None:
    if native.hot is None:
        pytest.skip("the C build is not in use")
    got = []
    for c in (True, False):
        with native.using(c):
            fake = FakeDevice(rate=0.999998, read_ns=7)
            install(fake)
            got.append(list(record_steps(fake)[1].spans.entry))
            assert type(record.Span("x")) is (native.hot.Span if c else record.PySpan)  # type: ignore[union-attr]
        gputrace.reset()
    assert got[0] == got[1] and any(got[0])


@pytest.mark.parametrize("streamed", [False, True], ids=["saved", "streamed"])
@pytest.mark.parametrize("arrows", [True, False], ids=["arrows", "no-arrows"])
def test_launch_arrows_off_leaves_them_out_of_the_file_not_out_of_the_digest(
    tmp_path: Any, streamed: bool, arrows: bool
) -> None:
    import orjson

    from gputrace.trace import chrome, digestfile

    fake = FakeDevice(rate=1.000002, read_ns=0)
    install(fake, launch_arrows=arrows, **({"out_dir": str(tmp_path)} if streamed else {}))
    record_steps(fake)
    gputrace.flush()
    path = gputrace.save(tmp_path)
    events = orjson.loads(open(path, "rb").read())["traceEvents"]
    launches = [e for e in events if e.get("cat") == "launch"]
    assert len(launches) == (6 if arrows else 0)
    read = chrome.read(path)
    assert (read.spans.entry is not None) == arrows
    assert sum(1 for e in events if e.get("ph") == "X" and e.get("cat") != "launch") == 12  # every span
    lags = digestfile.read(digestfile.digest_path(path)).launch_lag
    assert lags and all(lag is not None and lag > 0 for lag in lags), lags  # the digest keeps it either way
