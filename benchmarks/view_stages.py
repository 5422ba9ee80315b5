"""Where a cold `gputrace view` of many ranks spends its seconds before it serves.

    python benchmarks/view_stages.py [--ranks 64] [--steps 10000] [--dir DIR] [--traces] [--profile N]

Uses `viewer_scale.py`'s files (made once into `--dir` and reused). Builds the page's document
from the digests as `gputrace view` does the first time after a run (`viewer.data.digest_view`
with no kept document), in this process, and prints wall and CPU seconds per stage: reading the
digests, aligning them (merge's functions), `stats.summarize`, the rest of the summary from
digests, the viewer's document (of which the causes in words), and encoding. `--traces`: from
the traces alone (a folder of hard links to them). Where the checkout has it, first the page's
first document (`viewer.first`, what the command serves while the full one is computed) apart.
`--profile N`: also cProfile's N costliest functions by their own time.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import os
import pstats
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import viewer_scale  # noqa: E402
from gputrace import stats, summary  # noqa: E402
from gputrace.viewer import data  # noqa: E402

SPENT: dict[str, list[float]] = {}


def timed(owner: Any, attr: str, label: str) -> None:
    """Wrap `owner.attr` so that its wall and CPU seconds add up under `label`."""
    fn: Callable[..., Any] | None = getattr(owner, attr, None)
    if fn is None:  # an older checkout (--root-style before/after runs) without that stage
        return

    @functools.wraps(fn)
    def wrapper(*a: Any, **k: Any) -> Any:
        w, c = time.perf_counter(), time.process_time()
        try:
            return fn(*a, **k)
        finally:
            got = SPENT.setdefault(label, [0.0, 0.0])
            got[0] += time.perf_counter() - w
            got[1] += time.process_time() - c

    setattr(owner, attr, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--traces", action="store_true", help="from the traces alone")
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    args = ap.parse_args()
    directory = args.dir or os.path.join(tempfile.gettempdir(), "gputrace-viewer-bench")
    os.makedirs(directory, exist_ok=True)
    viewer_scale.inputs(directory, args.ranks, args.steps)
    folder = viewer_scale.traces_only(directory, args.ranks) if args.traces else directory
    for old in os.listdir(folder):  # the first view after the run: no document kept yet
        if old.startswith(".gputrace-view-") or (args.traces and old.startswith("digest_rank")):
            os.unlink(os.path.join(folder, old))

    timed(summary, "make_digests", "make the missing digests (workers)")
    timed(summary, "collect", "read the digests (summary.collect)")
    timed(summary, "load", "align them (summary.load: merge's functions)")
    timed(stats, "summarize", "stats.summarize")
    timed(summary, "summarize", "the summary from digests (all of it)")
    timed(data, "document", "the viewer's document (viewer.data.document)")
    timed(data, "causes", "  of which the causes in words")
    timed(data, "split", "encode it (orjson)")
    timed(data, "load", "read and align the traces (viewer.data.load)")
    # The page's first document (`viewer.first`: the heatmap from the digests' step rows), what
    # `gputrace view` serves before the full one, where this checkout has it.
    first_times = None
    try:
        from gputrace.viewer import first
    except ImportError:
        first = None  # type: ignore[assignment]
    if first is not None and not args.traces:
        found = data.digest_inputs([folder])
        job = data.DigestJob(found, "step", None, False, [folder]) if found is not None else None
        w, c = time.perf_counter(), time.process_time()
        got_first = first.document(job) if job is not None else None
        first_times = (time.perf_counter() - w, time.process_time() - c, got_first is not None)
    prof = cProfile.Profile() if args.profile else None
    w, c = time.perf_counter(), time.process_time()
    if prof is not None:
        prof.enable()
    got = data.digest_view([folder], inputs=[folder])
    if got is None:  # no digests: the traces, as `gputrace view` reads them
        from gputrace.trace.registry import expand

        files = expand([folder])
        doc = data.document(data.load(files), inputs=[folder])
        data.split(doc)
    if prof is not None:
        prof.disable()
    wall, cpu = time.perf_counter() - w, time.process_time() - c
    print(f"a cold document for `gputrace view`, {args.ranks} ranks x {args.steps:,} steps, {os.cpu_count()} cores")
    print(f"{'stage':<50} {'wall':>7} {'CPU':>7}")
    for label, (sw, sc) in SPENT.items():
        print(f"{label:<50} {sw:>6.2f}s {sc:>6.2f}s")
    print(f"{'all':<50} {wall:>6.2f}s {cpu:>6.2f}s  load average {os.getloadavg()[0]:.1f}")
    if first_times is not None:
        label = "the page's first document (viewer.first)" + ("" if first_times[2] else ": not made")
        print(f"{label:<50} {first_times[0]:>6.2f}s {first_times[1]:>6.2f}s  (before the above, apart)")
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
