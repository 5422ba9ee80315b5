"""The C build (`csrc/*.c`, one extension in files by stage). Its Python twins, and the state the
hot path reads, are in `record.py`, `resolve.py`, `trace/` and `digest.py`."""

from array import array
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, overload

from gputrace.clock import DeviceTimeline
from gputrace.record import HotState, Track, _Stack
from gputrace.resolve import SpanStore

_F = TypeVar("_F", bound=Callable[..., Any])

LAYOUT: tuple[int, tuple[str, ...]]
"""(HOT_LAYOUT, HotState's slot names), as this build reads them."""
STACK_LAYOUT: tuple[tuple[str, str], ...]
"""record.STACK_LAYOUT, as this build reads it."""
RESOLVE_LAYOUT: tuple[int, tuple[tuple[str, str], ...]]
"""(resolve.RESOLVE_LAYOUT_VERSION, resolve.RESOLVE_LAYOUT), as this build reads them."""

class Span:
    """One span: the handle span() returns, and the record the recorder keeps."""

    name: str
    args: dict[str, Any] | None
    stack: _Stack  # None only on a span skipped in CUDA graph capture
    parent: Span | None
    id: int | None
    gen: int
    t0: Any
    t1: Any
    error: str | None
    owner: Any
    cuda: bool
    sync: bool
    entry: int  # a device span: monotonic ns when the host entered it
    ranged: bool  # an NVTX range was pushed at its open and not yet popped
    def __init__(
        self, name: str, args: dict[str, Any] | None = None, cuda: bool = True, sync: bool = False, owner: Any = None
    ) -> None: ...
    def __enter__(self) -> Span: ...
    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any, /) -> None: ...
    def start(self) -> Span: ...
    def end(self) -> None: ...
    def __call__(self, fn: _F, /) -> _F: ...
    @property
    def track(self) -> Track | None: ...

@overload
def span(name: str, /, **args: Any) -> Span: ...
@overload
def span(name: _F, /) -> _F: ...
def bind(disabled: dict[str, Any], span_slow: Callable[..., Any], traced: Callable[..., Any], /) -> None: ...
def install(state: HotState | None, recording: bool, /) -> None: ...
def set_check_at(state: HotState, n: int, /) -> None: ...
def set_capture(n: int, /) -> None: ...
def open(span: Any, /) -> None: ...
def close(span: Any, /) -> None: ...
def encode_events(
    name_json: list[bytes],
    name_idx: list[int],
    cats: list[bytes],
    track_idx: list[int],
    lanes: list[int],
    tid_base: list[int],
    pid: int,
    starts: list[int],
    ends: list[int],
    base: int,
    args_json: list[bytes | None],
    /,
) -> bytes: ...
def layout(
    track_idx: list[int], starts: list[int], ends: list[int], ntracks: int, /
) -> tuple[list[int], list[int]]: ...
def resolve(
    done: list[Any],
    offset: int,
    store: SpanStore,
    timelines: list[DeviceTimeline],
    freed: list[list[Any]] | None,
    rounding_ns: int,
    timeline_type: type[DeviceTimeline],
    /,
) -> tuple[list[Any], list[list[Any]], dict[Any, list[int]]]: ...
def nest_tracks(
    lanes: dict[int, list[tuple[list[int], list[int]]]],
    tracks: array[int],
    starts: array[int],
    ends: array[int],
    limit: int,
    /,
) -> list[int] | None: ...
def encode_rows(
    name_json: list[bytes],
    names: array[int],
    tracks: array[int],
    starts: array[int],
    ends: array[int],
    args: list[dict[str, Any] | None],
    dump: Callable[[dict[str, Any]], bytes],
    track_info: Callable[[int], tuple[int, bytes]],
    pid: int,
    base: int,
    entry: array[int] | None = None,
    launch_tid: int = 0,
    first_flow: int = 0,
    write: Callable[[bytes], object] | None = None,
    /,
) -> bytes | None: ...
def split_finished(pending: list[Any], wait: bool, /) -> tuple[list[Any], list[Any], list[int]]: ...
def set_raw_elapsed(
    elapsed_ptr: int, clear_ptr: int, device_ptr: int, stands_for: Any, then_ptr: int = 0, /
) -> None: ...
def raw_elapsed_ms(a: Any, b: Any, /) -> float | None: ...
def set_current(device: int, stream: int, raw: int, device_for: Any, stream_for: Any, /) -> None: ...
def current_stream() -> tuple[int, int] | None: ...

class RawEvent:
    """A CUDA timing event made and recorded by the CUDA runtime (created at its first record)."""

    cuda_event: int
    device: int | None
    def __init__(self) -> None: ...
    def record(self, stream: Any, /) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...
    def elapsed_time(self, other: RawEvent, /) -> float: ...

def set_runtime(calls: dict[str, int] | None, /) -> None: ...
def record_floor(a: RawEvent, b: RawEvent, stream: int, n: int, driver: bool = False, /) -> int: ...
def set_driver(record: int, /) -> None: ...
def driver_record() -> bool: ...
def column_range(column: array[int], /) -> tuple[int, int] | None: ...
def entries_range(column: array[int], /) -> tuple[int, int]: ...
def int_deltas(a: Sequence[int], b: Sequence[int] | None, base: int, /) -> list[int] | Any: ...
def int_span_total(ends: array[int], starts: array[int], lo: int, hi: int, /) -> int | Any: ...
def digest_rows(
    names: array[int], tracks: array[int], starts: array[int], ends: array[int], row_mask: bytes, /
) -> tuple[list[int], int, int]: ...
def digest_fold(
    names: array[int],
    tracks: array[int],
    starts: array[int],
    ends: array[int],
    skip: bytes | None,
    step_starts: array[int],
    bucket: int,
    nb: int,
    bounds: array[int],
    /,
) -> Any: ...
def digest_cover(
    names: array[int],
    tracks: array[int],
    starts: array[int],
    ends: array[int],
    skip: bytes | None,
    row_mask: bytes,
    step_starts: array[int],
    step_ends: array[int],
    step_tracks: array[int],
    /,
) -> tuple[list[int], list[int], list[int]]: ...
def digest_nest(
    names: array[int],
    tracks: array[int],
    starts: array[int],
    ends: array[int],
    skip: bytes | None,
    step_starts: array[int],
    bucket: int,
    nb: int,
    carry_tracks: array[int],
    carry_starts: array[int],
    carry_ends: array[int],
    floor: array[int],
    lean: bool = False,
    carry_bytes: bool = False,
    /,
) -> Any: ...
def digest_entries(
    entry: Any, tracks: Any, starts: Any, ends: Any, skip: bytes | None, cuda_mask: bytes, /
) -> tuple[bytes, bytes]: ...
def digest_lags(
    xs: Any, ss: Any, step_starts: Any, step_ends: Any, final: bool, /
) -> tuple[list[int], list[int], list[int], bytes, bytes]: ...

class DisabledSpan:
    name: str
    args: dict[str, Any] | None
    cuda: bool
    sync: bool
    def __init__(
        self, name: str, args: dict[str, Any] | None = None, cuda: bool = True, sync: bool = False
    ) -> None: ...
    def __enter__(self) -> DisabledSpan: ...
    def __exit__(self, *exc: object) -> None: ...
    def start(self) -> DisabledSpan: ...
    def end(self) -> None: ...
    def __call__(self, fn: Any, /) -> Any: ...

class Writer:
    """Writes bytes to a file descriptor in a thread of its own, in order (see files.writes_behind)."""

    def __init__(self, fd: int, limit: int = ...) -> None: ...
    def write(self, data: bytes, /) -> None: ...
    def close(self) -> None: ...

# first.c: the page's first document (viewer.first._rows_py is its twin).
def first_rows(
    name: list[int],
    track: list[int],
    start: list[int],
    dur: list[int],
    flags: list[int],
    base: int,
    kinds: bytes,
    n_tracks: int,
    /,
) -> tuple[int, bool, bytes, bytes, bytes, tuple[tuple[bytes, bytes, bytes], ...]]: ...
def first_columns(rows: list[Any], count: int, /) -> tuple[list[int], list[int], list[int]]: ...
def first_others_median(rows: list[Any], count: int, /) -> list[list[int]]: ...

# readx.c: the Chrome JSON reader's plain X events (chrome._Builder.add's loop is its twin).
def read_x_rows(
    events: list[Any],
    i: int,
    base: int,
    track_index: dict[Any, int],
    name_index: dict[str, int],
    keys: frozenset[str] | None,
    args: list[Any],
    cats: list[Any] | None,
    /,
) -> tuple[int, bytes, bytes, bytes, bytes]: ...
