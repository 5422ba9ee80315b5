"""A fake device with a clock of its own, for testing the recorder and the anchoring math
exactly on a CPU.

Host time is a counter the test moves. The device clock runs at `rate` (1 + drift) from its
own `offset`; events run when their stream gets to them; `elapsed_time` rounds to float32
milliseconds as CUDA's does. Every event knows the host time it truly ran at, so a test can
compare what gputrace computed with the truth.
"""

from __future__ import annotations

import struct
from contextlib import contextmanager
from fractions import Fraction


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


class FakeEvent:
    def __init__(self, dev: FakeDevice) -> None:
        self.dev = dev
        self.host_ns: int | None = None  # when it ran, on the host clock
        self.device_ns: Fraction | None = None  # exact, so only float32 rounds
        self.records = 0

    def query(self) -> bool:
        assert self.host_ns is not None, "query of an event never recorded"
        return self.host_ns <= self.dev.now

    def synchronize(self) -> None:
        assert self.host_ns is not None
        self.dev.now = max(self.dev.now, self.host_ns + self.dev.wake_ns)
        self.dev.syncs += 1

    def elapsed_time(self, other: FakeEvent) -> float:
        assert self.device_ns is not None and other.device_ns is not None
        assert self.query() and other.query(), "elapsed_time on an event that has not run"
        return f32(float(other.device_ns - self.device_ns) / 1e6)


class FakeStream:
    def __init__(self, raw: int) -> None:
        self.raw = raw
        self.busy_until = 0


class FakeDevice:
    """One or more fake GPUs sharing one host clock; the methods the recorder binds."""

    def __init__(
        self,
        devices: int = 1,
        rate: Fraction | float = 1,
        offset_ns: int = 7_000_000_000,
        launch_ns: int = 4_000,
        wake_ns: int = 4_000,
        start_ns: int = 1_000_000_000,
        read_ns: int = 0,
    ) -> None:
        self.rate = Fraction(rate)
        self.offset_ns = offset_ns
        self.launch_ns = launch_ns
        self.wake_ns = wake_ns
        self.now = start_ns
        self.read_ns = read_ns
        self.syncs = 0  # event waits (anchors)
        self.device_syncs = 0  # whole-device waits
        self.events_made = 0
        self._n = devices
        self._dev = 0
        self._raw = 0x1000
        self.default = [FakeStream(0) for _ in range(devices)]
        self.current = list(self.default)
        self.streams: list[FakeStream] = list(self.default)
        self._side: dict[int, FakeStream] = {}
        self._capturing = False
        self.unusable = False  # a forked child: every device call fails, as CUDA's would

    @property
    def capturing(self) -> bool:
        return self._capturing

    @capturing.setter
    def capturing(self, value: bool) -> None:
        # As the watched torch.cuda.CUDAGraph does: tell the recorder a capture began or ended.
        from gputrace import record

        if value != self._capturing:
            record.capture_changed(+1 if value else -1)
        self._capturing = value

    # host clock
    def monotonic_ns(self) -> int:
        t = self.now
        self.now += self.read_ns
        return t

    def advance(self, ns: int) -> None:
        self.now += ns

    def device_time(self, host_ns: int) -> Fraction:
        return self.offset_ns + host_ns * self.rate

    # streams and work
    def new_stream(self) -> FakeStream:
        self._raw += 0x100
        s = FakeStream(self._raw)
        self.streams.append(s)
        return s

    @contextmanager
    def stream(self, s: FakeStream):  # type: ignore[no-untyped-def]
        prev, self.current[self._dev] = self.current[self._dev], s
        try:
            yield s
        finally:
            self.current[self._dev] = prev

    def work(self, ns: int, stream: FakeStream | None = None) -> None:
        """Enqueue `ns` of kernel time on a stream (the current one by default)."""
        s = stream or self.current[self._dev]
        s.busy_until = max(s.busy_until, self.now + self.launch_ns) + ns

    def set_device(self, dev: int) -> None:
        self._dev = dev

    # the recorder's interface
    def count(self) -> int:
        return self._n

    def initialized(self, dev: int) -> bool:
        return dev == self._dev

    def current_device(self) -> int:
        if self.unusable:
            raise RuntimeError("Cannot re-initialize CUDA in forked subprocess")
        return self._dev

    def raw_stream(self, dev: int) -> int:
        return self.current[dev].raw

    def new_event(self) -> FakeEvent:
        self.events_made += 1
        return FakeEvent(self)

    def record(self, ev: FakeEvent, stream: FakeStream) -> None:
        at = max(self.now + self.launch_ns, stream.busy_until)
        stream.busy_until = at
        ev.host_ns = at
        ev.device_ns = self.device_time(at)
        ev.records += 1

    def is_capturing(self) -> bool:
        return self._capturing

    def stream_for(self, dev: int) -> FakeStream:
        return self.current[dev]

    def side_stream(self, dev: int) -> FakeStream:
        s = self._side.get(dev)
        if s is None:
            s = self._side[dev] = self.new_stream()
        return s

    def synchronize(self) -> None:
        self.now = max([self.now] + [s.busy_until + self.wake_ns for s in self.streams])
        self.device_syncs += 1

    def name(self, dev: int) -> str:
        return f"Fake GPU {dev}"
