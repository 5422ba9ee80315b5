"""Trace formats side by side: how fast the Chrome JSON and the Perfetto protobuf writers write
the same trace, whole and streamed flush by flush, and how many bytes a span takes.

    python benchmarks/formats.py [--spans 1000000] [--flush 20000] [--repeats 3] [--dir DIR] [--entry]

`--entry`: every CUDA span carries its host entry time, as the recorder fills it, so both formats
write a launch arrow per CUDA span (compare with a run without it).

One rank of a training run as the recorder stores it (spans in the order they ended): steps of
nested spans on two CUDA streams and a host thread, a step number on every step span, memory
counters at every flush. Measured in one run, interleaved and repeated: `chrome.write` and
`perfetto.write` (a whole trace, as `save()` writes it), both `StreamWriter`s (a trace per
flush, as the session appends them; the flush traces are built before the clock starts), and
both readers. Prints medians of wall and CPU time (the CPU time moves less on a shared
machine), spans/s, bytes a span, and each protobuf figure as a ratio of the JSON one. Target:
protobuf at least 3x smaller than JSON.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gputrace.trace import chrome, perfetto  # noqa: E402
from gputrace.trace.model import Process, Trace, Track  # noqa: E402

BASE = 1_764_000_000_000_000_000
HEADER: dict[str, Any] = {
    "distributedInfo": {"rank": 0, "world_size": 8},
    "metadata": {"gputrace_version": "bench", "run_id": "b"},
}


def rank_trace(spans: int, seed: int = 0) -> Trace:
    """About `spans` spans, stored in the order they ended (children before their parents). Every
    duration and gap jitters as measured GPU times do (a few percent, on a 32 ns grid), so the
    files compress as real ones, not as a repeated pattern."""
    rng = random.Random(seed)

    def d(ns: int) -> int:
        return max(32, int(ns * rng.uniform(0.95, 1.05)) // 32 * 32)

    trace = Trace({"gputrace_version": "bench", "run_id": "b", "world_size": 8})
    p = trace.add_process(Process(1, 0, "rank 0 (bench)", 0, trace.metadata))
    compute = trace.add_track(Track(p, 1, "cuda:0 default stream", "cuda", 0, 0))
    comm = trace.add_track(Track(p, 2, "cuda:0 stream 13", "cuda", 0, 13))
    host = trace.add_track(Track(p, 3, "thread MainThread (host)", "cpu", None, 100))
    alloc = trace.add_track(Track(p, "cuda:0 memory allocated", "cuda:0 memory allocated", "counter", 0))
    t = BASE
    step = 0
    while len(trace.spans) < spans:
        s0 = t
        for j in range(12):  # forward: a layer span around two kernels
            k1 = t + d(1_000)
            k1_end = k1 + d(40_000)
            k2_end = k1_end + d(1_000) + d(8_000)
            trace.add_span("aten::mm", compute, k1, k1_end)
            trace.add_span("softmax", compute, k1_end + d(1_000), k2_end)
            t = k2_end + d(1_000)
            trace.add_span(f"layer{j}", compute, s0 if j == 0 else k1 - d(500), t)
        fwd_end = t
        trace.add_span("forward", compute, s0, fwd_end)
        t = fwd_end + d(900_000)
        trace.add_span("backward", compute, fwd_end, t)
        comm_end = t + d(20_000)
        trace.add_span("nccl:all_reduce", comm, fwd_end + d(300_000), comm_end, {"collective": True})
        opt = comm_end + d(5_000)
        opt_end = opt + d(100_000)
        trace.add_span("optimizer.step", compute, opt, opt_end)
        trace.add_span("dataloader", host, s0 - d(50_000), s0 - d(10_000))
        t = opt_end + d(5_000)
        trace.add_span("step", compute, s0, t, {"step": step})
        trace.counters.append(alloc, t, float((40 << 30) + rng.randrange(1 << 28)))
        t += d(200_000)
        step += 1
    return trace


def add_entries(trace: Trace, seed: int = 1) -> None:
    """A host entry for every CUDA span: entered 5-200 us before the GPU ran it."""
    from array import array

    rng = random.Random(seed)
    cuda = [t.kind == "cuda" for t in trace.tracks]
    sp = trace.spans
    trace.spans.entry = array(
        "q", [s - rng.randrange(5_000, 200_000) if cuda[t] else 0 for s, t in zip(sp.start, sp.track)]
    )


def flush_traces(trace: Trace, per_flush: int) -> list[tuple[Trace, range, range]]:
    """The trace cut into the traces a session appends, one per flush (tracks and names kept)."""
    out = []
    sp, c = trace.spans, trace.counters
    k = 0
    for lo in range(0, len(sp), per_flush):
        hi = min(lo + per_flush, len(sp))
        t = Trace(trace.metadata)
        t.processes, t.tracks, t.names, t._name_index = trace.processes, trace.tracks, trace.names, trace._name_index
        t.spans.extend(sp.name[lo:hi], sp.track[lo:hi], sp.start[lo:hi], sp.end[lo:hi], sp.args[lo:hi])
        if sp.entry is not None:
            t.spans.entry = sp.entry[lo:hi]
        last = sp.end[hi - 1]
        while k < len(c) and c.ts[k] <= last:
            t.counters.append(c.track[k], c.ts[k], c.value[k])
            k += 1
        out.append((t, range(hi - lo), range(len(t.counters))))
    return out


def streamed(writer: type, path: str, pieces: list[tuple[Trace, range, range]]) -> None:
    w = writer(path, BASE - 1_000_000, pieces[0][0].processes[0], HEADER)
    for t, rows, counters in pieces:
        w.append(t, rows, counters)
    w.finish({**HEADER, "metadata": {**HEADER["metadata"], "spans": w.spans_written}})


def packet_ways(spans: int) -> None:
    """Three ways to build the same begin/end packets (one sequence, its defaults giving the
    track, interned names, delta timestamps), side by side: the package's streaming builder (a
    `Trace` serialized per packet), the in-memory builder (packets appended to one `Trace` field
    by field, serialized once), and gputrace's (template packets parsed in bulk, only timestamps
    set, serialized per batch)."""
    from io import BytesIO

    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb
    from perfetto.trace_builder.proto_builder import StreamingTraceProtoBuilder, TraceProtoBuilder

    rng = random.Random(1)
    events = [(k % 2 == 0, 1 + (k // 2) % 20, rng.randrange(1, 100_000)) for k in range(2 * spans)]

    def fill(p: Any, begin: bool, iid: int, delta: int) -> None:
        p.timestamp = delta
        p.trusted_packet_sequence_id = 2
        p.sequence_flags = 2
        te = p.track_event
        te.type = 1 if begin else 2
        if begin:
            te.name_iid = iid

    def streaming() -> None:
        b = StreamingTraceProtoBuilder(BytesIO())
        for begin, iid, delta in events:
            p = b.create_packet()
            fill(p, begin, iid, delta)
            b.write_packet(p)

    def in_memory() -> None:
        b = TraceProtoBuilder()
        for begin, iid, delta in events:
            fill(b.add_packet(), begin, iid, delta)
        b.serialize()

    def templates() -> None:
        enc = perfetto._Encoder(0)
        lane = perfetto._Lane(2, 1)
        tmpl = {iid: perfetto._serialize([perfetto._event(2, 1, iid)]) for iid in range(1, 21)}
        parts = [tmpl[iid] if begin else lane.end for begin, iid, _ in events]
        enc._emit(parts, [d for *_, d in events], [], [])

    ways = {"streaming builder": streaming, "in-memory builder": in_memory, "templates (gputrace)": templates}
    cpu: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(3):
        for name, fn in ways.items():
            cpu[name].append(timed(fn)[1])
    assert len(pb.Trace.FromString(perfetto._serialize([perfetto._event(2, 1, 1)])).packet) == 1
    base = statistics.median(cpu["in-memory builder"])
    print(f"\nbuilding {spans:,} spans' begin/end packets (cpu time, median of 3):")
    for name, samples in cpu.items():
        m = statistics.median(samples)
        print(f"  {name:<22} {spans / m:12,.0f} spans/s {m / (2 * spans) * 1e9:8.0f} ns/packet {base / m:6.2f}x")


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    gc.collect()
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spans", type=int, default=1_000_000)
    ap.add_argument("--flush", type=int, default=20_000, help="spans a flush appends")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--entry", action="store_true", help="CUDA spans carry host entries: launch arrows")
    a = ap.parse_args()
    directory = a.dir or tempfile.mkdtemp(prefix="gputrace-formats-")
    os.makedirs(directory, exist_ok=True)
    t0 = time.perf_counter()
    trace = rank_trace(a.spans)
    if a.entry:
        add_entries(trace)
    pieces = flush_traces(trace, a.flush)
    n = len(trace.spans)
    built = time.perf_counter() - t0
    print(f"{n:,} spans, {len(pieces)} flushes of {a.flush:,}, built in {built:.1f} s; files in {directory}")

    paths = {
        "json": os.path.join(directory, "whole.json"),
        "perfetto": os.path.join(directory, "whole.pftrace"),
        "json stream": os.path.join(directory, "stream.json"),
        "perfetto stream": os.path.join(directory, "stream.pftrace"),
    }
    jobs: dict[str, Callable[[], object]] = {
        "json": lambda: chrome.write(trace, paths["json"], ordered=True),
        "perfetto": lambda: perfetto.write(trace, paths["perfetto"], ordered=True),
        "json stream": lambda: streamed(chrome.StreamWriter, paths["json stream"], pieces),
        "perfetto stream": lambda: streamed(perfetto.StreamWriter, paths["perfetto stream"], pieces),
        "json read": lambda: chrome.read(paths["json"]),
        "perfetto read": lambda: perfetto.read(paths["perfetto"]),
    }
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in jobs}
    for r in range(a.repeats):
        order = list(jobs) if r % 2 == 0 else list(jobs)[::-1][2:] + ["json read", "perfetto read"]
        order = [k for k in order if not k.endswith("read")] + ["json read", "perfetto read"]
        for name in order:
            samples[name].append(timed(jobs[name]))
            wall, cpu = samples[name][-1]
            print(f"  round {r + 1}: {name:<16} {wall:6.2f} s wall {cpu:6.2f} s cpu", flush=True)

    size = {k: os.path.getsize(p) for k, p in paths.items()}
    size["json read"], size["perfetto read"] = size["json"], size["perfetto"]
    assert len(perfetto.read(paths["perfetto stream"]).spans) == n
    assert len(chrome.read(paths["json stream"]).spans) == n

    def med(name: str, i: int) -> float:
        return statistics.median(s[i] for s in samples[name])

    print()
    cols = ("", "wall s", "cpu s", "spans/s (cpu)", "vs json (cpu)", "bytes/span", "size vs json")
    widths = (16, 7, 7, 13, 13, 10, 12)
    print("| " + " | ".join(f"{c:>{w}}" if i else f"{c:<{w}}" for i, (c, w) in enumerate(zip(cols, widths))) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for name in jobs:
        base = name.replace("perfetto", "json")
        speed = n / med(name, 1)
        ratio = med(base, 1) / med(name, 1)
        print(
            f"| {name:<16} | {med(name, 0):7.2f} | {med(name, 1):7.2f} | {speed:13,.0f} | {ratio:12.2f}x |"
            f" {size[name] / n:10.1f} | {size[name] / size[base]:11.3f}x |"
        )
    print()
    for kind in ("", " stream"):
        smaller = size["json" + kind] / size["perfetto" + kind]
        faster = med("json" + kind, 1) / med("perfetto" + kind, 1)
        print(
            f"perfetto{kind or ' whole'}: {smaller:.1f}x smaller than JSON (target >= 3x: {_met(smaller >= 3)}),"
            f" writes at {faster:.2f}x JSON's speed (cpu time)"
        )
    plain = inflated_size(paths["perfetto"])
    smaller = size["json"] / plain
    print(f"perfetto packets before compression: {plain / n:.1f} bytes/span, {smaller:.1f}x smaller than JSON")
    packet_ways(min(n, 200_000))


def inflated_size(path: str) -> int:
    """The file's size with its compressed packets inflated (what plain packets would take)."""
    import zlib

    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    with open(path, "rb") as f:
        trace = pb.Trace.FromString(f.read())
    return sum(
        len(zlib.decompress(p.compressed_packets)) if p.HasField("compressed_packets") else p.ByteSize() + 2
        for p in trace.packet
    )


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


if __name__ == "__main__":
    main()
