"""NCCL on two GPUs (marked `cuda`; skipped with fewer than two): the demo's ranks, merged, have
their all-reduce ends line up within the error bars."""

from __future__ import annotations

import statistics

import pytest

from gputrace import demo, merge
from gputrace.traceio import read_trace

from .conftest import HAS_CUDA, spans_of

pytestmark = pytest.mark.cuda

if HAS_CUDA:
    import torch

    TWO = torch.cuda.device_count() >= 2
else:
    TWO = False


@pytest.mark.skipif(not TWO, reason="needs two GPUs")
def test_nccl_all_reduce_ends_line_up_after_merge(tmp_path) -> None:  # type: ignore[no-untyped-def]
    paths = demo.run_ranks(str(tmp_path), steps=8, ranks=2)
    out = tmp_path / "merged.json"
    meta = merge.merge(paths, str(out))
    trace = read_trace(str(out))
    ends: dict[int, list[int]] = {}
    for e in spans_of(trace):
        if e["name"] == "all_reduce":
            ends.setdefault(e["pid"] - 1, []).append(e["end"])
    gaps = [abs(a - b) for a, b in zip(sorted(ends[0]), sorted(ends[1]))]
    sync_err = meta["alignment"]["per_rank"]["1"]["error_ns"]
    anchors = [meta["rank_metadata"][r]["clock"]["device_anchors"][0]["uncertainty_ns_max"] for r in ("0", "1")]
    bound = sync_err + sum(anchors) + 20_000
    print(
        f"NCCL all_reduce end gaps (ns): median {statistics.median(gaps)}, max {max(gaps)}; "
        f"clock sync +-{sync_err} ns, anchors +-{anchors} ns, bound {bound} ns"
    )
    assert statistics.median(gaps) <= bound
    tracks = {e["track"] for e in spans_of(trace)}
    assert {"cuda:0 default stream", "cuda:1 default stream"} <= tracks
    assert any(t.endswith("stream 2") or t.endswith("stream 1") for t in tracks)  # copy / comm streams
