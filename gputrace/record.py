"""Recording: span enter and exit, the hot path.

Takes: span opens and closes from the API (`Span` handles, timers).
Gives: `Recorder.pending`, closed spans that still hold device events (CUDA tracks) or
monotonic nanoseconds (host tracks), and one `DeviceTimeline` of anchors per device. At
`flush()` the spans the GPU has finished go to `resolve`, which makes them absolute.

Hot-path rules, each measured (see benchmarks/): a span records handles, not results; events
come from a pool; the stream is looked up by its raw handle through a cache, never through
`torch.cuda.current_stream()`; no strings, dicts, logging or synchronisation. Everything else
(new tracks, misuse, anchoring, resolving) lives in slow paths the hot path reaches rarely.

The hot path exists twice: `csrc/span.c` (used when built) and this module's `PySpan`, `_py_span`,
`Recorder._open_py` / `_close_py` (the reference, and the fallback). Both read one declared
state, `HotState`, and call the same slow paths here; the test suite runs against both.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, overload

from gputrace import native
from gputrace.clock import DeviceTimeline, HostClock, take_anchor
from gputrace.config import Config
from gputrace.errors import GputraceWarning
from gputrace.resolve import SpanStore, resolve
from gputrace.state import State


class TimerType(enum.Enum):
    CPU = "cpu"
    CUDA = "cuda"


class Track:
    """A timeline in the trace: one CUDA stream of one device, or one host thread."""

    __slots__ = ("index", "device", "stream", "ordinal", "name")

    def __init__(self, index: int, device: int | None, stream: Any, ordinal: int, name: str) -> None:
        self.index = index
        self.device = device  # None for a host-thread track
        self.stream = stream
        self.ordinal = ordinal
        self.name = name


F = TypeVar("F", bound=Callable[..., Any])


class _Stack(list["PySpan"]):
    """Open spans of one (thread, device, stream), innermost last. `device` and `stream` repeat
    the track's, one attribute read away for the hot path; `raw` is the stream's raw handle (the
    key it was found by; None on a host track), which runtime events are recorded on."""

    __slots__ = ("track", "device", "stream", "raw")
    track: Track
    device: int | None
    stream: Any
    raw: Any


HOT_LAYOUT = 2
"""The version of `HotState`'s layout. `csrc/hot.h` declares the same number and the same slots in
the same order; importing gputrace fails when a C build disagrees, rather than a span failing
mid-run. Change the number with any change to what a slot holds."""


STACK_LAYOUT: tuple[tuple[str, str], ...] = (
    ("stack", "track"),  # _Stack's slots, in order
    ("stack", "device"),
    ("stack", "stream"),
    ("stack", "raw"),
    ("local", "cuda"),  # HotState.local: a thread's stacks on devices and its host stack
    ("local", "host"),
)
"""What the hot path reads beside `HotState`, declared once; the C build reports the same pairs
(`STACK_LAYOUT`) and is refused at import where they differ."""


def _no_device(*args: Any) -> Any:
    raise RuntimeError("gputrace: a device call on a recorder without a device")


class HotState:
    """Everything the span hot path reads, declared once for both of its implementations.

    The C path reads these slots, in this order, when the recorder is installed (`csrc/hot.h`,
    `HOT_FIELDS`), and swaps its whole copy at once; the Python twin reads them by name. The
    containers are the recorder's own and only ever change in place; `check_at` is the one
    value that changes, through `Recorder._check_at` (which tells the C path)."""

    __slots__ = (
        "local",  # threading.local: .cuda = {(device, raw stream): stack}, .host = stack
        "has_device",  # False: every span goes on a host track
        "cur_dev",  # () -> the current device index
        "raw_stream",  # (device) -> the current stream's raw handle
        "capturing",  # () -> whether the current stream is capturing a CUDA graph
        "new_event",  # () -> a timing event
        "record",  # (event, stream) -> None
        "pools",  # per device: events to record again; popped (never tested first: threads race)
        "gens",  # per device: the index the next anchor will get
        "mono",  # () -> monotonic ns
        "pending",  # closed spans waiting for resolve
        "check_at",  # len(pending) at which a close calls pending_full
        "open_slow",  # (span) -> None: every open the fast path does not handle
        "close_slow",  # (span) -> None: the close of a cuda_sync span
        "close_unusual",  # (span) -> bool: a close not of the innermost open span; True: record its end
        "pending_full",  # () -> None
        "close_by_name",  # (handle) -> None: .end() on a handle that was never started
        "nvtx",  # gputrace.nvtx.Ranges: an NVTX range per span (the nvtx option), or None: off
    )

    local: threading.local
    has_device: bool
    cur_dev: Callable[[], int]
    raw_stream: Callable[[int], int]
    capturing: Callable[[], bool]
    new_event: Callable[[], Any]
    record: Callable[[Any, Any], Any]
    pools: list[list[Any]]
    gens: list[int]
    mono: Callable[[], int]
    pending: list[Any]
    check_at: int
    open_slow: Callable[[Any], None]
    close_slow: Callable[[Any], None]
    close_unusual: Callable[[Any], bool]
    pending_full: Callable[[], None]
    close_by_name: Callable[[Any], None]
    nvtx: Any

    def __init__(self, **fields: Any) -> None:
        missing = set(HotState.__slots__) - set(fields)
        extra = set(fields) - set(HotState.__slots__)
        if missing or extra:
            raise TypeError(f"HotState fields: missing {sorted(missing)}, unknown {sorted(extra)}")
        for name, value in fields.items():
            setattr(self, name, value)


class PySpan:
    """One span: the handle `span()` returns, and the record the recorder keeps.

    `t0`/`t1` hold CUDA events on a device track and monotonic ns on a host track. `stack` is
    unset until the span opens (None if it was skipped). The hot path sets as few fields as it
    can: `id` is given at resolve time, `error` only on an exception."""

    __slots__ = ("name", "args", "stack", "parent", "id", "gen", "t0", "t1", "entry", "error", "ranged")
    name: str
    args: dict[str, Any] | None
    # Unset until opened. Typed without None, which only a span skipped in CUDA graph capture
    # holds (set in _open_py, handled in _close_unusual): code that sees open spans reads it freely.
    stack: _Stack
    parent: PySpan | None
    id: int | None  # unset until resolve numbers it
    gen: int  # device spans: the first anchor that can follow the start event
    t0: Any  # a CUDA event, or monotonic ns
    t1: Any
    entry: int  # device spans: monotonic ns when the host entered it (queued its start event)
    error: str  # the exception's type name, set only on one
    ranged: bool  # an NVTX range was pushed at its open and not yet popped (the nvtx option)
    cuda: bool = True  # class-level defaults; OptSpan holds them per span
    sync: bool = False
    owner: Any = None

    def __init__(self, name: str, args: dict[str, Any] | None = None) -> None:
        self.name = name
        self.args = args

    def __enter__(self) -> PySpan:
        rec = RECORDER
        if rec is not None:
            rec.open(self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc_type is not None:
            self.error = exc_type.__name__
        rec = ACTIVE
        if rec is not None:
            rec.close(self)

    def start(self) -> PySpan:
        """Open the span; pair with `.end()`."""
        return self.__enter__()

    def end(self) -> None:
        """Close the span. On a handle that was never started, close the innermost open span
        of this name on the current stream (the `span("iteration").end()` loop idiom)."""
        try:
            self.stack  # noqa: B018
        except AttributeError:
            if RECORDER is not None:
                RECORDER.close_by_name(self)
            return
        self.__exit__(None, None, None)

    def __call__(self, fn: F) -> F:
        """The span as a decorator: every call of `fn` is a span of this name."""
        return traced(fn, self.name, self.args, self.cuda, self.sync)

    @property
    def track(self) -> Track | None:
        """The track the span was recorded on (None before it opens)."""
        stack = getattr(self, "stack", None)
        return stack.track if stack is not None else None

    def __repr__(self) -> str:
        return f"<gputrace span {self.name!r}>"


class PyOptSpan(PySpan):
    """A span with options: a host span, `cuda_sync`, or one that reports to a timer."""

    __slots__ = ("cuda", "sync", "owner")

    def __init__(
        self, name: str, args: dict[str, Any] | None = None, cuda: bool = True, sync: bool = False, owner: Any = None
    ) -> None:
        self.name = name
        self.args = args
        self.cuda = cuda
        self.sync = sync
        self.owner = owner


_new = object.__new__


class _NoopSpan:
    """A span that does nothing: what recording-off handles are made of."""

    __slots__ = ()

    def __enter__(self) -> _NoopSpan:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        return None

    def start(self) -> _NoopSpan:
        return self

    def end(self) -> None:
        return None


# An automatic resolve (the pending list full) works in slices of this many spans until this much
# time has passed (benchmarks/run.py measures the longest pause a span exit sees).
AUTO_RESOLVE_SLICE = 512
AUTO_RESOLVE_BUDGET_NS = 1_000_000

# The state this module reads (`gputrace.state`): the session owns it and installs it here
# (`install_state`); until then a state of this module's own, recording off.
STATE = State()
# The hot path's copies of STATE.recorder and STATE.active, one global read away (a span reads
# one of them on every enter and exit); `set_recorder` keeps them equal. RECORDER is None while
# recording is off; ACTIVE keeps the last recorder, so spans opened before disable() still close
# and saving still works.
RECORDER: Recorder | None = None
ACTIVE: Recorder | None = None
_warned: set[str] = STATE.warned  # the state's own containers, as globals for the hot path


def current() -> Recorder | None:
    """The recorder spans record into now (built here if the environment asked for one)."""
    if RECORDER is None and STATE.lazy is not None:
        STATE.lazy()
    return RECORDER


def warn_once(key: str, message: str, stacklevel: int = 3) -> None:
    """Misuse is reported once per kind, never raised into the user's training loop."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, GputraceWarning, stacklevel=stacklevel)


class Recorder:
    """Holds the open stacks, the event pool, the pending list and the device timelines.

    `device` is a `gputrace.cuda.CudaDevice` (or a test double with the same methods); None
    records host spans only."""

    def __init__(self, config: Config, device: Any, clock: HostClock) -> None:
        self.config = config
        self.device = device
        self.clock = clock
        self.store = SpanStore(config.max_spans)
        self.tracks: list[Track] = []
        self.timelines: list[DeviceTimeline] = []
        self.skipped_in_capture = 0
        self._stacks: list[_Stack] = []  # every stack of every thread, for save-time and misuse
        self._lock = threading.RLock()
        # Run once a flush on this thread lets go of the lock: the session's handling of a signal
        # caught while the lock was held here (a resolve half done), set by `on_release`.
        self._after_flush: Callable[[], None] | None = None
        self._mono = clock.monotonic_ns
        # When a flush last took anchors (the host clock's monotonic ns): see `_anchored_lately`.
        self._anchored_at = -(1 << 62)
        self._track_keys: dict[Any, Track] = {}
        self._has_device = device is not None
        ndev = device.count() if device is not None else 0
        self._cur_dev: Callable[[], int] = device.current_device if device is not None else _no_device
        self._raw_stream: Callable[[int], int] = device.raw_stream if device is not None else _no_device
        self._new_event: Callable[[], Any] = device.new_event if device is not None else _no_device
        self._record: Callable[[Any, Any], Any] = device.record if device is not None else _no_device
        self._capturing: Callable[[], bool] = device.is_capturing if device is not None else _no_device
        self.hot = HotState(
            local=threading.local(),
            has_device=device is not None,
            cur_dev=self._cur_dev,
            raw_stream=self._raw_stream,
            capturing=self._capturing,
            new_event=self._new_event,
            record=self._record,
            pools=[[] for _ in range(ndev)],
            gens=[0] * ndev,
            mono=self._mono,
            pending=[],
            check_at=config.max_pending,
            open_slow=self._open_py,
            close_slow=self._close_py,
            close_unusual=self._close_unusual,
            pending_full=self._pending_full,
            close_by_name=self.close_by_name,
            nvtx=_find_nvtx(config.nvtx),
        )
        # The C hot path when it is built (same logic; this class's _open_py/_close_py are the
        # reference and the fallback).
        self.open: Callable[[Any], None]
        self.close: Callable[[Any], None]
        self.open, self.close = (_hot.open, _hot.close) if _hot is not None else self._twin()
        if device is not None:
            for _ in range(ndev):
                self.timelines.append(DeviceTimeline(getattr(device, "elapsed", None)))
            for dev in range(ndev):
                if device.initialized(dev):
                    self._anchor(dev)

    # The containers of the hot state, under the names the slow paths use.

    @property
    def pending(self) -> list[Any]:
        """Closed spans waiting for resolve (changed in place only: the C path holds it)."""
        return self.hot.pending

    @property
    def pools(self) -> list[list[Any]]:
        """Per device: finished events to record again."""
        return self.hot.pools

    @property
    def gens(self) -> list[int]:
        """Per device: the index the next anchor will get."""
        return self.hot.gens

    def set_nvtx(self, on: bool) -> None:
        """Turn NVTX ranges on or off for spans opened from now on (install the recorder again)."""
        self.hot.nvtx = _find_nvtx(on)

    # ---- hot path -------------------------------------------------------------------------

    def _twin(self) -> tuple[Callable[[Any], None], Callable[[Any], None]]:
        """The Python twin's open and close: with NVTX ranges only while the option is on, so
        spans pay nothing for it off."""
        if self.hot.nvtx is None:
            return self._open_py, self._close_py
        return self._open_nvtx, self._close_nvtx

    def _open_nvtx(self, s: Any) -> None:
        # As the C path: pushed once the open is recorded, popped before the close is.
        self._open_py(s)
        ranges = self.hot.nvtx
        if ranges is not None and not getattr(s, "ranged", False):
            ranges.push(s.name)
            s.ranged = True

    def _close_nvtx(self, s: Any) -> None:
        ranges = self.hot.nvtx
        if getattr(s, "ranged", False) and ranges is not None:
            s.ranged = False
            ranges.pop()
        self._close_py(s)

    def _open_py(self, s: Any) -> None:
        h = self.hot
        if s.cuda and h.has_device:
            try:
                stacks = h.local.cuda
            except AttributeError:
                stacks = h.local.cuda = {}
            dev = h.cur_dev()
            key = (dev, h.raw_stream(dev))
            stack = stacks.get(key)
            if stack is None or h.capturing():
                stack = self._new_stack(stacks, key)
                if stack is None:  # capturing a CUDA graph: see _new_stack
                    s.stack = None
                    return
            if s.sync:
                self.device.synchronize()
            # The host moment the start is queued: one clock read, the host spans' own clock.
            s.entry = h.mono()
            try:  # not `if pool`: another thread may take the last event in between
                ev = h.pools[dev].pop()
            except IndexError:
                ev = h.new_event()
            h.record(ev, stack.stream)
            s.t0 = ev
            s.gen = h.gens[dev]
        else:
            try:
                stack = h.local.host
            except AttributeError:
                stack = self._new_stack(None, None)
            s.t0 = h.mono()
        s.parent = stack[-1] if stack else None
        s.stack = stack
        stack.append(s)

    def _close_py(self, s: Any) -> None:
        stack = s.stack
        if stack and stack[-1] is s:
            stack.pop()
        elif not self._close_unusual(s):
            return
        h = self.hot
        dev = stack.device
        if dev is None:
            s.t1 = h.mono()
        else:
            if s.sync:
                self.device.synchronize()
            try:
                ev = h.pools[dev].pop()
            except IndexError:
                ev = h.new_event()
            h.record(ev, stack.stream)
            s.t1 = ev
        pending = h.pending
        pending.append(s)
        if len(pending) >= h.check_at:
            self._pending_full()

    # ---- slow paths -----------------------------------------------------------------------

    def _new_stack(self, stacks: dict[Any, _Stack] | None, key: Any) -> _Stack | None:
        with self._lock:
            if key is None:
                thread = threading.current_thread()
                tkey: Any = ("thread", thread.ident)
                track = self._track_keys.get(tkey)
                if track is None:
                    n = sum(1 for t in self.tracks if t.device is None)
                    track = self._add_track(tkey, None, None, n, f"thread {thread.name} (host)")
            else:
                if self.device.is_capturing():
                    self._skip_capture()
                    return None
                if key in stacks:  # type: ignore[operator]
                    return stacks[key]  # type: ignore[index]
                dev, raw = key
                track = self._track_keys.get(key)
                if track is None:
                    if not self.timelines[dev].anchors:
                        self._anchor(dev)
                    n = sum(1 for t in self.tracks if t.device == dev)
                    label = "default stream" if raw == 0 else f"stream {n}"
                    track = self._add_track(key, dev, self.device.stream_for(dev), n, f"cuda:{dev} {label}")
            stack = _Stack()
            stack.track, stack.device, stack.stream = track, track.device, track.stream
            stack.raw = None if key is None else key[1]
            if stacks is None:
                self.hot.local.host = stack
            else:
                stacks[key] = stack
            self._stacks.append(stack)
            return stack

    def _add_track(self, key: Any, dev: int | None, stream: Any, ordinal: int, name: str) -> Track:
        track = Track(len(self.tracks), dev, stream, ordinal, name)
        self.tracks.append(track)
        self._track_keys[key] = track
        return track

    def _skip_capture(self) -> None:
        # Timing events cannot be recorded into a CUDA graph without changing it, and a failed
        # call would invalidate the user's capture: spans opened during capture record nothing.
        self.skipped_in_capture += 1
        warn_once("capture", "gputrace spans inside CUDA graph capture are not recorded (counted in the trace)")

    def _close_unusual(self, s: Span) -> bool:
        """A close that is not of the innermost open span. True: record its end."""
        stack: Any = getattr(s, "stack", False)
        if stack is None or stack is False:  # skipped during CUDA graph capture, or never opened
            return False
        if any(x is s for x in stack):
            warn_once(
                "misnest",
                f"span {s.name!r} ended before spans opened inside it; they are kept, and any that "
                "cannot nest are drawn on an overflow track",
            )
            for i in range(len(stack) - 1, -1, -1):
                if stack[i] is s:
                    del stack[i]
                    break
            return True
        warn_once("double-end", f"span {s.name!r} ended twice; the second end is ignored")
        return False

    def close_by_name(self, handle: Span) -> None:
        """`span("x").end()` on a fresh handle: close the innermost open "x" on this stream."""
        local = self.hot.local
        if handle.cuda and self._has_device:
            dev = self._cur_dev()
            stack = getattr(local, "cuda", {}).get((dev, self._raw_stream(dev)))
        else:
            stack = getattr(local, "host", None)
        for s in reversed(stack or ()):
            if s.name == handle.name:
                self.close(s)
                return
        warn_once(f"end-unopened:{handle.name}", f"span {handle.name!r} ended but none is open on this stream; ignored")

    @property
    def _check_at(self) -> int:
        """Pending length at which the hot path resolves by itself."""
        return self.hot.check_at

    @_check_at.setter
    def _check_at(self, n: int) -> None:
        self.hot.check_at = n
        if _hot is not None:
            _hot.set_check_at(self.hot, n)  # takes effect where this state is installed

    def _pending_full(self) -> None:
        # The oldest spans resolve in slices until a time budget is spent, so the span exit that
        # finds the list full pauses the program for a few milliseconds, not for the whole list.
        # At least one slice each time, so the list cannot outgrow max_pending by more than a
        # slice or two while the GPU keeps up.
        deadline = time.perf_counter_ns() + AUTO_RESOLVE_BUDGET_NS
        while self.pending:
            if not self.flush(wait=False, limit=min(AUTO_RESOLVE_SLICE, self.config.max_pending)):
                break  # the GPU has not finished the oldest: nothing to gain now
            if time.perf_counter_ns() >= deadline:
                break
        # Look again after another slice of new spans (each look resolves at least a slice), and
        # once the list is short, when it is full again.
        slice_ = min(AUTO_RESOLVE_SLICE, self.config.max_pending)
        self._check_at = max(len(self.pending) + slice_, self.config.max_pending)

    def _anchor(self, dev: int) -> None:
        pool = self.pools[dev]
        anchor = take_anchor(
            lambda: _pop_or(pool, self._new_event),
            self._record,
            self.device.side_stream(dev),
            self.clock,
            self.config.anchor_tries,
            pool.append,
            getattr(self.device, "wait", None) or (lambda ev: ev.synchronize()),
            self._good_round_trip(dev),
        )
        self.gens[dev] = self.timelines[dev].add(anchor) + 1

    def _anchored_lately(self) -> bool:
        """Whether a flush now would resolve nothing worth its anchor: one was taken less than
        `anchor_every_ms` ago. The spans the GPU finished since lie after it and would wait for
        the next anyway (host spans lose nothing waiting with them); an anchor now costs a
        side-stream round trip (~10 us: several hundred ns a span at a flush of 100 spans). A
        streamed trace anchors at every flush: its file has, at each, what the GPU finished."""
        config = self.config
        every = config.anchor_every_ms
        if every <= 0 or config.out_dir:
            return False
        return self._mono() - self._anchored_at < every * 1_000_000

    def _good_round_trip(self, dev: int) -> int:
        """A round trip within 1.5x of the least this device has shown is good enough to stop
        trying (anchors are taken every flush: each try blocks the host ~10 us)."""
        anchors = self.timelines[dev].anchors
        if not anchors:
            return 0  # the first anchor takes every try
        least = min(a.uncertainty_ns for a in anchors[-64:])
        return 3 * least  # round trip = 2 x uncertainty; 1.5x of it

    # ---- flush and save -------------------------------------------------------------------

    def busy_here(self) -> bool:
        """Whether this thread is inside the recorder's slow paths (a flush, a resolve of the open
        spans, a new track): what they change is then half changed."""
        return bool(self._lock._is_owned())  # type: ignore[attr-defined]

    def on_release(self, run: Callable[[], None]) -> None:
        """Call `run` once the flush under way on this thread has let go of the lock."""
        self._after_flush = run

    def flush(self, wait: bool = False, limit: int | None = None, force: bool = False) -> int:
        """Resolve every span the GPU has finished (all of them with `wait`) into the store;
        with `limit`, only among the oldest `limit` pending spans. Without `wait` it never drains
        the GPU: it asks events, and anchors on a side stream. A plain flush within
        `anchor_every_ms` of one that anchored does nothing; `force` (what reads the recorder in
        the process: timers, the straggler report) resolves what has finished regardless."""
        n = self._flush(wait, limit, force)
        if self._after_flush is not None and not self.busy_here():
            run, self._after_flush = self._after_flush, None
            run()
        return n

    def _flush(self, wait: bool, limit: int | None, force: bool = False) -> int:
        with self._lock:
            if wait and self.device is not None:
                self.device.synchronize()
            elif limit is None and not force and self._anchored_lately():
                return 0
            # In place: the C hot path holds this list. Each step is one atomic list operation,
            # so a span another thread appends meanwhile stays for the next flush.
            held = self.hot.pending
            n = len(held) if limit is None else min(limit, len(held))
            pending = held[:n]
            del held[:n]
            devices: list[int] = []
            waiting: list[Span] = []
            split: Any = NotImplemented
            if self.device is None:  # host spans only: all finished, none needs an anchor
                done = pending
            elif _split_c is not None and (split := _split_c(pending, wait)) is not NotImplemented:
                done, waiting, devices = split  # the C hot path's spans, split in one loop
            else:
                done, waiting = _split_finished(pending) if not wait else (pending, [])
                devices = sorted({s.stack.device for s in done} - {None})  # type: ignore[arg-type]
            for dev in devices:
                self._anchor(dev)
            if devices:
                self._anchored_at = self._mono()
            if done:
                later, freed, durations = resolve(done, self.timelines, self.clock, self.store)
                if freed:  # a list per device (none on a host-only recorder)
                    for pool, events in zip(self.hot.pools, freed):
                        pool.extend(events)  # the events are the pool's again
                if durations:
                    _hand_durations(durations)
            else:
                later = []
            if later or waiting:
                held[:0] = later + waiting
            check_at = len(held) + self.config.max_pending
            if check_at != self.hot.check_at:
                self._check_at = check_at
            return len(done) - len(later)

    def take_resolved(self) -> SpanStore:
        """The resolved rows, moved out of the store (which goes on empty) in one step: spans
        other threads resolve meanwhile (a full pending list resolves on any thread's span exit)
        go to the next take, never half into this one."""
        with self._lock:
            return self.store.take()

    def resolved_copy(self) -> SpanStore:
        """A copy of the resolved rows, taken in one step (as `take_resolved`)."""
        with self._lock:
            return self.store.copy()

    def open_spans(self) -> list[Span]:
        with self._lock:
            return [s for stack in self._stacks for s in stack]

    def resolve_open(self) -> SpanStore:
        """The spans open now, closed at this moment in a throwaway store and marked
        `unfinished` (the real ones stay open). Waits for the GPU when any is on a device."""
        with self._lock:
            snap = SpanStore(self.config.max_spans)
            snap.names, snap._name_index = self.store.names, self.store._name_index  # one set of names
            copies = []
            # One end for every open span of a track (one host reading; one event a stream), so
            # spans open inside each other end together and still nest.
            # Other threads open spans meanwhile (without this lock): the end is read once the
            # open spans are listed, so none of them starts after it.
            opened = self.open_spans()
            now = self._mono()
            ends: dict[int, Any] = {}
            for s in opened:
                c = PySpan(s.name, {**(s.args or {}), "unfinished": True})
                c.stack, c.parent, c.id, c.t0 = s.stack, s.parent, self.store.id_of(s), s.t0
                if s.stack.device is None:
                    c.t1 = now if now >= c.t0 else c.t0
                else:
                    end = ends.get(id(s.stack))
                    if end is None:
                        end = ends[id(s.stack)] = self._new_event()
                        self._record(end, s.stack.stream)
                    c.gen, c.t1, c.entry = s.gen, end, s.entry
                copies.append(c)
            if copies:
                if self.device is not None:
                    self.device.synchronize()
                    for dev in sorted({c.stack.device for c in copies if c.stack.device is not None}):
                        self._anchor(dev)
                # The freed events are left to go: the originals keep their start events, and
                # the copies' ends are this snapshot's. No owner is told: the spans go on.
                resolve(copies, self.timelines, self.clock, snap)
            return snap

    def discard(self) -> None:
        """Forget every resolved and pending span (a fresh trace); open spans stay open."""
        with self._lock:
            self.flush(wait=True)  # the pending spans' events go back to their pools
            self.store.clear()
            self.store.dropped = 0
            self.store.child_extent.clear()
            self.skipped_in_capture = 0


def _hand_durations(durations: dict[Any, list[int]]) -> None:
    """Each owner (a timer) its spans' durations from one resolve: the timer facade adds its own
    totals (`add_durations`; `add_ns` a span at a time for an owner without it)."""
    for owner, ns in durations.items():
        add = getattr(owner, "add_durations", None)
        if add is not None:
            add(ns)
        else:
            for d in ns:
                owner.add_ns(d)


def _split_finished(pending: list[Span]) -> tuple[list[Span], list[Span]]:
    """Split closed spans into those whose end event has run and the rest, without waiting.

    On one stream events complete in the order they were recorded, so per track the finished
    spans are a prefix of its pending spans: the last is asked first (at a flush a step the GPU
    has usually run them all), then a binary search asks O(log n) events."""
    by_track: dict[int, list[Span]] = {}
    done: list[Span] = []
    for s in pending:
        if s.track.device is None:  # type: ignore[union-attr]
            done.append(s)
        else:
            by_track.setdefault(s.track.index, []).append(s)  # type: ignore[union-attr]
    waiting: list[Span] = []
    for spans in by_track.values():
        lo, hi = 0, len(spans)  # spans[:lo] finished, spans[hi:] not
        while lo < hi:
            mid = len(spans) - 1 if hi == len(spans) else (lo + hi) // 2
            if spans[mid].t1.query():
                lo = mid + 1
            else:
                hi = mid
        done.extend(spans[:lo])
        waiting.extend(spans[lo:])
    return done, waiting


# ---- the user-facing constructors ---------------------------------------------------------------


class _DisabledSpan(_NoopSpan):
    """A do-nothing handle that remembers its name, so `@span("name")` applied while recording
    is off still traces under that name once recording is turned on."""

    __slots__ = ("name", "args", "cuda", "sync")

    def __init__(self, name: str, args: dict[str, Any] | None, cuda: bool, sync: bool) -> None:
        self.name, self.args, self.cuda, self.sync = name, args, cuda, sync

    def __call__(self, fn: F) -> F:
        return traced(fn, self.name, self.args, self.cuda, self.sync)


_disabled: dict[str, _DisabledSpan] = STATE.disabled


@overload
def _py_span(name: str, /, **args: Any) -> PySpan: ...
@overload
def _py_span(name: F, /) -> F: ...
def _py_span(name: Any, /, **args: Any) -> Any:
    """A span: `with span("fwd"):`, `@span`, `@span("name")`, or `s = span("x").start(); s.end()`.

    Keyword arguments land in the trace event's args, except `timer_type` (TimerType.CUDA, the
    default, or TimerType.CPU / "cpu" for a host-thread span) and `cuda_sync=True` (synchronise
    the device before each record, as nanotron's option does). While recording is off this
    returns a shared do-nothing object. Under torch.compile it returns `nullcontext()`, the one
    context manager Dynamo traces through without a graph break: a span times around a compiled
    region, not inside it."""
    if RECORDER is None:
        if not args:
            handle = _disabled.get(name)
            if handle is not None and not _compiling():
                return handle
        return _span_slow(name, args)
    if _compiling():
        return NULLCTX
    if args or type(name) is not str:
        return _span_slow(name, args)
    s = _new(PySpan)
    s.name = name
    s.args = None
    return s


def _span_slow(name: Any, args: dict[str, Any]) -> Any:
    if _compiling():
        return NULLCTX
    if RECORDER is None and STATE.lazy is not None:
        STATE.lazy()
    if type(name) is not str:
        if callable(name) and not args:  # bare @span
            return traced(name, _qualname(name), None, True, False)
        raise TypeError(f"span() takes a name (str) or a function, not {type(name).__name__}")
    timer_type = args.pop("timer_type", TimerType.CUDA)
    sync = bool(args.pop("cuda_sync", False))
    cuda = timer_type is TimerType.CUDA or timer_type == "cuda"
    if not cuda and not (timer_type is TimerType.CPU or timer_type == "cpu"):
        raise ValueError(f"timer_type must be TimerType.CUDA or TimerType.CPU, not {timer_type!r}")
    if RECORDER is None:
        if args or not cuda or sync:
            return DisabledSpan(name, args or None, cuda, sync)
        handle = _disabled[name] = DisabledSpan(name, None, True, False)
        if len(_disabled) > 4096:  # names built per step must not grow this without bound
            _disabled.clear()
        return handle
    if cuda and not sync:
        return Span(name, args or None)
    return OptSpan(name, args or None, cuda, sync)


def _compiling_lazy() -> bool:
    """Until `bind_compile_check()` has run: looks torch up on each call (Dynamo can trace this)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.compiler.is_compiling()


def bind_compile_check() -> None:
    """Once torch is imported the check is torch.compiler.is_compiling itself (one call); once
    Dynamo is imported it is told to trace the C span() as `nullcontext()` (it cannot trace
    into C). Dynamo is not imported for this: it costs most of a second."""
    global _compiling, _polyfilled
    torch = sys.modules.get("torch")
    if torch is None:
        return
    if _compiling is _compiling_lazy:
        _compiling = torch.compiler.is_compiling
    if _hot is not None and not _polyfilled and "torch._dynamo" in sys.modules:
        substitute = getattr(torch.compiler, "substitute_in_graph", None)
        if substitute is not None:
            substitute(_hot.span, skip_signature_check=True)(_span_in_graph)
        _polyfilled = True


def _span_in_graph(name: Any, /, **args: Any) -> Any:
    return NULLCTX


_polyfilled = False


_compiling: Callable[[], bool] = _compiling_lazy
NULLCTX = contextlib.nullcontext()


def traced(fn: F, name: str, args: dict[str, Any] | None, cuda: bool, sync: bool) -> F:
    """Wrap `fn` in a span. The wrapper checks one flag per call, so recording turned on after
    decoration (the usual order: decorate at import, enable in main) still works."""
    plain = cuda and not sync

    @functools.wraps(fn)
    def wrapper(*a: Any, **k: Any) -> Any:
        rec = RECORDER
        if rec is None or _compiling():
            return fn(*a, **k)
        s = Span(name, args) if plain else OptSpan(name, args, cuda, sync)
        with s:
            return fn(*a, **k)

    return wrapper  # type: ignore[return-value]


def _qualname(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


# ---- the C hot path, when built -----------------------------------------------------------------

HOT_UNUSED_BECAUSE: str | None = None
"""Why the C hot path is not in use (None: it is), for the twin tests and bug reports."""


def check_hot_layout(hot: Any) -> None:
    """Raise ImportError unless the C build `hot` reads the `HotState` declared here."""
    native.check_layout(hot, "LAYOUT", (HOT_LAYOUT, HotState.__slots__), "hot-state layout")


def check_stack_layout(hot: Any) -> None:
    """Raise ImportError unless the C build `hot` reads the stacks as STACK_LAYOUT declares."""
    native.check_layout(hot, "STACK_LAYOUT", STACK_LAYOUT, "stacks as")


_hot: Any = None  # the C build in use (gputrace.native decides), or None: the Python twin
_split_c: Any = None  # flush's split in C for the C hot path's spans (_split_finished is the reference)

if TYPE_CHECKING:  # both twins have the Python one's interface; checkers see that one
    Span = PySpan
    OptSpan = PyOptSpan
    span = _py_span
    DisabledSpan = _DisabledSpan


def _bind(hot: Any) -> None:
    """Bind the hot path to `hot` (the C build, or None: the twin); run by gputrace.native at
    import and at every switch. Refuses a build of another layout (ImportError, loudly)."""
    global _hot, _split_c, HOT_UNUSED_BECAUSE
    if hot is not None:
        check_hot_layout(hot)
        check_stack_layout(hot)
    old = _hot
    if old is not None and old is not hot:
        old.install(None, False)  # the old build keeps no recorder
    _hot, _split_c = hot, (hot.split_finished if hot is not None else None)
    HOT_UNUSED_BECAUSE = native.UNUSED_BECAUSE
    if hot is not None:
        globals().update(Span=hot.Span, OptSpan=hot.Span, span=hot.span, DisabledSpan=hot.DisabledSpan)
        hot.bind(_disabled, _span_slow, traced)
        hot.set_capture(STATE.captures)
    else:
        globals().update(Span=PySpan, OptSpan=PyOptSpan, span=_py_span, DisabledSpan=_DisabledSpan)
    if old is not hot:
        _disabled.clear()  # the do-nothing handles of recording off are the old implementation's
        if ACTIVE is not None:  # the recorder in use goes on in the new implementation
            set_recorder(RECORDER, ACTIVE)


def capture_changed(delta: int) -> None:
    """A capture began (+1) or ended (-1) (`STATE.captures`: the captures under way, as
    torch.cuda.CUDAGraph reports them). The C hot path then asks CUDA on every open; it
    does not otherwise, since the question costs ~0.35 us. A stream first seen during capture
    is always asked about (new tracks are made on the slow path)."""
    STATE.captures = max(0, STATE.captures + delta)
    if _hot is not None:
        _hot.set_capture(STATE.captures)


def set_recorder(rec: Recorder | None, active: Recorder | None) -> None:
    """Make `rec` the recorder spans record into (None: recording off) and `active` the one
    they close into and save from (`rec` is None or `active`)."""
    global RECORDER, ACTIVE
    if rec is not None and rec is not active:
        raise ValueError("set_recorder: the recorder spans record into must be the active one")
    STATE.recorder, STATE.active = rec, active
    RECORDER, ACTIVE = rec, active
    if active is not None:  # it records through the implementation in use (one built before a switch too)
        active.open, active.close = (_hot.open, _hot.close) if _hot is not None else active._twin()
    if _hot is not None:
        # Reads the whole state first, then switches in one step: a thread inside a span
        # meanwhile still sees the previous state, complete.
        _hot.install(active.hot if active is not None else None, rec is not None)


native.on_switch(_bind)
set_recorder(None, None)


def install_state(state: State) -> None:
    """Make `state` the one this module reads and changes (the session's), its recorders and
    captures what the hot path (Python or C) sees from now on. Installing the same state again
    after `State.clear()` is a fresh start."""
    global STATE, _warned, _disabled
    STATE = state
    _warned = state.warned
    _disabled = state.disabled
    if _hot is not None:
        _hot.bind(_disabled, _span_slow, traced)
        _hot.set_capture(state.captures)
    set_recorder(state.recorder, state.active)


def _after_fork_in_child() -> None:
    # A forked child (a DataLoader worker, say) cannot touch the parent's CUDA context, and its
    # spans would never be saved with the parent's: recording is off in the child.
    STATE.lazy = None
    set_recorder(None, None)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _find_nvtx(on: bool) -> Any:
    """The NVTX functions for the nvtx option (None: off, or none found, said once)."""
    if not on:
        return None
    from gputrace import nvtx

    ranges = nvtx.find()
    if ranges is None:
        warn_once(
            "nvtx",
            "gputrace: nvtx is on but no NVTX was found (torch without CUDA, or no NVTX library); "
            "spans are recorded without NVTX ranges",
            stacklevel=4,
        )
    return ranges


def _pop_or(pool: list[Any], make: Callable[[], Any]) -> Any:
    """An event from the pool, or a new one (no check-then-pop: another thread may take the last)."""
    try:
        return pool.pop()
    except IndexError:
        return make()
