"""Memory of reading real and hostile files: is every reader bounded by the file's size?

Each file goes through `validate`, `summary` and `merge` (the library calls behind the
commands), each in a fresh process: the peak resident memory above what the process held
after its imports (VmHWM, reset just before the call), the ratio of that peak to the file's
size, the time, and what came of it ("ok", or the one-line error a user would see). A child
that passes 8 GB of address space is stopped (a regression must not take the machine down).

Real files: one rank's trace of SPANS spans in both formats, and the same streamed (the array
form a running job leaves). Hostile files: a `ts` that is a 600,000-element list (1.8 MB) or a
2,000,000-element one (6 MB), 6 MB of empty events, an 8 MB array cut inside an event full of
`}`, a 0.5 MB protobuf whose compressed packets inflate to ~0.5 GB of valid packets, and 2,000
nested compressed packets.

    python benchmarks/hostile_memory.py [--spans 200000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import zlib
from typing import Any

CHILD = r"""
import gc, json, os, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
from gputrace import merge, summary
from gputrace.errors import GputraceError
from gputrace.trace import chrome, perfetto
from gputrace.validate import validate_file
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key): return int(line.split()[1]) * 1024
op, path, out = sys.argv[1], sys.argv[2], sys.argv[3]
call = {
    "validate": lambda: validate_file(path),
    "summary": lambda: summary.summary_of_files([path]),
    "merge": lambda: merge.merge([path], out, workers=1),
}[op]
gc.collect()
before = status("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current RSS
t = time.perf_counter()
try:
    call()
    outcome = "ok"
except GputraceError as e:
    outcome = str(e).replace(path, "FILE")
except MemoryError:
    outcome = "MemoryError (past 8 GB)"
dt = time.perf_counter() - t
print(json.dumps({"peak": status("VmHWM:") - before, "s": dt, "outcome": outcome}))
"""

BASE = 1_700_000_000_000_000_000


def own_trace(spans: int) -> Any:
    """One rank's trace as gputrace writes it: four CUDA streams of kernels at irregular times,
    a step span on the host every 100 spans, args on one span in ten."""
    from gputrace.trace.model import Process, Trace, Track

    meta = {"gputrace_version": "bench", "rank": 0, "world_size": 1, "run_id": "bench"}
    t = Trace(dict(meta))
    p = t.add_process(Process(1, 0, "rank 0", 0, meta))
    tracks = [t.add_track(Track(p, i + 1, f"cuda:0 stream {i}", "cuda", 0, i)) for i in range(4)]
    host = t.add_track(Track(p, 9, "thread MainThread (host)", "cpu", None, 9))
    step = 0
    for k in range(spans):
        s = BASE + k * 1_000 + (k * 7919) % 333  # irregular times, as real ones are
        if k % 100 == 0:
            t.add_span("step", host, s, s + 99_000, {"step": step})
            step += 1
        else:
            t.add_span(f"kernel_{k % 37}", tracks[k % 4], s, s + 400 + k % 97, {"bytes": k} if k % 10 == 0 else None)
    return t


def real_files(d: str, spans: int) -> dict[str, str]:
    from gputrace.trace import chrome, perfetto

    t = own_trace(spans)
    meta = t.metadata
    out = {}
    for name, fmt in (("own.json", chrome), ("own.pftrace", perfetto)):
        out[name] = os.path.join(d, name)
        fmt.write(t, out[name])
    stream = os.path.join(d, "stream.json")
    w = chrome.StreamWriter(stream, BASE, t.processes[0], {"metadata": meta})
    for lo in range(0, spans, 10_000):
        w.append(t, range(lo, min(lo + 10_000, spans)))
    w.abandon()
    out["stream.json"] = stream
    return out


def hostile_files(d: str) -> dict[str, str]:
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    header = {"baseTimeNanoseconds": BASE, "distributedInfo": {"rank": 0, "world_size": 1}}
    header["metadata"] = {"gputrace_version": "bench", "rank": 0, "world_size": 1}
    out = {}

    def write(name: str, data: bytes) -> None:
        out[name] = os.path.join(d, name)
        with open(out[name], "wb") as f:
            f.write(data)

    def events(evs: bytes) -> bytes:
        return json.dumps(header).encode()[:-1] + b', "traceEvents": [' + evs + b"]}"

    x = b'{"ph":"X","name":"a","pid":1,"tid":1,"dur":1,"ts":'
    write("ts_list_1.8MB.json", events(x + b"[" + b", ".join([b"0"] * 600_000) + b"]}"))
    write("ts_list_6MB.json", events(x + b"[" + b", ".join([b"0"] * 2_000_000) + b"]}"))
    write("empty_events_6MB.json", events(b",".join([b"{}"] * 2_000_000)))
    ev = b'{"ph":"X","name":"a","pid":1,"tid":1,"ts":1,"dur":1}'
    write("cut_braces_8MB.json", b"[" + b",".join([ev] * 1000) + b',{"ph":"X","name":"' + b"}" * 8_000_000)
    # A zlib bomb of valid packets: one small end event, repeated until ~0.5 GB.
    packet = pb.TracePacket(timestamp=1, trusted_packet_sequence_id=2, track_event=pb.TrackEvent(type=2, track_uuid=1))
    one = pb.Trace(packet=[packet]).SerializeToString()
    z = zlib.compressobj(9)
    block = one * ((1 << 20) // len(one))
    bomb = b"".join(z.compress(block) for _ in range(512)) + z.flush()
    bundle = pb.ChromeEventBundle(metadata=[{"name": "gputrace", "json_value": json.dumps(header)}])
    head = pb.Trace(packet=[pb.TracePacket(chrome_events=bundle)]).SerializeToString()
    write("zlib_bomb.pftrace", head + pb.Trace(packet=[pb.TracePacket(compressed_packets=bomb)]).SerializeToString())
    blob = one
    for _ in range(2000):
        blob = pb.Trace(packet=[pb.TracePacket(compressed_packets=zlib.compress(blob))]).SerializeToString()
    write("nested_2000.pftrace", head + blob)
    return out


def run(op: str, path: str, d: str) -> dict[str, object]:
    out = os.path.join(d, "merged" + os.path.splitext(path)[1])
    r = subprocess.run([sys.executable, "-c", CHILD, op, path, out], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        return {"peak": 0, "s": 0.0, "outcome": f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1:]}"}
    return json.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spans", type=int, default=200_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        files = {**real_files(d, args.spans), **hostile_files(d)}
        print(f"{'file':<24} {'size':>9} {'op':<9} {'peak RSS':>10} {'ratio':>7} {'time':>7}  outcome")
        for name, path in files.items():
            size = os.path.getsize(path)
            for op in ("validate", "summary", "merge"):
                r = run(op, path, d)
                peak = int(r["peak"])  # type: ignore[call-overload]
                print(
                    f"{name:<24} {size / 1e6:>7.2f}MB {op:<9} {peak / 1e6:>8.1f}MB {peak / size:>6.1f}x "
                    f"{float(r['s']):>6.2f}s  {str(r['outcome'])[:90]}"  # type: ignore[arg-type]
                )


if __name__ == "__main__":
    main()
