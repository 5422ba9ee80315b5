"""Whatever the user's code does, the trace is valid and complete (issue: traces always valid)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from click.testing import CliRunner

import gputrace
from gputrace import record
from gputrace.cli import main
from gputrace.errors import GputraceWarning
from gputrace.record import HotState
from gputrace.validate import Report, validate

from .conftest import install, run_py, spans_of
from .fakes import FakeDevice


def check(trace: dict) -> list[dict]:
    report = validate(trace, Report("<memory>"))
    assert report.ok, report.errors
    return spans_of(trace)


def test_outer_ended_before_inner_goes_to_an_overflow_track() -> None:
    gputrace.enable(cuda=False)
    outer = gputrace.span("outer").start()
    inner = gputrace.span("inner").start()
    with pytest.warns(GputraceWarning, match="ended before spans opened inside it"):
        outer.end()
    with gputrace.span("after outer"):
        pass
    inner.end()
    trace = gputrace.trace_dict()
    spans = check(trace)
    assert sorted(e["name"] for e in spans) == ["after outer", "inner", "outer"]
    tracks = {e["name"]: e["track"] for e in spans}
    assert tracks["outer"] == "thread MainThread (host)"
    assert tracks["inner"] == "thread MainThread (host) (overflow 1)" or tracks["after outer"].endswith("(overflow 1)")
    assert trace["metadata"]["overflow_tracks"] == 1


def test_double_end_and_end_of_a_never_started_handle_warn_once() -> None:
    gputrace.enable(cuda=False)
    s = gputrace.span("a").start()
    s.end()
    with pytest.warns(GputraceWarning, match="ended twice"):
        s.end()
    assert [e["name"] for e in check(gputrace.trace_dict())] == ["a"]


def test_stream_switched_inside_a_span_ends_it_on_its_own_stream() -> None:
    fake = FakeDevice()
    install(fake)
    other = fake.new_stream()
    s = gputrace.span("switch").start()
    fake.work(1_000_000)
    with fake.stream(other):
        fake.work(5_000_000, other)
        s.end()  # recorded on the span's own stream, not `other`
    spans = check(gputrace.trace_dict())
    assert len(spans) == 1 and spans[0]["track"] == "cuda:0 default stream"
    assert spans[0]["end"] - spans[0]["start"] < 2_000_000


def test_opened_on_one_thread_closed_on_another() -> None:
    gputrace.enable(cuda=False)
    s = gputrace.span("handed over").start()
    t = threading.Thread(target=s.end)
    t.start()
    t.join()
    with gputrace.span("next"):
        pass
    spans = check(gputrace.trace_dict())
    assert sorted(e["name"] for e in spans) == ["handed over", "next"]
    assert record.ACTIVE is not None and record.ACTIVE.open_spans() == []


def test_several_devices_get_their_own_tracks_and_anchors() -> None:
    fake = FakeDevice(devices=2)
    rec = install(fake)
    for dev in (0, 1):
        fake.set_device(dev)
        with gputrace.span(f"on {dev}"):
            fake.work(1_000_000)
    fake.advance(5_000_000)
    spans = check(gputrace.trace_dict())
    assert {e["name"]: e["track"] for e in spans} == {"on 0": "cuda:0 default stream", "on 1": "cuda:1 default stream"}
    assert all(tl.anchors for tl in rec.timelines)


def test_keyboard_interrupt_inside_a_span() -> None:
    gputrace.enable(cuda=False)
    with pytest.raises(KeyboardInterrupt):
        with gputrace.span("interrupted"):
            raise KeyboardInterrupt
    assert check(gputrace.trace_dict())[0]["args"] == {"error": "KeyboardInterrupt"}


@pytest.mark.filterwarnings("ignore::gputrace.errors.GputraceWarning")  # misnesting is the point
def test_generators_and_coroutines_holding_spans_across_yields() -> None:
    gputrace.enable(cuda=False)

    def gen():  # type: ignore[no-untyped-def]
        for i in range(3):
            with gputrace.span("gen", i=i):
                yield i

    async def coro(tag: str) -> None:
        for _ in range(3):
            with gputrace.span(f"coro {tag}"):
                await asyncio.sleep(0)

    async def both() -> None:
        await asyncio.gather(coro("a"), coro("b"))

    g = gen()
    with gputrace.span("caller"):
        next(g)
    for _ in g:
        with gputrace.span("between"):
            pass
    asyncio.run(both())
    spans = check(gputrace.trace_dict())
    names = [e["name"] for e in spans]
    assert names.count("gen") == 3 and names.count("coro a") == 3 and names.count("coro b") == 3


def test_very_deep_nesting() -> None:
    gputrace.enable(cuda=False)
    handles = [gputrace.span("d", level=i).start() for i in range(2000)]
    for h in reversed(handles):
        h.end()
    spans = check(gputrace.trace_dict())
    assert len(spans) == 2000 and len({e["track"] for e in spans}) == 1


def test_names_and_args_json_cannot_hold(tmp_path) -> None:  # type: ignore[no-untyped-def]
    gputrace.enable(cuda=False)
    weird = [
        "ünïcödé ✓ 名前",
        'quote " and \\ backslash',
        "new\nline",
        "</script><script>alert(1)</script>",
        "x" * 100_000,
        "\udc80 lone surrogate",
    ]
    for w in weird:
        with gputrace.span(w, value=w, nan=float("nan"), inf=float("-inf"), obj=object(), nested={"k": [1, None, w]}):
            pass
    path = gputrace.save(tmp_path)
    from .conftest import read_json as read_trace

    spans = check(read_trace(path))
    assert len(spans) == len(weird)
    assert {e["name"] for e in spans} >= set(weird[:5])


def test_many_threads_recording_at_once() -> None:
    gputrace.enable(cuda=False)
    n_threads, per = 16, 300
    barrier = threading.Barrier(n_threads)

    def work(k: int) -> None:
        barrier.wait()
        for i in range(per):
            with gputrace.span("outer", t=k):
                with gputrace.span("inner"):
                    pass

    threads = [threading.Thread(target=work, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spans = check(gputrace.trace_dict())
    assert len(spans) == n_threads * per * 2
    assert len({e["track"] for e in spans}) == n_threads


def test_a_million_spans_without_flush_are_all_kept() -> None:
    gputrace.enable(cuda=False, max_pending=50_000)
    rec = record.ACTIVE
    assert rec is not None
    for _ in range(250_000):
        with gputrace.span("a"):
            with gputrace.span("b"):
                pass
        with gputrace.span("c"):
            pass
        with gputrace.span("d"):
            pass
    # Resolved as it went, a slice at a time past max_pending: bounded.
    assert len(rec.pending) < 50_000 + 2 * record.AUTO_RESOLVE_SLICE
    rec.flush(wait=True)
    assert len(rec.store) == 1_000_000 and rec.store.dropped == 0


def test_past_max_spans_the_trace_says_how_many_were_dropped() -> None:
    gputrace.enable(cuda=False, max_spans=100)
    for _ in range(150):
        with gputrace.span("s"):
            pass
    trace = gputrace.trace_dict()
    assert len(check(trace)) == 100
    assert trace["metadata"]["spans_dropped"] == 50


def test_validate_cli_reports_problems_and_exits_non_zero(tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad.json"
    bad.write_text(
        '{"traceEvents": [{"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 0, "dur": 10},'
        '{"ph": "X", "name": "b", "pid": 1, "tid": 1, "ts": 5, "dur": 10},'
        '{"ph": "X", "name": "c", "pid": -1, "tid": 1, "ts": -3, "dur": 1}]}'
    )
    r = CliRunner().invoke(main, ["validate", str(bad)])
    assert r.exit_code == 1
    assert "partly overlaps" in r.output and "pid/tid must be integers" in r.output
    gputrace.enable(cuda=False)
    with gputrace.span("fine"):
        pass
    good = gputrace.save(tmp_path / "good")
    r = CliRunner().invoke(main, ["validate", good])
    assert r.exit_code == 0 and ": ok: 1 span on 1 track" in r.output
    r = CliRunner().invoke(main, ["validate", str(tmp_path / "missing.json")])
    assert r.exit_code == 2 and "Traceback" not in r.output


class _TakenMeanwhile(list):  # type: ignore[type-arg]
    """An event pool whose last event another thread takes right after it was seen there."""

    def __bool__(self) -> bool:
        seen = len(self) > 0
        self.clear()
        return seen


def test_the_last_pooled_event_taken_by_another_thread_meanwhile() -> None:
    fake = FakeDevice()
    rec = install(fake)
    with gputrace.span("first"):
        fake.work(1_000_000)
    fake.advance(5_000_000)
    gputrace.flush()  # its two events go back to the pool
    assert rec.pools[0]
    rec.pools[0] = _TakenMeanwhile(rec.pools[0])
    with gputrace.span("second"):
        fake.work(1_000_000)
    fake.advance(5_000_000)
    rec.pools[0] = list(rec.pools[0])  # the hot path's takes are the point here, not the anchor's
    assert [e["name"] for e in check(gputrace.trace_dict())] == ["first", "second"]


def test_install_switches_state_whole_while_another_thread_closes_a_span() -> None:
    rec = install()
    held = gputrace.span("held").start()
    closer = threading.Thread(target=held.end)

    class ReadSlowly(HotState):
        """While the C path reads this state to install it, another thread closes a span."""

        __slots__ = ()

        @property  # type: ignore[override]
        def pools(self) -> list[list[object]]:
            if closer.ident is None:
                closer.start()
                closer.join()
            return HotState.pools.__get__(self)  # type: ignore[attr-defined, no-any-return]

        @pools.setter
        def pools(self, value: list[list[object]]) -> None:
            HotState.pools.__set__(self, value)  # type: ignore[attr-defined]

    rec.hot = ReadSlowly(**{name: getattr(rec.hot, name) for name in HotState.__slots__})
    record.set_recorder(None, rec)  # recording off; the C path reads rec.hot now
    if closer.ident is None:  # the Python path reads no state to switch
        closer.start()
        closer.join()
    assert [e["name"] for e in check(gputrace.trace_dict())] == ["held"]


def test_threads_recording_while_recording_is_switched_on_and_off() -> None:
    # In a child: a crash here would take the test run with it.
    r = run_py(
        """
import sys, threading
import gputrace
from gputrace import record
sys.setswitchinterval(1e-6)
errors = []
threading.excepthook = lambda a: errors.append(a.exc_value)
gputrace.enable(cuda=False)
stop = False
def work():
    while not stop:
        outer = gputrace.span("outer").start()
        with gputrace.span("inner"):
            pass
        outer.end()
threads = [threading.Thread(target=work) for _ in range(3)]
for t in threads:
    t.start()
for _ in range(2000):
    gputrace.disable()
    gputrace.enable(cuda=False)
stop = True
for t in threads:
    t.join()
assert not errors, errors
assert record.ACTIVE.open_spans() == []
spans = [e for e in gputrace.trace_dict()["traceEvents"] if e["ph"] == "X"]
assert spans, "nothing recorded"
print("ok", len(spans))
""",
        env={"PYTHONWARNINGS": "ignore"},
    )
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr


@pytest.mark.filterwarnings("ignore::gputrace.errors.GputraceWarning")  # the double start is on purpose
def test_spans_in_a_cycle_are_still_collected() -> None:
    """Closed spans leave the collector's young objects, but not one still in a cycle: a handle
    started twice is its own parent, and a span closed around a still open one is that one's
    parent while it holds the stack."""
    import gc
    import weakref

    class Owner:
        def add_ns(self, ns: int) -> None:
            pass

    gputrace.enable(cuda=False)
    alive = []
    for _ in range(50):
        owner = Owner()
        alive.append(weakref.ref(owner))
        s = record.OptSpan("twice", None, False, False, owner)
        s.start()
        s.start()
        s.end()
        s.end()
        gputrace.flush()
        del s, owner
    gc.collect()
    assert sum(r() is not None for r in alive) == 0
