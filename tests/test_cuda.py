"""On a real GPU (marked `cuda`, skipped without one): streams, profiler agreement, no
implicit synchronisation, anchoring under load, CUDA graphs."""

from __future__ import annotations

import statistics
import time

import orjson
import pytest

import gputrace
from gputrace import record

from .conftest import HAS_CUDA, spans_of

pytestmark = pytest.mark.cuda

if HAS_CUDA:
    import torch


def big(n: int = 8192) -> torch.Tensor:
    return torch.randn(n, n, device="cuda", dtype=torch.bfloat16)


def test_two_streams_nest_per_stream_and_overlap_across() -> None:
    gputrace.enable()
    a = big(4096)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with gputrace.span("compute"):
        for i in range(3):
            with gputrace.span("mm", i=i):
                a @ a
        with torch.cuda.stream(side):
            with gputrace.span("side"):
                with gputrace.span("side mm"):
                    a @ a
        for i in range(3):
            with gputrace.span("mm2", i=i):
                a @ a
    trace = gputrace.trace_dict()
    spans = spans_of(trace)
    tracks = {e["track"] for e in spans}
    assert tracks == {"cuda:0 default stream", "cuda:0 stream 1"}
    by = {e["name"]: e for e in spans}
    compute, side_span, inner = by["compute"], by["side"], by["side mm"]
    for e in spans:
        if e["track"] == "cuda:0 default stream" and e["name"] != "compute":
            assert compute["start"] <= e["start"] <= e["end"] <= compute["end"]
    assert side_span["start"] <= inner["start"] <= inner["end"] <= side_span["end"]
    assert side_span["start"] < compute["end"] and compute["start"] < side_span["end"]  # overlap
    assert trace["metadata"]["overflow_tracks"] == 0


def test_span_agrees_with_profiler_kernel_time(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from torch.profiler import ProfilerActivity, profile

    a = big()
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        gputrace.enable()
        for _ in range(4):  # queue work ahead, so span events and kernels run back to back
            a @ a
        for i in range(10):
            with gputrace.span("mm", i=i):
                a @ a
        torch.cuda.synchronize()
        gputrace.flush()
    path = tmp_path / "kineto.json"
    prof.export_chrome_trace(str(path))
    kt = orjson.loads(path.read_bytes())
    base = kt.get("baseTimeNanoseconds", 0)
    kernels = sorted((e for e in kt["traceEvents"] if e.get("cat") == "kernel"), key=lambda e: e["ts"])[-10:]
    spans = sorted((e for e in spans_of(gputrace.trace_dict()) if e["name"] == "mm"), key=lambda e: e["start"])
    diffs, offsets = [], []
    for k, s in zip(kernels, spans):
        k_dur = round(k["dur"] * 1000)
        k_start = base + round(k["ts"] * 1000)
        diffs.append((s["end"] - s["start"]) - k_dur)
        offsets.append(s["start"] - k_start)
        assert abs((s["end"] - s["start"]) - k_dur) <= 2_000 + 0.01 * k_dur
    print(
        f"span - kernel duration (ns): median {statistics.median(diffs)}; "
        f"start offset median {statistics.median(offsets)}"
    )
    assert abs(statistics.median(offsets)) < 100_000


def test_hot_path_never_synchronizes_and_the_gpu_stays_busy() -> None:
    a = big()
    gputrace.enable()
    with gputrace.span("warm"):
        a @ a
    gputrace.flush()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        t0 = time.perf_counter()
        for i in range(40):
            with gputrace.span("step", i=i):
                with gputrace.span("mm"):
                    a @ a
        host = time.perf_counter() - t0
        busy = not torch.cuda.current_stream().query()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    gpu = time.perf_counter() - t0
    assert busy, "the GPU ran dry: the span loop waited on it"
    assert host < gpu / 4, (host, gpu, t1 - t0)
    assert len([e for e in spans_of(gputrace.trace_dict()) if e["name"] == "mm"]) == 40


def test_flush_under_load_blocks_for_microseconds_not_the_queue() -> None:
    a = big()
    gputrace.enable()
    with gputrace.span("warm"):
        a @ a
    torch.cuda.synchronize()
    gputrace.flush()
    for _ in range(30):  # tens of ms queued on the compute stream
        a @ a
    waits = []
    for _ in range(5):
        with gputrace.span("tiny"):
            pass
        t0 = time.perf_counter_ns()
        gputrace.flush()
        waits.append(time.perf_counter_ns() - t0)
    assert not torch.cuda.current_stream().query(), "the queue drained during flush"
    rec = record.ACTIVE
    assert rec is not None
    u = [x.uncertainty_ns for x in rec.timelines[0].anchors]
    print(
        f"flush under load: median {statistics.median(waits) / 1e3:.1f} us; "
        f"anchor +-{statistics.median(u) / 1e3:.1f} us"
    )
    assert statistics.median(u) < 30_000
    assert statistics.median(waits) < 2_000_000
    torch.cuda.synchronize()


def test_cuda_timer_matches_event_timing() -> None:
    a = big()
    gputrace.enable()
    ref0, ref1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ref0.record()  # torch makes an event's CUDA event at its first record: ~100 us, not the kernels'
    ref1.record()
    torch.cuda.synchronize()
    with gputrace.timer("mm"):
        ref0.record()
        for _ in range(3):
            a @ a
        ref1.record()
    torch.cuda.synchronize()
    ours = gputrace.timer("mm").total_time
    theirs = ref0.elapsed_time(ref1) / 1e3
    assert abs(ours - theirs) < 20e-6 + 0.01 * theirs


def test_spans_inside_cuda_graph_capture_do_not_break_it() -> None:
    a = torch.randn(256, 256, device="cuda")
    gputrace.enable()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            a @ a
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with pytest.warns(gputrace.GputraceWarning, match="capture"):
        with torch.cuda.graph(g):
            with gputrace.span("captured"):
                out = a @ a
    g.replay()
    torch.cuda.synchronize()
    assert torch.allclose(out, a @ a)
    trace = gputrace.trace_dict()
    assert trace["metadata"]["spans_skipped_in_cuda_graph_capture"] >= 1
    with gputrace.span("after"):
        g.replay()
    assert [e["name"] for e in spans_of(gputrace.trace_dict())] == ["after"]


def test_streamed_cuda_spans_with_memory_counters_and_a_kill(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import signal
    import subprocess
    import sys

    from gputrace.trace import chrome
    from gputrace.validate import validate_file

    code = (
        "import sys, torch, gputrace\n"
        "gputrace.enable(out_dir=sys.argv[1])\n"
        "a = torch.randn(2048, 2048, device='cuda')\n"
        "n = 0\n"
        "for step in range(100000):\n"
        "    with gputrace.span('step', step=step):\n"
        "        for i in range(4):\n"
        "            with gputrace.span('mm'):\n"
        "                a @ a\n"
        "                n += 1\n"
        "    n += 1\n"
        "    torch.cuda.synchronize()\n"  # so that this flush resolves every span of the step
        "    gputrace.flush()\n"
        "    print(n, flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for _ in range(30):
        flushed = int(proc.stdout.readline())
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    path = tmp_path / "trace_rank0.json"
    trace = chrome.read(str(path))
    assert len(trace.spans) >= flushed
    assert validate_file(str(path)).ok
    counters = {trace.tracks[t].name for t in trace.counters.track}
    assert counters == {"cuda:0 memory allocated", "cuda:0 memory reserved"}
    assert min(trace.counters.value) > 0  # the matrices are allocated
    # Spans nest on the stream although every flush wrote a piece.
    assert trace.metadata.get("overflow_tracks", 0) == 0 and all("overflow" not in t.name for t in trace.tracks)


def test_the_runtime_elapsed_call_gives_torchs_numbers_and_leaves_no_error() -> None:
    """The C resolve measures events with the CUDA runtime's cudaEventElapsedTime on their raw
    handles: the same float32 as torch's elapsed_time, no answer (and no error left behind for
    torch's next launch check) for an event not yet run, and the same span times as resolving
    through torch's method."""
    from gputrace import cuda, resolve

    gputrace.enable()
    rec = record.ACTIVE
    assert rec is not None and record._hot is not None
    assert cuda.runtime_calls() is not None
    hot = record._hot
    x = big(2048)
    evs = [torch.cuda.Event(enable_timing=True) for _ in range(12)]
    for e in evs:
        e.record()
        x @ x
    torch.cuda.synchronize()
    for a in evs:
        for b in evs[::3]:
            assert hot.raw_elapsed_ms(a, b) == a.elapsed_time(b)
    y = big()
    for _ in range(30):
        y @ y
    late = torch.cuda.Event(enable_timing=True)
    late.record()
    if not late.query():
        assert hot.raw_elapsed_ms(evs[0], late) is None
    never = torch.cuda.Event(enable_timing=True)
    assert hot.raw_elapsed_ms(evs[0], never) is None
    (x @ x).sum().item()  # torch's launch checks find no error left by the refusals
    torch.cuda.synchronize()

    # Span times: the raw call against torch's method, on the same events and anchors.
    gputrace.reset()
    for i in range(50):
        with gputrace.span("mm", i=i):
            x @ x
    torch.cuda.synchronize()
    rec._anchor(0)
    pending = list(rec.pending)
    tl = rec.timelines[0]
    want = []
    for s in pending:
        a = tl.locate(s.t0, s.gen)
        assert a is not None
        b = tl.locate(s.t1, a[0])
        assert b is not None
        want.append((tl.to_host_ns(*a), tl.to_host_ns(*b)))
    assert resolve._resolve_c is not None
    rec.flush()
    got = list(zip(rec.store.start, rec.store.end))
    assert got == [(s, max(s, e)) for s, e in want]
