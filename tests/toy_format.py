"""A toy trace format, to show that a format is one module plus its registration (test_formats.py
registers it as "toy", extension ".toy").

Takes: a `Trace` (`write`, or `StreamWriter` flush by flush). Gives: a text file of one record a
line, a tag and a JSON array, times in integer ns; `read` gives the `Trace` back, whole.

    gputrace-toy/1
    H [header]                                   the header (a later one replaces it)
    U [update]                                   a header update (`layout.update_header`)
    P [pid, rank, label, sort, foreign, metadata]
    T [key, process, tid, name, kind, device, ordinal]
    S [track key, start, end, name, args, cat]
    C [track key, ts, value]
    X [event]                                    another tool's event (`Trace.extra`)

Appending is natural (a line a record), so the stream writer only appends; a last line cut off
mid-write is dropped by the reader.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from gputrace.errors import TraceFormatError
from gputrace.trace.files import AppendFile, atomic_writer, read_bytes
from gputrace.trace.layout import dumps, output_pids, update_header
from gputrace.trace.model import Process, Trace, Track

MAGIC = b"gputrace-toy/1\n"


def recognise(head: bytes) -> bool:
    return head.startswith(MAGIC)


def _line(tag: bytes, value: Any) -> bytes:
    return tag + b" " + dumps(value) + b"\n"


def _process(p: Process, pid: Any) -> bytes:
    return _line(b"P", [pid, p.rank, p.label, p.sort_index, p.foreign, dict(p.metadata)])


def _track(key: int, t: Track, process: int) -> bytes:
    return _line(b"T", [key, process, t.tid, t.name, t.kind, t.device, t.ordinal])


def _header(trace: Trace, base_ns: int) -> dict[str, Any]:
    meta = {k: v for k, v in trace.metadata.items() if k != "base_ns"}
    own = [p for p in trace.processes if p.rank is not None and not p.foreign]
    info: dict[str, Any] = {}
    if len(own) == 1 and not meta.get("merged"):
        info["rank"] = own[0].rank
    if isinstance(meta.get("world_size"), int):
        info["world_size"] = meta["world_size"]
    return {"baseTimeNanoseconds": base_ns, "distributedInfo": info, "metadata": meta}


def _spans(trace: Trace, rows: Sequence[int], key_of: Callable[[int], int]) -> list[bytes]:
    sp = trace.spans
    return [
        _line(b"S", [key_of(sp.track[i]), sp.start[i], sp.end[i], trace.names[sp.name[i]], sp.args[i], sp.cat[i]])
        for i in rows
    ]


def _counters(trace: Trace, rows: Sequence[int], key_of: Callable[[int], int]) -> list[bytes]:
    c = trace.counters
    return [_line(b"C", [key_of(c.track[i]), c.ts[i], c.value[i]]) for i in rows]


def write(
    trace: Trace,
    path: str,
    base_ns: int | None = None,
    ordered: bool = False,
    meanwhile: Callable[[], object] | None = None,
) -> None:
    rng = trace.time_range()
    if base_ns is None:
        base_ns = rng[0] if rng else int(trace.metadata.get("base_ns", 0) or 0)
    pid_of = output_pids(trace)
    out = [MAGIC, _line(b"H", _header(trace, base_ns))]
    out += [_process(p, pid_of[i]) for i, p in enumerate(trace.processes)]
    out += [_track(i, t, t.process) for i, t in enumerate(trace.tracks)]
    out += _spans(trace, range(len(trace.spans)), int)
    out += _counters(trace, range(len(trace.counters)), int)
    out += [_line(b"X", e) for e in trace.extra]
    with atomic_writer(path, meanwhile=meanwhile) as f:
        f.write(b"".join(out))


class StreamWriter(AppendFile):
    """One rank's file, a line a record, flush by flush."""

    def __init__(self, path: str, base_ns: int, process: Process, header: dict[str, Any]) -> None:
        super().__init__(path, base_ns, process, header)
        self._keys: dict[tuple[Any, str, str], int] = {}  # a chunk's track -> its key in the file
        self._write(MAGIC + _line(b"H", self._header()) + _process(process, self.pid))

    def _header(self) -> dict[str, Any]:
        return {"baseTimeNanoseconds": self.base_ns, **self.header}

    def _key_of(self, trace: Trace, out: list[bytes]) -> Callable[[int], int]:
        # A chunk's track indices can change from flush to flush (a new track comes before the
        # counters): the file keys tracks by what they are.
        def key_of(t: int) -> int:
            track = trace.tracks[t]
            ident = (track.tid, track.name, track.kind)
            key = self._keys.get(ident)
            if key is None:
                key = self._keys[ident] = len(self._keys)
                out.append(_track(key, track, 0))
            return key

        return key_of

    def overflow_tracks(self) -> int:
        return 0

    def append(self, trace: Trace, rows: Sequence[int], counters: Sequence[int] = (), update: Any = None) -> None:
        out: list[bytes] = []
        if update:
            out.append(_line(b"U", update))
        key_of = self._key_of(trace, out)
        for i in rows:  # one at a time: a new track's line goes before its first span's
            out += _spans(trace, [i], key_of)
        for i in counters:
            out += _counters(trace, [i], key_of)
        if out:
            self._write(b"".join(out))
        self.spans_written += len(rows)

    def finish(self, header: dict[str, Any] | None = None) -> None:
        if self._fd < 0:
            return
        if header is not None:
            self.header = header
        try:
            self._write(_line(b"H", self._header()))
        finally:
            os.close(self._fd)
            self._fd = -1

    def resume(self) -> None:
        if self._fd < 0:
            self._reopen()


def _records(path: str, data: bytes) -> list[tuple[bytes, Any]]:
    if not recognise(data[: len(MAGIC)]):
        raise TraceFormatError(path, "not a toy trace")
    lines = data[len(MAGIC) :].split(b"\n")
    out = []
    for n, line in enumerate(lines):
        if not line:
            continue
        tag, _, body = line.partition(b" ")
        try:
            out.append((tag, orjson.loads(body)))
        except orjson.JSONDecodeError:
            if n == len(lines) - 1:
                break  # cut off mid-write
            raise TraceFormatError(path, f"line {n + 2} is not JSON") from None
    return out


def _header_of(records: list[tuple[bytes, Any]]) -> dict[str, Any]:
    header: dict[str, Any] = {}
    for tag, value in records:
        if tag == b"H":
            header = dict(value)
        elif tag == b"U":
            update_header(header, value)
    return header


def read_header(path: str) -> dict[str, Any]:
    return _header_of(_records(path, read_bytes(path)))


def read(path: str, data: bytes | None = None) -> Trace:
    if data is None:
        data = read_bytes(path)
    records = _records(path, data)
    header = _header_of(records)
    meta = dict(header.get("metadata") or {})
    trace = Trace(dict(meta))
    trace.metadata["base_ns"] = header.get("baseTimeNanoseconds", 0)
    world = (header.get("distributedInfo") or {}).get("world_size")
    if world is not None:
        trace.metadata.setdefault("world_size", world)
    tracks: dict[int, int] = {}
    for tag, v in records:
        if tag == b"P":
            pid, rank, label, sort, foreign, pmeta = v
            if not pmeta and not foreign and not meta.get("merged"):
                pmeta = meta  # a rank's own file: the header's metadata is the rank's
            trace.add_process(Process(pid, rank, label, sort, pmeta, foreign))
        elif tag == b"T":
            key, process, tid, name, kind, device, ordinal = v
            tracks[key] = trace.add_track(Track(process, tid, name, kind, device, ordinal))
        elif tag == b"S":
            key, start, end, name, args, cat = v
            trace.add_span(name, tracks[key], start, end, args, cat)
        elif tag == b"C":
            key, ts, value = v
            trace.counters.append(tracks[key], ts, float(value))
        elif tag == b"X":
            trace.extra.append(v)
    return trace
