"""Merge and load at scale: time and peak memory, in this process's absence.

    python benchmarks/merge_scale.py [--quick] [--dir DIR] [--rounds N]

Writes synthetic per-rank traces with gputrace's own Chrome writer (per step: a host `step`
span, and forward, backward and all_reduce on a CUDA stream; a clock sync per rank), then runs
each of `merge.load` and `merge.merge` in a fresh interpreter, in that process and with worker
processes, alternating the two. Each run reports its wall time, the CPU time it and its workers
used (on a shared machine the steadier figure; the wall time is what a user waits), its peak
resident memory (VmHWM) and its largest worker's. Prints one table: medians, min-max over rounds,
and each worker run's wall time against the in-process run measured beside it. Sizes: 64 ranks
x 40,000 spans (the issue's figure) and 1,024 ranks x 2,000 spans (`--quick`: 16 x 5,000 and
128 x 500).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gputrace.trace import chrome  # noqa: E402
from gputrace.trace.model import Process, Trace, Track  # noqa: E402

BASE = 1_700_000_000_000_000_000


def rank_trace(rank: int, world: int, spans: int) -> Trace:
    meta = {
        "gputrace_version": "bench",
        "run_id": "bench",
        "rank": rank,
        "world_size": world,
        "clock": {"sync_to_rank0": [{"at_ns": BASE, "offset_ns": rank * 1_000, "error_ns": 500}]},
    }
    t = Trace(dict(meta))
    p = t.add_process(Process(rank + 1, rank, f"rank {rank}", rank, meta))
    host = t.add_track(Track(p, 1, "thread MainThread (host)", "cpu", None, 1))
    cuda = t.add_track(Track(p, 2, "cuda:0 stream 7", "cuda", 0, 0))
    s = BASE + rank * 137
    for k in range(spans // 4):
        t.add_span("step", host, s, s + 9_000, {"step": k})
        t.add_span("forward", cuda, s + 100, s + 3_000)
        t.add_span("backward", cuda, s + 3_000, s + 7_000)
        t.add_span("all_reduce", cuda, s + 7_000, s + 8_900)
        s += 10_000
    return t


def write_ranks(directory: str, ranks: int, spans: int) -> float:
    """The traces (kept from an earlier run when they are all there); returns their size in MB."""
    os.makedirs(directory, exist_ok=True)
    for r in range(ranks):
        path = os.path.join(directory, f"trace_rank{r}.json")
        if not os.path.exists(path):
            chrome.write(rank_trace(r, ranks, spans), path)
    return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)) / 1e6


CHILD = """
import sys, time
sys.path.insert(0, {root!r})
from gputrace import merge
t0 = time.perf_counter()
{call}
wall = time.perf_counter() - t0
hwm = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM'))
import resource
me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
cpu = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime  # this interpreter and its workers
print(wall, hwm / 1e3, kids.ru_maxrss / 1e3, cpu)  # ru_maxrss of children: the largest worker's peak
"""

CALLS = {
    "load": "trace = merge.load([{d!r}], workers={w}); assert len(trace.spans)",
    "merge": "merge.merge([{d!r}], {out!r}, workers={w})",
    "nothing": "pass",
}


def run_child(what: str, directory: str, workers: int, out: str) -> tuple[float, float, float, float]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = CHILD.format(root=root, call=CALLS[what].format(d=directory, w=workers, out=out))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{what} failed:\n{r.stderr}")
    wall, mb, worker_mb, cpu = r.stdout.split()
    return float(wall), float(mb), float(worker_mb), float(cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--dir", default=None, help="where to keep the synthetic traces (reused when present)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per measurement")
    ap.add_argument("--workers", type=int, default=2, help="worker processes for the parallel runs")
    args = ap.parse_args()
    sizes = [(16, 5_000), (128, 500)] if args.quick else [(64, 40_000), (1024, 2_000)]
    root = args.dir or tempfile.mkdtemp(prefix="gputrace-merge-scale-")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"# merge and load at scale; {cpus} CPUs; load average {os.getloadavg()[0]:.1f}; traces in {root}")
    _, idle_mb, _, _ = run_child("nothing", root, 1, "")
    rows: list[tuple[str, str, list[float], list[float], list[float], list[float], str]] = []
    for ranks, spans in sizes:
        d = os.path.join(root, f"{ranks}x{spans}")
        t0 = time.perf_counter()
        size = write_ranks(d, ranks, spans)
        group = f"{ranks} ranks x {spans:,} spans ({size:,.0f} MB)"
        print(f"{group}: traces ready in {time.perf_counter() - t0:.1f} s", flush=True)
        out = os.path.join(root, f"merged-{ranks}.json")
        for what in ("load", "merge"):
            times: dict[int, list[float]] = {1: [], args.workers: []}
            mems: dict[int, list[float]] = {1: [], args.workers: []}
            wmems: dict[int, list[float]] = {1: [], args.workers: []}
            cpus_used: dict[int, list[float]] = {1: [], args.workers: []}
            for _ in range(args.rounds):
                for w in (1, args.workers):  # alternated, so load on the machine hits both alike
                    wall, mb, worker_mb, cpu = run_child(what, d, w, out)
                    times[w].append(wall)
                    cpus_used[w].append(cpu)
                    mems[w].append(mb)
                    wmems[w].append(worker_mb if w > 1 else 0.0)
                    extra = f", largest worker {worker_mb:,.0f} MB" if w > 1 else ""
                    print(f"  {what} workers={w}: {wall:.2f} s (cpu {cpu:.2f} s), peak {mb:,.0f} MB{extra}", flush=True)
            base = statistics.median(times[1])
            for w in (1, args.workers):
                ratio = "1.00x" if w == 1 else f"{statistics.median(times[w]) / base:.2f}x"
                name = f"{what}, {w} worker{'s' if w > 1 else ''}" if w > 1 else f"{what}, in process"
                rows.append((group, name, times[w], cpus_used[w], mems[w], wmems[w], ratio))
        if os.path.exists(out):
            os.unlink(out)
    print()
    head = (
        f"{'traces':<38} {'run':<20} {'wall s (min-max)':>22} {'cpu s':>7} {'peak MB':>8} {'+ worker MB':>12}"
        f" {'wall ratio':>11}"
    )
    print(head)
    for group, name, times, cpu_s, mems, wmems, ratio in rows:
        t = f"{statistics.median(times):.2f} ({min(times):.2f}-{max(times):.2f})"
        w = f"{statistics.median(wmems):,.0f}" if any(wmems) else "-"
        c = statistics.median(cpu_s)
        print(f"{group:<38} {name:<20} {t:>22} {c:>7.2f} {statistics.median(mems):>8,.0f} {w:>12} {ratio:>11}")
    print(f"(an interpreter that imports gputrace.merge and does nothing peaks at {idle_mb:,.0f} MB)")


if __name__ == "__main__":
    main()
