"""The trace model: what every stage after recording reads and writes.

Takes: nothing (a data type). Gives: `Trace`, a columnar trace with integer epoch nanoseconds
everywhere, interned span names, processes (one per rank for gputrace's own, any number for
another tool's), tracks (one per CUDA stream, host thread or counter), and the metadata each
rank wrote (its rank, run id, clock syncs, drop counts). The readers in `chrome` and `perfetto`
build a `Trace`; the writers write one; merge, stats, validate and the viewer work on it alone.

Why columns: a rank of a long run holds millions of spans. Python objects per span cost ~200
bytes and seconds to build; `array` columns cost 8 bytes a value and are built from the
parsed file in one pass. Why integer ns: a double in microseconds since the epoch keeps only
0.25 us; integer ns keep the nanosecond through every stage until a writer formats `ts`.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import compress, count, repeat
from typing import Any

from gputrace import native

#: Track kinds. A "cuda" track is one CUDA stream, "cpu" one host thread, "counter" a series of
#: values (memory), "other" a thread of another tool's trace whose nature gputrace does not know.
KINDS = ("cuda", "cpu", "counter", "other")


@dataclasses.dataclass(frozen=True)
class Process:
    """One process of the trace: a rank (gputrace's `rank N` process) or another tool's process.

    `pid` is the id it is written with (gputrace: rank + 1; Perfetto's pid 0 is the kernel).
    `rank` is None for a process that is not a rank (a Kineto GPU process keeps the rank of the
    file it came from in `rank` and `foreign=True`)."""

    pid: int | str
    rank: int | None
    label: str
    sort_index: int
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    foreign: bool = False


@dataclasses.dataclass(frozen=True)
class Track:
    """A timeline inside a process. `tid` is the id it is written with; `ordinal` orders tracks
    of one process (CUDA streams by device and stream first, then host threads)."""

    process: int  # index into Trace.processes
    tid: int | str
    name: str
    kind: str = "other"
    device: int | None = None
    ordinal: int = 0


class SpanColumns:
    """Spans, one column per field: name (index into `Trace.names`), track (index into
    `Trace.tracks`), start and end (epoch ns, [start, end)), args (a dict or None each), cat.

    `entry` is optional: None, or one epoch ns per span of the host moment the span was entered
    (CUDA spans: when the host queued its start event; 0 where not known). A stage that keeps a
    subset of spans keeps the same subset of `entry` when it is not None."""

    __slots__ = ("name", "track", "start", "end", "args", "cat", "entry")

    def __init__(self) -> None:
        self.name = array("l")
        self.track = array("l")
        self.start = array("q")
        self.end = array("q")
        self.args: list[dict[str, Any] | None] = []
        self.cat: list[str | None] = []
        self.entry: array[int] | None = None

    def __len__(self) -> int:
        return len(self.start)

    @classmethod
    def wrap(
        cls,
        name: array[int],
        track: array[int],
        start: array[int],
        end: array[int],
        args: list[dict[str, Any] | None],
    ) -> SpanColumns:
        """Columns over existing arrays, not copies (a recorder's store as a trace)."""
        self = cls()
        self.name, self.track, self.start, self.end, self.args = name, track, start, end, args
        self.cat = _NoCats(len(start))
        return self

    def append(
        self, name: int, track: int, start: int, end: int, args: dict[str, Any] | None = None, cat: str | None = None
    ) -> None:
        self.name.append(name)
        self.track.append(track)
        self.start.append(start)
        self.end.append(end)
        self.args.append(args)
        self.cat.append(cat)

    def extend(
        self,
        name: Sequence[int],
        track: Sequence[int],
        start: Sequence[int],
        end: Sequence[int],
        args: Sequence[dict[str, Any] | None] | None = None,
        cat: Sequence[str | None] | None = None,
    ) -> None:
        n = len(start)
        if not (len(name) == len(track) == len(end) == n):
            raise ValueError("span columns of different lengths")
        self.name.extend(name)
        self.track.extend(track)
        self.start.extend(start)
        self.end.extend(end)
        self.args.extend(args if args is not None else [None] * n)
        self.cat.extend(cat if cat is not None else [None] * n)


class _RowsColumn(list):  # type: ignore[type-arg]
    """A column that is a list to the code that takes lists (`type(x)` checks, C loops through
    `dense()` or a slice) but keeps its rows elsewhere, so its list storage is empty: the list
    operations that would read that storage answer from its rows instead, and those that would
    change it in place are refused. (`orjson.dumps` of the column itself reads the storage: dump
    `list(column)`.)"""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, list) and len(self) == len(other) and all(map(_same, self, other))

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = None

    def __contains__(self, value: object) -> bool:
        return any(v == value for v in self)

    def count(self, value: Any) -> int:
        return sum(1 for v in self if v == value)

    def index(self, value: Any, *bounds: Any) -> int:
        return list(self).index(value, *bounds)

    def copy(self) -> list[Any]:
        return list(self)

    def __add__(self, other: Any) -> list[Any]:
        return list(self) + list(other)

    def __radd__(self, other: Any) -> list[Any]:
        return list(other) + list(self)

    def __iadd__(self, other: Any) -> Any:
        self.extend(other)
        return self

    def __reversed__(self) -> Iterator[Any]:
        return iter(list(self)[::-1])

    def __repr__(self) -> str:
        return f"<{type(self).__name__} of {len(self)} rows>"

    def _refuse(self, *a: Any, **k: Any) -> Any:
        raise TypeError(f"a {type(self).__name__} column is read and appended to, not changed in place")

    __setitem__ = __delitem__ = insert = pop = remove = clear = sort = reverse = _refuse
    __mul__ = __rmul__ = __imul__ = _refuse

    def __reduce__(self) -> Any:
        # Its fields, not the rows it iterates as (which pickle and copy would append to a list).
        return (_restore_column, (type(self), self.__dict__))


def _same(a: Any, b: Any) -> bool:
    return bool(a == b)


def _restore_column(cls: type, state: dict[str, Any]) -> Any:
    col: Any = list.__new__(cls)
    col.__dict__.update(state)
    return col


class _NoCats(_RowsColumn):
    """A `cat` column of all None that takes no memory per row (read as a list of None)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self._n = n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [None] * len(range(*i.indices(self._n)))
        if not -self._n <= i < self._n:
            raise IndexError("cat index out of range")
        return None

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[Any]:
        return repeat(None, self._n)

    def append(self, value: Any) -> None:
        self._n += 1

    def extend(self, values: Any) -> None:
        self._n += len(values)

    def dense(self) -> list[Any]:
        """The column as a plain list (a C loop's input)."""
        return [None] * self._n


class SparseArgs(_NoCats):
    """An `args` column where few spans have arguments: memory for those alone ({row: args});
    every other row reads None. What a trace read for the statistics keeps
    (`summary.load_for_statistics`); for reading, not for appending to."""

    def __init__(self, args: Sequence[dict[str, Any] | None]) -> None:
        super().__init__(len(args))
        # A dict of arguments is never empty in a column (readers keep None for none).
        kept: Iterator[dict[str, Any]] = compress(args, args)  # type: ignore[arg-type]
        self.rows: dict[int, dict[str, Any]] = dict(zip(compress(count(), args), kept))

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return list(map(self.rows.get, range(*i.indices(self._n))))
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("args index out of range")
        return self.rows.get(i)

    def __iter__(self) -> Iterator[Any]:
        return map(self.rows.get, range(self._n))

    def append(self, value: Any) -> None:
        raise TypeError("a sparse args column is read, not appended to")

    def extend(self, values: Any) -> None:
        raise TypeError("a sparse args column is read, not appended to")

    def dense(self) -> list[Any]:
        out: list[Any] = [None] * self._n
        for i, a in self.rows.items():
            out[i] = a
        return out


class PackedArgs(_RowsColumn):
    """An `args` column without a dict a span: what a whole read of a protobuf trace keeps. Each
    distinct tuple of keys (a shape) is kept once, each value as an int64 where it is an int,
    else as an index into a table of the other values (each distinct string once); a span
    without arguments costs its 4-byte place alone. Reading a row makes its dict, equal to the
    one packed (its values the same objects) but a new dict each time: a stage that changes a
    span's arguments changes its own copy. Appendable, as a list of dicts is (merge extends it
    with other ranks' rows). Like `SparseArgs`, a list with empty storage: a C loop takes
    `dense()` (or a slice, a list)."""

    def __init__(self, args: Iterable[dict[str, Any] | None] = ()) -> None:
        super().__init__()
        self.at = array("i")  # per span: its packed row, -1 for None
        self._shape = array("i")  # per packed row: its shape
        self._off = array("q")  # per packed row: its first value in _vals
        self._vals = array("q")  # an int, or (its shape says which) an index into _objs
        self._objs: list[Any] = []
        self._shapes: list[tuple[tuple[Any, ...], bytes | None]] = []  # keys, and which are in _objs
        self._shape_of: dict[tuple[tuple[Any, ...], bytes], int] = {}
        self._strs: dict[str, int] = {}
        for a in args:
            self.at.append(self.pack(a))

    def pack(self, args: dict[str, Any] | None) -> int:
        """Keep `args` (not as a row of this column: a reader places the index it returns in
        `at` itself); -1 for None."""
        if args is None:
            return -1
        vals, objs, strs = self._vals, self._objs, self._strs
        j = len(self._off)
        self._off.append(len(vals))
        kinds = bytearray(len(args))
        for k, v in enumerate(args.values()):
            if type(v) is int and -(2**63) <= v < 2**63:
                vals.append(v)
                continue
            kinds[k] = 1
            if type(v) is str:
                i = strs.get(v)
                if i is None:
                    i = strs[v] = len(objs)
                    objs.append(v)
            else:
                i = len(objs)
                objs.append(v)
            vals.append(i)
        key = (tuple(args), bytes(kinds))
        s = self._shape_of.get(key)
        if s is None:
            s = self._shape_of[key] = len(self._shapes)
            self._shapes.append((key[0], key[1] if any(kinds) else None))
        self._shape.append(s)
        return j

    def _row(self, j: int) -> dict[str, Any]:
        keys, kinds = self._shapes[self._shape[j]]
        o = self._off[j]
        values = self._vals[o : o + len(keys)]
        if kinds is None:
            return dict(zip(keys, values))
        objs = self._objs
        return {k: objs[v] if b else v for k, b, v in zip(keys, kinds, values)}

    def __getitem__(self, i: Any) -> Any:
        if type(i) is not slice:  # a writer reads a row at a time: this first
            j = self.at[i]
            return None if j < 0 else self._row(j)
        row = self._row
        return [None if j < 0 else row(j) for j in self.at[i]]

    def __len__(self) -> int:
        return len(self.at)

    def __iter__(self) -> Iterator[Any]:
        row = self._row
        for j in self.at:
            yield None if j < 0 else row(j)

    def append(self, value: Any) -> None:
        self.at.append(self.pack(value))

    def extend(self, values: Any) -> None:
        at, pack = self.at, self.pack
        for a in values:
            at.append(pack(a))

    def dense(self) -> list[Any]:
        """The column as a plain list of dicts (a C loop's input)."""
        at, row = self.at, self._row
        out: list[Any] = [None] * len(at)
        for i in compress(count(), map((0).__le__, at)):  # the rows with arguments alone
            out[i] = row(at[i])
        return out


class CounterColumns:
    """Counter samples: track (a "counter" track), time (epoch ns), value."""

    __slots__ = ("track", "ts", "value")

    def __init__(self) -> None:
        self.track = array("l")
        self.ts = array("q")
        self.value = array("d")

    def __len__(self) -> int:
        return len(self.ts)

    def append(self, track: int, ts: int, value: float) -> None:
        self.track.append(track)
        self.ts.append(ts)
        self.value.append(value)


def intern(names: list[str], index: dict[str, int], name: str) -> int:
    """`name`'s index in `names` (with `index` its inverse), added at the end when new."""
    i = index.get(name)
    if i is None:
        i = index[name] = len(names)
        names.append(name)
    return i


class Trace:
    """A whole trace: one rank's, a merged one, or another tool's.

    `metadata` is the trace's own (for a merged trace: the alignment applied); each rank's
    metadata is on its `Process`. `extra` holds events of other tools that gputrace carries
    through without interpreting them (instants, flows), as dicts whose times are already
    epoch ns (`ts_ns`, and `dur_ns` where they have one) and whose `process` is an index."""

    def __init__(self, metadata: dict[str, Any] | None = None) -> None:
        self.metadata: dict[str, Any] = metadata if metadata is not None else {}
        self.processes: list[Process] = []
        self.tracks: list[Track] = []
        self.names: list[str] = []
        self._name_index: dict[str, int] = {}
        self.spans = SpanColumns()
        self.counters = CounterColumns()
        self.extra: list[dict[str, Any]] = []

    # ---- building ----------------------------------------------------------------------------

    def intern(self, name: str) -> int:
        return intern(self.names, self._name_index, name)

    def add_process(self, process: Process) -> int:
        self.processes.append(process)
        return len(self.processes) - 1

    def add_track(self, track: Track) -> int:
        if track.kind not in KINDS:
            raise ValueError(f"unknown track kind {track.kind!r}")
        self.tracks.append(track)
        return len(self.tracks) - 1

    def add_span(
        self, name: str, track: int, start: int, end: int, args: dict[str, Any] | None = None, cat: str | None = None
    ) -> None:
        self.spans.append(self.intern(name), track, start, end, args, cat)

    def without_entry(self) -> Trace:
        """The same trace without the `entry` column (a shallow copy: the columns are shared)."""
        t = Trace(self.metadata)
        t.processes, t.tracks, t.names, t._name_index = self.processes, self.tracks, self.names, self._name_index
        sp = self.spans
        t.spans = SpanColumns.wrap(sp.name, sp.track, sp.start, sp.end, sp.args)
        t.spans.cat = sp.cat
        t.counters, t.extra = self.counters, self.extra
        return t

    # ---- reading -----------------------------------------------------------------------------

    @property
    def ranks(self) -> list[int]:
        """The ranks of gputrace's own processes, ascending."""
        return sorted({p.rank for p in self.processes if p.rank is not None and not p.foreign})

    def rank_process(self, rank: int) -> Process:
        for p in self.processes:
            if p.rank == rank and not p.foreign:
                return p
        raise KeyError(rank)

    def track_rank(self) -> list[int | None]:
        """The rank of each track (None for tracks of processes that are not ranks)."""
        return [self.processes[t.process].rank for t in self.tracks]

    def time_range(self) -> tuple[int, int] | None:
        """(first start, last end) over spans and counters, or None for an empty trace."""
        lo: list[int] = []
        hi: list[int] = []
        if len(self.spans):
            lo.append(_column_range(self.spans.start)[0])
            hi.append(_column_range(self.spans.end)[1])
        if len(self.counters):
            lo.append(min(self.counters.ts))
            hi.append(max(self.counters.ts))
        for e in self.extra:
            lo.append(e["ts_ns"])
            hi.append(e["ts_ns"] + e.get("dur_ns", 0))
        return (min(lo), max(hi)) if lo else None

    def iter_spans(self) -> Iterator[tuple[str, int, int, int, dict[str, Any] | None]]:
        """(name, track, start, end, args) per span, in storage order. For tests and small
        traces; stages that scale work on the columns."""
        names, s = self.names, self.spans
        for i in range(len(s)):
            yield names[s.name[i]], s.track[i], s.start[i], s.end[i], s.args[i]

    def __repr__(self) -> str:
        return (
            f"<Trace ranks={self.ranks} processes={len(self.processes)} tracks={len(self.tracks)} "
            f"spans={len(self.spans)} counters={len(self.counters)}>"
        )


def unfinished_mask(trace: Trace) -> list[bool]:
    """Per span: was it still open when the trace was written (`args.unfinished`)?"""
    return [a is not None and bool(a.get("unfinished")) for a in trace.spans.args]


def _column_range_py(column: Sequence[int]) -> tuple[int, int]:
    return min(column), max(column)


def _column_range(column: Sequence[int]) -> tuple[int, int]:
    """(least, largest) of a non-empty column: one C loop over an array('q') where the C build
    is in use (min() and max() make a Python int per item: ~70 ns a span at save)."""
    if _column_range_c is not None and isinstance(column, array) and column.typecode == "q":
        return _column_range_c(column)  # type: ignore[no-any-return]
    return _column_range_py(column)


_column_range_c: Any = None  # the C build's loop, or None


def _bind(hot: Any) -> None:
    global _column_range_c
    _column_range_c = hot.column_range if hot is not None else None


native.on_switch(_bind)
