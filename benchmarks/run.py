"""gputrace benchmarks: every approach side by side in one run, interleaved, repeated.

    python benchmarks/run.py [--quick] [--out BENCHMARKS.md] [--section NAME ...]

Runs the CPU parts anywhere and the CUDA parts where a GPU is present; prints one table of
medians (with min-max over repeats) and ratios against the baseline measured in the same run,
and writes it, with the hardware and versions, to the output file (a section per machine).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gputrace  # noqa: E402
from gputrace import record, session  # noqa: E402


@dataclass
class Row:
    group: str
    name: str
    unit: str
    samples: list[float]
    baseline: str | None = None  # name of the row in the same group this is compared with
    target: str = ""  # e.g. "<= 1.25x"
    limit: float | None = None  # ratio limit (<=) or, with higher_is_better, value floor
    higher_is_better: bool = False

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


ROWS: list[Row] = []


def add(row: Row) -> Row:
    ROWS.append(row)
    print(f"  {row.group:<28} {row.name:<58} {fmt(row.median, row.unit):>14}", flush=True)
    return row


_FORMATS = {  # unit -> (divisor, format, shown unit)
    "ns": (1, ",.0f", "ns"),
    "us": (1, ",.1f", "us"),
    "ms": (1, ",.2f", "ms"),
    "s": (1, ",.2f", "s"),
    "spans/s": (1e6, ",.2f", "M/s"),
    "MB": (1, ",.0f", "MB"),
}


def fmt(v: float, unit: str) -> str:
    div, spec, shown = _FORMATS.get(unit, (1, ",.3f", unit))
    return f"{v / div:{spec}} {shown}"


def reset() -> None:
    record.set_recorder(None, None)
    session.SESSION.close()


def interleaved(
    stmts: dict[str, str], ns: dict[str, Any], number: int, repeats: int, between: Callable[[], Any] | None = None
) -> dict[str, list[float]]:
    """ns per execution of each statement; the statements take turns in every repeat.
    `between` runs after each timed batch, untimed (gputrace's flush: resolving is measured
    on its own, in the pipeline section)."""
    timers = {k: timeit.Timer(v, globals=ns) for k, v in stmts.items()}
    out: dict[str, list[float]] = {k: [] for k in stmts}
    for t in timers.values():
        t.timeit(max(1, number // 10))  # warm up
        if between:
            between()
    for _ in range(repeats):
        for k, t in timers.items():
            gc.disable()
            try:
                out[k].append(t.timeit(number) / number * 1e9)
            finally:
                gc.enable()
            if between:
                between()
    return out


class _Nothing:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> None:
        return None


# ---- host cost of one span ----------------------------------------------------------------------


def bench_host(quick: bool) -> None:
    number, repeats = (5_000, 5) if quick else (20_000, 15)
    nothing = _Nothing()
    reset()
    ns = {"gputrace": gputrace, "nothing": nothing}
    res = interleaved({"bare": "with nothing: pass", "disabled": "with gputrace.span('x'): pass"}, ns, number, repeats)
    add(Row("disabled span", "bare no-op context manager", "ns", res["bare"]))
    add(
        Row(
            "disabled span",
            "gputrace span, recording off",
            "ns",
            res["disabled"],
            "bare no-op context manager",
            "<= 1.2x",
            1.2,
        )
    )

    import time as _t

    reset()
    gputrace.enable(cuda=False, max_pending=1 << 30)
    lst: list[int] = []
    ns = {"gputrace": gputrace, "pc": _t.perf_counter_ns, "lst": lst}
    res = interleaved(
        {"floor": "a = pc(); b = pc(); lst.append((a, b))", "span": "with gputrace.span('x'): pass"},
        ns,
        number,
        repeats,
    )
    add(Row("CPU span (enabled)", "2x perf_counter_ns + list append", "ns", res["floor"]))
    add(
        Row(
            "CPU span (enabled)",
            "gputrace span (host track)",
            "ns",
            res["span"],
            "2x perf_counter_ns + list append",
            "<= 3x",
            3.0,
        )
    )
    reset()


def bench_cuda_span(quick: bool) -> None:
    import torch

    number, repeats = (5_000, 5) if quick else (20_000, 15)
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()
    e1, e2 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reset()
    # Enter + exit only, in steady state: the event pool is warm (as in a run that flushes once a
    # step) and nothing resolves inside the timed loop; resolving is the pipeline section's row.
    gputrace.enable(max_pending=1 << 30)
    for _ in range(number):
        with gputrace.span("warm"):
            pass
    torch.cuda.synchronize()
    record.ACTIVE.flush(wait=True)  # type: ignore[union-attr]

    def drain() -> None:
        torch.cuda.synchronize()
        record.ACTIVE.flush(wait=True)  # type: ignore[union-attr]

    ns = {
        "torch": torch,
        "gputrace": gputrace,
        "stream": stream,
        "e1": e1,
        "e2": e2,
        "rf": torch.profiler.record_function,
        "nvtx": torch.cuda.nvtx,
        "raw": torch._C._CudaEventBase.record,
        "Event": torch.cuda.Event,
        "dev": torch._C._cuda_getDevice,
        "raws": torch._C._cuda_getCurrentRawStream,
        "capt": torch._C._cuda_isCurrentStreamCapturing,
    }
    stmts = {
        "floor": "e1.record(stream); e2.record(stream)",
        "gputrace": "with gputrace.span('x'): pass",
        "fresh": "a = Event(enable_timing=True); a.record(); b = Event(enable_timing=True); b.record()",
        "record_function": "with rf('x'): pass",
        "nvtx": "nvtx.range_push('x'); nvtx.range_pop()",
        "raw": "raw(e1, stream); raw(e2, stream)",
        "lookup": "d = dev(); r = raws(d); d = dev(); r = raws(d)",
        "capturing": "capt(); capt()",
    }
    res = interleaved(stmts, ns, number, repeats, between=drain)
    g = "CUDA span host cost"
    add(Row(g, "floor: 2 pooled Event.record(stream)", "ns", res["floor"]))
    add(
        Row(
            g,
            "gputrace span (enabled)",
            "ns",
            res["gputrace"],
            "floor: 2 pooled Event.record(stream)",
            "<= 1.25x",
            1.25,
        )
    )
    add(Row(g, "2 raw _CudaEventBase.record(ev, stream)", "ns", res["raw"], "floor: 2 pooled Event.record(stream)"))
    add(
        Row(
            g,
            "fresh Events per span (nanotron timer style)",
            "ns",
            res["fresh"],
            "gputrace span (enabled)",
            ">= 4x",
            4.0,
            True,
        )
    )
    add(Row(g, "record_function (no profiler)", "ns", res["record_function"], "gputrace span (enabled)"))
    add(Row(g, "nvtx range_push/pop", "ns", res["nvtx"], "gputrace span (enabled)"))
    add(Row(g, "part: 2x (current device + raw stream)", "ns", res["lookup"]))
    add(Row(g, "part: 2x isCurrentStreamCapturing", "ns", res["capturing"]))
    torch.cuda.synchronize()
    reset()


def _runtime_floor(torch: Any, n: int, driver: bool = False) -> float | None:
    """ns a span for n iterations of two cudaEventRecord calls on raw handles and the raw current
    stream, in a C loop (the C build's helper), or None where the runtime's events are not had;
    `driver`: two of the driver's cuEventRecord instead (None where the driver's is not used)."""
    from gputrace import cuda

    raw = cuda.bind_runtime_events()
    hot: Any = record._hot
    if raw is None or (driver and not (hasattr(hot, "driver_record") and hot.driver_record())):
        return None
    a, b = raw(), raw()
    stream = torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())
    return float(hot.record_floor(a, b, stream, n, *([True] if driver else []))) / n


def bench_runtime_span(quick: bool) -> None:
    """A CUDA span's enter/exit against the runtime's own floor (two cudaEventRecord calls from
    C), measured in turns in one process: gputrace with the runtime's events, with torch's
    events, and with NVTX ranges on (the C functions or torch's bindings)."""
    import torch

    from gputrace import cuda, nvtx
    from gputrace.config import Config
    from gputrace.cuda import CudaDevice
    from gputrace.record import Recorder

    number, repeats = (5_000, 5) if quick else (20_000, 15)
    if _runtime_floor(torch, 100) is None:
        print("  (no runtime events: the C build is not in use or the runtime's calls are not found)")
        return
    reset()
    config = Config().replace(max_pending=1 << 30)
    clock = gputrace.HostClock()
    runtime_dev, torch_dev = CudaDevice(runtime=True), CudaDevice(runtime=False)
    recorders = {
        "runtime": Recorder(config, runtime_dev, clock),
        "torch": Recorder(config, torch_dev, clock),
        "nvtx C": Recorder(config, runtime_dev, clock),
        "nvtx torch": Recorder(config, runtime_dev, clock),
    }
    ranges = {"nvtx C": nvtx.find("runtime"), "nvtx torch": nvtx.find("torch")}
    for key, r in ranges.items():
        if r is None:
            del recorders[key]
        else:
            recorders[key].hot.nvtx = r
    span = gputrace.span
    timer = timeit.Timer("with span('x'): pass", globals={"span": span})
    out: dict[str, list[float]] = {k: [] for k in ["floor", *recorders]}

    def use(rec: Recorder) -> None:
        session.SESSION.install(rec)

    def drain() -> None:
        torch.cuda.synchronize()
        rec = record.ACTIVE
        if rec is not None:
            rec.flush(wait=True)

    hot: Any = record._hot
    driver_calls = cuda.driver_calls() if hasattr(hot, "driver_record") and hot.driver_record() else None
    driver_at = driver_calls["cuEventRecord"] if driver_calls else 0
    for key, rec in recorders.items():  # warm up: pools, tracks
        use(rec)
        timer.timeit(number)
        drain()
    out["whole"] = []
    steps = 200 if quick else 1000
    with tempfile.TemporaryDirectory() as d:
        _whole_no_kernels(torch, 20, 100, d)  # warm up
        for _ in range(repeats):
            floor = _runtime_floor(torch, number)
            assert floor is not None
            out["floor"].append(floor)
            driver = _runtime_floor(torch, number, driver=True)
            if driver is not None:
                out.setdefault("driver floor", []).append(driver)
            for key, rec in recorders.items():
                use(rec)
                gc.disable()
                try:
                    out[key].append(timer.timeit(number) / number * 1e9)
                finally:
                    gc.enable()
                drain()
            if driver_at:  # the same spans with the runtime's cudaEventRecord: what the driver's saves
                use(recorders["runtime"])
                hot.set_driver(0)
                gc.disable()
                try:
                    out.setdefault("runtime record", []).append(timer.timeit(number) / number * 1e9)
                finally:
                    gc.enable()
                    hot.set_driver(driver_at)
                drain()
            out["whole"].append(_whole_no_kernels(torch, steps, 100, d))
    g = "CUDA span vs the runtime"
    floor_name = "floor: 2 cudaEventRecord on raw handles, C loop"
    add(Row(g, floor_name, "ns", out["floor"]))
    if "driver floor" in out:  # what the hot path calls where the driver's cuEventRecord is found
        add(Row(g, "2 cuEventRecord (the driver's) on raw handles, C loop", "ns", out["driver floor"], floor_name))
    add(Row(g, "gputrace span, the runtime's events", "ns", out["runtime"], floor_name, "<= 1.2x", 1.2))
    if "runtime record" in out:
        add(Row(g, "gputrace span, the runtime's events by cudaEventRecord", "ns", out["runtime record"], floor_name))
    add(Row(g, "gputrace span, torch's events (the fallback)", "ns", out["torch"], floor_name))
    add(
        Row(
            g,
            "whole cost: span + a flush every 100 spans + save (spans around no work)",
            "ns",
            out["whole"],
            floor_name,
            "<= 1.5x",
            1.5,
        )
    )
    if "nvtx C" in out:
        add(
            Row(
                g,
                "gputrace span + NVTX range (C functions)",
                "ns",
                out["nvtx C"],
                "gputrace span, the runtime's events",
            )
        )
    if "nvtx torch" in out:
        add(
            Row(
                g,
                "gputrace span + NVTX range (torch's bindings)",
                "ns",
                out["nvtx torch"],
                "gputrace span, the runtime's events",
            )
        )
    torch.cuda.synchronize()
    reset()


# ---- the whole cost of a span: enter/exit, the flush each step, the save ----------------------------


def _whole_no_kernels(torch: Any, steps: int, per: int, directory: str) -> float:
    """ns a span of everything a user pays for `steps` x `per` CUDA spans around no work (so no
    kernel launch is subtracted: nothing but gputrace runs), a flush each `per` spans and the
    save of the trace and its digest, gc on, against the runtime floor measured in turns with
    it. A fresh recorder, as a job starts; its pools and tracks warmed by the first 20 steps
    (the events a job makes once, in its first steps, whatever its length), whose rows are then
    dropped."""
    reset()
    gputrace.enable()
    span, flush = gputrace.span, gputrace.flush
    for _ in range(20):
        for _ in range(per):
            with span("op"):
                pass
        flush()
    session.SESSION.flush(wait=True)
    rec = record.ACTIVE
    assert rec is not None
    rec.take_resolved()
    torch.cuda.synchronize()
    t = time.perf_counter_ns()
    for _ in range(steps):
        for _ in range(per):
            with span("op"):
                pass
        flush()
    gputrace.save(os.path.join(directory, f"whole{next(_RUNS)}.json"))
    ns = time.perf_counter_ns() - t
    reset()
    return ns / (steps * per)


# Each run saves to a file of its own, as a job saves its trace once (saving over an earlier
# run's file also pays for deleting it: a few ms for 100,000 spans on the H200 VM).
_RUNS = itertools.count()


def _whole_host(steps: int, per: int, directory: str) -> dict[str, float]:
    """Seconds for `steps` x `per` host spans, each way, one after the other."""
    pc = time.perf_counter_ns
    out: dict[str, float] = {}
    t = time.perf_counter()
    for _ in range(steps):
        for _ in range(per):
            pass
    out["bare"] = time.perf_counter() - t
    lst: list[tuple[int, int]] = []
    t = time.perf_counter()
    for _ in range(steps):
        for _ in range(per):
            a = pc()
            b = pc()
            lst.append((a, b))
    out["floor"] = time.perf_counter() - t
    for key, options in (("gputrace", {}), ("streamed", {"out_dir": os.path.join(directory, f"s{next(_RUNS)}")})):
        reset()
        gputrace.enable(cuda=False, **options)
        span, flush = gputrace.span, gputrace.flush
        flushing = 0.0
        t = time.perf_counter()
        for _ in range(steps):
            for _ in range(per):
                with span("op"):
                    pass
            f = time.perf_counter()
            flush()
            flushing += time.perf_counter() - f
        s = time.perf_counter()
        gputrace.save(os.path.join(directory, f"{key}{next(_RUNS)}.json") if not options else None)
        end = time.perf_counter()
        out[key] = end - t
        out[key + ":flush"], out[key + ":save"] = flushing, end - s  # parts, not beyond the bare loop
    reset()
    return out


def _whole_cuda(steps: int, per: int, directory: str) -> dict[str, float]:
    import torch

    x = torch.zeros(1, device="cuda")
    stream = torch.cuda.current_stream()
    pools = [[torch.cuda.Event(enable_timing=True) for _ in range(2 * per + 1)] for _ in range(2)]
    out: dict[str, float] = {}
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        for _ in range(per):
            x.add_(1)
    torch.cuda.synchronize()
    out["bare"] = time.perf_counter() - t
    # The floor of any CUDA-event timer that yields numbers: two pooled records a span, and two
    # elapsed_time a span (start and end against a reference) once the step has run.
    out["floor"] = _event_timer(torch, x, stream, pools, steps, per)
    # The same floor with the CUDA runtime's cudaEventElapsedTime called from C on the events'
    # raw handles (what gputrace's resolve calls) instead of torch's elapsed_time.
    from gputrace import cuda, record

    hot: Any = getattr(record, "_hot", None)  # the C build in use, or None
    if hot is not None and cuda.bind_raw_elapsed(torch._C._CudaEventBase.elapsed_time):
        out["floor_raw"] = _event_timer(torch, x, stream, pools, steps, per, hot.raw_elapsed_ms)
    # The runtime's floor: two cudaEventRecord calls a span from C, nothing read back.
    floor_c = _runtime_floor(torch, steps * per)
    if floor_c is not None:
        out["floor_c"] = floor_c * steps * per / 1e9 + out["bare"]  # seconds, as the others
    for key, options in (("gputrace", {}), ("streamed", {"out_dir": os.path.join(directory, f"c{next(_RUNS)}")})):
        reset()
        gputrace.enable(**options)
        span, flush = gputrace.span, gputrace.flush
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            for _ in range(per):
                with span("op"):
                    x.add_(1)
            flush()
        gputrace.save(os.path.join(directory, f"{key}{next(_RUNS)}_cuda.json") if not options else None)
        out[key] = time.perf_counter() - t
    reset()
    return out


def _event_timer(
    torch: Any,
    x: Any,
    stream: Any,
    pools: list[list[Any]],
    steps: int,
    per: int,
    elapsed: Callable[[Any, Any], Any] | None = None,
) -> float:
    """Seconds for `steps` steps of `per` spans timed with bare pooled event pairs, each step's
    numbers read (against the step's first event) once the next step is queued: with torch's
    `Event.elapsed_time`, or with `elapsed(a, b)`."""
    times: list[float] = []
    torch.cuda.synchronize()
    t = time.perf_counter()
    prev = None
    for k in range(steps):
        pool = pools[k % 2]
        if prev is not None:
            prev[-1].synchronize()  # the previous step, long finished: its numbers
            ref = prev[0]
            if elapsed is None:  # torch's Event.elapsed_time, called as a user calls it
                for i in range(1, 2 * per + 1, 2):
                    times.append(ref.elapsed_time(prev[i]))
                    times.append(ref.elapsed_time(prev[i + 1]))
            else:
                for i in range(1, 2 * per + 1, 2):
                    times.append(elapsed(ref, prev[i]))
                    times.append(elapsed(ref, prev[i + 1]))
        pool[0].record(stream)
        for i in range(1, 2 * per + 1, 2):
            pool[i].record(stream)
            x.add_(1)
            pool[i + 1].record(stream)
        prev = pool
    torch.cuda.synchronize()
    return time.perf_counter() - t


def bench_whole(quick: bool, cuda: bool) -> None:
    """Host time a span costs beyond the bare loop, everything a user pays included: enter and
    exit, a flush a step (resolving, writing when streamed), and the save at the end."""
    import tempfile

    # 100,000 spans a run (a short run): the save's fixed costs (an fsync and a rename for the
    # trace and for the digest, ~10 ms on the CPU machine) are spread over them as in a real run.
    steps, per, repeats = (100, 100, 3) if quick else (1000, 100, 7)
    n = steps * per
    kinds = [("host", _whole_host)] + ([("CUDA", _whole_cuda)] if cuda else [])
    for kind, run in kinds:
        res: dict[str, list[float]] = {}
        with tempfile.TemporaryDirectory() as d:
            run(max(2, steps // 10), per, d)  # warm up: pools, tracks, imports
            for _ in range(repeats):
                for key, secs in run(steps, per, d).items():
                    res.setdefault(key, []).append(secs)
        bare = statistics.median(res["bare"])
        per_span = {k: [(v if ":" in k else v - bare) / n * 1e9 for v in vs] for k, vs in res.items() if k != "bare"}
        g = f"whole cost, {kind} span"
        floor = "2x perf_counter_ns + list append" if kind == "host" else "floor: 2 pooled record + 2 elapsed_time"
        add(Row(g, floor, "ns", per_span["floor"]))
        target = ("<= 3x", 3.0) if kind == "host" else ("<= 1.3x", 1.3)
        add(Row(g, "gputrace: span + flush a step + save", "ns", per_span["gputrace"], floor, *target))
        # Streaming (an output directory) is not the default: its row has no target of its own.
        add(Row(g, "gputrace streamed to out_dir (flush writes)", "ns", per_span["streamed"], floor))
        for key, label in (("gputrace", ""), ("streamed", ", streamed")):
            if key + ":flush" in per_span:
                add(Row(g, f"part: the flushes{label}", "ns", per_span[key + ":flush"], floor))
                add(Row(g, f"part: the save{label}", "ns", per_span[key + ":save"], floor))
        if "floor_raw" in per_span:
            add(Row(g, "floor with the runtime's cudaEventElapsedTime from C", "ns", per_span["floor_raw"], floor))
        if "floor_c" in per_span:
            floor_c = "floor: 2 cudaEventRecord on raw handles, C loop"
            add(Row(g, floor_c, "ns", per_span["floor_c"]))
            add(
                Row(
                    g,
                    "gputrace (span + flushes + save) / the runtime floor",
                    "ns",
                    per_span["gputrace"],
                    floor_c,
                    "<= 1.5x",
                    1.5,
                )
            )
    _auto_resolve_pause(quick)


def _auto_resolve_pause(quick: bool) -> None:
    """The longest single span exit in a run that never flushes (the automatic resolve), beside
    the longest single iteration of the floor's loop (two clock reads and an append) over as
    many iterations in the same run: the pauses the machine itself causes (page faults, the
    hypervisor taking the core), which no recorder can avoid."""
    import gc

    pc = time.perf_counter_ns
    n = 100_000 if quick else 300_000
    worst: list[float] = []
    floor: list[float] = []
    for _ in range(3):
        lst: list[tuple[int, int]] = []
        longest = 0
        gc.disable()  # the collector's own pauses are not gputrace's
        try:
            for _ in range(n):
                t = pc()
                a = pc()
                b = pc()
                lst.append((a, b))
                longest = max(longest, pc() - t)
        finally:
            gc.enable()
        floor.append(longest / 1e6)
        del lst
        reset()
        gputrace.enable(cuda=False)
        span = gputrace.span
        longest = 0
        gc.disable()
        try:
            for _ in range(n):
                t = pc()
                with span("x"):
                    pass
                longest = max(longest, pc() - t)
        finally:
            gc.enable()
        worst.append(longest / 1e6)
        reset()
    g = "whole cost, host span"
    add(Row(g, "floor: longest iteration of 2x perf_counter_ns + append", "ms", floor))
    add(Row(g, "longest span exit (automatic resolve), no flush", "ms", worst, None, "<= 5 ms", 5.0))


# ---- a real step -------------------------------------------------------------------------------


def _model(torch: Any, width: int, depth: int) -> Any:
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n1, self.n2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
            self.heads = max(1, width // 128)

        def forward(self, x: Any) -> Any:
            span = gputrace.span
            b, t, c = x.shape
            with span("attention"):
                with span("qkv"):
                    q, k, v = self.qkv(self.n1(x)).view(b, t, 3, self.heads, c // self.heads).unbind(2)
                with span("sdpa"):
                    y = torch.nn.functional.scaled_dot_product_attention(
                        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
                    )
                with span("proj"):
                    x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
            with span("mlp"):
                with span("fc1"):
                    h = torch.nn.functional.gelu(self.fc1(self.n2(x)))
                with span("fc2"):
                    x = x + self.fc2(h)
            return x

    return nn.ModuleList([Block() for _ in range(depth)])


def _step_fn(torch: Any, width: int, depth: int, batch: int, seq: int, dtype: Any) -> Callable[[], None]:
    model = _model(torch, width, depth).cuda().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x0 = torch.randn(batch, seq, width, device="cuda", dtype=dtype)

    def step() -> None:
        span = gputrace.span  # looked up per step: the benchmark swaps in the floor variant
        with span("step"):
            with span("forward"):
                x = x0
                for i, blk in enumerate(model):
                    with span("block", layer=i):
                        x = blk(x)
                loss = x.float().pow(2).mean()
            with span("backward"):
                loss.backward()
            with span("optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)

    return step


class _RawEvents:
    """The floor for a real step: the same spans as bare pooled event pairs on the (only)
    stream, with no bookkeeping. What any CUDA-event timer costs the GPU and the host."""

    def __init__(self, torch: Any, n: int = 8192) -> None:
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        self.stream = torch.cuda.current_stream()
        self.i = 0

    def __call__(self, name: str, **args: Any) -> _RawEvents:
        return self

    def __enter__(self) -> None:
        self.events[self.i % len(self.events)].record(self.stream)
        self.i += 1

    def __exit__(self, *a: Any) -> None:
        self.events[self.i % len(self.events)].record(self.stream)
        self.i += 1


def bench_step(quick: bool) -> None:
    import torch

    real_span = gputrace.span
    for label, (width, depth, batch, seq), rounds in [
        ("GPU-bound step", (2048, 12, 8, 1024), 8 if quick else 25),
        ("launch-bound step", (128, 12, 1, 16), 15 if quick else 60),
    ]:
        reset()
        gputrace.enable()
        step = _step_fn(torch, width, depth, batch, seq, torch.bfloat16)
        raw = _RawEvents(torch)
        for _ in range(3):
            step()
        gputrace.flush()
        torch.cuda.synchronize()
        spans_per_step = 4 + depth * 9
        variants = ["off", "raw", "on"]
        times: dict[str, list[float]] = {v: [] for v in variants}
        for i in range(rounds):
            for v in variants[i % 3 :] + variants[: i % 3]:  # rotate the order every round
                gputrace.span = raw if v == "raw" else real_span  # type: ignore[assignment]
                if v == "on":
                    gputrace.enable()
                else:
                    gputrace.disable()
                torch.cuda.synchronize()
                t0 = time.perf_counter_ns()
                step()
                if v == "on":
                    gputrace.flush()
                torch.cuda.synchronize()
                times[v].append((time.perf_counter_ns() - t0) / 1e6)
        gputrace.span = real_span  # type: ignore[assignment]
        g = f"{label} ({spans_per_step} spans)"
        add(Row(g, "gputrace off", "ms", times["off"]))
        add(Row(g, "floor: bare pooled event pairs, no gputrace", "ms", times["raw"], "gputrace off"))
        limit = 1.01 if label.startswith("GPU") else None
        add(
            Row(
                g,
                "gputrace on (+ flush each step)",
                "ms",
                times["on"],
                "gputrace off",
                "<= 1.01x" if limit else "",
                limit,
            )
        )
        gputrace.disable()
        del step
        torch.cuda.empty_cache()
    reset()


# ---- anchoring under load ----------------------------------------------------------------------


def bench_anchor(quick: bool) -> None:
    import torch

    from gputrace.clock import HostClock, take_anchor
    from gputrace.cuda import CudaDevice

    dev = CudaDevice()
    clock = HostClock()
    side = dev.side_stream(0)
    pool = [dev.new_event() for _ in range(2)]
    for ev in pool:  # created on first record: keep that out of the figures, as the recorder's pool does
        dev.record(ev, side)
    torch.cuda.synchronize()

    def poll(ev: Any) -> None:
        while not ev.query():
            pass

    waits = {"synchronize()": lambda ev: ev.synchronize(), "polling query()": poll}
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    idle: list[float] = []
    first: dict[str, list[float]] = {k: [] for k in waits}
    second: dict[str, list[float]] = {k: [] for k in waits}
    queued: list[float] = []
    for i in range(20 if quick else 60):
        t0 = time.perf_counter_ns()
        take_anchor(lambda: pool[0], dev.record, side, clock, 1)
        idle.append((time.perf_counter_ns() - t0) / 1e3)
        for _ in range(20):
            a @ a
        # Both ways of waiting, in turn first and second after the matmuls are queued: the first
        # anchor after a burst of launches pays for them, whichever way it waits.
        order = list(waits) if i % 2 == 0 else list(waits)[::-1]
        for k, name in enumerate(order):
            t0 = time.perf_counter_ns()
            take_anchor(lambda: pool[0], dev.record, side, clock, 1, wait=waits[name])
            (first if k == 0 else second)[name].append((time.perf_counter_ns() - t0) / 1e3)
        queued.append(0.0 if torch.cuda.current_stream().query() else 1.0)
        torch.cuda.synchronize()
    g = "anchor (1 try) host block"
    add(Row(g, "idle GPU (synchronize)", "us", idle))
    for name in waits:
        add(Row(g, f"busy stream, first after 20 queued 8k matmuls, {name}", "us", first[name]))
    add(
        Row(
            g,
            "busy stream, second anchor, synchronize() (gputrace's way)",
            "us",
            second["synchronize()"],
            None,
            "< 30 us",
            30.0,
        )
    )
    add(Row(g, "busy stream, second anchor, polling query()", "us", second["polling query()"]))
    add(Row(g, "compute queue still busy after the anchors (1 = yes)", "x", queued, None, "= 1", None))


# ---- resolve, export, merge, start-up ---------------------------------------------------------


def _host_spans(n: int) -> None:
    for i in range(n // 4):
        with gputrace.span("step", i=i):
            with gputrace.span("fwd"):
                with gputrace.span("layer"):
                    pass
            with gputrace.span("bwd"):
                pass


def bench_pipeline(quick: bool, cuda: bool) -> None:
    n = 50_000 if quick else 250_000
    resolve_s, export_s = [], []
    for _ in range(3):
        reset()
        gputrace.enable(cuda=cuda, max_pending=1 << 30)
        _host_spans(n)
        if cuda:
            import torch

            torch.cuda.synchronize()
        t0 = time.perf_counter()
        record.ACTIVE.flush(wait=True)  # type: ignore[union-attr]
        resolve_s.append(n / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        data = session.trace_bytes()  # what save() writes: layout, encoding, metadata
        export_s.append(n / (time.perf_counter() - t0))
        del data
    kind = "CUDA" if cuda else "host"
    add(Row("pipeline", f"resolve at flush ({kind} spans)", "spans/s", resolve_s))
    add(
        Row(
            "pipeline",
            f"export to Chrome JSON ({kind} spans)",
            "spans/s",
            export_s,
            None,
            ">= 1M/s" if not cuda else "",
            1e6 if not cuda else None,
            True,
        )
    )
    reset()


def bench_startup(quick: bool) -> None:
    samples = []
    for _ in range(5 if quick else 15):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "gputrace", "--help"], capture_output=True, check=True)
        samples.append((time.perf_counter() - t0) * 1e3)
    r = subprocess.run(
        [sys.executable, "-c", "import sys, gputrace.cli; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
    )
    add(
        Row(
            "start-up",
            "gputrace --help (torch imported: " + r.stdout.strip() + ")",
            "ms",
            samples,
            None,
            "< 150 ms",
            150.0,
        )
    )


def bench_merge(quick: bool) -> None:
    try:
        from gputrace import merge as merge_mod
    except ImportError:
        return
    ranks, per = (8, 25_000) if quick else (8, 250_000)
    with tempfile.TemporaryDirectory() as d:
        code = (
            "import sys; sys.path.insert(0, %r); from benchmarks.run import write_synthetic; "
            "write_synthetic(%r, %d, %d)" % (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), d, ranks, per)
        )
        subprocess.run([sys.executable, "-c", code], check=True)
        size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)) / 1e6
        # Peaks from VmHWM: ru_maxrss survives exec, so a child of this (torch-loaded) process
        # would report the parent's peak. The interpreter's own peak is subtracted.
        base_r = subprocess.run(
            [
                sys.executable,
                "-c",
                "import gputrace.cli, gputrace.merge; "
                "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        baseline = int(base_r.stdout.strip().splitlines()[-1]) / 1e3
        secs, peaks = [], []
        for _ in range(1 if not quick else 1):
            out = os.path.join(d, "merged.json")
            t0 = time.perf_counter()
            r = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "import resource, sys; from gputrace.cli import main; "
                    "sys.argv=['gputrace','merge',%r,'-o',%r,'--quiet'];\n"
                    "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
                    "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))" % (d, out),
                ],
                capture_output=True,
                text=True,
            )
            secs.append(time.perf_counter() - t0)
            assert r.returncode == 0, r.stderr
            peaks.append(int(r.stdout.strip().splitlines()[-1]) / 1e3)
        _ = merge_mod
    g = f"merge {ranks} ranks x {per:,} spans ({size:,.0f} MB in)"
    add(Row(g, "wall time", "s", secs))
    add(Row(g, "peak RSS of the merge process", "MB", peaks))
    add(Row(g, "peak RSS of the same interpreter doing nothing", "MB", [baseline]))
    add(
        Row(
            g,
            f"merge's own peak (difference; target <= 2x input = {2 * size:,.0f} MB)",
            "MB",
            [p - baseline for p in peaks],
            None,
            "<= 2x input",
            2 * size,
        )
    )


# name index, track, start, end of each span of one synthetic step, in the order they end
_STEP_SHAPE = ((2, 0, 20, 300), (1, 0, 10, 400), (3, 0, 500, 900), (5, 1, 600, 950), (0, 0, 0, 1000))


def write_synthetic(directory: str, ranks: int, per: int) -> None:
    """Per-rank traces of `per` spans each, as the recorder writes them."""
    from gputrace.trace import chrome
    from gputrace.trace.model import Process, Trace, Track

    base = time.time_ns()
    names = ["step", "forward", "block", "backward", "optimizer", "all_reduce"]
    for r in range(ranks):
        meta = {"gputrace_version": gputrace.__version__, "rank": r, "world_size": ranks, "rank_source": "env"}
        trace = Trace(dict(meta))
        p = trace.add_process(Process(r + 1, r, f"rank {r}", r, meta))
        tracks = [
            trace.add_track(Track(p, 0, "cuda:0 default stream", "cuda", 0, 0)),
            trace.add_track(Track(p, 1, "cuda:0 stream 1", "cuda", 0, 1)),
        ]
        t = base + r * 1000
        for _ in range(per // 5):
            for ni, ti, s0, e0 in (
                (2, 0, 20, 300),
                (1, 0, 10, 400),
                (3, 0, 500, 900),
                (5, 1, 600, 950),
                (0, 0, 0, 1000),
            ):
                trace.add_span(names[ni], tracks[ti], t + s0, t + e0)
            t += 1000
        chrome.write(trace, os.path.join(directory, f"trace_rank{r}.json"))


# ---- report ------------------------------------------------------------------------------------


def hardware() -> dict[str, str]:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    info = {"cpu": f"{cpu} ({os.cpu_count()} cores)", "python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["cuda"] = str(torch.version.cuda)
    except ImportError:
        pass
    return info


def table() -> str:
    lines = ["| group | measurement | median | min-max | ratio | target | met |", "|---|---|---|---|---|---|---|"]
    by_name = {(r.group, r.name): r for r in ROWS}
    for r in ROWS:
        ratio, met = "", ""
        if r.baseline:
            b = by_name[(r.group, r.baseline)]
            x = r.median / b.median
            ratio = f"{x:.2f}x of {r.baseline.split(':')[0]}"
            if r.limit is not None:
                met = "yes" if (x >= r.limit if r.higher_is_better else x <= r.limit) else "NO"
        elif r.limit is not None:
            met = "yes" if (r.median >= r.limit if r.higher_is_better else r.median < r.limit) else "NO"
        lo, hi = min(r.samples), max(r.samples)
        lines.append(
            f"| {r.group} | {r.name} | {fmt(r.median, r.unit)} | {fmt(lo, r.unit)} - {fmt(hi, r.unit)} "
            f"| {ratio} | {r.target} | {met} |"
        )
    return "\n".join(lines)


SECTIONS = {
    "host": lambda q, cuda: bench_host(q),
    "cuda": lambda q, cuda: cuda and bench_cuda_span(q),
    "runtime": lambda q, cuda: cuda and bench_runtime_span(q),
    "step": lambda q, cuda: cuda and bench_step(q),
    "anchor": lambda q, cuda: cuda and bench_anchor(q),
    "pipeline": lambda q, cuda: (bench_pipeline(q, False), cuda and bench_pipeline(q, True)),
    "whole": lambda q, cuda: bench_whole(q, cuda),
    "merge": lambda q, cuda: bench_merge(q),
    "startup": lambda q, cuda: bench_startup(q),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    ap.add_argument("--out", default=None, help="markdown file to add this run's section to")
    ap.add_argument("--section", action="append", choices=sorted(SECTIONS), help="run only these sections")
    ns = ap.parse_args()
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    hw = hardware()
    print("hardware: " + "; ".join(f"{k} {v}" for k, v in hw.items()), flush=True)
    for name in ns.section or list(SECTIONS):
        SECTIONS[name](ns.quick, cuda)
    text = table()
    print()
    print(text)
    if ns.out:
        title = hw.get("gpu", "CPU only") + " / " + hw["cpu"]
        cmd = (
            "python benchmarks/run.py"
            + (" --quick" if ns.quick else "")
            + "".join(f" --section {s}" for s in ns.section or [])
        )
        section = (
            f"## {title}\n\n"
            f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} with `{cmd}`; "
            + ", ".join(f"{k} {v}" for k, v in hw.items())
            + ".\n\n"
            + text
            + "\n"
        )
        with open(ns.out, "a") as f:
            f.write("\n" + section)


if __name__ == "__main__":
    main()
