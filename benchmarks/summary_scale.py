"""How `gputrace summary` scales: per-rank files of a long run, summarized beside merging them.

    python benchmarks/summary_scale.py [--ranks 64] [--steps 10000] [--dir DIR] [--repeats 1]

Writes `--ranks` files of `--steps` steps (4 spans a step: step, forward, backward and an
all_reduce marked collective=True, on two CUDA streams), the way the recorder's files look,
with the Chrome writer; one rank is slow in every 7th step. Files in `--dir` from an earlier run
of the same size are reused. Then it times, in one run, side by side: reading the files, the
in-process summary, and the `gputrace merge` and `gputrace summary` commands as subprocesses,
and prints a table with the ratios. Target: summarizing takes no longer than merging.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gputrace import stats  # noqa: E402
from gputrace.trace import chrome  # noqa: E402
from gputrace.trace.model import Process, Trace, Track  # noqa: E402
from gputrace.version import __version__  # noqa: E402

BASE = 1_700_000_000_000_000_000


def write_rank(directory: str, rank: int, ranks: int, steps: int) -> str:
    """One rank's file: every step is 1 ms of work (+-1% jitter) then an all_reduce that ends
    when the last rank arrives; rank ranks//2 works 1.3 ms in every 7th step."""
    meta = {
        "gputrace_version": __version__,
        "rank": rank,
        "world_size": ranks,
        "run_id": "bench",
        "spans_dropped": 0,
        "spans_skipped_in_cuda_graph_capture": 0,
        "clock": {"device_anchors": [{"device": 0, "uncertainty_ns_max": 4_000}]},
    }
    trace = Trace(dict(meta))  # a rank's file carries its metadata at the top
    p = trace.add_process(Process(rank + 1, rank, f"rank {rank}", rank, meta))
    compute = trace.add_track(Track(p, 1, "cuda:0 stream 7", "cuda", 0, 7))
    comm = trace.add_track(Track(p, 2, "cuda:0 stream 13", "cuda", 0, 13))
    t = BASE
    coll = {"collective": True}
    for k in range(steps):
        # Every rank draws the same sequence, so the last arrival is known to all of them.
        rng = random.Random(k)
        work = [1_000_000 + rng.randrange(-10_000, 10_000) for _ in range(ranks)]
        if k % 7 == 3:
            work[ranks // 2] += 300_000
        last = max(work)
        mine = work[rank]
        end = t + last + 50_000
        trace.add_span("step", compute, t, end)
        trace.add_span("forward", compute, t, t + mine // 3)
        trace.add_span("backward", compute, t + mine // 3, t + mine)
        trace.add_span("all_reduce", comm, t + mine, end, coll)
        t = end + 1_000
    path = os.path.join(directory, f"trace_rank{rank}.json")
    chrome.write(trace, path)
    return path


def make_files(directory: str, ranks: int, steps: int) -> list[str]:
    stamp = os.path.join(directory, f".made-{ranks}x{steps}")
    if not os.path.exists(stamp):
        for f in os.listdir(directory):
            if f.startswith("trace_rank"):
                os.unlink(os.path.join(directory, f))
        with ProcessPoolExecutor(max_workers=2) as pool:
            list(pool.map(write_rank, [directory] * ranks, range(ranks), [ranks] * ranks, [steps] * ranks))
        open(stamp, "w").close()
    return sorted(os.path.join(directory, f"trace_rank{r}.json") for r in range(ranks))


def load(paths: list[str]) -> Trace:
    """The files as one merged, aligned trace, as `gputrace summary` and `gputrace view` load them."""
    from gputrace import merge

    return merge.load(paths)


def _children_cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_CHILDREN)
    return u.ru_utime + u.ru_stime


def timed(fn, *a):  # type: ignore[no-untyped-def]
    """(wall s, CPU s of this process and of the worker processes it started, result)."""
    gc.collect()
    t0, c0, k0 = time.perf_counter(), time.process_time(), _children_cpu()
    out = fn(*a)
    return time.perf_counter() - t0, time.process_time() - c0 + _children_cpu() - k0, out


def command(args: list[str]) -> tuple[float, float]:
    """(wall s, CPU s of the command and any processes it started)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "gputrace", *args], capture_output=True, cwd=ROOT)
    took = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"gputrace {' '.join(args)} failed:\n{r.stderr.decode()}")
    return took, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--dir", default=None, help="where the rank files are made (reused when of the same size)")
    ap.add_argument("--repeats", type=int, default=1)
    ns = ap.parse_args()
    directory = ns.dir or os.path.join(tempfile.gettempdir(), f"gputrace-summary-scale-{ns.ranks}x{ns.steps}")
    os.makedirs(directory, exist_ok=True)
    t0 = time.perf_counter()
    paths = make_files(directory, ns.ranks, ns.steps)
    made = time.perf_counter() - t0
    size = sum(os.path.getsize(p) for p in paths) / 1e6
    spans = ns.ranks * ns.steps * 4
    print(f"{ns.ranks} ranks x {ns.steps:,} steps = {spans:,} spans, {size:,.0f} MB in {directory} ({made:.1f} s)")

    # CPU seconds beside wall seconds: on a shared machine the wall clock also counts waiting
    # for a core; the ratios are taken on both.
    rows: dict[str, list[tuple[float, float]]] = {}

    def add(name: str, secs: tuple[float, float]) -> None:
        rows.setdefault(name, []).append(secs)
        print(f"  {name:<44} {secs[0]:8.2f} s wall {secs[1]:8.2f} s CPU", flush=True)

    merged = os.path.join(directory, "merged.json")
    for _ in range(ns.repeats):
        add("gputrace merge (command)", command(["merge", *paths, "-o", merged, "--quiet"]))
        add("gputrace summary (command)", command(["summary", *paths]))
        add("gputrace summary --json (command)", command(["summary", "--json", *paths]))
        wall, cpu, trace = timed(load, paths)
        add("merge.load: read + align (in process)", (wall, cpu))
        wall, cpu, summary = timed(stats.summarize, trace)
        add("summarize (in process)", (wall, cpu))
        wall, cpu, _ = timed(stats.table, summary)
        add("table (in process)", (wall, cpu))
        wall, cpu, _ = timed(stats.to_json, summary)
        add("to_json (in process)", (wall, cpu))
        del trace, summary
        os.unlink(merged)

    def med(name: str, k: int) -> float:
        v = sorted(x[k] for x in rows[name])
        return v[len(v) // 2]

    merge_wall, merge_cpu = med("gputrace merge (command)", 0), med("gputrace merge (command)", 1)
    print()
    print(f"{'stage':<44} {'wall s':>8} {'/ merge':>8} {'CPU s':>8} {'/ merge':>8}  target")
    for name in rows:
        target = "<= 1x merge" if name in ("summarize (in process)", "gputrace summary (command)") else ""
        w, c = med(name, 0), med(name, 1)
        print(f"{name:<44} {w:8.2f} {w / merge_wall:7.2f}x {c:8.2f} {c / merge_cpu:7.2f}x  {target}")
    print(f"\nsummarize: {spans / med('summarize (in process)', 1) / 1e6:.2f} M spans per CPU second")


if __name__ == "__main__":
    main()
