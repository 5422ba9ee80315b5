"""NCCL on two GPUs (marked `cuda`; skipped with fewer than two): the demo's ranks, merged, have
their all-reduce ends within 3 us of each other, and each rank's device-refined offset carries an
error bar that contains the offset the workload's own all-reduces show.

The workload is `gputrace demo`'s, untouched: its sync_clocks() calls (at the start and the end)
refine the offsets with their own tiny all-reduces; the demo's 50 MB gradient all-reduces, on a
stream of their own, are only what the test looks at."""

from __future__ import annotations

import statistics

import pytest

from gputrace import demo, merge
from gputrace.trace import chrome
from gputrace.trace.model import Trace

from .conftest import HAS_CUDA

pytestmark = pytest.mark.cuda

if HAS_CUDA:
    import torch

    TWO = torch.cuda.device_count() >= 2
else:
    TWO = False

TARGET_NS = 3_000


def all_reduce_ends(trace: Trace) -> dict[int, list[int]]:
    ranks = trace.track_rank()
    ends: dict[int, list[int]] = {}
    for name, track, _, end, _ in trace.iter_spans():
        if name == "all_reduce":
            ends.setdefault(ranks[track], []).append(end)  # type: ignore[arg-type]
    return {r: sorted(v) for r, v in ends.items()}


@pytest.mark.skipif(not TWO, reason="needs two GPUs")
def test_nccl_all_reduce_ends_line_up_after_merge(tmp_path) -> None:  # type: ignore[no-untyped-def]
    paths = demo.run_ranks(str(tmp_path), steps=12, ranks=2)
    out = tmp_path / "merged.json"
    merge.merge(paths, str(out))
    merged = chrome.read(str(out))
    ends = all_reduce_ends(merged)
    gaps = [b - a for a, b in zip(ends[0], ends[1])]
    # The truth, as well as the workload can tell it: the offset that makes rank 1's all-reduce
    # ends (in its own file, unaligned) meet rank 0's.
    raw = [chrome.read(p) for p in paths]
    own = [all_reduce_ends(t)[r] for r, t in enumerate(raw)]
    truth = statistics.median(a - b for a, b in zip(own[0], own[1]))
    syncs = raw[1].metadata["clock"]["sync_to_rank0"]
    host = [(s["offset_ns"], s["error_ns"]) for s in syncs]
    device = [(s["device"]["offset_ns"], s["device"]["error_ns"], s["device"]["spread_ns"]) for s in syncs]
    print(
        f"\nall_reduce end gaps after merge (rank 1 - rank 0, ns): median |gap| "
        f"{statistics.median(abs(g) for g in gaps):.0f}, max {max(abs(g) for g in gaps)}, all {gaps}\n"
        f"truth (workload's own ends) {truth:.0f} ns; host syncs (offset, error) {host}; "
        f"device syncs (offset, error, spread) {device}"
    )
    assert len(gaps) == 12
    assert statistics.median(abs(g) for g in gaps) <= TARGET_NS
    for offset, error, _ in device:
        assert abs(offset - truth) <= error, (offset, error, truth)
    tracks = {t.name for t in merged.tracks}
    assert {"cuda:0 default stream", "cuda:1 default stream"} <= tracks
