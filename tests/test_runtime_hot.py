"""The C hot path on the CUDA runtime's own events, on a machine without a GPU: `tests/fake_cuda.c`
stands in for the runtime, the driver and c10 (an event takes the host's monotonic time and the
stream it is recorded on, and has run at once), so the same C code a GPU run takes (RawEvent,
the driver's record first, the close on its open's stream, events taken from the pools in
bundles) runs here, and its spans resolve to the host times they were recorded at."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import gputrace
from gputrace import cuda, native, session
from gputrace.clock import HostClock
from gputrace.config import Config
from gputrace.record import Recorder

from .conftest import spans_of

STREAM_A, STREAM_B, SIDE = 0xA000, 0xB000, 0x51DE


class Fake:
    """The library and what the recorder asks of a device, from it."""

    def __init__(self, path: str) -> None:
        self.lib = ctypes.CDLL(path)
        self.lib.event_stream.restype = ctypes.c_void_p
        self.lib.event_stream.argtypes = [ctypes.c_void_p]
        self.lib.c10_current_device.restype = ctypes.c_int8

    def addr(self, name: str) -> int:
        return ctypes.cast(getattr(self.lib, name), ctypes.c_void_p).value or 0

    def counter(self, name: str) -> int:
        return ctypes.c_longlong.in_dll(self.lib, name).value

    def set(self, name: str, value: int) -> None:
        kind = ctypes.c_void_p if name == "current_stream" else ctypes.c_int
        kind.in_dll(self.lib, name).value = value

    def stream_of(self, event: Any) -> int:
        return self.lib.event_stream(event.cuda_event) or 0


class Stream:
    def __init__(self, raw: int, device: int) -> None:
        self.cuda_stream = raw
        self.device_index = device


class Device:
    """A recorder's device on the fake library, its events the C build's RawEvents."""

    events = "runtime"

    def __init__(self, fake: Fake) -> None:
        hot: Any = native.hot
        self.fake = fake
        self.current_device: Callable[[], int] = lambda: int(fake.lib.c10_current_device())
        self.raw_stream: Callable[[int], int] = lambda dev: (
            ctypes.c_void_p.in_dll(fake.lib, "current_stream").value or 0
        )
        self.record = hot.RawEvent.record
        self.elapsed = hot.RawEvent.elapsed_time
        self.is_capturing = lambda: False

    devices = 1

    def count(self) -> int:
        return self.devices

    def initialized(self, dev: int) -> bool:
        return True

    def new_event(self) -> Any:
        return native.hot.RawEvent()  # type: ignore[union-attr]

    def stream_for(self, dev: int) -> Stream:
        return Stream(self.raw_stream(dev), dev)

    def side_stream(self, dev: int) -> Stream:
        return Stream(SIDE, dev)

    def synchronize(self) -> None:
        pass

    def memory(self, dev: int) -> tuple[int, int]:
        return (0, 0)

    def name(self, dev: int) -> str:
        return "fake"


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> str:
    hot: Any = native.hot
    if hot is None or not hasattr(hot, "set_driver"):
        pytest.skip("the C build is not in use")
    if cuda.event_calls() is not None:  # events of the real runtime may be alive: not handed to the fake
        pytest.skip("a CUDA runtime is loaded: tests/test_cuda_hot.py runs this path on it")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    out = str(tmp_path_factory.mktemp("fake_cuda") / "fake_cuda.so")
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", out, str(Path(__file__).with_name("fake_cuda.c"))], check=True)
    return out


@pytest.fixture
def fake(library: str) -> Iterator[Fake]:
    hot: Any = native.hot
    f = Fake(library)
    for name in ("created", "runtime_records", "driver_records", "driver_refusals", "runtime_elapsed"):
        ctypes.c_longlong.in_dll(f.lib, name).value = 0
    f.set("driver_fails", 0)
    f.set("elapsed_fails", 0)
    f.lib.cudaSetDevice(0)
    f.set("current_stream", STREAM_A)
    device = Device(f)
    calls = {name: f.addr(name) for name in cuda._EVENT_CALLS}  # every runtime call RawEvent makes
    hot.set_runtime(calls)
    hot.set_driver(f.addr("cuEventRecord"))
    hot.set_current(
        f.addr("c10_current_device"),
        f.addr("c10_current_stream"),
        f.addr("c10_stream"),
        device.current_device,
        device.raw_stream,
    )
    hot.set_raw_elapsed(
        f.addr("cuEventElapsedTime"),
        f.addr("cudaGetLastError"),
        f.addr("cudaGetDevice"),
        device.elapsed,
        f.addr("cudaEventElapsedTime"),  # where the driver's refuses, as cuda.bind_raw_elapsed binds them
    )
    f.device = device  # type: ignore[attr-defined]
    try:
        yield f
    finally:
        session.SESSION.close()
        hot.set_current(0, 0, 0, None, None)
        hot.set_raw_elapsed(0, 0, 0, None)
        hot.set_runtime(None)  # the driver's record goes with it
        assert not hot.driver_record()


def recorder(f: Fake) -> Recorder:
    config = Config().replace(anchor_every_ms=0)
    rec = Recorder(config, f.device, HostClock())  # type: ignore[attr-defined]
    session.SESSION.config = config
    session.SESSION.install(rec)
    return rec


def test_spans_on_runtime_events_resolve_to_the_host_times_they_ran_at(fake: Fake, tmp_path: Path) -> None:
    rec = recorder(fake)
    assert rec.hot.new_event == fake.device.new_event  # type: ignore[attr-defined]
    for _ in range(3):
        with gputrace.span("step"):
            for _ in range(2):
                with gputrace.span("fwd"):
                    time.sleep(0.004)
            with gputrace.span("bwd"):
                time.sleep(0.002)
        gputrace.flush()
    path = tmp_path / "t.json"
    gputrace.save(str(path))
    import json

    spans = spans_of(json.loads(path.read_text()))
    assert [s["name"] for s in spans].count("fwd") == 6
    for s in spans:
        assert s["track"] != "host"
        want = {"fwd": 4e6, "bwd": 2e6, "step": 10e6}[s["name"]]
        # It slept that long between its two records; a loaded machine wakes it late, never early.
        assert want <= s["end"] - s["start"] < want + 200e6, s
    steps = sorted((s["start"], s["end"]) for s in spans if s["name"] == "step")
    inner = [s for s in spans if s["name"] != "step"]
    assert all(any(a <= s["start"] and s["end"] <= b for a, b in steps) for s in inner)  # nested, on one clock
    # Every record went through the driver's call (the spans' and the anchors'); the runtime's not once.
    assert fake.counter("driver_records") >= 2 * 12
    assert fake.counter("runtime_records") == 0


def test_a_close_records_on_the_stream_its_open_did(fake: Fake) -> None:
    recorder(fake)
    for stream in (STREAM_B, STREAM_A):  # each stream's first span makes its stack (the Python path)
        fake.set("current_stream", stream)
        with gputrace.span("first"):
            pass
    outer = gputrace.span("outer")
    outer.__enter__()
    fake.set("current_stream", STREAM_B)  # the program switches streams inside the span
    with gputrace.span("inner"):
        pass
    outer.__exit__(None, None, None)
    fake.set("current_stream", STREAM_A)
    assert fake.stream_of(outer.t0) == fake.stream_of(outer.t1) == STREAM_A
    pending = session.SESSION.recorder.pending  # type: ignore[union-attr]
    inner = next(s for s in pending if s.name == "inner")
    assert fake.stream_of(next(s for s in pending if s.name == "first").t1) == STREAM_B
    assert fake.stream_of(inner.t0) == fake.stream_of(inner.t1) == STREAM_B
    assert inner.parent is None  # another stream: another stack, so not outer's child
    gputrace.flush()
    trace = session.trace()
    cuda_tracks = {t for t in trace.spans.track}
    assert len(cuda_tracks) == 2


def test_a_driver_that_refuses_leaves_the_records_to_the_runtime(fake: Fake) -> None:
    hot: Any = native.hot
    recorder(fake)
    fake.set("driver_fails", 201)  # CUDA_ERROR_INVALID_CONTEXT
    for _ in range(10):
        with gputrace.span("x"):
            pass
    assert fake.counter("runtime_records") == 20  # each made again by the runtime
    assert hot.driver_record()
    for _ in range(40):
        with gputrace.span("x"):
            pass
    assert not hot.driver_record()  # refused 64 times in a row: left alone
    refused = fake.counter("driver_refusals")
    assert refused == 64
    for _ in range(5):
        with gputrace.span("x"):
            pass
    assert fake.counter("driver_refusals") == refused
    assert fake.counter("runtime_records") == 110
    gputrace.flush()
    assert len(session.trace().spans) == 55


def test_every_event_comes_back_to_the_pool(fake: Fake) -> None:
    rec = recorder(fake)
    for step in range(30):
        for _ in range(100 if step % 3 else 7):
            with gputrace.span("x"):
                pass
        gputrace.flush()
    rec.flush(wait=True)
    held_by_anchors = sum(len(t.anchors) for t in rec.timelines)
    pool = rec.pools[0]
    session.SESSION.close()  # the hot path's state goes: the events it took and did not use come back
    assert len(pool) + held_by_anchors == fake.counter("created")
    assert len(pool) >= 200  # a step's spans' events, made once and used again
    assert fake.counter("created") < 2 * 2120  # not one a record


def test_an_elapsed_read_the_driver_refuses_is_asked_of_the_runtime(fake: Fake) -> None:
    recorder(fake)
    fake.set("elapsed_fails", 201)  # no context current on this thread, say
    with gputrace.span("x"):
        time.sleep(0.003)
    gputrace.flush()
    trace = session.trace()
    assert len(trace.spans) == 1
    assert 3e6 <= trace.spans.end[0] - trace.spans.start[0] < 200e6
    assert fake.counter("runtime_elapsed") >= 2  # the span's two reads, at least


def test_spans_alternating_between_devices_take_each_devices_events(fake: Fake) -> None:
    fake.device.devices = 2  # type: ignore[attr-defined]
    rec = recorder(fake)
    for step in range(6):
        for i in range(150):
            fake.lib.cudaSetDevice(i % 2)
            with gputrace.span(f"d{i % 2}"):
                pass
        fake.lib.cudaSetDevice(0)
        gputrace.flush()
    rec.flush(wait=True)
    assert len(session.trace().spans) == 900
    for d, pool in enumerate(rec.pools):
        assert pool and all(ev.device == d for ev in pool), d  # each pool holds its own device's events
    anchors = sum(len(t.anchors) for t in rec.timelines)
    pools = rec.pools
    session.SESSION.close()
    assert sum(len(p) for p in pools) + anchors == fake.counter("created")
    assert all(ev.device == d for d, pool in enumerate(pools) for ev in pool)
    assert fake.counter("created") < 2 * 900  # events used again on both devices


def test_a_span_closed_under_a_recorder_of_fewer_devices_closes(fake: Fake) -> None:
    fake.device.devices = 2  # type: ignore[attr-defined]
    recorder(fake)
    fake.lib.cudaSetDevice(1)
    for i in range(2):  # the device's stack made, then a span opened on it by the C path
        s = gputrace.span("on 1")
        s.__enter__()
        if i == 0:
            s.__exit__(None, None, None)
    fake.device.devices = 1  # type: ignore[attr-defined]
    fake.lib.cudaSetDevice(0)
    recorder(fake)  # the program starts again on one device, a span still open
    s.__exit__(None, None, None)  # its end recorded on a new event, as the Python path does
    assert s.t1 is not None and s.t1.device == 1
