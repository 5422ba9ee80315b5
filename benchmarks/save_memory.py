"""Memory of saving and streaming: what `save()` needs beyond the spans it holds, and what a
long streamed run holds.

Each case runs in a fresh process (peak resident memory is per process):
- save: N host spans recorded and resolved (no output directory), then `save(path)`; the store's
  resting size (RSS after recording minus before) against the peak during save (VmHWM, reset
  just before saving, minus the same before-recording RSS). Target: peak <= 1.5x the store.
- stream: N host spans with an output directory and a flush every 1,000 spans; RSS sampled
  along the run (it should stay flat: written spans leave memory) and the file's size.

    python benchmarks/save_memory.py [--spans 2000000] [--stream-spans 10000000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD_SAVE = r"""
import gc, json, os, sys, time
import gputrace
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"): return int(line.split()[1]) * 1024
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"): return int(line.split()[1]) * 1024
n, path, fmt = int(sys.argv[1]), sys.argv[2], sys.argv[3]
gputrace.enable(cuda=False, max_pending=4096)
gc.collect(); before = rss()
span = gputrace.span
for i in range(n // 100):
    with span("step", step=i):
        for j in range(99):
            with span("op"):
                pass
gputrace.flush()
gc.collect(); rest = rss()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
t = time.perf_counter()
gputrace.save(path, format=fmt)
dt = time.perf_counter() - t
peak = hwm()
print(json.dumps({"store": rest - before, "peak": peak - before, "save_s": dt, "bytes": os.path.getsize(path)}))
"""

CHILD_STREAM = r"""
import gc, json, os, sys, time
import gputrace
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"): return int(line.split()[1]) * 1024
n, out = int(sys.argv[1]), sys.argv[2]
gputrace.enable(cuda=False, out_dir=out)
span, flush = gputrace.span, gputrace.flush
samples = []
t = time.perf_counter()
for i in range(n // 1000):
    with span("step", step=i):
        for j in range(999):
            with span("op"):
                pass
    flush()
    if i % max(1, (n // 1000) // 10) == 0:
        samples.append(rss())
path = gputrace.save()
dt = time.perf_counter() - t
print(json.dumps({"rss": samples, "s": dt, "bytes": os.path.getsize(path)}))
"""


def run(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spans", type=int, default=2_000_000)
    ap.add_argument("--stream-spans", type=int, default=10_000_000)
    a = ap.parse_args()
    mb = 1 << 20
    with tempfile.TemporaryDirectory() as d:
        print(f"save: {a.spans:,} host spans held in memory, then save()")
        print(f"{'format':<10} {'store MB':>9} {'peak MB':>9} {'peak/store':>11} {'save s':>8} {'file MB':>8}")
        for fmt, ext in (("json", ".json"), ("perfetto", ".pftrace")):
            try:
                r = run(CHILD_SAVE, str(a.spans), os.path.join(d, "t" + ext), fmt)
            except subprocess.CalledProcessError as e:
                print(f"{fmt:<10} failed: {e.stderr.strip().splitlines()[-1] if e.stderr else e}")
                continue
            print(
                f"{fmt:<10} {r['store'] / mb:9.1f} {r['peak'] / mb:9.1f} {r['peak'] / r['store']:10.2f}x "
                f"{r['save_s']:8.2f} {r['bytes'] / mb:8.1f}"
            )
        if a.stream_spans:
            r = run(CHILD_STREAM, str(a.stream_spans), os.path.join(d, "stream"))
            rss = [x / mb for x in r["rss"]]
            print(f"\nstream: {a.stream_spans:,} host spans, a flush every 1,000, output directory set")
            print("RSS MB along the run: " + ", ".join(f"{x:.0f}" for x in rss))
            print(
                f"first {rss[0]:.0f} MB, last {rss[-1]:.0f} MB, max {max(rss):.0f} MB; "
                f"{r['s']:.1f} s ({r['s'] / a.stream_spans * 1e6:.2f} us a span, recording + flush + write); "
                f"file {r['bytes'] / mb:.0f} MB"
            )


if __name__ == "__main__":
    main()
