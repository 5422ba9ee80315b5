"""One module decides C or Python (gputrace.native), and tests switch in one process; resolve is
pure and reads a declared layout, checked against the C build at import."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import gputrace
from gputrace import native, record, resolve, session
from gputrace.resolve import RESOLVE_LAYOUT, RESOLVE_LAYOUT_VERSION, SpanStore
from gputrace.trace import chrome, files, layout, model

from .conftest import install
from .fakes import FakeDevice
from .test_resolve_twins import workload

needs_c = pytest.mark.skipif(native.hot is None, reason="the C build is not built or not in use")


@pytest.fixture(autouse=True)
def back_to_the_start() -> Any:
    """Each test leaves the implementation as it found it."""
    before = native.hot is not None
    yield
    gputrace.reset()
    native.use(before)


def test_the_modules_follow_the_one_decision() -> None:
    hot = native.hot
    assert record._hot is hot and (resolve._resolve_c is not None) == (hot is not None)
    assert (chrome._encode_rows is not None) == (files._Writer is not None) == (model._column_range_c is not None)
    assert (hot is not None) == (record.span is not record._py_span)


@needs_c
def test_use_switches_every_module_and_back() -> None:
    hot = native.hot
    with native.using(False):
        assert native.hot is None and record._hot is None and record.HOT_UNUSED_BECAUSE
        assert record.Span is record.PySpan and record.span is record._py_span
        assert record.DisabledSpan is record._DisabledSpan and record._split_c is None
        assert resolve._resolve_c is None and chrome._encode_events is None and layout._nest_tracks is None
        assert files._Writer is None and model._column_range_c is None
        assert gputrace.span is record._py_span  # the facade looks the name up again
        rec = install(FakeDevice())
        assert rec.open == rec._open_py
        with gputrace.span("py") as s:
            assert type(s) is record.PySpan
    gputrace.reset()
    assert native.hot is hot and record._hot is hot and record.HOT_UNUSED_BECAUSE is None
    assert record.Span is hot.Span and gputrace.span is hot.span and resolve._resolve_c is hot.resolve
    rec = install(FakeDevice())
    assert rec.open is hot.open
    with gputrace.span("c") as s:
        assert type(s) is hot.Span


@needs_c
def test_the_recorder_in_use_moves_with_a_switch() -> None:
    """Spans opened after a switch record into the same recorder, through the new hot path."""
    gputrace.enable(cuda=False)
    with gputrace.span("before"):
        pass
    native.use(False)
    rec = record.ACTIVE
    assert rec is not None and rec.open == rec._open_py
    with gputrace.span("after"):
        pass
    rec.flush(wait=True)
    assert [rec.store.names[i] for i in rec.store.name] == ["before", "after"]


@needs_c
def test_a_recorder_built_before_a_switch_records_through_the_implementation_in_use() -> None:
    hot = native.hot
    rec = install(FakeDevice())  # built while the C build is in use
    record.set_recorder(None, None)  # not current while the switch happens
    with native.using(False):
        session.SESSION.install(rec)
        assert rec.open == rec._open_py and rec.close == rec._close_py
        with gputrace.timer("t"):
            pass
        with gputrace.span("py") as s:
            assert type(s) is record.PySpan
        rec.flush(wait=True)
        assert [rec.store.names[i] for i in rec.store.name] == ["t", "py"]
    assert rec.open is hot.open and rec.close is hot.close


@needs_c
def test_recording_off_gives_the_handles_of_the_implementation_in_use() -> None:
    hot = native.hot
    assert type(gputrace.span("off")) is hot.DisabledSpan
    with native.using(False):
        assert type(gputrace.span("off")) is record._DisabledSpan
    assert type(gputrace.span("off")) is hot.DisabledSpan


@needs_c
@pytest.mark.filterwarnings("ignore::gputrace.errors.GputraceWarning")  # the misnests are on purpose
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("max_spans", [1_000_000, 150])
def test_one_recording_through_both_twins_in_one_process(seed: int, max_spans: int) -> None:
    """The same seeded recording on the fake device clock, once through the C build and once
    through the Python twins, switched in this process: the rows, ids, args, extents, drops,
    the events back in the pools and the timer's durations are all equal."""
    with native.using(True):
        c = workload(seed, max_spans)
        assert type(record.Span("x")) is native.hot.Span  # type: ignore[union-attr]
    gputrace.reset()
    with native.using(False):
        py = workload(seed, max_spans)
        assert type(record.Span("x")) is record.PySpan
    assert len(c["columns"][0]) > 50 and c["owner"]
    assert c == py


@needs_c
@pytest.mark.parametrize("perfetto", [False, True])
def test_a_saved_trace_is_the_same_bytes_from_both_twins(tmp_path: Path, perfetto: bool) -> None:
    def run(c: bool) -> bytes:
        with native.using(c):
            fake = FakeDevice(rate=1.000002, read_ns=7)
            install(fake)
            timer = gputrace.timer("t") if hasattr(gputrace, "timer") else None
            for step in range(30):
                with gputrace.span("step", step=step):
                    fake.work(20_000)
                    with gputrace.span("fwd"):
                        fake.work(50_000)
                    if timer is not None:
                        with timer:
                            fake.work(1_000)
                fake.advance(100_000)
            name = "c" if c else "py"
            path = gputrace.save(tmp_path / (f"{name}.pftrace" if perfetto else f"{name}.json"))
            gputrace.reset()
            return Path(path).read_bytes()

    c, py = run(True), run(False)
    assert len(c) > 1000 and c == py


# ---- resolve is pure ---------------------------------------------------------------------------


class Owner:
    def __init__(self) -> None:
        self.ns: list[int] = []

    def add_ns(self, ns: int) -> None:
        self.ns.append(ns)


@pytest.mark.parametrize("c", [False, True])
def test_resolve_gives_freed_events_and_durations_and_touches_no_pool_or_owner(c: bool) -> None:
    if c and native.hot is None:
        pytest.skip("the C build is not built or not in use")
    with native.using(c):
        fake = FakeDevice()
        rec = install(fake)
        owner = Owner()
        spans = [
            record.Span("a"),
            record.OptSpan("h", None, False, False, owner),
            record.OptSpan("b", None, True, False, owner),
        ]
        for s in spans:
            with s:
                fake.work(10_000)
        done = list(rec.pending)
        del rec.pending[:]
        events = [(s.t0, s.t1) for s in done if s.cuda]
        fake.synchronize()
        rec._anchor(0)
        pools = [list(p) for p in rec.pools]
        store = SpanStore(100)
        later, freed, durations = resolve.resolve(done, rec.timelines, rec.clock, store)
        assert later == [] and len(store) == 3
        assert freed == [[e for pair in events for e in pair]]  # each span's start, then end
        assert durations == {owner: [store.end[i] - store.start[i] for i in (1, 2)]} and owner.ns == []
        assert [list(p) for p in rec.pools] == pools  # the recorder refills its pools, not resolve


def test_flush_refills_the_pools_and_tells_the_owners() -> None:
    fake = FakeDevice()
    rec = install(fake)
    owner = Owner()
    with record.OptSpan("b", None, True, False, owner):
        fake.work(10_000)
    before = len(rec.pools[0])
    rec.flush(wait=True)
    assert len(owner.ns) == 1 and owner.ns[0] > 0
    assert len(rec.pools[0]) >= before + 2  # the span's two events (an anchor may take one back)


# ---- the declared layout resolve reads ------------------------------------------------------------


def test_the_declared_layout_names_what_the_objects_have() -> None:
    assert resolve.layout_missing() == []
    have = {"stack": set(record._Stack.__slots__), "track": set(record.Track.__slots__)}
    assert [(w, n) for w, n in RESOLVE_LAYOUT if w in have and n not in have[w]] == []


def test_a_renamed_attribute_is_named_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resolve, "RESOLVE_LAYOUT", (*RESOLVE_LAYOUT, ("store", "renamed"), ("timeline", "gone")))
    assert resolve.layout_missing() == [("store", "renamed"), ("timeline", "gone")]


def test_a_c_build_that_reads_another_resolve_layout_is_refused() -> None:
    class Stale:
        __file__ = "stale/_hot.abi3.so"
        RESOLVE_LAYOUT = (RESOLVE_LAYOUT_VERSION, RESOLVE_LAYOUT)

    resolve.check_resolve_layout(Stale)
    for bad in [(RESOLVE_LAYOUT_VERSION + 1, RESOLVE_LAYOUT), (RESOLVE_LAYOUT_VERSION, RESOLVE_LAYOUT[1:]), None]:
        Stale.RESOLVE_LAYOUT = bad  # type: ignore[assignment]
        with pytest.raises(ImportError, match="resolve layout"):
            resolve.check_resolve_layout(Stale)
    if native.hot is not None:
        assert native.hot.RESOLVE_LAYOUT == (RESOLVE_LAYOUT_VERSION, RESOLVE_LAYOUT)


@needs_c
def test_a_switch_to_a_refused_build_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    hot = native.hot
    with native.using(False):
        monkeypatch.setattr(resolve, "RESOLVE_LAYOUT_VERSION", RESOLVE_LAYOUT_VERSION + 1)
        with pytest.raises(ImportError, match="resolve layout"):
            native.use(True)
        assert native.hot is None and record._hot is None and resolve._resolve_c is None
        monkeypatch.undo()
    assert native.hot is hot


def test_the_stack_layout_is_the_stacks_and_the_c_builds() -> None:
    assert tuple(n for w, n in record.STACK_LAYOUT if w == "stack") == record._Stack.__slots__
    if native.hot is not None:
        assert native.hot.STACK_LAYOUT == record.STACK_LAYOUT

    class Stale:
        STACK_LAYOUT = record.STACK_LAYOUT[::-1]

    with pytest.raises(ImportError, match="reads stacks as"):
        record.check_stack_layout(Stale)
