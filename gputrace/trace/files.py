"""Trace files on disk: atomic writes, finding the files a user names, appending a rank's file.

Takes: paths (files, directories, globs) and bytes to write. Gives: files that are either whole
or untouched (`atomic_writer`), the list of trace files behind a user's arguments (`expand`; a
directory's are its ranks' files of every registered format), and what both stream writers share
(`AppendFile`). Which format a file is: `registry.py`.
"""

from __future__ import annotations

import contextlib
import glob
import os
import stat
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, BinaryIO

from gputrace import native
from gputrace.errors import GputraceError, TraceFormatError
from gputrace.trace import registry

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
        fd, tmp = tempfile.mkstemp(prefix=".gputrace-", suffix=".tmp", dir=directory)
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


def expand(paths: Iterable[str]) -> list[str]:
    """Files, directories (their trace_rank*.json / .pftrace, one pattern per registered format)
    and globs -> a list of files, each once, in the order given (a directory's files sorted)."""
    files: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            globs = registry.rank_file_globs()
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


def read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise TraceFormatError(path, "no such file") from None
    except IsADirectoryError:
        raise TraceFormatError(path, "is a directory, not a trace file") from None
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
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o666)

    def _write(self, data: bytes) -> None:
        write_all(self._fd, data)

    def _reopen(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)

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
