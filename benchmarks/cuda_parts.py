"""Where a CUDA span's whole cost goes, per span: the loop of spans, and inside the flushes the
split (event queries), the anchors and the resolve (the elapsed reads and the placing), then the
save; wall and process CPU time, in rounds. Then single runtime calls, an anchor's round trip
included. Needs a GPU.

    python benchmarks/cuda_parts.py [--steps 1000] [--per 100] [--rounds 2] [--no-kernels]

Each part is timed by wrapping the recorder's own functions (a few hundred ns a call of
overhead, on calls made once a flush); single runtime calls are timed last, on events that ran.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gputrace  # noqa: E402
from gputrace import cuda, record, session  # noqa: E402

SPENT: dict[str, int] = {}
CALLS: dict[str, int] = {}


def timed(owner: Any, name: str, key: str) -> None:
    """Wrap owner.name so that its calls add their ns to SPENT[key]."""
    fn = getattr(owner, name)
    if fn is None:
        return

    def wrapper(*a: Any, **k: Any) -> Any:
        t = time.perf_counter_ns()
        try:
            return fn(*a, **k)
        finally:
            SPENT[key] = SPENT.get(key, 0) + time.perf_counter_ns() - t
            CALLS[key] = CALLS.get(key, 0) + 1

    setattr(owner, name, wrapper)


def one_run(torch: Any, steps: int, per: int, kernels: bool = True) -> dict[str, float]:
    record.set_recorder(None, None)
    session.SESSION.close()
    gputrace.enable()
    x = torch.zeros(1, device="cuda")
    span, flush = gputrace.span, gputrace.flush
    for _ in range(20):  # the pools and tracks, made before the clock starts (a job's first steps)
        for _ in range(per):
            with span("op"):
                x.add_(1)
        flush()
    session.SESSION.flush(wait=True)
    if record.ACTIVE is not None:
        record.ACTIVE.take_resolved()  # the warm-up's rows are not the run's
    torch.cuda.synchronize()
    SPENT.clear()
    CALLS.clear()
    flushing = 0
    t0, c0 = time.perf_counter_ns(), time.process_time_ns()
    work = x.add_ if kernels else (lambda _: None)
    for _ in range(steps):
        for _ in range(per):
            with span("op"):
                work(1)
        f = time.perf_counter_ns()
        flush()
        flushing += time.perf_counter_ns() - f
    s = time.perf_counter_ns()
    with tempfile.TemporaryDirectory() as d:
        gputrace.save(os.path.join(d, "t.json"))
    end, c1 = time.perf_counter_ns(), time.process_time_ns()
    n = steps * per
    out = {
        "loop (spans, kernels)": (s - t0 - flushing) / n,
        "flushes": flushing / n,
        "save": (end - s) / n,
        "total wall": (end - t0) / n,
        "total CPU (all threads)": (c1 - c0) / n,
    }
    out.update({f"  {k} ({CALLS[k]} calls)": v / n for k, v in SPENT.items()})
    return out


def single_calls(torch: Any) -> dict[str, float]:
    hot: Any = record._hot
    raw = cuda.bind_runtime_events()
    out: dict[str, float] = {}
    if hot is None or raw is None:
        return out
    a, b = raw(), raw()
    stream = torch.cuda.current_stream()
    a.record(stream)
    torch.zeros(1, device="cuda").add_(1)
    b.record(stream)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()

    def anchor(ev: Any) -> None:
        ev.record(side)
        ev.synchronize()

    calls: list[tuple[str, Callable[[], Any]]] = [
        ("cudaEventElapsedTime from C (raw_elapsed_ms)", lambda: hot.raw_elapsed_ms(a, b)),
        ("RawEvent.elapsed_time", lambda: a.elapsed_time(b)),
        ("RawEvent.query", b.query),
        ("an anchor's round trip (record on a side stream, wait)", lambda: anchor(a)),
    ]
    for name, fn in calls:
        t = time.perf_counter_ns()
        for _ in range(20_000):
            fn()
        out[name] = (time.perf_counter_ns() - t) / 20_000
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--per", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-kernels", action="store_true", help="spans around no work (no launch in the loop)")
    ns = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("cuda_parts.py: no CUDA device here; it times the CUDA runtime's calls")
    torch.zeros(1, device="cuda")
    gputrace.enable()
    timed(record.Recorder, "_anchor", "anchors")
    timed(record, "_split_c", "split (event queries)")
    timed(record, "resolve", "resolve (elapsed reads, placing)")
    timed(session.Session, "_sample_memory", "memory counters")
    timed(session.Session, "save", "save")
    for r in range(ns.rounds):
        res = one_run(torch, ns.steps, ns.per, not ns.no_kernels)
        print(f"round {r + 1}, ns a span ({ns.per} spans a flush):")
        for k, v in res.items():
            print(f"  {k:<60} {v:>10,.0f}")
    for k, v in single_calls(torch).items():
        print(f"{k:<62} {v:>10,.0f} ns a call")


if __name__ == "__main__":
    main()
