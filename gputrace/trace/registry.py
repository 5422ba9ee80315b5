"""The trace formats gputrace reads and writes, in one registry.

Takes: each format's declaration (`Format`: its name and the other names users may give it, its
file extensions, how its files are recognised by their first bytes, and the module that reads and
writes it). Gives: the format for a name, for a path to write, or for a file to read, the file
names a folder of ranks holds, and the trace files behind a user's paths (`expand`). Every stage
that reads or writes traces asks here; none tests a format by name, so adding a format is one
module plus one `register` call.

A format's module provides:

- ``read(path, data=None) -> Trace`` (raises `TraceFormatError` with the reason);
- ``read_header(path) -> dict`` (baseTimeNanoseconds, distributedInfo, metadata, without events);
- ``write(trace, path, base_ns=None, ordered=False, meanwhile=None)``, atomic (`ordered`: the
  spans of each track are stored in the order they ended, as a recorder's are; `meanwhile`: work
  to run before the file is in place);
- ``StreamWriter(path, base_ns, process, header)`` with ``append(trace, rows, counters=(),
  update=None)``, ``finish(header=None)``, ``resume()``, ``abandon()``, ``overflow_tracks()``,
  and the attributes ``path``, ``base_ns``, ``closed`` and ``spans_written``: one rank's file,
  flush by flush (`files.AppendFile` has the file handling; `layout.py` the lanes, pids, tids).

It may offer more, which a stage asks for by name with `Format.capability` instead of testing the
format's name: ``parse(path, data) -> (header, events)`` (the file's raw Chrome JSON events, which
`validate` checks against Perfetto's JSON importer rules; the JSON format offers it), and
``parse_batches(path)`` (the same events a batch at a time, so a large file is checked holding
one batch), and ``read_spans(path, data=None, keys=None)`` (`read` without the spans'
categories and with only the arguments named in `keys`: plain lists of None but for those; `keys`
None: no arguments, columns that take no memory, for validate's checks of names, tracks and
times; both formats offer it). Within `only_args(keys)`, `read` reads that way where the format
can (a `read_spans` without the `keys` parameter, written before it had one, is left alone: the
file is read whole): the statistics of `summary` and `view` look at three arguments of a span and at none of its
categories, and a dict of arguments a span is most of a read trace's memory. For merge, written
rank by rank: ``MergedWriter(f, base_ns, metadata, world_size)`` (a part's event lines encoded
apart, `write`, `close`: JSON) or ``MergedPartsWriter(f)`` (each part `note`d as it is taken,
then `close(metadata, parts)` writes the file from the parts given again in order: protobuf,
whose file begins with what only the whole merged trace knows).

The module is imported on first use, so `import gputrace` and the CLI's help never load protobuf.
Adding a format: a module as above, and a `register(Format(...))` call below (or, for a format
that lives outside gputrace, anywhere before it is used; `unregister` takes it away again).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import glob
import importlib
import inspect
import os
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

from gputrace.errors import GputraceError, TraceFormatError

if TYPE_CHECKING:
    from gputrace.trace.model import Process, Trace


@dataclasses.dataclass(frozen=True, eq=False)
class Format:
    name: str
    #: Extensions of its files; the first is the one a rank's file gets.
    extensions: tuple[str, ...]
    #: True when a file's first bytes (up to 64) are this format's.
    recognise: Callable[[bytes], bool]
    #: The module that reads and writes it (imported on first use).
    module: str
    #: Other names users may give it (``format="chrome"``).
    aliases: tuple[str, ...] = ()
    _impl: list[ModuleType] = dataclasses.field(default_factory=list, repr=False)

    @property
    def impl(self) -> ModuleType:
        """The module that reads and writes the format (ImportError when it cannot be loaded)."""
        if not self._impl:
            self._impl.append(importlib.import_module(self.module))
        return self._impl[0]

    @property
    def extension(self) -> str:
        return self.extensions[0]

    def _reader(self, path: str) -> ModuleType:
        try:
            return self.impl
        except ImportError as e:
            raise TraceFormatError(path, f"a {self.name} trace, which this installation cannot read ({e})") from None

    def _writer(self, path: str) -> ModuleType:
        try:
            return self.impl
        except ImportError as e:
            raise GputraceError(f"cannot write {path}: writing {self.name} needs {self.module} ({e})") from None

    def read(self, path: str, data: bytes | None = None) -> Trace:
        keys = _ONLY_ARGS.get()
        lean = self._read_keeping(path) if keys is not None else None
        trace: Trace = lean(path, data, keys=keys) if lean is not None else self._reader(path).read(path, data)
        return trace

    def _read_keeping(self, path: str) -> Callable[..., Any] | None:
        """The format's `read_spans` where it takes `keys`, else None (read whole: one that takes
        none would keep no argument, and the statistics need three)."""
        fn = self.capability("read_spans", path)
        if fn is None:
            return None
        try:
            takes = "keys" in inspect.signature(fn).parameters
        except (TypeError, ValueError):  # no signature to read (a C function): not known to take it
            return None
        return fn if takes else None

    def read_header(self, path: str) -> dict[str, Any]:
        header: dict[str, Any] = self._reader(path).read_header(path)
        return header

    def write(self, trace: Trace, path: str, **options: Any) -> None:
        self._writer(path).write(trace, path, **options)

    def stream_writer(self, path: str, base_ns: int, process: Process, header: dict[str, Any]) -> Any:
        return self._writer(path).StreamWriter(path, base_ns, process, header)

    def capability(self, name: str, path: str = "") -> Callable[..., Any] | None:
        """The optional function `name` of the format's module (see the module docstring), or
        None when this format does not offer it."""
        found = getattr(self._reader(path), name, None)
        return found if callable(found) else None

    def __repr__(self) -> str:
        return f"Format({self.name!r})"


_FORMATS: dict[str, Format] = {}
DEFAULT = "json"


def register(fmt: Format) -> Format:
    """Add `fmt` (replacing a format of the same name); the order of registration is the order in
    which `detect` asks formats to recognise a file."""
    _FORMATS[fmt.name] = fmt
    return fmt


def unregister(name: str) -> None:
    if name == DEFAULT:
        raise GputraceError(f"the {DEFAULT} format cannot be removed")
    _FORMATS.pop(name, None)


def formats() -> list[Format]:
    return list(_FORMATS.values())


def names() -> list[str]:
    return list(_FORMATS)


def get(name: str) -> Format:
    """The format called `name` (or one of its aliases)."""
    for fmt in _FORMATS.values():
        if name == fmt.name or name in fmt.aliases:
            return fmt
    raise GputraceError(f"unknown trace format {name!r}: use {' or '.join(_FORMATS)}")


def by_extension(path: str) -> Format | None:
    lower = os.fspath(path).lower()
    for fmt in _FORMATS.values():
        if lower.endswith(fmt.extensions):
            return fmt
    return None


def for_path(path: str, name: str | None = None) -> Format:
    """The format to write `path` in: the one named, else by extension, else JSON."""
    if name is not None:
        return get(name)
    return by_extension(path) or _FORMATS[DEFAULT]


def detect(path: str, head: bytes | None = None) -> Format:
    """The format of an existing file, by its first bytes, else by its extension, else JSON
    (whose reader then says what is wrong with the file)."""
    if head is None:
        from gputrace.trace.files import read_head  # files asks the registry for folders' globs

        try:
            head = read_head(path, 64)
        except TraceFormatError:  # the reader says why
            head = b""
    for fmt in _FORMATS.values():
        if head and fmt.recognise(head):
            return fmt
    return by_extension(path) or _FORMATS[DEFAULT]


_ONLY_ARGS: contextvars.ContextVar[frozenset[str] | None] = contextvars.ContextVar("gputrace_only_args", default=None)


@contextlib.contextmanager
def only_args(keys: Iterable[str]) -> Iterator[None]:
    """Within it, `read` (and what reads through it: `merge.load`) keeps of the spans' arguments
    only those named in `keys`, and no categories, where the format offers `read_spans`: for a
    stage that looks at nothing else. In this thread (and its context) only: a merge's worker
    processes read whole traces."""
    token = _ONLY_ARGS.set(frozenset(keys))
    try:
        yield
    finally:
        _ONLY_ARGS.reset(token)


def read(path: str, data: bytes | None = None, module: str | None = None) -> Trace:
    """One trace file of any registered format, as a `Trace`. `module`: read it with that format's
    module, as another process detected it (a merge worker starts with the built-in formats only,
    not those its parent registered)."""
    if module is None:
        return detect(path, data[:64] if data is not None else None).read(path, data)
    fmt = next((f for f in _FORMATS.values() if f.module == module), None)
    if fmt is None:
        fmt = Format(module, (), _never, module)  # known by its module alone, for this one read
    return fmt.read(path, data)


def _never(head: bytes) -> bool:
    return False


def rank_file_globs() -> tuple[str, ...]:
    """The names of ranks' trace files in a folder, one pattern per format."""
    return tuple(f"trace_rank*{fmt.extension}" for fmt in _FORMATS.values())


def _is_json(head: bytes) -> bool:
    return head.lstrip()[:1] in (b"{", b"[")


def _is_protobuf(head: bytes) -> bool:
    return head[:1] == b"\x0a"  # field 1 of a Trace (a TracePacket), length-delimited


register(Format("json", (".json",), _is_json, "gputrace.trace.chrome", aliases=("chrome",)))
register(
    Format(
        "perfetto",
        (".pftrace", ".perfetto-trace", ".pb", ".proto"),
        _is_protobuf,
        "gputrace.trace.perfetto",
        aliases=("pftrace", "protobuf"),
    )
)


def expand(paths: Iterable[str]) -> list[str]:
    """Files, directories (their trace_rank*.json / .pftrace, one pattern per registered format)
    and globs -> a list of files, each once, in the order given (a directory's files sorted)."""
    files: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            globs = rank_file_globs()
            found = sorted(f for pattern in globs for f in glob.glob(os.path.join(p, pattern)))
            if not found:
                raise GputraceError(f"{p}: no {' or '.join(globs)} files in this directory")
            files += found
        elif any(c in p for c in "*?["):
            found = sorted(glob.glob(p))
            if not found:
                raise GputraceError(f"{p}: no files match")
            files += found
        elif os.path.exists(p):
            files.append(p)
        else:
            raise TraceFormatError(p, "no such file")
    return list(dict.fromkeys(files))
