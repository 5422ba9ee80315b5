"""A nanotron-compatible timer facade over the same recorder (public as `gputrace.timer`,
`gputrace.Timers`, `gputrace.TimerRecord`; this module's name is private so that importing it
can never put a module where `gputrace.timer` should be).

Takes: `timer("name", timer_type=TimerType.CUDA, cuda_sync=False)` used as a context manager,
a decorator (every form, `@timer("name")` included) or `.start()`/`.end()`.
Gives: `TimerRecord`s with `.elapsed`, `.total_time`, `.average_time` (seconds) and
`.call_count`, every call also a span in the trace. Values of CUDA timers are resolved when
read (that waits for the GPU, as reading a CUDA timer must), never in the timed code.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, overload

from gputrace import record, session
from gputrace.dist import rank_info
from gputrace.record import PyOptSpan, TimerType, warn_once

F = TypeVar("F", bound=Callable[..., Any])


class Logger(Protocol):
    """Anything with `info(str)`: a `logging.Logger`, a `LoggerAdapter`, ..."""

    def info(self, msg: str, /) -> Any: ...


def _hint_if_never_recorded() -> None:
    """Timers used while recording was never on measure nothing; say so once, as values are
    read or logged (a warning: the library never prints)."""
    if record.STATE.active is None and record.STATE.lazy is None:
        warn_once(
            "timers-never-recorded",
            "gputrace timers are read but recording was never turned on, so they measured nothing: "
            "call gputrace.enable() (or set GPUTRACE=1 or ENABLE_TIMERS=1) before the timed code",
            stacklevel=4,
        )


class TimerRecord:
    """One named timer: its running spans and the totals of its finished ones."""

    def __init__(self, name: str, timer_type: TimerType = TimerType.CUDA, cuda_sync: bool = False) -> None:
        self.name = name
        self.timer_type = timer_type
        self.cuda_sync = cuda_sync
        self.call_count = 0
        self._running: list[PyOptSpan] = []
        self._total_ns = 0
        self._last_ns = 0
        self._resolved = 0
        self._skip = 0  # durations still to come of calls ended before a reset()

    # -- recording --
    def start(self) -> TimerRecord:
        """Start one call of the timer; pair with `.end()`."""
        rec = record.current()
        if rec is not None:
            s = record.OptSpan(self.name, None, self.timer_type is TimerType.CUDA, self.cuda_sync, self)
            rec.open(s)
            if s.stack is not None:
                self._running.append(s)
        return self

    def end(self) -> None:
        """End the innermost running call."""
        if not self._running:
            if record.RECORDER is not None:
                warn_once(f"timer-not-running:{self.name}", f"timer {self.name!r} ended but not running; ignored")
            return
        s = self._running.pop()
        s.__exit__(None, None, None)
        self.call_count += 1

    def __enter__(self) -> TimerRecord:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc_type is not None and self._running:
            self._running[-1].error = exc_type.__name__
        self.end()

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:
            with self:
                return fn(*a, **k)

        return timed  # type: ignore[return-value]

    def add_ns(self, ns: int) -> None:
        """One finished call's duration."""
        if self._skip:
            self._skip -= 1
            return
        self._total_ns += ns
        self._last_ns = ns
        self._resolved += 1

    def add_durations(self, ns: list[int]) -> None:
        """The durations of this timer's calls that one flush resolved, in order (resolve gives
        them per owner; the recorder hands them here)."""
        if self._skip:
            k = min(self._skip, len(ns))
            self._skip -= k
            ns = ns[k:]
        if ns:
            self._total_ns += sum(ns)
            self._last_ns = ns[-1]
            self._resolved += len(ns)

    # -- values (seconds, as nanotron) --
    def _settle(self) -> None:
        rec = record.ACTIVE
        if self._resolved < self.call_count and rec is not None:
            rec.flush(force=True)  # what has finished (a CPU timer's calls: all), without a drain
            if self._resolved < self.call_count:
                rec.flush(wait=True)

    @property
    def elapsed(self) -> float:
        """Seconds of the last finished call."""
        _hint_if_never_recorded()
        self._settle()
        return self._last_ns / 1e9

    @property
    def total_time(self) -> float:
        """Seconds of every finished call together."""
        _hint_if_never_recorded()
        self._settle()
        return self._total_ns / 1e9

    @property
    def average_time(self) -> float:
        """Seconds per finished call (0.0 before the first)."""
        _hint_if_never_recorded()
        self._settle()
        return self._total_ns / self._resolved / 1e9 if self._resolved else 0.0

    @property
    def running(self) -> bool:
        return bool(self._running)

    def reset(self) -> None:
        """Forget the totals (running calls keep running)."""
        rec = record.ACTIVE
        if self._resolved < self.call_count and rec is not None:
            rec.flush(force=True)
        # Calls ended before the reset whose spans are still pending resolve later: not ours.
        self._skip += self.call_count - self._resolved
        self.call_count = self._total_ns = self._last_ns = self._resolved = 0

    def summary(self) -> str:
        """One line: total, average and calls, labelled with the clock that timed them (a CUDA
        timer times on the host where the recorder has no device: `cuda=False`, or no GPU)."""
        self._settle()
        avg = self._total_ns / self._resolved / 1e6 if self._resolved else 0.0
        kind = self.timer_type.value
        rec = record.RECORDER
        if self.timer_type is TimerType.CUDA and rec is not None and rec.device is None:
            kind = f"{TimerType.CPU.value}: recorded without CUDA"
        return (
            f"Timer '{self.name}' ({kind}): {self._total_ns / 1e6:.2f}ms total, "
            f"{avg:.2f}ms avg, {self.call_count} calls"
        )


class Timers:
    """`gputrace.timer`: one `TimerRecord` per name."""

    def __init__(self) -> None:
        # The registry is the session's state's (`State.timers`, cleared with it), held here
        # directly: a timer call looks its name up without another attribute read.
        self._timers: dict[str, TimerRecord] = session.SESSION.state.timers

    @overload
    def __call__(
        self, name: str, timer_type: TimerType | str | None = None, cuda_sync: bool = False
    ) -> TimerRecord: ...

    @overload
    def __call__(self, name: F) -> F: ...

    def __call__(self, name: Any, timer_type: TimerType | str | None = None, cuda_sync: bool = False) -> Any:
        """The timer called `name` (made on first use; CUDA unless `timer_type` says CPU)."""
        if callable(name) and not isinstance(name, str):  # bare @timer
            fn = name
            return self(getattr(fn, "__qualname__", repr(fn)))(fn)
        if not isinstance(name, str):
            raise TypeError(f"timer() takes a name (str), not {type(name).__name__}")
        if record._compiling():
            return record.NULLCTX  # see span(): Dynamo traces through nullcontext only
        tt = TimerType(timer_type) if isinstance(timer_type, str) else timer_type
        t = self._timers.get(name)
        if t is None:
            t = self._timers[name] = TimerRecord(name, tt or TimerType.CUDA, cuda_sync)
        elif tt is not None and t.timer_type is not tt:
            warn_once(f"timer-type:{name}", f"timer {name!r} exists as {t.timer_type.value}; {tt.value} ignored")
        return t

    def __getitem__(self, name: str) -> TimerRecord:
        return self._timers[name]

    def __contains__(self, name: str) -> bool:
        return name in self._timers

    def enable(self, **options: Any) -> None:
        """`gputrace.enable(**options)`."""
        session.enable(**options)

    def disable(self) -> None:
        """`gputrace.disable()`."""
        session.disable()

    def is_enabled(self) -> bool:
        """`gputrace.is_enabled()`."""
        return session.is_enabled()

    def reset(self, name: str | None = None) -> None:
        """Reset one timer, or all of them."""
        for t in self._timers.values() if name is None else [self._timers[name]] if name in self._timers else []:
            t.reset()

    def reset_all(self) -> None:
        self.reset()

    def log(self, name: str, logger: Logger | None = None, rank: int | None = 0) -> None:
        """Print (or `logger.info`) one timer's totals, on `rank` only (None: every rank)."""
        _hint_if_never_recorded()
        t = self._timers.get(name)
        if t is None or t.call_count == 0 or not _on_rank(rank):
            return
        _emit(logger, t.summary())

    def log_all(self, logger: Logger | None = None, rank: int | None = None) -> None:
        """Print (or `logger.info`) every timer's totals, on `rank` only (None: every rank)."""
        _hint_if_never_recorded()
        if not _on_rank(rank):
            return
        timers = [t for _, t in sorted(self._timers.items()) if t.call_count]
        if timers:
            me = rank_info().rank
            _emit(logger, f"---- Timing information (rank {me}) ----")
            for t in timers:
                _emit(logger, t.summary())


def _on_rank(rank: int | None) -> bool:
    return rank is None or rank_info().rank == rank


def _emit(logger: Logger | None, line: str) -> None:
    if logger is None:
        print(line, flush=True)  # the one place the library prints: log() and log_all() were asked to
    else:
        logger.info(line)


timer = Timers()
