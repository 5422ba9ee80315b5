"""Spans inside torch.compile'd code: no graph break, no span (documented behaviour)."""

from __future__ import annotations

import torch
import torch._dynamo.testing

import gputrace

from .conftest import spans_of


def test_span_inside_compiled_code_does_not_break_the_graph() -> None:
    gputrace.enable(cuda=False)

    @gputrace.span("decorated")
    def helper(x: torch.Tensor) -> torch.Tensor:
        return x - 1

    def f(x: torch.Tensor) -> torch.Tensor:
        with gputrace.span("inside"):
            y = x * 2
        return helper(y + 1)

    counter = torch._dynamo.testing.CompileCounter()
    g = torch.compile(f, backend=counter)
    with gputrace.span("around"):
        out = g(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 2.0))
    assert counter.frame_count == 1  # one graph: no break at the span
    assert [e["name"] for e in spans_of(gputrace.trace_dict())] == ["around"]
    torch._dynamo.reset()


def test_disabled_spans_and_timers_inside_compiled_code_keep_one_graph() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        with gputrace.span("off"):
            y = x * 2
        with gputrace.timer("t"):
            y = y + 1
        return y

    counter = torch._dynamo.testing.CompileCounter()
    g = torch.compile(f, backend=counter)
    assert torch.equal(g(torch.ones(3)), torch.full((3,), 3.0))
    assert counter.frame_count == 1
    torch._dynamo.reset()
