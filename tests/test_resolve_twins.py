"""The C loops of flush, resolve and the writer against their Python references, on the same
spans: rows, ids, args, the children's extents, dropped counts, the events handed back, and the
bytes written must all be equal."""

from __future__ import annotations

import random
from array import array
from typing import Any

import pytest

import gputrace
from gputrace import record, resolve

from .conftest import install
from .fakes import FakeDevice, FakeEvent

pytestmark = pytest.mark.skipif(resolve._resolve_c is None, reason="the C resolve loop is not built or not in use")


class Owner:
    def __init__(self) -> None:
        self.ns: list[int] = []

    def add_ns(self, ns: int) -> None:
        self.ns.append(ns)


def workload(seed: int, max_spans: int, fake: FakeDevice | None = None) -> dict[str, Any]:
    """A seeded mix of device and host spans: nested, misnested, with args, errors and an owner,
    flushed now and then with and without a limit; returns everything resolve produced."""
    rng = random.Random(seed)
    fake = fake or FakeDevice(rate=1.000002, read_ns=7)
    rec = install(fake, max_spans=max_spans)
    owner = Owner()
    side = fake.new_stream()
    for step in range(40):
        open_: list[Any] = []
        for _ in range(rng.randrange(1, 12)):
            if open_ and rng.random() < 0.45:
                s = open_.pop(rng.randrange(len(open_))) if rng.random() < 0.1 else open_.pop()
                fake.work(rng.randrange(0, 50_000))
                s.__exit__(ValueError if rng.random() < 0.1 else None, None, None)
            else:
                kind = rng.random()
                args = {"i": step} if rng.random() < 0.3 else None
                if kind < 0.2:
                    s = record.OptSpan(f"h{rng.randrange(3)}", args, False, False, owner)
                elif kind < 0.3:
                    with fake.stream(side):
                        s = record.Span(f"side{rng.randrange(2)}", args)
                        s.__enter__()
                        fake.work(rng.randrange(0, 30_000))
                        s.__exit__(None, None, None)
                    continue
                else:
                    s = record.Span(f"d{rng.randrange(4)}", args)
                s.__enter__()
                open_.append(s)
            fake.advance(rng.randrange(0, 20_000))
        while open_:
            fake.work(rng.randrange(0, 10_000))
            open_.pop().__exit__(None, None, None)
        fake.advance(rng.randrange(0, 200_000))
        if rng.random() < 0.6:
            rec.flush(wait=rng.random() < 0.3, limit=rng.choice([None, 3, 17]))
    rec.flush(wait=True)
    st = rec.store
    return {
        "names": list(st.names),
        "columns": [list(c) for c in (st.name, st.track, st.start, st.end, st.entry)],
        "args": list(st.args),
        "dropped": st.dropped,
        "last_id": st._last_id,
        "extent": dict(st.child_extent),
        "pools": [len(p) for p in rec.pools],
        "owner": owner.ns,
    }


@pytest.mark.filterwarnings("ignore::gputrace.errors.GputraceWarning")  # the misnests are on purpose
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("max_spans", [1_000_000, 150])
def test_the_c_loop_resolves_as_the_python_one(seed: int, max_spans: int, monkeypatch: pytest.MonkeyPatch) -> None:
    c = workload(seed, max_spans)
    gputrace.reset()
    monkeypatch.setattr(resolve, "_resolve_c", None)
    monkeypatch.setattr(record, "_split_c", None)
    py = workload(seed, max_spans)
    assert len(c["columns"][0]) > 50
    assert c == py


class RawEvent(FakeEvent):
    """A fake event with a raw handle, as torch's events have `cuda_event`."""

    registry: dict[int, RawEvent] = {}

    def __init__(self, dev: FakeDevice) -> None:
        super().__init__(dev)
        self.cuda_event = 0x10_0000 + 16 * len(RawEvent.registry)
        RawEvent.registry[self.cuda_event] = self


def fake_torch_elapsed(a: FakeEvent, b: FakeEvent) -> float:
    """Plays torch's `_CudaEventBase.elapsed_time`: what the raw call stands in for."""
    CALLS["python"] += 1
    return a.elapsed_time(b)


CALLS = {"python": 0, "raw": 0, "refused": 0, "cleared": 0}
CURRENT = [0]  # the device the fake runtime says the thread is on


class RawDevice(FakeDevice):
    elapsed = staticmethod(fake_torch_elapsed)

    def new_event(self) -> RawEvent:
        self.events_made += 1
        return RawEvent(self)


@pytest.mark.filterwarnings("ignore::gputrace.errors.GputraceWarning")
@pytest.mark.parametrize(("refuse_every", "thread_device"), [(0, 0), (5, 0), (0, 1)])
def test_the_raw_elapsed_call_resolves_as_the_python_method(
    refuse_every: int, thread_device: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C resolve measures events through a C function on their raw handles (the CUDA
    runtime's cudaEventElapsedTime on a GPU; a C-callable fake of it here, on the fake clock)
    and gets exactly the rows the Python reference gets through the Python method. A refusal
    (an event not yet run, another context) clears the runtime's error and asks the method;
    on a thread whose device is not the events' the method is asked throughout (the runtime
    would make a context on the thread's device)."""
    CURRENT[0] = thread_device
    import ctypes

    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p)

    def raw(out: Any, a: int, b: int) -> int:
        ea, eb = RawEvent.registry[a], RawEvent.registry[b]
        if ea.host_ns is None or eb.host_ns is None or not (ea.query() and eb.query()):
            return 600  # cudaErrorNotReady
        if refuse_every and (CALLS["raw"] + CALLS["refused"]) % refuse_every == 0:
            CALLS["refused"] += 1
            return 400  # cudaErrorInvalidResourceHandle
        CALLS["raw"] += 1
        out[0] = ea.elapsed_time(eb)  # stored as float32, as the runtime stores it
        return 0

    def clear() -> int:
        CALLS["cleared"] += 1
        return 0

    def device(out: Any) -> int:
        out[0] = CURRENT[0]
        return 0

    raw_c, clear_c = proto(raw), ctypes.CFUNCTYPE(ctypes.c_int)(clear)
    device_c = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int))(device)
    hot = record._hot
    address = [ctypes.cast(f, ctypes.c_void_p).value for f in (raw_c, clear_c, device_c)]
    hot.set_raw_elapsed(*address, fake_torch_elapsed)
    try:
        CALLS.update(python=0, raw=0, refused=0, cleared=0)
        got = workload(3, 1_000_000, RawDevice(rate=1.000002, read_ns=7))
        calls = dict(CALLS)
        ran = [e for e in RawEvent.registry.values() if e.host_ns is not None and e.query()]
        a, b = ran[0], ran[-1]
        if not refuse_every:
            assert hot.raw_elapsed_ms(a, b) == a.elapsed_time(b) != 0.0
        unrun = RawEvent(a.dev)
        assert hot.raw_elapsed_ms(a, unrun) is None  # not run: no answer, and the error cleared
    finally:
        hot.set_raw_elapsed(0, 0, 0, None)
    gputrace.reset()
    monkeypatch.setattr(resolve, "_resolve_c", None)
    monkeypatch.setattr(record, "_split_c", None)
    want = workload(3, 1_000_000, FakeDevice(rate=1.000002, read_ns=7))
    assert got == want and len(got["columns"][0]) > 50
    if thread_device == 0:
        assert calls["raw"] > 2 * len(got["columns"][0]) // 3  # the device spans went through the raw call
    else:
        assert calls["raw"] == 0 and calls["python"] > 2 * len(got["columns"][0]) // 3
    assert CALLS["cleared"] == CALLS["refused"] + 1 and (CALLS["refused"] > 0) == bool(refuse_every)
    assert calls["python"] >= calls["refused"]  # the Python method stood in for every refusal


def test_spans_of_another_type_go_to_the_python_loop() -> None:
    fake = FakeDevice()
    rec = install(fake)
    s = record.PySpan("py")
    c = record.Span("c")
    with c:
        s.stack, s.parent, s.t0, s.t1 = c.stack, None, c.t0, c.t0
    assert resolve._resolve_c([s], 0, rec.store, rec.timelines, rec.pools, 0, resolve.DeviceTimeline) is NotImplemented
    assert len(rec.store) == 0


def random_trace(seed: int, n: int, cross: float = 0.03) -> Any:
    """One process's spans in the columns a recorder's store makes (no cats), in the order they
    ended per track, mostly nested, some crossing; args of every kind the writer meets."""
    from gputrace.trace.model import Process, SpanColumns, Trace, Track

    rng = random.Random(seed)
    trace = Trace({})
    p = trace.add_process(Process(1, 0, "rank 0", 0))
    for k in range(4):
        trace.add_track(Track(p, k, f"t{k}", "cuda" if k < 2 else "cpu", 0 if k < 2 else None, k))
    rows = []
    for k in range(4):
        t = 1_000_000 + rng.randrange(1000)
        for _ in range(n // 4):
            t += rng.randrange(0, 5000)
            s, d = t, rng.randrange(0, 3000)
            rows.append((s + d, k, s))
            t += d
            if rng.random() < 0.5:  # a child, or now and then a span crossing the last
                c = s + rng.randrange(0, max(1, d))
                e = min(s + d, c + rng.randrange(0, 1000)) if rng.random() >= cross else s + d + 500
                rows.append((e, k, c))
    rows.sort(key=lambda r: (r[1], r[0]))  # per track in end order; the tracks interleave below
    rng.shuffle(rows)
    rows.sort(key=lambda r: r[0])
    weird = [
        None,
        {},
        {"i": 3},
        {"a": [{}, {"ph": 1}]},  # an event boundary inside args
        {"x": float("nan"), "o": object()},
        {1: "non-str key"},  # orjson refuses: every args of the piece goes through dumps
        {"s": 'caf\u00e9 \\ " },{"ph"'},
    ]
    sp = SpanColumns.wrap(*(array(c) for c in ("l", "l", "q", "q")), [])
    for e, k, s in rows:
        sp.name.append(trace.intern(f"n{rng.randrange(5)}"))
        sp.track.append(k)
        sp.start.append(s)
        sp.end.append(e)
        sp.args.append(rng.choice(weird) if rng.random() < 0.2 else None)
    sp.cat = type(sp.cat)(len(sp.start))
    trace.spans = sp
    return trace


def encodings(trace: Any, pieces: int) -> tuple[bytes, bytes]:
    """The trace written whole, and streamed in `pieces` appends."""
    import os
    import tempfile

    from gputrace.trace import chrome

    whole = chrome.encode(trace, ordered=True)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "s.json")
        w = chrome.StreamWriter(path, 0, trace.processes[0], {})
        n = len(trace.spans)
        cuts = sorted({0, n, *random.Random(n).sample(range(n), pieces - 1)})
        for a, b in zip(cuts, cuts[1:]):
            w.append(trace, range(a, b))
        with open(path, "rb") as f:
            streamed = f.read()
        w.abandon()
    return whole, streamed


@pytest.mark.parametrize("seed", range(5))
def test_the_c_layout_and_encoder_write_what_the_python_ones_write(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from gputrace.trace import chrome, layout

    if chrome._encode_rows is None:
        pytest.skip("the C encoder is not built or not in use")
    trace = random_trace(seed, 4000)
    for pieces in (1, 7):
        c = encodings(trace, pieces)
        with monkeypatch.context() as m:
            m.setattr(chrome, "_encode_rows", None)
            m.setattr(layout, "_nest_tracks", None)
            py = encodings(trace, pieces)
        assert c == py
    assert b"(overflow 1)" in c[0]  # the crossing spans took the general layout


@pytest.mark.parametrize("seed", range(3))
def test_nested_pieces_take_the_c_path(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from gputrace.trace import chrome, layout

    if chrome._encode_rows is None:
        pytest.skip("the C encoder is not built or not in use")
    calls: list[int] = []
    real = chrome._encode_rows
    trace = random_trace(seed, 3000, cross=0)
    with monkeypatch.context() as m:
        m.setattr(chrome, "_encode_rows", lambda *a: calls.append(1) or real(*a))
        c = encodings(trace, 5)
    # The whole trace, and the appends whose spans all lie on lane 0 (one call each: args orjson
    # refuses are cleaned a dict at a time, not by a second pass).
    assert len(calls) >= 5
    with monkeypatch.context() as m:
        m.setattr(chrome, "_encode_rows", None)
        m.setattr(layout, "_nest_tracks", None)
        assert c == encodings(trace, 5)


@pytest.mark.parametrize("seed", range(4))
def test_the_c_split_finds_the_finished_spans_the_python_one_finds(seed: int) -> None:
    if record._split_c is None:
        pytest.skip("the C hot path is not built or not in use")
    rng = random.Random(seed)
    fake = FakeDevice(devices=2)
    rec = install(fake, max_pending=1 << 20)
    streams = [fake.default[0], fake.new_stream()]
    for _ in range(300):
        dev = rng.randrange(2)
        fake.set_device(dev)
        kind = rng.random()
        if kind < 0.2:
            s = record.OptSpan("h", None, False)
            with s:
                fake.advance(rng.randrange(0, 3000))
            continue
        with fake.stream(streams[rng.randrange(2)] if dev == 0 else fake.default[1]):
            with record.Span(f"d{dev}"):
                fake.work(rng.randrange(0, 40_000))  # queued work: later spans finish later
        fake.advance(rng.randrange(0, 20_000))
    pending = list(rec.pending)
    c_done, c_waiting, c_devices = record._split_c(pending, False)
    py_done, py_waiting = record._split_finished(pending)
    assert [id(s) for s in c_done] == [id(s) for s in py_done]
    assert [id(s) for s in c_waiting] == [id(s) for s in py_waiting]
    assert c_devices == sorted({s.stack.device for s in py_done} - {None})
    assert c_waiting and len(c_done) > len([s for s in pending if s.stack.device is None])
    done_all, waiting_none, devices_all = record._split_c(pending, True)
    assert [id(s) for s in done_all] == [id(s) for s in pending] and not waiting_none and devices_all == [0, 1]
    rec.flush(wait=True)


@pytest.mark.parametrize("n", [1, 2, 1000])
def test_the_c_column_range_is_min_and_max(n: int) -> None:
    from gputrace.trace import model

    if model._column_range_c is None:
        pytest.skip("the C build is not in use")
    rng = random.Random(n)
    col = array("q", (rng.randrange(-(2**63), 2**63) for _ in range(n)))
    assert model._column_range(col) == model._column_range_py(col) == (min(col), max(col))
    assert model._column_range_c(array("q")) is None
