"""What the live straggler report (`report_every`) costs: real gloo processes on this machine.

    python benchmarks/report_scale.py [--worlds 8 64] [--reports 10] [--every 5] [--spans 20]

For each world size, one process group (forked from this process after torch is imported) runs
steps of `--spans` spans each (one of them a collective-marked span) with a flush after each
step, and `report_every=--every`. Before each flush every rank waits at a barrier (outside the
timing), so a flush's time is its own, not the skew between ranks. Per world it prints the
median (min-max) over ranks and reports of:

- `report flush`: a flush that reports (one all_gather of 10 int64 a rank on the report's gloo
  group, the report built on every rank, one log record on rank 0), the slowest rank's time;
- `first report`: the same, the first time, with the gloo group being made (once a run);
- `plain flush`: a flush between reports, with report_every on (the rows read, the steps counted);
- `flush, off`: a flush of the same steps without report_every (the baseline);
- `bare all_gather`: the same all_gather alone, on the job's group (what the collective costs).

On a 2-core machine 64 processes share 2 cores: every message costs context switches among all
of them, so the times at 64 ranks are upper bounds of what one host's worth of ranks pays.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402  (imported before the fork: the children share it)
import torch.distributed as dist  # noqa: E402

import gputrace  # noqa: E402
from gputrace import native, session  # noqa: E402
from gputrace.demo import free_port  # noqa: E402

KINDS = ("report flush", "first report", "plain flush", "flush, off", "bare all_gather")


def steps(n: int, spans: int, flushes: list[int], barrier: bool) -> None:
    for _ in range(n):
        with gputrace.span("step"):
            for _ in range(spans - 2):
                with gputrace.span("work"):
                    pass
            with gputrace.span("sync", collective=True):
                pass
        if barrier:
            dist.barrier()
        t0 = time.perf_counter_ns()
        gputrace.flush()
        flushes.append(time.perf_counter_ns() - t0)


def child(rank: int, world: int, port: int, reports: int, every: int, spans: int, out: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    logging.getLogger("gputrace.straggler").addHandler(logging.NullHandler())
    times: dict[str, list[int]] = {k: [] for k in KINDS}
    session.SESSION.close()
    gputrace.enable(cuda=False)
    off: list[int] = []
    steps(every * reports, spans, off, True)
    times["flush, off"] = off
    session.SESSION.close()
    gputrace.enable(cuda=False, report_every=every)
    on: list[int] = []
    steps(every * (reports + 1), spans, on, True)
    for i, t in enumerate(on):
        if (i + 1) % every:
            times["plain flush"].append(t)
        elif i + 1 == every:
            times["first report"].append(t)
        else:
            times["report flush"].append(t)
    report = gputrace.last_report()
    assert report is not None and report["report"] == reports + 1
    box = torch.zeros(10, dtype=torch.int64)
    for _ in range(reports):
        dist.barrier()
        t0 = time.perf_counter_ns()
        dist.all_gather([torch.empty_like(box) for _ in range(world)], box)
        times["bare all_gather"].append(time.perf_counter_ns() - t0)
    out.put((rank, times))
    dist.barrier()
    session.SESSION.close()
    dist.destroy_process_group()


def measure(world: int, reports: int, every: int, spans: int) -> dict[str, list[float]]:
    ctx = mp.get_context("fork")
    q: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=child, args=(r, world, port, reports, every, spans, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join(timeout=120)
        if p.exitcode != 0:
            raise SystemExit(f"a rank of the {world}-process group exited with {p.exitcode}")
    res: dict[str, list[float]] = {}
    for k in KINDS:
        # A collective: the slowest rank's time, report by report.
        if k in ("report flush", "first report", "bare all_gather"):
            n = len(got[0][k])
            res[k] = [max(got[r][k][i] for r in got) / 1e3 for i in range(n)]
        else:  # per rank: each flush
            res[k] = [t / 1e3 for r in got for t in got[r][k]]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--reports", type=int, default=10)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--spans", type=int, default=20)
    args = ap.parse_args()
    print(
        f"straggler report cost, gloo on {os.cpu_count()} cores, report_every={args.every}, {args.spans} spans a "
        f"step, torch {torch.__version__}, {'C' if native.hot is not None else 'Python'} hot path"
    )
    print(f"{'ranks':>5}  {'what':<14} {'median us':>10} {'min-max us':>20}")
    for world in args.worlds:
        res = measure(world, args.reports, args.every, args.spans)
        for k in KINDS:
            v = res[k]
            print(f"{world:>5}  {k:<14} {statistics.median(v):>10.1f} {min(v):>9.1f}-{max(v):<10.1f}", flush=True)


if __name__ == "__main__":
    main()
