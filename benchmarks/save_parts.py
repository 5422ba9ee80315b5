"""Where a CUDA span's save goes, per span, on a CPU: 100k CUDA spans recorded on a fake device
(`tests/fakes.py`: two streams, nested four deep, in steps, a flush a step, every span with its
host entry, so each has a launch arrow), then the parts of `gputrace.save()`.

    python benchmarks/save_parts.py [--steps 2000] [--rounds 3] [--flat] [--root DIR ...]

`--flat`: the shape `benchmarks/cuda_parts.py` records on a GPU instead (50 spans named "op" a
flush on one stream, no steps: the digest then waits for steps and places every entry at the end).

Parts, in ns a span (CPU time of the process, all its threads; wall beside it), each the median
of `--rounds`:
- `snapshot`: the recorder's columns as the trace to write (`Session.snapshot`);
- `json spans`: `chrome.write` of the trace without entry times (encoding, writing, fsync,
  rename); `json arrows`: what the launch arrows add to it (with entries, less without);
- `protobuf spans`, `protobuf arrows`: the same for `perfetto.write`;
- `digest`: the digest of the trace (`digest.from_trace`) and its document encoded;
- `write+fsync`: the JSON trace's bytes, encoded before, through the atomic writer alone;
- `save json`, `save protobuf`: `gputrace.save()` whole (trace, digest, fsyncs, renames), on a
  run recorded again for each (a save ends the recording's store as it is);
- `host: save ...`: the same saves of 100k host spans (no device).

`--root DIR` (repeatable): also run the tree at DIR (e.g. `git archive main | tar -x -C DIR` and
its own `python setup.py build_ext --inplace`), the trees taking turns in fresh processes, and
print them side by side. Each tree's own `gputrace` and `tests/fakes.py` are used.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PARTS = (
    "snapshot",
    "json spans",
    "json arrows",
    "protobuf spans",
    "protobuf arrows",
    "digest",
    "write+fsync",
    "save json",
    "save protobuf",
    "host: save json",
    "host: save protobuf",
)


def _install(root: str, fake: Any) -> Any:
    """A recorder on `fake` (None: host spans only), made current, as the tests install one."""
    from gputrace import session
    from gputrace.clock import HostClock
    from gputrace.config import Config
    from gputrace.record import Recorder

    session.SESSION.close()
    if fake is None:
        clock = HostClock()
    else:
        clock = HostClock(monotonic_ns=fake.monotonic_ns, realtime_ns=lambda: fake.now + 1_700_000_000_000_000_000)
    config = Config()
    rec = Recorder(config, fake, clock)
    session.SESSION.config = config
    session.SESSION.install(rec)
    return rec


def record_cuda(root: str, steps: int) -> int:
    """`steps` steps of 50 CUDA spans on two streams, nested up to four deep, a flush a step (the
    host waits out the step's device work first, so each flush resolves the whole step)."""
    import gputrace
    from tests.fakes import FakeDevice

    fake = FakeDevice()
    _install(root, fake)
    side = fake.new_stream()
    span, flush = gputrace.span, gputrace.flush
    for _ in range(steps):
        with span("step"):
            with span("forward"):
                for j in range(8):
                    with span(f"layer{j}"):
                        for name in ("aten::mm", "softmax", "aten::add"):
                            with span(name):
                                fake.work(20_000)
                            fake.advance(3_000)
            with span("backward"):
                for j in range(7):
                    with span(f"layer{j}.grad"):
                        with span("aten::mm"):
                            fake.work(40_000)
                        fake.advance(3_000)
            with fake.stream(side), span("nccl:all_reduce", collective=True):
                fake.work(100_000)
            fake.advance(5_000)
        fake.advance(1_000_000)  # the device's work done by the flush, as a step's end waits for it
        flush()
    return steps * 50


def record_flat(root: str, steps: int) -> int:
    """As `benchmarks/cuda_parts.py` records on a GPU: 50 spans named "op" a flush, one stream,
    no nesting, no steps."""
    import gputrace
    from tests.fakes import FakeDevice

    fake = FakeDevice()
    _install(root, fake)
    span, flush = gputrace.span, gputrace.flush
    for _ in range(steps):
        for _ in range(50):
            with span("op"):
                fake.work(2_000)
            fake.advance(3_000)
        fake.advance(100_000)
        flush()
    return steps * 50


def record_host(root: str, steps: int) -> int:
    import gputrace

    _install(root, None)
    span, flush = gputrace.span, gputrace.flush
    cpu = gputrace.TimerType.CPU
    for _ in range(steps):
        with span("step", timer_type=cpu):
            for j in range(7):
                with span(f"layer{j}", timer_type=cpu):
                    for name in ("a", "b", "c", "d", "e", "f"):
                        with span(name, timer_type=cpu):
                            pass
        flush()
    return steps * 50


def _timed(fn: Callable[[], Any]) -> tuple[int, int]:
    c, w = time.process_time_ns(), time.perf_counter_ns()
    fn()
    return time.process_time_ns() - c, time.perf_counter_ns() - w


def child(root: str, steps: int, flat: bool = False) -> dict[str, tuple[float, float]]:
    """One round in this process, on the tree at `root`: {part: (cpu ns, wall ns) a span}."""
    sys.path.insert(0, root)
    import gputrace
    from gputrace import digest, session
    from gputrace.trace import chrome, perfetto
    from gputrace.trace.files import atomic_writer
    from gputrace.trace.layout import dumps

    out: dict[str, tuple[float, float]] = {}
    d = tempfile.mkdtemp(prefix="save_parts-")
    record = record_flat if flat else record_cuda
    n = record(root, steps)
    rec = session.SESSION.recorder
    trace = session.SESSION.snapshot(rec)
    assert len(trace.spans) == n, (len(trace.spans), n)
    assert trace.spans.entry is not None and all(trace.spans.entry), "every CUDA span has its entry"
    bare = trace.without_entry()

    def per(cpu_wall: tuple[int, int]) -> tuple[float, float]:
        return cpu_wall[0] / n, cpu_wall[1] / n

    out["snapshot"] = per(_timed(lambda: session.SESSION.snapshot(rec)))
    for fmt, mod in (("json", chrome), ("protobuf", perfetto)):
        target = os.path.join(d, "parts." + fmt)
        spans = per(_timed(lambda: mod.write(bare, target, ordered=True)))  # noqa: B023
        arrows = per(_timed(lambda: mod.write(trace, target, ordered=True)))  # noqa: B023
        out[f"{fmt} spans"], out[f"{fmt} arrows"] = spans, (arrows[0] - spans[0], arrows[1] - spans[1])
    path = os.path.join(d, "trace_rank0.json")
    out["digest"] = per(_timed(lambda: dumps(digest.from_trace(trace, "step", path))))
    data = chrome.encode(trace, ordered=True)

    def write() -> None:
        with atomic_writer(path) as f:
            f.write(data)

    out["write+fsync"] = per(_timed(write))
    for fmt, ext in (("json", ".json"), ("protobuf", ".pftrace")):
        record(root, steps)
        cuda_path, host_path = os.path.join(d, "trace_rank0" + ext), os.path.join(d, "host_rank0" + ext)
        out[f"save {fmt}"] = per(_timed(lambda: gputrace.save(cuda_path)))  # noqa: B023
        record_host(root, steps)
        out[f"host: save {fmt}"] = per(_timed(lambda: gputrace.save(host_path)))  # noqa: B023
    session.SESSION.close()
    for f in os.listdir(d):
        os.unlink(os.path.join(d, f))
    os.rmdir(d)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000, help="steps of 50 spans (default 2000: 100k spans)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--root", action="append", default=[], help="another tree to run side by side")
    ap.add_argument("--flat", action="store_true", help="cuda_parts.py's shape: spans named op, no steps")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.child:
        print(json.dumps(child(ns.child, ns.steps, ns.flat)))
        return
    roots = [HERE] + [os.path.abspath(r) for r in ns.root]
    got: dict[str, list[dict[str, list[float]]]] = {r: [] for r in roots}
    for _ in range(ns.rounds):
        for r in roots:  # the trees take turns, each in a fresh process
            p = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--child", r, "--steps", str(ns.steps)]
                + (["--flat"] if ns.flat else []),
                capture_output=True,
                text=True,
                cwd=r,
                env={**os.environ, "PYTHONPATH": r},
            )
            if p.returncode:
                sys.exit(f"save_parts.py: the run of {r} failed:\n{p.stderr}")
            got[r].append(json.loads(p.stdout.strip().splitlines()[-1]))
    load = os.getloadavg()[0]
    shape = "flat, no steps" if ns.flat else "2 streams, nested, in steps"
    print(f"{ns.steps * 50:,} CUDA spans (fake device, {shape}), ns a span, CPU (wall)", end="")
    print(f", median of {ns.rounds}; load {load:.2f}")
    head = f"{'part':<22}" + "".join(f"{os.path.basename(r) or r:>24}" for r in roots)
    if len(roots) > 1:
        head += f"{'this / other':>14}"
    print(head)
    for part in PARTS:
        cells, cpus = [], []
        for r in roots:
            cpu = statistics.median(x[part][0] for x in got[r])
            wall = statistics.median(x[part][1] for x in got[r])
            cpus.append(cpu)
            cells.append(f"{cpu:>12,.0f} ({wall:>8,.0f})")
        line = f"{part:<22}" + "".join(f"{c:>24}" for c in cells)
        if len(roots) > 1 and cpus[1] > 0:
            line += f"{cpus[0] / cpus[1]:>13.2f}x"
        print(line)


if __name__ == "__main__":
    main()
