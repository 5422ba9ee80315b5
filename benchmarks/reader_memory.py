"""Peak memory of the commands that read a trace: does each stay within 1.5x the file's size,
or 100 bytes an event, whichever is larger?

One rank's trace of `--events` spans (3M by default; four CUDA streams and a host thread, a
step span every 100, an argument on one span in ten) in both formats, each read by `validate`,
`summary`, `merge` and `view` (the library calls behind the commands; `view`: its page, the
trace read as `gputrace view` reads it for the document, and the document computed;
`timeline`, not run unless named: the whole trace the page's timeline then reads, with every
argument), each in a fresh process: the peak resident memory of that
process (VmHWM, its imports included), its ratio to the file's size, the bytes an event, the
time (wall and CPU), and whether it is within the bound. `--root DIR` measures another checkout of gputrace
(a `git archive` of main: the numbers before a change). Files are kept in `--dir` and reused.

    python benchmarks/reader_memory.py [--events 3000000] [--dir DIR] [--root DIR] [--ops validate,summary]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, os, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (12 << 30, 12 << 30))
sys.path.insert(0, sys.argv[4])
from gputrace import merge, summary
from gputrace.viewer import data
from gputrace.validate import validate_file
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key): return int(line.split()[1]) * 1024
op, path, out = sys.argv[1], sys.argv[2], sys.argv[3]
try:  # the heap as the commands set it (gputrace summary, view, merge), where the tree has it
    from gputrace import heap
    if op in ("summary", "view", "timeline", "merge"):
        heap.map_large_blocks()
except ImportError:
    pass
# What `gputrace view` reads for its page (the whole trace, in code that has no other read).
page_read = getattr(summary, "load_for_statistics", data.load)
call = {
    "validate": lambda: validate_file(path),
    "summary": lambda: summary.summary_of_files([path]),
    "merge": lambda: merge.merge([path], out, workers=1),
    "view": lambda: data.document(page_read([path])),
    "timeline": lambda: data.load([path]),
}[op]
imports = status("VmRSS:")
t, cpu = time.perf_counter(), time.process_time()
try:
    call()
    outcome = "ok"
except MemoryError:
    outcome = "MemoryError (past 12 GB)"
took = {"s": time.perf_counter() - t, "cpu": time.process_time() - cpu}
print(json.dumps({"peak": status("VmHWM:"), "imports": imports, **took, "outcome": outcome}))
"""


def make(d: str, events: int) -> dict[str, str]:
    sys.path.insert(0, ROOT)
    from gputrace.trace import chrome, perfetto

    out = {"own.json": os.path.join(d, f"own-{events}.json"), "own.pftrace": os.path.join(d, f"own-{events}.pftrace")}
    if all(os.path.exists(p) for p in out.values()):
        return out
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from hostile_memory import own_trace  # the same trace as the hostile-input benchmark's

    t = own_trace(events)
    chrome.write(t, out["own.json"])
    perfetto.write(t, out["own.pftrace"])
    return out


def run(op: str, path: str, d: str, root: str) -> dict[str, object]:
    out = os.path.join(d, "merged" + os.path.splitext(path)[1])
    cmd = [sys.executable, "-c", CHILD, op, path, out, root]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=d)
    if r.returncode != 0:
        return {"peak": 0, "imports": 0, "s": 0.0, "outcome": f"exit {r.returncode}: {r.stderr.strip()[-200:]}"}
    return json.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=3_000_000)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "gputrace-reader-memory"))
    ap.add_argument("--root", default=ROOT, help="the gputrace checkout to measure")
    ap.add_argument("--ops", default="validate,summary,merge,view")
    ap.add_argument("--formats", default="own.json,own.pftrace")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    files = make(args.dir, args.events)
    print(f"{args.events:,} events, code in {args.root}")
    print(
        f"{'file':<12} {'size':>9} {'op':<9} {'peak RSS':>9} {'imports':>8} {'x size':>7} {'B/event':>8} "
        f"{'time':>7} {'CPU':>7}  bound"
    )
    for name in args.formats.split(","):
        path = files[name]
        size = os.path.getsize(path)
        bound = max(1.5 * size, 100 * args.events)
        for op in args.ops.split(","):
            r = run(op, path, args.dir, os.path.abspath(args.root))
            peak = int(r["peak"])  # type: ignore[call-overload]
            verdict = ("within" if peak <= bound else "OVER") if r["outcome"] == "ok" else str(r["outcome"])[:80]
            print(
                f"{name:<12} {size / 1e6:>7.1f}MB {op:<9} {peak / 1e6:>7.0f}MB {int(r['imports']) / 1e6:>6.0f}MB "  # type: ignore[call-overload]
                f"{peak / size:>6.2f}x {peak / args.events:>8.0f} {float(r['s']):>6.1f}s "  # type: ignore[arg-type]
                f"{float(r.get('cpu', 0.0)):>6.1f}s  {verdict}",  # type: ignore[arg-type]
                flush=True,
            )


if __name__ == "__main__":
    main()
