"""What the open file (`gputrace.live`) costs a rank: the training thread's worst wait on it and
the watcher thread's CPU.

Each case runs in a fresh process for a fixed time: host spans streamed to a folder, steps of
100 spans six deep (`step` > `layer` > `block` > `attn` > `proj` > `op`), the gaps between
consecutive `op` spans timed (enter + exit + the loop). Cases: the open file off
(`open_every_s=0`), at its default (a look a second), and looking every millisecond (the
stress case: the step changes between looks, so nearly every look rewrites the file); each with
a flush a step (pending stays small) and without flushing (tens of thousands of pending spans for
the watcher to count). Reported: the worst gap and its 99.99th percentile against the case off,
gaps over 1 ms, the watcher's looks and rewrites, its thread's CPU time per second of run, and
the CPU time of its longest look, and of its longest stretch without giving up the interpreter
("hold": what a span can wait on it at worst, on an unloaded machine; it lets go between slices
of its counting and while writing).

    python benchmarks/live.py [--seconds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, sys, time
import gputrace
from gputrace.session import SESSION
seconds, out, every, flush_each = float(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4] == "1"
gputrace.enable(cuda=False, out_dir=out, open_every_s=every, max_pending=65536)
span, flush, pc = gputrace.span, gputrace.flush, time.perf_counter_ns
gaps = []
add = gaps.append
end = time.monotonic() + seconds
step = 0
last = pc()
t0 = time.monotonic()
while time.monotonic() < end:
    with span("step"), span("layer"), span("block"), span("attn"), span("proj"):
        for i in range(95):
            with span("op"):
                pass
            now = pc(); add(now - last); last = now
    step += 1
    if flush_each or step % 500 == 0:
        flush()
        last = pc()  # the flush itself is not the watcher's
wall = time.monotonic() - t0
w = SESSION.watcher
cpu = time.clock_gettime_ns(time.pthread_getcpuclockid(w.thread.ident)) if w is not None else 0
ticks, writes = (w.ticks, w.writes) if w is not None else (0, 0)
look_max = w.cpu_max_ns if w is not None else 0
hold_max = w.hold_max_ns if w is not None else 0
gaps.sort()
n = len(gaps)
print(json.dumps({
    "spans": n, "max_ns": gaps[-1], "p9999_ns": gaps[int(n * 0.9999)], "p50_ns": gaps[n // 2],
    "over_1ms": sum(g > 1_000_000 for g in gaps), "watcher_cpu_ns": cpu, "wall_s": wall,
    "looks": ticks, "rewrites": writes, "look_cpu_max_ns": look_max, "hold_max_ns": hold_max,
}))
SESSION.close()
"""


def run(seconds: float, every: float, flush_each: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(k, None)
        res = subprocess.run(
            [sys.executable, "-c", CHILD, str(seconds), out, str(every), "1" if flush_each else "0"],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        return json.loads(res.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    a = ap.parse_args()
    print(f"{a.seconds:g} s a case; gaps between consecutive spans of the training thread; {os.cpu_count()} CPUs")
    print(
        f"{'case':<34} {'p50':>8} {'p99.99':>9} {'max':>9} {'>1ms':>5} {'looks':>6} {'rewrites':>8} "
        f"{'watcher CPU':>12} {'longest look':>12} {'longest hold':>12}"
    )
    for flush_each in (True, False):
        for every, label in ((0.0, "off"), (1.0, "a look a second"), (0.001, "a look a millisecond")):
            r = run(a.seconds, every, flush_each)
            case = f"{label}, {'flush a step' if flush_each else 'no flush (pending)'}"
            cpu = r["watcher_cpu_ns"] / 1e6 / r["wall_s"]
            print(
                f"{case:<34} {r['p50_ns'] / 1e3:>6.2f}us {r['p9999_ns'] / 1e3:>7.1f}us {r['max_ns'] / 1e3:>7.1f}us "
                f"{r['over_1ms']:>5} {r['looks']:>6} {r['rewrites']:>8} {cpu:>7.2f} ms/s "
                f"{r['look_cpu_max_ns'] / 1e3:>9.0f} us {r['hold_max_ns'] / 1e3:>9.0f} us",
                flush=True,
            )


if __name__ == "__main__":
    main()
