"""The step digest's file: the `gputrace-digest/2` format (and /1), read and written.

Takes: a digest as JSON-ready data (made by `gputrace.digest`), or a digest file. Gives: the file,
written atomically (`write`); a `RankDigest` read back (`read`, `from_document`): the rank's step
and collective spans as a one-rank `Trace` and its per-name aggregates; where a trace's digest
lies (`digest_path`), whether a path names one (`is_digest_path`), whether it is as new as its
trace (`fresh`), and the step name it was written with (`step_name_of`, from its first bytes).

The file is columnar JSON (arrays of ints parse fast): `format`, `rank`, `world_size`,
`run_id`, `trace`, `trace_bytes` and `trace_head` (the trace file's name, size and a hash of its
first bytes, which hold its header: rank, run id, base time, when the digest was written: a
digest older than its trace, or another rank's or run's, is recognised), `step_name`, `base_ns`, `label`,
`unfinished`, `negative`, `warmup` ({steps, exact}), `names`, `tracks` (tid, name, kind,
device, ordinal), `spans` (name, track, start as deltas from the one before, the first from
base_ns; dur; flags), `stats` (per name and warm-up bucket: count, total, min, max, max_start
from base_ns, max_track, hist as [bucket, count, ...], self: the total less the spans' children,
or null where not known), `cover` (track, start as deltas, dur: the union of the rank's other
spans per track, `gputrace.digest_breakdown`), `launch_lag` (per finished step in start order,
or null) and the rank's trace `metadata`. Version 1 has no self, cover and launch_lag.
"""

from __future__ import annotations

import dataclasses
import hashlib
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

FORMAT = "gputrace-digest/2"
#: Digests of the first version are read too: they have no cover, self time or launch lags
#: (`RankDigest.version` says so, and the summary says those are not known).
FORMATS = {"gputrace-digest/1": 1, FORMAT: 2}
#: The name of the cover's spans in a digest read back (`gputrace.digest_breakdown`); their
#: args say `cover`, which `stats.summarize` takes for the rank's other spans.
COVER_NAME = "gputrace.cover"
#: The digests of a folder of ranks (`digest_path` names them).
RANK_GLOB = "digest_rank*.digest"

# Span flags.
COLL = 1  # the span has a `collective` argument
COLL_TRUE = 2  # ... and it is true
UNFINISHED = 4  # the span was open when the trace was written
#: Histogram buckets of this format: `digest.HIST_PER_OCTAVE` (16) a factor of two, to 2^62 ns
#: (bucket -1 holds 0).
HIST_BUCKETS = 62 * 16
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
    """Write `doc` to `path`; a digest that names its trace (`trace`, `trace_bytes`) is tied to
    the trace file beside it as that file lies now (`trace_head`)."""
    if doc.get("trace") and doc.get("trace_bytes") is not None:
        doc = {**doc, "trace_head": head_hash(os.path.join(os.path.dirname(path), doc["trace"]))}
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
    trace_head: str | None = None  # `head_hash` of its trace when it was written
    version: int = 2  # 1: no cover, self time or launch lags
    launch_lag: list[int | None] | None = None  # per finished step in start order (version 2)


class DamagedDigest(TraceFormatError):
    """A digest that is valid JSON of this format but wrong inside (a column of the wrong type
    or length, a reference to a name or track that is not there)."""


def read(path: str) -> RankDigest:
    """The digest at `path`. `TraceFormatError` when it is not one of this version (cut short,
    not JSON), `DamagedDigest` when it is but is wrong inside."""
    return from_document(read_document(path), path)


def read_document(path: str) -> Any:
    """The digest file at `path` parsed, not yet checked (`from_document` checks it; the viewer's
    first document checks only the rows it takes). `TraceFormatError` when it is not JSON."""
    data = read_bytes(path)
    try:
        return orjson.loads(data)
    except (orjson.JSONDecodeError, RecursionError):
        raise TraceFormatError(path, "not a gputrace digest (not valid JSON); delete it, or pass --full") from None


def from_document(doc: Any, path: str) -> RankDigest:
    if not isinstance(doc, dict) or doc.get("format") not in FORMATS:
        raise TraceFormatError(path, f"not a gputrace digest of this version ({FORMAT}); delete it, or pass --full")
    try:
        return _from_document(doc, path)
    except (KeyError, TypeError, ValueError, IndexError, OverflowError, AttributeError, RecursionError) as e:
        raise DamagedDigest(path, f"a damaged gputrace digest ({_reason(e)}); delete it, or pass --full") from None


def _reason(e: BaseException) -> str:
    if isinstance(e, KeyError):
        return f"no {e}"
    return str(e)[:200] or type(e).__name__


def _ints(doc: Any, key: str, n: int | None = None, lo: int = -(2**63), hi: int = 2**63 - 1) -> list[int]:
    """The column `key` of `doc`: a list of `n` integers in [lo, hi] (ValueError else)."""
    col = doc[key]
    if not isinstance(col, list) or (n is not None and len(col) != n):
        raise ValueError(f"{key} is not a list of {n if n is not None else 'some'} numbers")
    # The whole column checked at C speed (its items' types, its least and largest); only a
    # column that fails is looked through for the item to name.
    if col and (set(map(type, col)) != {int} or min(col) < lo or max(col) > hi):
        for x in col:
            if type(x) is not int or not lo <= x <= hi:
                raise ValueError(f"{key} holds {str(x)[:40]}, not an integer in range")
    return col


def _from_document(doc: dict[str, Any], path: str) -> RankDigest:
    if not isinstance(doc["metadata"], dict):
        raise ValueError("metadata is not an object")
    meta = dict(doc["metadata"])
    rank = doc["rank"]
    base = doc["base_ns"]
    if type(rank) is not int or rank < 0 or type(base) is not int or not -(2**63) <= base < 2**63:
        raise ValueError("rank or base_ns is not an integer in range")
    trace = Trace(dict(meta))
    trace.metadata["base_ns"] = base
    if isinstance(doc.get("world_size"), int):
        trace.metadata.setdefault("world_size", doc["world_size"])
    p = trace.add_process(Process(rank + 1, rank, str(doc.get("label") or f"rank {rank}"), rank, meta))
    tr = doc["tracks"]
    n_tracks = len(tr["tid"])
    ordinals = _ints(tr, "ordinal", n_tracks)
    if not all(len(tr[k]) == n_tracks for k in ("name", "kind", "device")):
        raise ValueError("track columns of different lengths")
    for tid, name, kind, device, ordinal in zip(tr["tid"], tr["name"], tr["kind"], tr["device"], ordinals):
        if not isinstance(tid, (int, str)) or not isinstance(name, str) or not (device is None or type(device) is int):
            raise ValueError("a track's tid, name or device is of the wrong type")
        trace.add_track(Track(p, tid, name, kind, device, ordinal))
    if not isinstance(doc["names"], list):
        raise ValueError("names is not a list")
    names = [x if type(x) is str else str(x) for x in doc["names"]]
    for x in names:
        trace.intern(x)  # names that cleaning made equal are one name, as in the trace read back
    s = doc["spans"]
    n = len(s["name"])
    _ints(s, "dur", n, 0)
    _ints(s, "start", n)
    span_names = array("l", s["name"])
    if len(trace.names) != len(names):
        span_names = array("l", [trace._name_index[names[k]] for k in span_names])
    starts = array("q", accumulate(s["start"], initial=base))
    del starts[0]
    ends = array("q", map(int.__add__, starts, s["dur"]))
    args = [_ARGS[f] for f in _ints(s, "flags", n, 0, 7)]
    span_tracks = array("l", s["track"])
    version = FORMATS[doc["format"]]
    lags: list[int | None] | None = None
    if version >= 2:
        cv = doc["cover"]
        m = len(cv["track"])
        _ints(cv, "dur", m, 0)
        cover_starts = array("q", accumulate(_ints(cv, "start", m), initial=base))
        del cover_starts[0]
        span_tracks.extend(_ints(cv, "track", m))
        span_names.extend([trace.intern(COVER_NAME)] * m)
        starts.extend(cover_starts)
        ends.extend(map(int.__add__, cover_starts, cv["dur"]))
        args += [_COVER] * m
        lags = doc["launch_lag"]
        if not isinstance(lags, list) or not all(x is None or type(x) is int for x in lags):
            raise ValueError("launch_lag is not a list of integers or nulls")
    trace.spans = SpanColumns.wrap(span_names, span_tracks, starts, ends, args)
    trace.spans.cat = [None] * len(args)  # a list: merge copies it at C speed
    st = doc["stats"]
    m = len(st["name"])
    _ints(st, "name", m, 0, len(names) - 1)
    for key in ("bucket", "count", "total", "min", "max", "max_start"):
        _ints(st, key, m, 0 if key in ("count", "total") else -(2**63))
    _ints(st, "max_track", m, 0, max(len(trace.tracks) - 1, 0))
    if not isinstance(st["hist"], list) or len(st["hist"]) != m:
        raise ValueError("hist is not a list of one histogram per name")
    for h in st["hist"]:
        _ints({"hist": h}, "hist", None, -1)
        if len(h) % 2 or any(b >= HIST_BUCKETS for b in h[0::2]):
            raise ValueError("a histogram of odd length, or with a bucket past the last")
    if any(x + base != max(min(x + base, 2**63 - 1), -(2**63)) for x in st["max_start"]):
        raise ValueError("max_start is out of range")
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
        "self": None,
    }
    if version >= 2:
        own = st["self"]
        if not isinstance(own, list) or len(own) != m or not all(x is None or type(x) is int for x in own):
            raise ValueError("self is not a list of one integer or null per name")
        cols["self"] = own
    if not (len(starts) == len(ends) == len(args) == len(trace.spans.name) == len(trace.spans.track)):
        raise ValueError("span columns of different lengths")
    sp = trace.spans
    if len(sp) and not (
        0 <= min(sp.track) <= max(sp.track) < len(trace.tracks) and 0 <= min(sp.name) <= max(sp.name) < len(trace.names)
    ):
        raise ValueError("a span refers to a name or track that is not there")
    warm = doc.get("warmup") or {}
    if not isinstance(warm, dict):
        raise ValueError("warmup is not an object")
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
        doc.get("trace") if isinstance(doc.get("trace"), str) else None,
        doc.get("trace_bytes") if type(doc.get("trace_bytes")) is int else None,
        trace_head=doc.get("trace_head") if isinstance(doc.get("trace_head"), str) else None,
        version=version,
        launch_lag=lags,
    )


# Shared argument dicts of digest rows, by flags (nothing mutates span arguments downstream).
_ARGS: dict[int, dict[str, Any] | None] = {
    f: (({"collective": bool(f & COLL_TRUE)} if f & COLL else {}) | ({"unfinished": True} if f & UNFINISHED else {}))
    or None
    for f in range(8)
}


_COVER: dict[str, Any] = {"cover": True}

#: How much of a trace file `head_hash` reads: its header (rank, run id, base time) is in it.
HEAD_BYTES = 4096


def head_hash(trace_path: str) -> str | None:
    """A hash of the first `HEAD_BYTES` of the trace file (None when it cannot be read). The
    header there differs between ranks and runs (rank, run id, base time to the ns), and stays
    the same when the files are copied (unlike their mtime)."""
    try:
        return hashlib.blake2b(read_head(trace_path, HEAD_BYTES), digest_size=16).hexdigest()
    except TraceFormatError:
        return None


def fresh(d: RankDigest, trace_path: str) -> bool:
    """Was `d` written for the trace now at `trace_path`: the same size it had then, the same
    first bytes (its header: not another rank's or run's trace of that size), and the rank the
    file's name says (`trace_rank3.json`)?"""
    m = TRACE_NAME.match(os.path.basename(trace_path))
    if m is not None and int(m.group(1)) != d.rank:
        return False
    try:
        if d.trace_bytes is None or os.path.getsize(trace_path) != d.trace_bytes:
            return False
    except OSError:
        return False
    return d.trace_head is not None and head_hash(trace_path) == d.trace_head


def looks_current(path: str, trace_path: str, step_name: str) -> bool:
    """Whether the digest at `path` is one a summary with steps named `step_name` would read for
    the trace at `trace_path`, as far as its first bytes tell (format 2 or later, that step name,
    written for a trace of the size it has now): a cheap look, before `read` and `fresh` say it
    for sure."""
    try:
        head = read_head(path, 4096)
        size = os.path.getsize(trace_path)
    except (TraceFormatError, OSError):
        return False
    version = re.match(rb'\{"format":"gputrace-digest/(\d+)"', head)
    written = re.search(rb'"trace_bytes":(\d+)[,}]', head)
    return (
        version is not None
        and int(version.group(1)) >= 2
        and written is not None
        and int(written.group(1)) == size
        and step_name_of(path) == step_name
    )


def step_name_of(path: str) -> str | None:
    """The step name the digest at `path` was written with, read from the file's first bytes
    (None where it cannot be read there)."""
    try:
        head = read_head(path, 4096)
    except TraceFormatError:
        return None
    m = re.search(rb'"step_name":("(?:[^"\\]|\\.)*")', head)
    if m is None:
        return None
    try:
        return str(orjson.loads(m.group(1)))
    except orjson.JSONDecodeError:  # not text (invalid UTF-8): the digest is read to say so
        return None
