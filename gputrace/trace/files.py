"""Trace files on disk: atomic writes, reading only regular files, appending a rank's file.

Takes: paths and bytes to write. Gives: files that are either whole or untouched
(`atomic_writer`), its temporary files named for their writer so that the next write into a
folder removes those a dead process left (`temp_file`), files opened for reading only when they
are regular (`open_regular`), and what both stream writers share (`AppendFile`). Which format a
file is, and the trace files behind a user's arguments (`expand`): `registry.py`.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, BinaryIO

from gputrace import native
from gputrace.errors import GputraceError, NotAFile, TraceFormatError

if TYPE_CHECKING:
    from gputrace.trace.model import Process

_Writer: Any = None  # the C build's writer thread (writes_behind), or None


def _bind(hot: Any) -> None:
    global _Writer
    _Writer = hot.Writer if hot is not None else None


native.on_switch(_bind)


@contextlib.contextmanager
def atomic_writer(path: str, durable: bool = True, meanwhile: Callable[[], object] | None = None) -> Iterator[BinaryIO]:
    """A file to write `path` through: a temporary file in the same directory, renamed over
    `path` only when the block ends without an error. An existing file is never half-overwritten
    and a crash leaves no partial trace. `durable`: the data reaches the disk before the rename
    (fsync), so it survives the machine going down too (data that can be made again, such as a
    digest, skips it: an fsync costs milliseconds). `meanwhile`: work to do while the disk
    syncs (the fsync runs in a thread; it releases the GIL), before the rename. A `path` that
    names something other than a regular file (a device, a FIFO, a directory, a link to one) is
    refused before anything is written (`check_target`)."""
    check_target(path)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = temp_file(directory)
    except OSError as e:
        raise GputraceError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "w+b") as f:
            yield f
            f.flush()
            if durable and meanwhile is not None:
                _sync_while(f.fileno(), meanwhile)
            elif durable:
                os.fsync(f.fileno())
            elif meanwhile is not None:
                meanwhile()
        publish(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise GputraceError(f"cannot write {path}: {e.strerror or e}") from None
        raise


_TEMP_PREFIX, _TEMP_SUFFIX = ".gputrace-", ".tmp"


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "_"


def temp_file(directory: str) -> tuple[int, str]:
    """A new temporary file in `directory` (its descriptor and path), named for the process that
    writes it, `.gputrace-{pid}@{host}@{random}.tmp`, so that a later writer can tell one a dead
    process left (killed mid-save) and remove it: done here first (`remove_dead_temps`)."""
    remove_dead_temps(directory)
    return tempfile.mkstemp(prefix=f"{_TEMP_PREFIX}{os.getpid()}@{_host()}@", suffix=_TEMP_SUFFIX, dir=directory)


def remove_dead_temps(directory: str) -> list[str]:
    """Remove the temporary files in `directory` that a process of this host, now dead, left
    (a save killed part way: a trace's size each). A live process's, another host's (the folder
    may be shared) and any not named by `temp_file` are left alone. Returns the paths removed."""
    removed: list[str] = []
    host = _host()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed  # nothing to read: nothing to clean, and the write says why it fails
    for entry in entries:
        name = entry.name
        if not (name.startswith(_TEMP_PREFIX) and name.endswith(_TEMP_SUFFIX)):
            continue
        parts = name[len(_TEMP_PREFIX) : -len(_TEMP_SUFFIX)].split("@")
        if len(parts) != 3 or parts[1] != host or not parts[0].isdigit() or _alive(int(parts[0])):
            continue
        with contextlib.suppress(OSError):  # another writer removed it first
            os.unlink(entry.path)
            removed.append(entry.path)
    return removed


def _alive(pid: int) -> bool:
    """Whether process `pid` of this host lives (a zombie counts: its parent has not seen it end)."""
    if pid <= 0:
        return True  # not a process id: leave its file alone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (EPERM): alive
        return True
    return True


def _sync_while(fd: int, work: Callable[[], object]) -> None:
    """fsync(fd) in a thread while `work` runs here; the fsync's error, if any, is raised."""
    failed: list[OSError] = []

    def sync() -> None:
        try:
            os.fsync(fd)
        except OSError as e:
            failed.append(e)

    t = threading.Thread(target=sync, name="gputrace-fsync", daemon=True)
    try:
        t.start()
    except RuntimeError:  # no new threads (the interpreter is shutting down): one after the other
        os.fsync(fd)
        work()
        return
    try:
        work()
    finally:
        t.join()
    if failed:
        raise failed[0]


@contextlib.contextmanager
def writes_behind(f: BinaryIO, after: int = 1 << 20) -> Iterator[Callable[[bytes], object]]:
    """A `write` for `f` whose writes, past the first `after` bytes, run in a thread of the C
    build (`_hot.Writer`): the kernel's copy of one piece into the page cache overlaps the
    encoding of the next. That thread runs no Python, so it never waits for the GIL the encoder
    holds (a Python thread would, up to the interpreter's 5 ms switch interval a write). A
    failed write's error is raised by a later `write` or when the block ends. Without the C
    build, or with no thread to be had, writes happen in place."""
    writer: Any = None
    written = 0
    start_at = after if _Writer is not None else None  # None: in place to the end

    def write(data: bytes) -> None:
        nonlocal writer, written, start_at
        if writer is None and start_at is not None and written >= start_at:
            f.flush()  # the thread writes at the descriptor's offset from here to the block's end
            try:
                writer = _Writer(f.fileno())
            except OSError:  # no thread to be had
                start_at = None
        if writer is not None:
            writer.write(data if type(data) is bytes else bytes(data))
            return
        written += len(data)
        f.write(data)

    try:
        yield write
    finally:
        if writer is not None:
            writer.close()  # waits for the queued writes; raises the first one's error


def write_atomic(path: str, data: bytes) -> None:
    with atomic_writer(path) as f:
        f.write(data)


_KINDS = (
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)


def check_target(path: str) -> None:
    """Raise a `GputraceError` unless `path` is a regular file or names nothing yet (a link is
    judged by what it points to). A rename over a device would replace it with a regular file
    (as root, `-o /dev/null` would destroy /dev/null); over a FIFO or a socket, it would cut off
    whoever reads it."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return  # a new file (or a link to nothing): the rename makes it
    except OSError as e:
        raise GputraceError(f"cannot write {path}: {e.strerror or e}") from None
    except ValueError as e:  # a NUL in the path
        raise GputraceError(f"cannot write {path!r}: {e}") from None
    if stat.S_ISREG(mode):
        return
    kind = next((what for test, what in _KINDS if test(mode)), "a special file")
    link = " (through a symbolic link)" if os.path.islink(path) else ""
    raise GputraceError(
        f"cannot write {path}: it is {kind}{link}, not a regular file; gputrace writes only regular files, "
        "so name a new or a regular file"
    )


def publish(tmp: str, path: str) -> None:
    """Give the temporary file the permissions a new file would have, and rename it over `path`
    (refused when `path` has become something other than a regular file: `check_target`)."""
    check_target(path)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, path)


def open_regular(path: str) -> BinaryIO:
    """`path` opened for reading in binary, when it is a regular file (through links); else a
    `TraceFormatError` with the reason. Every reader opens its files here: a FIFO would block
    the reader forever, and a device such as /dev/zero never ends."""
    try:
        # O_NONBLOCK: opening a FIFO with no writer must not block; nothing is read before the check.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise NotAFile(path, "no such file") from None
    except IsADirectoryError:
        raise NotAFile(path, "is a directory, not a trace file") from None
    except OSError as e:
        raise TraceFormatError(path, e.strerror or str(e)) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotAFile(
                path, "is a directory, not a trace file" if stat.S_ISDIR(mode) else "not a regular file"
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str) -> bytes:
    """The whole of a regular file (see `open_regular`), or a `TraceFormatError`."""
    with open_regular(path) as f:
        try:
            return f.read()
        except OSError as e:
            raise TraceFormatError(path, e.strerror or str(e)) from None


def read_head(path: str, limit: int) -> bytes:
    """The first `limit` bytes of a regular file (see `open_regular`), or a `TraceFormatError`."""
    with open_regular(path) as f:
        try:
            return f.read(limit)
        except OSError as e:
            raise TraceFormatError(path, e.strerror or str(e)) from None


class AppendFile:
    """What both formats' stream writers share: one rank's file, opened fresh (an earlier file
    of that name is replaced), appended to with one `write()` of whole events a flush, and the
    facts the rank's events carry (pid = rank + 1, the time base, the header)."""

    def __init__(self, path: str, base_ns: int, process: Process, header: dict[str, Any]) -> None:
        self.path = path
        self.base_ns = base_ns
        self.pid = (process.rank or 0) + 1
        self.process = process
        self.header = header  # distributedInfo / metadata
        self.spans_written = 0
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        remove_dead_temps(os.path.dirname(os.path.abspath(path)))  # a killed run's save, before this one
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o666)
        self._size = 0  # what the file holds of whole writes

    def _write(self, data: bytes) -> None:
        """Append `data` whole, or raise OSError with the file as it was (a full disk can cut a
        write short; later writes would then land after half an event)."""
        try:
            write_all(self._fd, data)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)
            raise
        self._size += len(data)

    def _reopen(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._size = os.fstat(self._fd).st_size

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def abandon(self) -> None:
        """Close without finishing (the file stays loadable as it is)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def write_all(fd: int, data: bytes) -> None:
    """Write all of `data` to `fd` (an append-mode file: each call lands whole at the end while
    the process lives; a kill can cut only the bytes of a call under way)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
