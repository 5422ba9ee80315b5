"""Property-based: random programs of span operations across threads and (fake) streams,
misuse included. The written trace always validates, every span is in it, and every closed
span has the parent the program gave it."""

from __future__ import annotations

import queue
import threading
import warnings
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gputrace
from gputrace import record
from gputrace.validate import Report, validate

from .conftest import _reset, install
from .fakes import FakeDevice

THREADS = 2
STREAMS = 2

opening = st.tuples(st.just("open"), st.integers(0, THREADS - 1), st.integers(0, STREAMS - 1), st.booleans())
op = st.one_of(
    opening,
    opening,
    opening,
    st.tuples(st.just("close_top"), st.integers(0, THREADS - 1)),
    st.tuples(st.just("close_top"), st.integers(0, THREADS - 1)),
    st.tuples(st.just("close_any"), st.integers(0, THREADS - 1), st.integers(0, 10)),
    st.tuples(st.just("close_elsewhere"), st.integers(0, THREADS - 1), st.integers(0, 10)),
    st.tuples(st.just("end_by_name"), st.integers(0, THREADS - 1), st.integers(0, STREAMS - 1), st.integers(0, 3)),
    st.tuples(
        st.just("double_end"),
    ),
    st.tuples(st.just("work"), st.integers(0, STREAMS - 1), st.integers(0, 2_000_000)),
    st.tuples(st.just("advance"), st.integers(0, 3_000_000)),
    st.tuples(
        st.just("flush"),
    ),
)


class Worker:
    """A real thread that runs what it is given, one call at a time."""

    def __init__(self) -> None:
        self.q: queue.Queue[Any] = queue.Queue()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        while True:
            fn, done = self.q.get()
            if fn is None:
                return
            try:
                done.append(fn())
            except BaseException as e:  # noqa: BLE001 - handed back to the caller
                done.append(e)

    def call(self, fn: Callable[[], Any]) -> Any:
        done: list[Any] = []
        self.q.put((fn, done))
        while not done:
            threading.Event().wait(0.0002)
        if isinstance(done[0], BaseException):
            raise done[0]
        return done[0]

    def stop(self) -> None:
        self.q.put((None, None))
        self.t.join()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=30, max_size=90))
def test_random_programs_always_give_valid_complete_traces(program: list[tuple]) -> None:
    _reset()
    fake = FakeDevice(read_ns=1_000)  # every clock read moves time on, so spans have lengths
    rec = install(fake, max_pending=7)
    streams = [fake.default[0], fake.new_stream()]
    workers = [Worker() for _ in range(THREADS)]
    opened: list[tuple[int, Any, int | None]] = []  # (i, span, expected parent i)
    model: dict[tuple[int, Any], list[int]] = {}  # (thread, stream or "cpu") -> open i's
    where: dict[int, tuple[int, Any]] = {}
    closed: set[int] = set()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for step in program:
                kind = step[0]
                if kind == "open":
                    _, t, s, cpu = step
                    key = (t, "cpu" if cpu else s)
                    i = len(opened)
                    fake.current[0] = streams[s]
                    stack = model.setdefault(key, [])
                    timer_type = "cpu" if cpu else "cuda"
                    h = workers[t].call(
                        lambda i=i, tt=timer_type: gputrace.span(f"n{i % 4}", i=i, timer_type=tt).start()
                    )
                    opened.append((i, h, stack[-1] if stack else None))
                    stack.append(i)
                    where[i] = key
                elif kind in ("close_top", "close_any", "close_elsewhere"):
                    t = step[1]
                    mine = [i for i in range(len(opened)) if i not in closed and where[i][0] == t]
                    if not mine:
                        continue
                    i = mine[-1] if kind == "close_top" else mine[step[2] % len(mine)]
                    runner = workers[t] if kind != "close_elsewhere" else workers[(t + 1) % THREADS]
                    runner.call(opened[i][1].end)
                    closed.add(i)
                    model[where[i]].remove(i)
                elif kind == "end_by_name":
                    _, t, s, n = step
                    fake.current[0] = streams[s]
                    key = (t, s)
                    target = next((i for i in reversed(model.get(key, [])) if i % 4 == n), None)
                    workers[t].call(lambda n=n: gputrace.span(f"n{n}").end())
                    if target is not None:
                        closed.add(target)
                        model[key].remove(target)
                elif kind == "double_end" and closed:
                    opened[max(closed)][1].end()
                elif kind == "work":
                    fake.work(step[2], streams[step[1]])
                elif kind == "advance":
                    fake.advance(step[1])
                elif kind == "flush":
                    gputrace.flush()
            trace = gputrace.trace_dict()
    finally:
        for w in workers:
            w.stop()
    report = validate(trace, Report("<random program>"))
    assert report.ok, report.errors
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e.get("cat") != "launch"]  # not arrow sources
    seen = [e["args"]["i"] for e in spans]
    assert sorted(seen) == list(range(len(opened)))  # every span, once
    unfinished = {e["args"]["i"] for e in spans if e["args"].get("unfinished")}
    assert unfinished == set(range(len(opened))) - closed
    # Parents, as the recorder keeps them on each span: the span innermost when it opened.
    index_of = {id(h): i for i, h, _ in opened}
    for i, h, want in opened:
        parent = getattr(h, "parent", None)
        assert (index_of[id(parent)] if parent is not None else None) == want, (i, want)
    assert record.ACTIVE is rec
