"""How long `sync_clocks()` takes as the world grows: real gloo processes on this machine.

    python benchmarks/sync_scale.py [--worlds 8 16 32 64] [--repeats 5] [--exchanges 16]

For each world size, one process group (forked from this process after torch is imported, so
the children share its pages) times, interleaved in every repeat, four ways to sync:

- `one host`: every rank on this machine, as it is: one all_gather_object and no exchange;
- `hosts of 8`: `GPUTRACE_HOST_ID` (the test seam) makes each 8 consecutive ranks a host: one
  leader per host, the leaders in a binomial tree, the others derived from their leader;
- `every rank a host`: the tree with every rank a leader (the most exchanges gputrace makes);
- `serial (before)`: rank 0 ping-pongs every other rank in turn, as gputrace did before.

and, once per world, how long gloo took to build the group (every pair connected: what a gloo
side group costs the first sync_clocks() of an NCCL job).

A call's wall time is from a barrier until the last rank returns (the largest per-rank time).
Prints the medians over repeats (min-max) and each against `serial (before)` of the same world.
On a 2-core machine every message costs context switches among all the processes, so these are
upper bounds for one host's worth of processes; docs/scale.md turns them into a projection.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402  (imported before the fork: the children share it)
import torch.distributed as dist  # noqa: E402

from gputrace import dist as gdist  # noqa: E402
from gputrace.clock import HostClock  # noqa: E402
from gputrace.demo import free_port  # noqa: E402

MODES = ("one host", "hosts of 8", "every rank a host", "serial (before)")


def serial_sync(clock: HostClock, exchanges: int) -> None:
    """The earlier protocol: rank 0 answers every other rank in turn."""
    me, world = dist.get_rank(), dist.get_world_size()
    buf = torch.zeros(1, dtype=torch.int64)
    if me == 0:
        for r in range(1, world):
            for _ in range(exchanges):
                dist.recv(buf, src=r)
                buf[0] = clock.now()
                dist.send(buf, dst=r)
        return
    for _ in range(exchanges):
        dist.send(buf, dst=0)
        dist.recv(buf, src=0)


def child(rank: int, world: int, port: int, repeats: int, exchanges: int, out: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    t0 = time.perf_counter_ns()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dist.barrier()
    init_ns = time.perf_counter_ns() - t0
    clock = HostClock()
    calls = {
        "one host": lambda: gdist.sync_clocks(clock, None, exchanges),
        "hosts of 8": lambda: gdist.sync_clocks(clock, None, exchanges),
        "every rank a host": lambda: gdist.sync_clocks(clock, None, exchanges),
        "serial (before)": lambda: serial_sync(clock, exchanges),
    }
    host = {"one host": None, "hosts of 8": f"h{rank // 8}", "every rank a host": f"r{rank}", "serial (before)": None}
    times: dict[str, list[int]] = {m: [] for m in MODES}
    for rep in range(repeats + 1):  # the first round warms up (connections, code paths)
        for mode in MODES:
            if host[mode] is None:
                os.environ.pop(gdist.HOST_ID_ENV, None)
            else:
                os.environ[gdist.HOST_ID_ENV] = host[mode]  # type: ignore[assignment]
            dist.barrier()
            t0 = time.perf_counter_ns()
            calls[mode]()
            if rep:
                times[mode].append(time.perf_counter_ns() - t0)
    out.put((rank, times, init_ns))
    dist.barrier()
    dist.destroy_process_group()


def measure(world: int, repeats: int, exchanges: int) -> tuple[dict[str, list[float]], float]:
    ctx = mp.get_context("fork")
    q: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=child, args=(r, world, port, repeats, exchanges, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = [q.get(timeout=1800) for _ in procs]
    per_rank = {r: t for r, t, _ in got}
    init_ms = max(i for _, _, i in got) / 1e6
    for p in procs:
        p.join(timeout=120)
        if p.exitcode != 0:
            raise SystemExit(f"a rank of the {world}-process group exited with {p.exitcode}")
    # A call's wall time: the slowest rank's, repeat by repeat.
    res = {m: [max(per_rank[r][m][i] for r in per_rank) / 1e6 for i in range(repeats)] for m in MODES}
    return res, init_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--exchanges", type=int, default=16)
    args = ap.parse_args()
    print(
        f"sync_clocks() wall time, gloo on {os.cpu_count()} cores, {args.exchanges} exchanges per pair, "
        f"torch {torch.__version__}"
    )
    print(f"{'ranks':>5}  {'mode':<18} {'median ms':>10} {'min-max ms':>16} {'vs serial':>10}")
    for world in args.worlds:
        res, init_ms = measure(world, args.repeats, args.exchanges)
        base = statistics.median(res["serial (before)"])
        for mode in MODES:
            v = res[mode]
            med = statistics.median(v)
            print(f"{world:>5}  {mode:<18} {med:>10.1f} {min(v):>7.1f}-{max(v):<8.1f} {med / base:>9.2f}x", flush=True)
        print(f"{world:>5}  {'(gloo group, once)':<18} {init_ms:>10.1f}  init_process_group + barrier, full mesh")


if __name__ == "__main__":
    main()
