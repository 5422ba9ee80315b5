"""The step digest's file: the `gputrace-digest/1` format, read and written.

Takes: a digest as JSON-ready data (made by `gputrace.digest`), or a digest file. Gives: the file,
written atomically (`write`); a `RankDigest` read back (`read`, `from_document`): the rank's step
and collective spans as a one-rank `Trace` and its per-name aggregates; where a trace's digest
lies (`digest_path`), whether a path names one (`is_digest_path`), whether it is as new as its
trace (`fresh`), and the step name it was written with (`step_name_of`, from its first bytes).

The file is columnar JSON (arrays of ints parse fast): `format`, `rank`, `world_size`,
`run_id`, `trace` and `trace_bytes` (the trace file's name and size when the digest was
written: a digest older than its trace is recognised), `step_name`, `base_ns`, `label`,
`unfinished`, `negative`, `warmup` ({steps, exact}), `names`, `tracks` (tid, name, kind,
device, ordinal), `spans` (name, track, start as deltas from the one before, the first from
base_ns; dur; flags), `stats` (per name and warm-up bucket: count, total, min, max, max_start
from base_ns, max_track, hist as [bucket, count, ...]) and the rank's trace `metadata`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from array import array
from itertools import accumulate
from typing import Any

import orjson

from gputrace.errors import TraceFormatError
from gputrace.trace import layout
from gputrace.trace.files import atomic_writer, read_bytes, read_head
from gputrace.trace.model import Process, SpanColumns, Trace, Track

FORMAT = "gputrace-digest/1"

# Span flags.
COLL = 1  # the span has a `collective` argument
COLL_TRUE = 2  # ... and it is true
UNFINISHED = 4  # the span was open when the trace was written
_DIGEST_NAME = re.compile(r"^digest_rank(\d+)\.digest$|\.digest$")
#: A rank's trace file by its name: group 1 is the rank.
TRACE_NAME = re.compile(r"^trace_rank(\d+)\.")


def digest_path(trace_path: str) -> str:
    """Where the digest of `trace_path` lies: `trace_rank3.json` -> `digest_rank3.digest` beside
    it (a name that the `trace_rank*.json` globs of merge and summary do not pick up, nor tools
    that take every `*.json` of a directory for a trace, as HTA does), any other `x.json` ->
    `x.digest`."""
    directory, base = os.path.split(trace_path)
    m = TRACE_NAME.match(base)
    if m:
        return os.path.join(directory, f"digest_rank{m.group(1)}.digest")
    return os.path.join(directory, os.path.splitext(base)[0] + ".digest")


def is_digest_path(path: str) -> bool:
    return _DIGEST_NAME.search(os.path.basename(path)) is not None


def write(doc: dict[str, Any], path: str) -> None:
    # Not fsynced: a digest lost with the machine is made again from its trace by the summary.
    with atomic_writer(path, durable=False) as f:
        f.write(layout.dumps(doc))  # names JSON cannot hold are cleaned as the trace writer cleans them


@dataclasses.dataclass
class RankDigest:
    """One rank's digest, read: its step and collective spans as a one-rank `Trace` (with the
    rank's metadata, as its trace file would give it) and its per-name aggregates."""

    path: str
    rank: int
    step_name: str
    trace: Trace | None  # None once `load` has taken its spans
    stats: dict[str, Any]  # columns: name (str), bucket, count, total, min, max, max_start (epoch ns), max_track, hist
    unfinished: int
    negative: int
    warmup_steps: int
    warmup_exact: bool
    trace_file: str | None
    trace_bytes: int | None
    computed: bool = False  # made from the trace here, not read from a digest file


def read(path: str) -> RankDigest:
    data = read_bytes(path)
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise TraceFormatError(path, "not a gputrace digest (not valid JSON); delete it, or pass --full") from None
    return from_document(doc, path)


def from_document(doc: Any, path: str) -> RankDigest:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise TraceFormatError(path, f"not a gputrace digest of this version ({FORMAT}); delete it, or pass --full")
    try:
        meta = dict(doc["metadata"])
        rank = int(doc["rank"])
        base = int(doc["base_ns"])
        trace = Trace(dict(meta))
        trace.metadata["base_ns"] = base
        if isinstance(doc.get("world_size"), int):
            trace.metadata.setdefault("world_size", doc["world_size"])
        p = trace.add_process(Process(rank + 1, rank, str(doc.get("label") or f"rank {rank}"), rank, meta))
        tr = doc["tracks"]
        for tid, name, kind, device, ordinal in zip(tr["tid"], tr["name"], tr["kind"], tr["device"], tr["ordinal"]):
            trace.add_track(Track(p, tid, name, kind, device, ordinal))
        names = [str(x) for x in doc["names"]]
        for x in names:
            trace.intern(x)  # names that cleaning made equal are one name, as in the trace read back
        s = doc["spans"]
        span_names = array("l", s["name"])
        if len(trace.names) != len(names):
            span_names = array("l", [trace._name_index[names[k]] for k in span_names])
        starts = array("q", accumulate(s["start"], initial=base))
        del starts[0]
        ends = array("q", map(int.__add__, starts, s["dur"]))
        args = [_ARGS[f] for f in s["flags"]]
        trace.spans = SpanColumns.wrap(span_names, array("l", s["track"]), starts, ends, args)
        trace.spans.cat = [None] * len(args)  # a list: merge copies it at C speed
        st = doc["stats"]
        cols = {
            "name": [names[k] for k in st["name"]],
            "bucket": st["bucket"],
            "count": st["count"],
            "total": st["total"],
            "min": st["min"],
            "max": st["max"],
            "max_start": [base + x for x in st["max_start"]],
            "max_track": st["max_track"],
            "hist": st["hist"],
        }
        if not (len(starts) == len(ends) == len(args) == len(trace.spans.name) == len(trace.spans.track)):
            raise ValueError("span columns of different lengths")
        sp = trace.spans
        if len(sp) and not (
            0 <= min(sp.track) <= max(sp.track) < len(trace.tracks)
            and 0 <= min(sp.name) <= max(sp.name) < len(trace.names)
        ):
            raise ValueError("a span refers to a name or track that is not there")
        warm = doc.get("warmup") or {}
        return RankDigest(
            path,
            rank,
            str(doc["step_name"]),
            trace,
            cols,
            int(doc.get("unfinished") or 0),
            int(doc.get("negative") or 0),
            int(warm.get("steps") or 0),
            bool(warm.get("exact", False)),
            doc.get("trace"),
            doc.get("trace_bytes"),
        )
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise TraceFormatError(path, f"a damaged gputrace digest ({e}); delete it, or pass --full") from None


# Shared argument dicts of digest rows, by flags (nothing mutates span arguments downstream).
_ARGS: dict[int, dict[str, Any] | None] = {
    f: (({"collective": bool(f & COLL_TRUE)} if f & COLL else {}) | ({"unfinished": True} if f & UNFINISHED else {}))
    or None
    for f in range(8)
}


def fresh(d: RankDigest, trace_path: str) -> bool:
    """Was `d` written for the trace now at `trace_path` (the same size it had then)?"""
    try:
        return d.trace_bytes is not None and os.path.getsize(trace_path) == d.trace_bytes
    except OSError:
        return False


def step_name_of(path: str) -> str | None:
    """The step name the digest at `path` was written with, read from the file's first bytes
    (None where it cannot be read there)."""
    try:
        head = read_head(path, 4096)
    except TraceFormatError:
        return None
    m = re.search(rb'"step_name":("(?:[^"\\]|\\.)*")', head)
    return str(orjson.loads(m.group(1))) if m else None
