"""On a real GPU (marked `cuda`, skipped without one): the hot path's host entry time, NVTX
ranges, and timing events the C hot path records through the CUDA runtime."""

from __future__ import annotations

import time

import pytest

import gputrace
from gputrace import record, session

from .conftest import HAS_CUDA

pytestmark = pytest.mark.cuda

if HAS_CUDA:
    import torch


def test_a_cuda_span_is_entered_before_it_starts_and_the_queue_shows() -> None:
    gputrace.enable()
    a = torch.randn(2048, 2048, device="cuda")
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    # Outputs allocated up front: an allocation while the GPU is busy can wait for it, and the
    # host would no longer run ahead.
    c, d = torch.matmul(a, a), torch.matmul(b, b)
    torch.cuda.synchronize()
    rec = record.ACTIVE
    assert rec is not None
    before = time.monotonic_ns() + rec.clock.epoch_offset_ns
    with gputrace.span("block"):
        for _ in range(20):  # ~30 ms of GPU time: what follows waits in the queue
            torch.matmul(b, b, out=d)
    for i in range(5):
        with gputrace.span("queued", i=i):
            torch.matmul(a, a, out=c)
    with gputrace.span("host", timer_type="cpu"):
        pass
    after = time.monotonic_ns() + rec.clock.epoch_offset_ns
    trace = session.trace()
    sp = trace.spans
    assert sp.entry is not None and len(sp.entry) == len(sp.start)
    names = [trace.names[i] for i in sp.name]
    lags = [(n, sp.start[k] - sp.entry[k]) for k, n in enumerate(names)]
    for k, name in enumerate(names):
        if name == "host":
            assert sp.entry[k] == 0
            continue
        assert before <= sp.entry[k] <= after, name
        assert sp.entry[k] <= sp.start[k], name
        if name == "queued":  # entered while "block" still ran on the GPU
            assert sp.start[k] - sp.entry[k] > 1_000_000, lags


# ---- the runtime's own events ------------------------------------------------------------------


def _recorder(runtime: bool) -> record.Recorder:
    from gputrace.clock import HostClock
    from gputrace.config import Config
    from gputrace.cuda import CudaDevice

    device = CudaDevice(runtime=runtime)
    assert device.events == ("runtime" if runtime else "torch")
    rec = record.Recorder(Config(), device, HostClock())
    session.SESSION.install(rec)
    return rec


def _timed_against_torch(rec: record.Recorder, n: int = 8) -> list[tuple[float, float]]:
    """(span duration, torch events' duration around the same kernels), in us, for n spans."""
    a = torch.randn(4096, 4096, device="cuda")
    # The GPU's clocks up and cuBLAS ready first: on a machine just started, the first of the two
    # recorders measured would otherwise run its kernels slower than the second.
    for _ in range(50):
        a @ a
    torch.cuda.synchronize()
    # Work queued ahead: the spans' events and torch's then run back to back on the GPU, whatever
    # the host does between their records (a torch Event makes its CUDA event at its first record,
    # ~100 us that an idle GPU would show between the span's start and torch's).
    for _ in range(10):
        a @ a
    pairs = []
    for i in range(n):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with gputrace.span("mm", i=i):
            e0.record()
            for _ in range(3):
                a @ a
            e1.record()
        pairs.append((e0, e1))
    torch.cuda.synchronize()
    rec.flush(wait=True)
    st = rec.store
    spans = [(st.end[k] - st.start[k]) / 1e3 for k in range(len(st.start)) if st.names[st.name[k]] == "mm"]
    return [(s, e0.elapsed_time(e1) * 1e3) for s, (e0, e1) in zip(spans, pairs)]


def test_runtime_events_time_the_same_kernels_as_torchs_path() -> None:
    got = {}
    for runtime in (True, False):
        rec = _recorder(runtime)
        with gputrace.span("probe") as s:
            kind = type(s.t0).__name__
        assert kind == ("RawEvent" if runtime and record._hot is not None else "Event"), kind
        got[runtime] = _timed_against_torch(rec)
        gputrace.reset()
    for runtime, pairs in got.items():
        for span_us, torch_us in pairs:
            # The span's events sit just outside torch's: a few us of host time between them.
            assert torch_us <= span_us + 1.0 and span_us - torch_us < 100, (runtime, span_us, torch_us)
    med = {k: sorted(s for s, _ in v)[len(v) // 2] for k, v in got.items()}
    assert abs(med[True] - med[False]) / med[False] < 0.1, med


def test_runtime_events_across_streams_and_threads_nest_and_leave_no_error() -> None:
    import threading

    rec = _recorder(True)
    a = torch.randn(2048, 2048, device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()

    def worker() -> None:
        s2 = torch.cuda.Stream()
        with torch.cuda.stream(s2):
            for _ in range(5):
                with gputrace.span("thread"):
                    a @ a

    t = threading.Thread(target=worker)
    t.start()
    with gputrace.span("outer"):
        a @ a
        with torch.cuda.stream(side):
            with gputrace.span("side"):
                a @ a
        with gputrace.span("inner"):
            a @ a
    t.join()
    rec.flush(wait=True)
    st = rec.store
    rows = {}
    for k in range(len(st.start)):
        rows.setdefault(st.names[st.name[k]], []).append((st.start[k], st.end[k], rec.tracks[st.track[k]].name))
    assert len(rows["thread"]) == 5 and len({r[2] for r in rows["thread"]}) == 1
    (outer,), (inner,), (side_row,) = rows["outer"], rows["inner"], rows["side"]
    assert outer[0] <= inner[0] <= inner[1] <= outer[1] and inner[2] == outer[2]
    assert side_row[2] != outer[2]
    assert len({r[2] for r in rows["thread"]} | {outer[2], side_row[2]}) == 3
    # Nothing left for torch to find: a launch and a sync after it all go through.
    (a @ a).sum().item()
    torch.cuda.synchronize()


@pytest.mark.filterwarnings("ignore::gputrace.errors.GputraceWarning")  # the skipped span is said
def test_runtime_events_skip_graph_capture_and_the_graph_replays() -> None:
    rec = _recorder(True)
    x = torch.zeros(1024, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x.add_(1)  # warm up on the side stream, as torch.cuda.graph asks
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        with gputrace.span("captured"):
            x.add_(1)
    for _ in range(3):
        with gputrace.span("replay"):
            g.replay()
    torch.cuda.synchronize()
    rec.flush(wait=True)
    names = [rec.store.names[i] for i in rec.store.name]
    assert names.count("replay") == 3 and "captured" not in names and rec.skipped_in_capture == 1
    assert x[0].item() == 4.0  # warm-up + 3 replays


@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_runtime_events_across_a_device_switch() -> None:
    rec = _recorder(True)
    a0 = torch.randn(1024, 1024, device="cuda:0")
    a1 = torch.randn(1024, 1024, device="cuda:1")
    with gputrace.span("on0"):
        a0 @ a0
        torch.cuda.set_device(1)
        with gputrace.span("on1"):
            a1 @ a1
    torch.cuda.set_device(0)  # "on0" closed on device 1's current device, recorded on its own
    rec.flush(wait=True)
    devs = {rec.store.names[rec.store.name[k]]: rec.tracks[rec.store.track[k]].device for k in range(len(rec.store))}
    assert devs == {"on0": 0, "on1": 1}


def test_a_raw_event_reports_runtime_errors_clearly() -> None:
    _recorder(True)
    hot = record._hot
    assert hot is not None
    ev = hot.RawEvent()
    assert ev.query() is True and ev.cuda_event == 0  # never recorded: nothing to wait for
    other = hot.RawEvent()
    with pytest.raises(ValueError, match="recorded"):
        ev.elapsed_time(other)
    ev.record(torch.cuda.current_stream())
    ev.synchronize()
    assert ev.query() is True and ev.device == torch.cuda.current_device()


def test_the_drivers_record_and_elapsed_time_agree_with_the_runtimes() -> None:
    """The hot path records with the driver's cuEventRecord and the resolve reads
    cuEventElapsedTime where the driver has them: the same events, times and errors as the
    runtime's calls. Spans around the same kernels measure alike either way."""
    from gputrace import cuda, native

    hot = native.hot
    driver = cuda.driver_calls()
    if hot is None or driver is None or cuda.bind_runtime_events() is None:
        pytest.skip("no C build, or the driver's calls are not found")
    assert hot.driver_record()
    assert cuda.bind_raw_elapsed(hot.RawEvent.elapsed_time)  # what a CudaDevice binds: the driver's elapsed
    x = torch.ones(1 << 22, device="cuda")
    stream = torch.cuda.current_stream()
    events = [hot.RawEvent() for _ in range(4)]
    events[0].record(stream)  # through the driver
    for _ in range(20):
        x.mul_(1.0001)
    events[1].record(stream)
    hot.set_driver(0)  # the runtime's from here
    try:
        events[2].record(stream)
        for _ in range(20):
            x.mul_(1.0001)
        events[3].record(stream)
    finally:
        hot.set_driver(driver["cuEventRecord"])
    torch.cuda.synchronize()
    for a, b in ((0, 1), (2, 3), (0, 3), (1, 2)):
        runtime_ms = events[a].elapsed_time(events[b])  # RawEvent's: the runtime's cudaEventElapsedTime
        driver_ms = hot.raw_elapsed_ms(events[a], events[b])  # the resolve's: the driver's
        assert driver_ms is not None and runtime_ms >= 0, (a, b, driver_ms, runtime_ms)
        assert abs(driver_ms - runtime_ms) <= 1e-6 * max(1.0, runtime_ms), (a, b, driver_ms, runtime_ms)
    assert events[0].elapsed_time(events[1]) > 0.001  # the kernels lie between
    # Spans recorded through each measure the same kernels alike.
    got = {}
    for on in (True, False):
        rec = _recorder(True)  # binds the driver's record again
        if not on:
            hot.set_driver(0)
        try:
            assert hot.driver_record() == on
            got[on] = _timed_against_torch(rec)
            gputrace.reset()
        finally:
            hot.set_driver(driver["cuEventRecord"])
    for on, pairs in got.items():
        for span_us, torch_us in pairs:
            assert torch_us <= span_us + 1.0 and span_us - torch_us < 100, (on, span_us, torch_us)
