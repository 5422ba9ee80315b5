"""Merge's spool: parts of a merged trace kept on disk until the writer wants them again.

Takes: parts (`Trace`s of one or more ranks, as merge takes them), in output order, and a folder
(the output's: a folder the user can write to, on a disk rather than in memory). Gives: the same
parts back, in the same order, one at a time (`parts`). A format whose file begins with what only
the whole merged trace knows (protobuf: its first instant, its processes) writes every part after
the last is read; the spool holds them meanwhile, so memory holds one part, not every rank's.
A merge of one group keeps its part in memory instead (`add(part, keep=True)`): it never
touches the disk.

The file is unnamed (`tempfile.TemporaryFile`): it goes away when closed, or with the process.
Columns go as their raw bytes (40 bytes a span); the arguments and categories as pickles of
`SLICE` rows each, so the pickler's memo of one slice is all it holds. The output's folder so
needs room for the parts beside the output, ~40 bytes a span and their arguments (twice that for
protobuf inputs, which are put aside there too while they are described); a folder on tmpfs
holds them in memory. The writer keeps every part's counters and other tools' events until it
closes (`perfetto.MergedPartsWriter`): memory is one part's spans plus those.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
from array import array
from collections.abc import Iterator
from typing import Any, BinaryIO

from gputrace.errors import GputraceError
from gputrace.trace.model import PackedArgs, SpanColumns, Trace, _NoCats

#: Rows of arguments (or categories) pickled at a time.
SLICE = 65536
_ITEMS = 1 << 20  # column values read back at a time
_PACKED = "packed"  # a column's mark: a `PackedArgs`, pickled whole (else True: _NoCats, False: slices)


class Spool:
    """Parts written to an unnamed temporary file in `directory`, read back in order once."""

    def __init__(self, directory: str | None = None) -> None:
        self.directory = directory
        self._file: BinaryIO | None = None
        self._count = 0
        self._kept: Trace | None = None

    def add(self, part: Trace, keep: bool = False) -> None:
        """Spool `part` (the caller drops it). `keep`: the last part, held in memory instead where
        it is the only one (else it would be held while the others are written)."""
        if self._kept is not None:
            raise ValueError("a part was kept in memory: it must be the last")
        if keep and not self._count:
            self._kept = part
            return
        with self._refused():
            _write(self._open(), part)
        self._count += 1

    def put(self, trace: Trace) -> int:
        """Put `trace` aside (the caller drops it); gives where, for `get`. A spool either takes
        parts in order (`add`) or puts traces aside, not both."""
        with self._refused():
            f = self._open()
            f.seek(0, os.SEEK_END)
            at = f.tell()
            _write(f, trace)
        return at

    @contextlib.contextmanager
    def _refused(self) -> Iterator[None]:
        """A folder that refuses the spool (read-only, full) is one line, as a refused output is."""
        try:
            yield
        except OSError as e:
            where = self.directory or tempfile.gettempdir()
            raise GputraceError(
                f"cannot spool the merge's ranks in {where}, beside its output: {e.strerror or e}"
            ) from None

    def get(self, at: int) -> Trace:
        """The trace put aside at `at` (read again each time)."""
        assert self._file is not None
        self._file.flush()
        self._file.seek(at)
        return _read(self._file)

    def _open(self) -> BinaryIO:
        if self._file is None:
            self._file = tempfile.TemporaryFile(dir=self.directory)
        return self._file

    def parts(self) -> Iterator[Trace]:
        """Every part added, in order (each read when the one before it was taken)."""
        f = self._file
        if f is not None:
            f.flush()
            f.seek(0)
            for _ in range(self._count):
                yield _read(f)
            f.close()
            self._file = None
        kept, self._kept = self._kept, None
        if kept is not None:
            yield kept

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._kept = None


def _write(f: BinaryIO, part: Trace) -> None:
    sp = part.spans
    columns = (sp.name, sp.track, sp.start, sp.end, sp.entry)
    part.spans = SpanColumns()
    try:
        shapes = [None if c is None else (c.typecode, len(c)) for c in columns]
        pickle.dump((part, shapes), f, pickle.HIGHEST_PROTOCOL)
    finally:
        part.spans = sp  # the caller's part unchanged
    for c in columns:
        if c is not None:
            f.write(memoryview(c).cast("B"))  # no copy of the column
    for rows in (sp.args, sp.cat):
        if type(rows) is PackedArgs:  # packed arguments (a protobuf read's) go as they are, small
            pickle.dump(_PACKED, f)
            pickle.dump(rows, f, pickle.HIGHEST_PROTOCOL)
            continue
        blank = type(rows) is _NoCats  # a column of None that takes no memory (not SparseArgs, one of them)
        pickle.dump(blank, f)
        if not blank:
            for lo in range(0, len(rows), SLICE):
                pickle.dump(list(rows[lo : lo + SLICE]), f, pickle.HIGHEST_PROTOCOL)


def _read(f: BinaryIO) -> Trace:
    part, shapes = pickle.load(f)
    sp = SpanColumns()
    columns: list[array[int] | None] = []
    for shape in shapes:
        if shape is None:
            columns.append(None)
            continue
        typecode, n = shape
        col = array(typecode)
        for lo in range(0, n, _ITEMS):
            col.fromfile(f, min(_ITEMS, n - lo))
        columns.append(col)
    sp.name, sp.track, sp.start, sp.end, sp.entry = columns  # type: ignore[assignment]
    n = len(sp.start)
    args: Any = _rows(f, n)
    sp.args = args
    sp.cat = _rows(f, n)
    part.spans = sp
    return part  # type: ignore[no-any-return]


def _rows(f: BinaryIO, n: int) -> Any:
    kind = pickle.load(f)
    if kind == _PACKED:
        return pickle.load(f)
    if kind is True:
        return _NoCats(n)
    rows: list[Any] = []
    for _ in range(0, n, SLICE):
        rows += pickle.load(f)
    return rows
