"""The CUDA side of recording: the few torch calls the recorder makes, bound once.

Takes: torch with CUDA. Gives: `CudaDevice`, whose attributes the recorder binds into its hot
path. Tests drive the same recorder with a fake device that has these methods.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class CudaDevice:
    def __init__(self) -> None:
        import torch

        self._torch: Any = torch  # torch's private calls below are untyped
        c: Any = torch._C
        # Raw calls: torch.cuda.current_stream() builds a Stream object per call (~4-5 us), and
        # Event.record() without a stream looks it up the same way.
        self.current_device: Callable[[], int] = c._cuda_getDevice
        self.raw_stream: Callable[[int], int] = c._cuda_getCurrentRawStream
        self.record: Callable[[Any, Any], None] = c._CudaEventBase.record
        self.elapsed: Callable[[Any, Any], float] = c._CudaEventBase.elapsed_time
        self.is_capturing: Callable[[], bool] = c._cuda_isCurrentStreamCapturing
        self._event: Any = torch.cuda.Event
        self._side: dict[int, Any] = {}
        watch_graph_capture(torch)

    def count(self) -> int:
        return int(self._torch.cuda.device_count())

    def initialized(self, dev: int) -> bool:
        # Anchoring a device the program never touched would create a context on it.
        return dev == self.current_device() and self._torch.cuda.is_initialized()

    def new_event(self) -> Any:
        return self._event(enable_timing=True)

    def stream_for(self, dev: int) -> Any:
        """The current stream of `dev` as a Stream object (slow path, once per track)."""
        return self._torch.cuda.current_stream(dev)

    def side_stream(self, dev: int) -> Any:
        """A stream of gputrace's own, idle, where reference events run at once."""
        s = self._side.get(dev)
        if s is None:
            s = self._side[dev] = self._torch.cuda.Stream(device=dev)
        return s

    def synchronize(self) -> None:
        torch = self._torch
        for dev in range(torch.cuda.device_count()):
            if dev in self._side or dev == self.current_device():
                torch.cuda.synchronize(dev)

    def memory(self, dev: int) -> tuple[int, int]:
        """The caching allocator's allocated and reserved bytes on `dev` (no device sync)."""
        cuda = self._torch.cuda
        return int(cuda.memory_allocated(dev)), int(cuda.memory_reserved(dev))

    def name(self, dev: int) -> str:
        return str(self._torch.cuda.get_device_name(dev))


def watch_graph_capture(torch: Any) -> None:
    """Tell the recorder when torch.cuda.CUDAGraph captures begin and end (torch.cuda.graph and
    make_graphed_callables go through it), so the hot path need not ask CUDA on every span."""
    from gputrace import record

    graph = torch.cuda.graphs.CUDAGraph
    if getattr(graph, "_gputrace_watched", False):
        return
    begin, end = graph.capture_begin, graph.capture_end

    def capture_begin(self: Any, *a: Any, **k: Any) -> Any:
        record.capture_changed(+1)
        try:
            return begin(self, *a, **k)
        except BaseException:
            record.capture_changed(-1)
            raise

    def capture_end(self: Any, *a: Any, **k: Any) -> Any:
        try:
            return end(self, *a, **k)
        finally:
            record.capture_changed(-1)

    graph.capture_begin, graph.capture_end = capture_begin, capture_end
    graph._gputrace_watched = True
