"""Trace files on disk: atomic writes, and reading Chrome trace JSON back.

Takes: bytes to write, or a path to read. Gives: files that are either whole or untouched, and
parsed traces (object form, array form, and an array form cut off by a crash).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import Any, BinaryIO

import orjson

from gputrace.errors import GputraceError, TraceFormatError


@contextlib.contextmanager
def atomic_writer(path: str) -> Iterator[BinaryIO]:
    """A file to write `path` through: a temporary file in the same directory, renamed over
    `path` only when the block ends without an error. An existing file is never half-overwritten
    and a crash leaves no partial trace."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".gputrace-", suffix=".tmp", dir=directory)
    except OSError as e:
        raise GputraceError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise GputraceError(f"cannot write {path}: {e.strerror or e}") from None
        raise


def write_atomic(path: str, data: bytes) -> None:
    with atomic_writer(path) as f:
        f.write(data)


def publish(tmp: str, path: str) -> None:
    """Give the temporary file the permissions a new file would have, and rename it over `path`."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, path)


def us_to_ns(us: Any) -> int:
    """A Chrome trace's microseconds (ts, dur) as integer nanoseconds."""
    return round(float(us) * 1000)


def read_trace(path: str) -> dict[str, Any]:
    """Parse a Chrome trace file into the object form ({"traceEvents": [...], ...}).

    The array form `[{...}, ...]` is accepted, also without its closing bracket, as a process
    that crashed while streaming leaves it."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise TraceFormatError(path, "no such file") from None
    except IsADirectoryError:
        raise TraceFormatError(path, "is a directory, not a trace file") from None
    except OSError as e:
        raise TraceFormatError(path, e.strerror or str(e)) from None
    body = data.lstrip()
    if not body:
        raise TraceFormatError(path, "empty file")
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        if body[:1] == b"[":
            parsed = _repair_array(path, body)
        else:
            raise TraceFormatError(path, f"not valid JSON ({_short(e)}); the file may be truncated") from None
    if isinstance(parsed, list):
        return {"traceEvents": parsed}
    if not isinstance(parsed, dict) or not isinstance(parsed.get("traceEvents"), list):
        raise TraceFormatError(path, "not a Chrome trace: expected a traceEvents list or an array of events")
    return parsed


def _repair_array(path: str, body: bytes) -> list[Any]:
    # Cut back to the last complete event and close the array.
    end = body.rstrip().rstrip(b",")
    while True:
        cut = end.rfind(b"}")
        if cut < 0:
            raise TraceFormatError(path, "array-form trace with no complete event")
        try:
            events = orjson.loads(end[: cut + 1] + b"]")
            if isinstance(events, list):
                return events
        except orjson.JSONDecodeError:
            pass
        end = end[:cut]


def _short(e: Exception) -> str:
    return str(e).split(":", 1)[0]
