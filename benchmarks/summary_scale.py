"""How `gputrace summary` scales: per-rank files of a long run, summarized beside merging them.

    python benchmarks/summary_scale.py [--ranks 64] [--steps 10000] [--ops 0] [--dir DIR] [--repeats 1]

Writes `--ranks` files of `--steps` steps (4 spans a step: step, forward, backward and an
all_reduce marked collective=True, on two CUDA streams, and `--ops` small spans inside forward),
the way the recorder's files look, with the Chrome writer, and beside each its step digest (made
by the recorder's own digest builder); one rank is slow in every 7th step. Files in `--dir` from
an earlier run of the same size are reused. Then it times, in one run, side by side: reading the
files, the in-process summary, and the `gputrace merge` and `gputrace summary --full` commands as
subprocesses; then the summary from the digests (`gputrace summary`, which reads them, and in
process), and what the digest costs the recorder per span beside the streamed writer's append.
It prints a table with the ratios, and the peak memory of each command. Targets: summarizing
takes no longer than merging; from digests, time and memory follow ranks x steps, not spans.
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

from gputrace import digest, stats  # noqa: E402
from gputrace import summary as summaries  # noqa: E402
from gputrace.trace import chrome, digestfile  # noqa: E402
from gputrace.trace.model import Process, Trace, Track  # noqa: E402
from gputrace.version import __version__  # noqa: E402

BASE = 1_700_000_000_000_000_000


def rank_trace(rank: int, ranks: int, steps: int, ops: int = 0) -> Trace:
    """One rank's trace: every step is 1 ms of work (+-1% jitter; `ops` spans inside forward)
    then an all_reduce that ends when the last rank arrives; rank ranks//2 works 1.3 ms in every
    7th step."""
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
        for i in range(ops):
            a = t + i * (mine // 3) // ops
            trace.add_span("op", compute, a, a + (mine // 3) // ops // 2 + i)
        trace.add_span("backward", compute, t + mine // 3, t + mine)
        trace.add_span("all_reduce", comm, t + mine, end, coll)
        t = end + 1_000
    return trace


def write_rank(directory: str, rank: int, ranks: int, steps: int, ops: int = 0) -> str:
    """The rank's trace file and, beside it, its digest (the recorder's builder over the spans)."""
    trace = rank_trace(rank, ranks, steps, ops)
    path = os.path.join(directory, f"trace_rank{rank}.json")
    chrome.write(trace, path)
    digestfile.write(digest.from_trace(trace, "step", path), digestfile.digest_path(path))
    return path


def make_files(directory: str, ranks: int, steps: int, ops: int = 0) -> list[str]:
    stamp = os.path.join(directory, f".made-{ranks}x{steps}x{ops}-digests")
    if not os.path.exists(stamp):
        for f in os.listdir(directory):
            if f.startswith(("trace_rank", "digest_rank", ".made-")):
                os.unlink(os.path.join(directory, f))
        with ProcessPoolExecutor(max_workers=2) as pool:
            n = ranks
            list(pool.map(write_rank, [directory] * n, range(n), [ranks] * n, [steps] * n, [ops] * n))
        open(stamp, "w").close()
    return sorted(os.path.join(directory, f"trace_rank{r}.json") for r in range(ranks))


def feed_cost(ranks: int, steps: int, ops: int, per_chunk: int = 10) -> tuple[float, float, int]:
    """CPU seconds of the digest builder and of the streamed Chrome writer over one rank's spans
    in chunks of `per_chunk` steps (a flush every few steps), and the spans."""
    whole = rank_trace(ranks // 2, ranks, steps, ops)
    sp = whole.spans
    per_step = 4 + ops
    chunks = []
    for k in range(0, len(sp), per_step * per_chunk):
        part = Trace(dict(whole.metadata))
        part.processes, part.tracks, part.names = whole.processes, whole.tracks, whole.names
        part._name_index = whole._name_index
        for i in range(k, min(k + per_step * per_chunk, len(sp))):
            part.spans.append(sp.name[i], sp.track[i], sp.start[i], sp.end[i], sp.args[i])
        chunks.append(part)
    built, streamed = [], []
    for _ in range(3):  # the least of three: the machine may be shared
        gc.collect()
        b = digest.Builder("step")
        c0 = time.process_time()
        for part in chunks:
            b.add(part)
        b.document(dict(whole.metadata), sp.start[0], "rank")  # what is left in its batch, worked through
        built.append(time.process_time() - c0)
        with tempfile.TemporaryDirectory() as tmp:
            w = chrome.StreamWriter(os.path.join(tmp, "t.json"), sp.start[0], whole.processes[0], {"metadata": {}})
            c0 = time.process_time()
            for part in chunks:
                w.append(part, range(len(part.spans)))
            streamed.append(time.process_time() - c0)
            w.abandon()
    return min(built), min(streamed), len(sp)


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


PEAK_MB: dict[str, float] = {}  # command -> its peak resident memory

# The command runs under this wrapper, which writes its own peak memory (VmHWM) at exit: a child's
# ru_maxrss would count the memory of this benchmark process it was forked from.
_WRAP = (
    "import atexit, runpy, sys\n"
    "out = sys.argv[1]\n"
    "def peak():\n"
    "    for line in open('/proc/self/status'):\n"
    "        if line.startswith('VmHWM:'):\n"
    "            open(out, 'w').write(line.split()[1])\n"
    "atexit.register(peak)\n"
    "sys.argv = ['gputrace', *sys.argv[2:]]\n"
    "runpy.run_module('gputrace', run_name='__main__')\n"
)


def command(args: list[str], label: str | None = None) -> tuple[float, float]:
    """(wall s, CPU s of the command and any processes it started); its peak resident memory
    goes to PEAK_MB under `label`."""
    with tempfile.TemporaryFile() as err, tempfile.NamedTemporaryFile("r") as peak:
        t0 = time.perf_counter()
        p = subprocess.Popen(
            [sys.executable, "-c", _WRAP, peak.name, *args], stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT
        )
        _, status, usage = os.wait4(p.pid, 0)  # this child's own CPU time, its workers' with it
        took = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        if p.returncode != 0:
            err.seek(0)
            raise SystemExit(f"gputrace {' '.join(args)} failed:\n{err.read().decode()}")
        kb = peak.read().strip()
    if label and kb:
        PEAK_MB[label] = int(kb) / 1024
    return took, usage.ru_utime + usage.ru_stime


def recording_cost(steps: int = 2_000, ops: int = 8) -> tuple[float, float, float, float, int]:
    """CPU seconds of a real recording (host spans through the session, streamed to a directory,
    a flush every 10 steps) with the step digest and without it, then of its save (the digest
    worked through and written: once a run), and the spans."""
    import gputrace
    from gputrace import record, session

    def run() -> tuple[float, float]:
        with tempfile.TemporaryDirectory() as out:
            gputrace.enable(out_dir=out, cuda=False)
            gc.collect()
            c0 = time.process_time()
            for k in range(steps):
                with gputrace.span("step", step=k):
                    with gputrace.span("forward"):
                        for _ in range(ops):
                            with gputrace.span("op"):
                                pass
                    with gputrace.span("backward"):
                        pass
                    with gputrace.span("all_reduce", collective=True):
                        pass
                if k % 10 == 9:
                    gputrace.flush()
            c1 = time.process_time()
            gputrace.save()
            c2 = time.process_time()
            session.SESSION.close()
            record.set_recorder(None, None)
        return c1 - c0, c2 - c1

    feed = digest.StreamDigest.add
    with_digest, without = [], []
    try:
        for _ in range(3):  # the least of three, alternating: the machine may be shared
            digest.StreamDigest.add = feed  # type: ignore[method-assign]
            with_digest.append(run())
            digest.StreamDigest.add = lambda *a: None  # type: ignore[method-assign]
            without.append(run())
    finally:
        digest.StreamDigest.add = feed  # type: ignore[method-assign]
    return (
        min(r for r, _ in with_digest),
        min(r for r, _ in without),
        min(s for _, s in with_digest),
        min(s for _, s in without),
        steps * (4 + ops),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--ops", type=int, default=0, help="small spans inside each forward (not in the digest's rows)")
    ap.add_argument("--dir", default=None, help="where the rank files are made (reused when of the same size)")
    ap.add_argument("--repeats", type=int, default=1)
    ns = ap.parse_args()
    directory = ns.dir or os.path.join(
        tempfile.gettempdir(), f"gputrace-summary-scale-{ns.ranks}x{ns.steps}" + (f"x{ns.ops}" if ns.ops else "")
    )
    os.makedirs(directory, exist_ok=True)
    t0 = time.perf_counter()
    paths = make_files(directory, ns.ranks, ns.steps, ns.ops)
    made = time.perf_counter() - t0
    size = sum(os.path.getsize(p) for p in paths) / 1e6
    dsize = sum(os.path.getsize(digestfile.digest_path(p)) for p in paths) / 1e6
    spans = ns.ranks * ns.steps * (4 + ns.ops)
    print(
        f"{ns.ranks} ranks x {ns.steps:,} steps = {spans:,} spans, {size:,.0f} MB of traces and {dsize:,.1f} MB of "
        f"digests in {directory} ({made:.1f} s)"
    )

    # CPU seconds beside wall seconds: on a shared machine the wall clock also counts waiting
    # for a core; the ratios are taken on both.
    rows: dict[str, list[tuple[float, float]]] = {}

    def add(name: str, secs: tuple[float, float]) -> None:
        rows.setdefault(name, []).append(secs)
        peak = f" {PEAK_MB[name]:8.0f} MB peak" if name in PEAK_MB else ""
        print(f"  {name:<46} {secs[0]:8.2f} s wall {secs[1]:8.2f} s CPU{peak}", flush=True)

    merged = os.path.join(directory, "merged.json")
    for _ in range(ns.repeats):
        name = "gputrace merge (command)"
        add(name, command(["merge", *paths, "-o", merged, "--quiet"], name))
        name = "gputrace summary --full (command)"
        add(name, command(["summary", "--full", *paths], name))
        name = "gputrace summary --full --json (command)"
        add(name, command(["summary", "--full", "--json", *paths], name))
        wall, cpu, trace = timed(load, paths)
        add("merge.load: read + align (in process)", (wall, cpu))
        wall, cpu, summary = timed(stats.summarize, trace)
        add("summarize (in process)", (wall, cpu))
        wall, cpu, _ = timed(stats.table, summary)
        add("table (in process)", (wall, cpu))
        wall, cpu, _ = timed(stats.to_json, summary)
        add("to_json (in process)", (wall, cpu))
        del trace
        os.unlink(merged)
        # From the digests: the same steps and collectives.
        name = "gputrace summary, from digests (command)"
        add(name, command(["summary", *paths], name))
        name = "gputrace summary --json, from digests (command)"
        add(name, command(["summary", "--json", *paths], name))
        inputs = summaries.find(paths)
        wall, cpu, digests = timed(summaries.collect, inputs, "step")
        add("digest.collect: read digests (in process)", (wall, cpu))
        wall, cpu, (_, from_digests) = timed(summaries.summarize, digests, "step")
        add("digest.summarize: align + summarize (in process)", (wall, cpu))
        assert from_digests.steps == summary.steps and from_digests.collectives == summary.collectives
        del digests, summary, from_digests

    built, streamed, one = feed_cost(ns.ranks, 2_000, ns.ops)
    rec_with, rec_without, save_with, save_without, rec_spans = recording_cost(5_000, ns.ops)

    def med(name: str, k: int) -> float:
        v = sorted(x[k] for x in rows[name])
        return v[len(v) // 2]

    merge_wall, merge_cpu = med("gputrace merge (command)", 0), med("gputrace merge (command)", 1)
    print()
    print(f"{'stage':<48} {'wall s':>8} {'/ merge':>8} {'CPU s':>8} {'/ merge':>8} {'peak MB':>8}  target")
    for name in rows:
        target = "<= 1x merge" if name in ("summarize (in process)", "gputrace summary --full (command)") else ""
        w, c = med(name, 0), med(name, 1)
        peak = f"{PEAK_MB[name]:8.0f}" if name in PEAK_MB else " " * 8
        print(f"{name:<48} {w:8.2f} {w / merge_wall:7.2f}x {c:8.2f} {c / merge_cpu:7.2f}x {peak}  {target}")
    print(f"\nsummarize: {spans / med('summarize (in process)', 1) / 1e6:.2f} M spans per CPU second")
    full_cpu = med("gputrace summary --full (command)", 1)
    dig_cpu = med("gputrace summary, from digests (command)", 1)
    print(
        f"summary from digests: {dig_cpu / full_cpu:.3f}x the CPU time and "
        f"{PEAK_MB['gputrace summary, from digests (command)'] / PEAK_MB['gputrace summary --full (command)']:.3f}x "
        "the peak memory of the full-trace summary; the same steps and collectives (checked)"
    )
    print(
        f"recorder side, one rank's {one:,} spans in flushes of 10 steps: digest builder {built / one * 1e9:.0f} ns "
        f"a span, streamed Chrome writer {streamed / one * 1e9:.0f} ns a span ({built / streamed:.2f}x)"
    )
    print(
        f"a real recording of {rec_spans:,} host spans, streamed, a flush every 10 steps: "
        f"{rec_without / rec_spans * 1e9:.0f} ns a span without the digest, {rec_with / rec_spans * 1e9:.0f} with it "
        f"(+{(rec_with / rec_without - 1) * 100:.0f}%); its save {save_without * 1e3:.0f} ms without, "
        f"{save_with * 1e3:.0f} ms with the digest"
    )


if __name__ == "__main__":
    main()
