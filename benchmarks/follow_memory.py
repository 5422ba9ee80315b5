"""`gputrace view --follow`'s memory over a long run: steps appended to streamed traces, the
follower looking after each batch.

    python benchmarks/follow_memory.py [--ranks 4] [--steps 200000] [--batch 10000] [--window 1000]

Each rank's `trace_rank{R}.json` is written in the stream's own form (one event a line, as
`gputrace.trace.chrome.StreamWriter` appends it: a step span, two work spans and an all_reduce
marked collective a step). After every batch of steps the follower reads what was appended and
builds the page's document (`Follower.snapshot`). Prints, every few batches: the steps so far,
the bytes on disk, the memory the follower holds (tracemalloc, after the snapshot), the peak
during the snapshot, and how long the snapshot took. Memory should stop growing once the window
is full.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import tracemalloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gputrace.viewer.follow import Follower  # noqa: E402


def header(rank: int) -> bytes:
    return (
        b'[{"ph":"M","name":"gputrace","pid":%d,"tid":0,"args":{"baseTimeNanoseconds":1,'
        b'"distributedInfo":{"rank":%d,"world_size":4}}},\n' % (rank + 1, rank)
    )


def steps(rank: int, first: int, n: int) -> bytes:
    out = []
    for i in range(first, first + n):
        t = i * 100_000.0
        w = 40_000.0 + (20_000.0 if rank == 1 else 0.0)
        pid = rank + 1
        out.append(
            b'{"ph":"X","cat":"cpu","name":"work","pid":%d,"tid":2,"ts":%.3f,"dur":%.3f},\n' % (pid, t + 1, w / 2)
        )
        out.append(
            b'{"ph":"X","cat":"cpu","name":"work","pid":%d,"tid":2,"ts":%.3f,"dur":%.3f},\n'
            % (pid, t + 1 + w / 2, w / 2)
        )
        out.append(
            b'{"ph":"X","cat":"cpu","name":"all_reduce","pid":%d,"tid":2,"ts":%.3f,"dur":%.3f,"args":{"collective":true}},\n'
            % (pid, t + 2 + w, 99_000.0 - w)
        )
        out.append(
            b'{"ph":"X","cat":"cpu","name":"step","pid":%d,"tid":2,"ts":%.3f,"dur":99000.0,"args":{"step":%d}},\n'
            % (pid, t, i)
        )
    return b"".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=10_000)
    ap.add_argument("--window", type=int, default=1000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        files = [open(os.path.join(d, f"trace_rank{r}.json"), "wb") for r in range(args.ranks)]
        for r, f in enumerate(files):
            f.write(header(r))
        f0 = Follower(d, window=args.window)
        tracemalloc.start()
        print(f"{args.ranks} ranks, window {args.window} steps, a look after every {args.batch} steps")
        print(f"{'steps':>9} {'on disk MB':>11} {'held KB':>9} {'peak KB':>9} {'look ms':>8}")
        done = 0
        while done < args.steps:
            for r, f in enumerate(files):
                f.write(steps(r, done, args.batch))
                f.flush()
            done += args.batch
            tracemalloc.reset_peak()
            t0 = time.perf_counter()
            doc = f0.snapshot()
            took = (time.perf_counter() - t0) * 1e3
            held, peak = tracemalloc.get_traced_memory()
            del doc
            held = tracemalloc.get_traced_memory()[0]
            disk = sum(os.path.getsize(f.name) for f in files) / 1e6
            if done % (args.batch * max(1, args.steps // args.batch // 10)) == 0 or done == args.batch:
                print(f"{done:>9} {disk:>11.1f} {held / 1e3:>9.0f} {peak / 1e3:>9.0f} {took:>8.0f}", flush=True)
        assert f0.snapshot()["count"] == args.steps
        for f in files:
            f.close()


if __name__ == "__main__":
    main()
