"""The runtime's own timing events (`_hot.RawEvent`) where no CUDA runtime is loaded: refused with
a clear error, never half made, and torch's events stay the fallback (the GPU side is in
tests/test_cuda_hot.py)."""

from __future__ import annotations

import pytest

from gputrace import cuda, native, record

pytestmark = pytest.mark.skipif(native.hot is None, reason="the C build is not in use")


def test_without_the_runtime_a_raw_event_is_refused_clearly() -> None:
    hot = native.hot
    assert hot is not None
    if cuda.event_calls() is not None:
        pytest.skip("a CUDA runtime is loaded here")
    hot.set_runtime(None)
    with pytest.raises(RuntimeError, match="runtime"):
        hot.RawEvent()
    assert cuda.bind_runtime_events() is None  # the device keeps torch's events


def test_the_runtime_calls_must_all_be_given() -> None:
    hot = native.hot
    assert hot is not None
    with pytest.raises(ValueError, match="cudaEventRecord"):
        hot.set_runtime({"cudaEventCreateWithFlags": 1})
    with pytest.raises(TypeError):
        hot.set_runtime([1, 2])
    cuda.bind_runtime_events()  # as it was: bound where the runtime is loaded


def test_the_stack_layout_names_the_raw_stream() -> None:
    assert ("stack", "raw") in record.STACK_LAYOUT
    assert native.hot is not None and native.hot.STACK_LAYOUT == record.STACK_LAYOUT
    assert native.hot.current_stream() is None  # c10's calls are not bound without torch's CUDA
