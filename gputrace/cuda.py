"""The CUDA side of recording: the few torch calls the recorder makes, bound once.

Takes: torch with CUDA. Gives: `CudaDevice`, whose attributes the recorder binds into its hot
path. Tests drive the same recorder with a fake device that has these methods.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable
from typing import Any


class CudaDevice:
    """`runtime` None: the CUDA runtime's own events (`_hot.RawEvent`, recorded from C with
    cudaEventRecord) where the C build is in use and the runtime's calls are found, else torch's;
    True or False asks for one (True falls back to torch's where they cannot be had).
    `events` says which it uses: "runtime" or "torch"."""

    def __init__(self, runtime: bool | None = None) -> None:
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
        event: Any = torch.cuda.Event
        self._event: Callable[[], Any] = lambda: event(enable_timing=True)
        self._memory_stats: Callable[[int], Any] | None = getattr(c, "_cuda_memoryStats", None)
        self._side: dict[int, Any] = {}
        watch_graph_capture(torch)
        self.events = "torch"
        if runtime is not False:
            raw = bind_runtime_events()
            if raw is not None:
                # The same methods on the runtime's events: anchors, flush's split and resolve
                # take them as they take torch's.
                self._event = raw
                self.record = raw.record
                self.elapsed = raw.elapsed_time
                self.events = "runtime"
                bind_current_stream(torch, self.current_device, self.raw_stream)
        bind_raw_elapsed(self.elapsed)

    def count(self) -> int:
        return int(self._torch.cuda.device_count())

    def initialized(self, dev: int) -> bool:
        # Anchoring a device the program never touched would create a context on it.
        return dev == self.current_device() and self._torch.cuda.is_initialized()

    def new_event(self) -> Any:
        return self._event()

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
        """The caching allocator's allocated and reserved bytes on `dev` (no device sync). One
        call of the allocator's nested statistics (~10 us on the H200 host), not
        `memory_allocated` and `memory_reserved`, which flatten them each (~70 us each)."""
        stats = self._memory_stats
        if stats is not None:
            nested = stats(dev)
            try:
                return int(nested["allocated_bytes"]["all"]["current"]), int(nested["reserved_bytes"]["all"]["current"])
            except (KeyError, TypeError):  # another torch's layout: the public calls from now on
                self._memory_stats = None
        cuda = self._torch.cuda
        return int(cuda.memory_allocated(dev)), int(cuda.memory_reserved(dev))

    def name(self, dev: int) -> str:
        return str(self._torch.cuda.get_device_name(dev))


def loaded_library(name: str) -> str | None:
    """The path of the one library this process has loaded whose file name starts with `name`
    (e.g. "libtorch_cuda.so"), or None: not Linux, none loaded, or more than one."""
    if not sys.platform.startswith("linux"):
        return None
    found = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").rpartition(" ")[2]
                if os.path.basename(path).startswith(name):
                    found.add(os.path.realpath(path))
    except OSError:
        return None
    return found.pop() if len(found) == 1 else None


def runtime_calls() -> tuple[int, int, int] | None:
    """The addresses of cudaEventElapsedTime, cudaGetLastError and cudaGetDevice as torch's CUDA
    library resolves them (looked up through its handle, so through the runtime it links),
    or None where they cannot be found."""
    path = loaded_library("libtorch_cuda.so")
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)  # the loaded library itself: dlopen of a loaded path adds a reference
        calls = (lib.cudaEventElapsedTime, lib.cudaGetLastError, lib.cudaGetDevice)
    except (OSError, AttributeError):
        return None
    addresses = tuple(ctypes.cast(c, ctypes.c_void_p).value or 0 for c in calls)
    return addresses if all(addresses) else None  # type: ignore[return-value]


_EVENT_CALLS = (
    "cudaEventCreateWithFlags",
    "cudaEventRecord",
    "cudaEventQuery",
    "cudaEventSynchronize",
    "cudaEventDestroy",
    "cudaEventElapsedTime",
    "cudaGetLastError",
    "cudaGetDevice",
    "cudaSetDevice",
)


def event_calls() -> dict[str, int] | None:
    """The addresses of the CUDA runtime's event calls (`_EVENT_CALLS`) as torch's CUDA library
    resolves them, or None where any cannot be found."""
    path = loaded_library("libtorch_cuda.so")
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
        found = {name: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0 for name in _EVENT_CALLS}
    except (OSError, AttributeError):
        return None
    return found if all(found.values()) else None


def driver_calls() -> dict[str, int] | None:
    """The addresses of the CUDA driver's cuEventRecord and cuEventElapsedTime (its _v2 where the
    driver has it) in the driver library the runtime loaded, or None where either is not found.
    The runtime's events and streams are the driver's: these take the same handles, without the
    runtime's checks around them."""
    path = loaded_library("libcuda.so")
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
        record = ctypes.cast(lib.cuEventRecord, ctypes.c_void_p).value or 0
        elapsed = getattr(lib, "cuEventElapsedTime_v2", None) or lib.cuEventElapsedTime
        found = {"cuEventRecord": record, "cuEventElapsedTime": ctypes.cast(elapsed, ctypes.c_void_p).value or 0}
    except (OSError, AttributeError):
        return None
    return found if all(found.values()) else None


def bind_runtime_events() -> Any:
    """The C build's RawEvent type, its runtime calls bound, or None: no C build in use, or the
    calls not found (torch's events then)."""
    from gputrace import native

    hot: Any = native.hot
    if hot is None or not hasattr(hot, "RawEvent"):
        return None
    calls = event_calls()
    if calls is None:
        return None
    hot.set_runtime(calls)
    if hasattr(hot, "set_driver"):
        driver = driver_calls()
        hot.set_driver(driver["cuEventRecord"] if driver else 0)
    return hot.RawEvent


_C10_CALLS = (
    "_ZN3c104cuda14current_deviceEv",  # c10::cuda::current_device()
    "_ZN3c104cuda20getCurrentCUDAStreamEa",  # c10::cuda::getCurrentCUDAStream(DeviceIndex)
    "_ZNK3c104cuda10CUDAStream6streamEv",  # c10::cuda::CUDAStream::stream() const
)


def bind_current_stream(torch: Any, device: Callable[[], int], raw_stream: Callable[[int], int]) -> bool:
    """Let the C hot path ask c10 itself for torch's current device and raw current stream (the
    calls torch's bindings `device` and `raw_stream` make, without pybind around them). Bound
    only once they give the bindings' answers on the default stream and on another; otherwise,
    or where the symbols are not found, the bindings stay. True when bound."""
    from gputrace import native

    hot: Any = native.hot
    path = loaded_library("libc10_cuda.so")
    if hot is None or not hasattr(hot, "set_current") or path is None:
        return False
    try:
        lib = ctypes.CDLL(path)
        addrs = [ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0 for name in _C10_CALLS]
    except (OSError, AttributeError):
        return False
    if not all(addrs):
        return False
    hot.set_current(*addrs, device, raw_stream)
    try:
        dev = device()
        agree = bool(hot.current_stream() == (dev, raw_stream(dev)))
        with torch.cuda.stream(torch.cuda.Stream()):
            agree = agree and bool(hot.current_stream() == (dev, raw_stream(dev)))
        agree = agree and bool(hot.current_stream() == (dev, raw_stream(dev)))
    except Exception:  # noqa: BLE001 - any failure leaves the bindings in place
        agree = False
    if not agree:
        hot.set_current(0, 0, 0, None, None)
    return agree


def bind_raw_elapsed(elapsed: Callable[[Any, Any], float]) -> bool:
    """Let the C resolve measure events with the driver's cuEventElapsedTime (else the runtime's
    cudaEventElapsedTime) on their raw handles, standing in for torch's `elapsed` (which also asks
    both events whether they ran and sets the device around the call: ~3 us against ~0.1-0.5 us a
    call on the H200 VM). The same float32; used only on a thread whose current device is the
    events' (so no context is made elsewhere); any failure falls back to torch's call. True when
    bound."""
    from gputrace import native

    hot: Any = native.hot  # the C build in use, or None
    calls = runtime_calls() if hot is not None else None
    if calls is None:
        return False
    driver = driver_calls()
    if driver is None:
        hot.set_raw_elapsed(*calls, elapsed)
    else:  # the same call without the runtime's checks around it (~half the time); the runtime's
        # where it refuses (a thread with no context current yet)
        hot.set_raw_elapsed(driver["cuEventElapsedTime"], *calls[1:], elapsed, calls[0])
    return True


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
