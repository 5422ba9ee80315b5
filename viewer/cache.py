"""The viewer's document from step digests, kept beside them for the next `gputrace view`.

Takes: the trace files and digests a view reads (`summary.Inputs`), the options that shape the
document, and a document `data.digest_view` computed (as `data.split` gives it: its small keys
and the rest encoded). Gives: the document again (`load`), without reading a digest or a trace,
while every one of those files is as it was when the document was computed (the same path,
size, modification time and inode), else None; `store` writes it atomically beside the first
digest, as `.gputrace-view-<key>.view` (a name no trace or digest glob picks up, nor a tool that
takes every `*.json` for a trace): a line of JSON with the small keys, then the rest of the
document as one JSON object.

Why: the cross-rank statistics of a large run (64 ranks x 10,000 steps: 1.3M step and
collective spans) take seconds to compute, and the page is opened again and again on files that
have not changed; the kept document is read back in a fraction of a second. A file changed,
added or removed gives another key, so a stale document is never shown; an old one is removed
when its replacement is written. A directory that cannot be written to only costs the saving.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
from collections.abc import Iterable
from typing import Any

import orjson

from gputrace.errors import GputraceError
from gputrace.trace.files import atomic_writer
from gputrace.version import __version__

PREFIX = ".gputrace-view-"
SUFFIX = ".view"


def key(inputs: Any, options: dict[str, Any], names: Iterable[str]) -> str | None:
    """The key of the document for these files and options (None: a file cannot be looked at)."""
    files = [*inputs.traces, *inputs.digests.values(), *inputs.lone]
    parts: list[Any] = [__version__, options, list(names)]
    for f in files:
        try:
            st = os.stat(f)
        except OSError:
            return None
        parts.append([os.path.abspath(f), st.st_size, st.st_mtime_ns, st.st_ino])
    return hashlib.sha256(orjson.dumps(parts, option=orjson.OPT_NON_STR_KEYS)).hexdigest()[:32]


def where(inputs: Any) -> str | None:
    """The directory the document is kept in: the first digest's."""
    first = next(iter(inputs.digests.values()), None) or next(iter(inputs.lone), None)
    return os.path.dirname(os.path.abspath(first)) if first else None


def load(inputs: Any, k: str) -> tuple[dict[str, Any], bytes] | None:
    """The document kept under key `k` (`data.split`'s two parts), or None."""
    d = where(inputs)
    if d is None:
        return None
    try:
        with open(os.path.join(d, PREFIX + k + SUFFIX), "rb") as f:
            line, body = f.read().split(b"\n", 1)
        head = orjson.loads(line)
    except (OSError, ValueError):  # gone, or not one of these files (orjson's error is a ValueError)
        return None
    if not isinstance(head, dict) or head.pop("cache_key", None) != k or not body.startswith(b"{"):
        return None
    return head, body


def store(inputs: Any, k: str, head: dict[str, Any], body: bytes) -> None:
    """Keep a document (`data.split`'s two parts) under key `k`, and remove the documents kept
    for these files before."""
    d = where(inputs)
    if d is None:
        return
    path = os.path.join(d, PREFIX + k + SUFFIX)
    try:
        with atomic_writer(path, durable=False) as f:  # made again from the digests if lost
            f.write(orjson.dumps({**head, "cache_key": k}) + b"\n")  # orjson writes no raw newline
            f.write(body)
    except (OSError, GputraceError):  # a folder that cannot be written to: the page is shown all the same
        return
    for old in glob.glob(os.path.join(glob.escape(d), PREFIX + "*" + SUFFIX)):
        if old != path:
            with contextlib.suppress(OSError):
                os.unlink(old)
