"""On a real GPU (marked `cuda`, skipped without one): the hot path's host entry time, NVTX
ranges, and timing events the C hot path records through the CUDA runtime."""

from __future__ import annotations

import time

import pytest

import gputrace
from gputrace import record, session

from .conftest import HAS_CUDA

pytestmark = pytest.mark.cuda

if HAS_CUDA:
    import torch


def test_a_cuda_span_is_entered_before_it_starts_and_the_queue_shows() -> None:
    gputrace.enable()
    a = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    rec = record.ACTIVE
    assert rec is not None
    before = time.monotonic_ns() + rec.clock.epoch_offset_ns
    with gputrace.span("block"):
        torch.cuda._sleep(50_000_000)  # tens of ms of GPU time: what follows waits in the queue
    for i in range(5):
        with gputrace.span("queued", i=i):
            a @ a
    with gputrace.span("host", timer_type="cpu"):
        pass
    after = time.monotonic_ns() + rec.clock.epoch_offset_ns
    trace = session.trace()
    sp = trace.spans
    assert sp.entry is not None and len(sp.entry) == len(sp.start)
    names = [trace.names[i] for i in sp.name]
    for k, name in enumerate(names):
        if name == "host":
            assert sp.entry[k] == 0
            continue
        assert before <= sp.entry[k] <= after, name
        assert sp.entry[k] <= sp.start[k], name
        if name == "queued":  # entered while "block" still ran on the GPU
            assert sp.start[k] - sp.entry[k] > 1_000_000
