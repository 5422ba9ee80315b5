"""Merging: many ranks' traces -> one aligned timeline.

Takes: per-rank Chrome trace files (gputrace's object form, or array forms, also cut off by a
crash), and how to align them: measured clock offsets (`clock`, the default), none, or the
ends of the n-th occurrence of a named collective span (`align_on`).
Gives: one trace, written atomically, with each rank its own process (pid = rank + 1) and the
alignment applied recorded in its metadata, with error bars.

Memory: ranks are read one at a time and their events written out before the next is read,
so the peak is about the output plus one rank's parsed events.
"""

from __future__ import annotations

import gc
import glob
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from gputrace.errors import MergeError, TraceFormatError
from gputrace.traceio import atomic_writer, read_trace, us_to_ns
from gputrace.version import __version__

Progress = Callable[[str, int, int], None]  # (what, done, total)
_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)")


@dataclass
class RankFile:
    path: str
    rank: int
    world_size: int | None
    base_ns: int
    metadata: dict[str, Any]
    offset_ns: int = 0  # added to this rank's times
    error_ns: int = 0
    drift: float = 0.0  # offset change per ns of this rank's time, from repeated clock syncs
    drift_at_ns: int = 0
    notes: list[str] = field(default_factory=list)


def expand(paths: Iterable[str]) -> list[str]:
    """Files, directories (their trace_rank*.json) and globs -> a sorted list of files."""
    files: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            found = sorted(glob.glob(os.path.join(p, "trace_rank*.json")))
            if not found:
                raise MergeError(f"{p}: no trace_rank*.json files in this directory")
            files += found
        elif any(c in p for c in "*?["):
            found = sorted(glob.glob(p))
            if not found:
                raise MergeError(f"{p}: no files match")
            files += found
        elif os.path.exists(p):
            files.append(p)
        else:
            raise TraceFormatError(p, "no such file")
    return list(dict.fromkeys(files))


def read_header(path: str) -> dict[str, Any]:
    """The top-level keys before `traceEvents` (gputrace writes its header first), without
    parsing the events; falls back to parsing the whole file for other writers."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 20)
    except OSError as e:
        raise TraceFormatError(path, e.strerror or str(e)) from None
    cut = head.find(b'"traceEvents":')
    if head.lstrip().startswith(b"{") and cut > 0:
        try:
            header = orjson.loads(head[:cut].rstrip().rstrip(b",") + b"}")
            if isinstance(header, dict) and "baseTimeNanoseconds" in header:
                return header
        except orjson.JSONDecodeError:
            pass
    trace = read_trace(path)
    trace.pop("traceEvents")
    return trace


def describe(path: str, header: dict[str, Any], rank_from_filename: bool) -> RankFile:
    meta = header.get("metadata") if isinstance(header.get("metadata"), dict) else {}
    info = header.get("distributedInfo") if isinstance(header.get("distributedInfo"), dict) else {}
    if meta.get("merged"):
        raise MergeError(f"{path}: already a merged trace; merge the per-rank files instead")
    rank = info.get("rank", meta.get("rank"))
    if rank_from_filename:
        m = _RANK_IN_NAME.search(os.path.basename(path))
        if m is None:
            raise MergeError(f"{path}: --rank-from-filename, but the name has no 'rank<N>' in it")
        rank = int(m.group(1))
    if not isinstance(rank, int) or rank < 0:
        raise MergeError(
            f"{path}: the trace does not say which rank it is (no distributedInfo.rank); "
            "name the files trace_rank<N>.json and pass --rank-from-filename"
        )
    base = header.get("baseTimeNanoseconds", 0)
    if not isinstance(base, int):
        raise TraceFormatError(path, "baseTimeNanoseconds is not an integer")
    world = info.get("world_size", meta.get("world_size"))
    return RankFile(path, rank, world if isinstance(world, int) else None, base, meta)


def plan(
    paths: Iterable[str],
    align: str = "clock",
    align_on: str | None = None,
    occurrence: int = 1,
    rank_from_filename: bool = False,
) -> list[RankFile]:
    """Read every header, check the ranks, and work out each rank's offset."""
    files = expand(paths)
    if not files:
        raise MergeError("nothing to merge")
    ranks: dict[int, RankFile] = {}
    for path in files:
        rf = describe(path, read_header(path), rank_from_filename)
        if rf.rank in ranks:
            raise MergeError(
                f"rank {rf.rank} appears twice: {ranks[rf.rank].path} and {path}; "
                "merge one run at a time (or use --rank-from-filename if the files name their ranks)"
            )
        ranks[rf.rank] = rf
    out = [ranks[r] for r in sorted(ranks)]
    if align_on is not None:
        _align_on(out, align_on, occurrence)
    elif align == "clock":
        for rf in out:
            _apply_clock_sync(rf)
    elif align != "none":
        raise MergeError(f"unknown alignment {align!r}: use clock or none")
    return out


def _apply_clock_sync(rf: RankFile) -> None:
    syncs = (rf.metadata.get("clock") or {}).get("sync_to_rank0") or []
    syncs = [s for s in syncs if isinstance(s, dict) and {"offset_ns", "error_ns", "at_ns"} <= set(s)]
    if not syncs:
        rf.notes.append("no clock sync recorded: host clocks taken as they are (NTP)")
        return
    first, last = syncs[0], syncs[-1]
    span = last["at_ns"] - first["at_ns"]
    if span > 1_000_000_000:
        # Offsets measured at two times: the line through them (clocks drift apart).
        rf.drift = (last["offset_ns"] - first["offset_ns"]) / span
        rf.drift_at_ns = int(first["at_ns"])
        rf.offset_ns, rf.error_ns = int(first["offset_ns"]), max(int(first["error_ns"]), int(last["error_ns"]))
    else:
        best = min(syncs, key=lambda s: s["error_ns"])
        rf.offset_ns, rf.error_ns = int(best["offset_ns"]), int(best["error_ns"])


def _align_on(files: list[RankFile], name: str, occurrence: int) -> None:
    """Offsets that make the end of the n-th `name` span the same on every rank as on the
    lowest rank (for traces recorded without sync_clocks)."""
    ends: dict[int, int] = {}
    for rf in files:
        trace = read_trace(rf.path)
        found = sorted(
            (rf.base_ns + us_to_ns(e.get("ts", 0)), rf.base_ns + us_to_ns(e.get("ts", 0)) + us_to_ns(e.get("dur", 0)))
            for e in trace["traceEvents"]
            if isinstance(e, dict) and e.get("ph") == "X" and e.get("name") == name
        )
        if len(found) < occurrence:
            raise MergeError(
                f"{rf.path}: --align-on {name!r}: the trace has {len(found)} such spans, occurrence {occurrence} asked"
            )
        ends[rf.rank] = found[occurrence - 1][1]
    ref = ends[files[0].rank]
    for rf in files:
        rf.offset_ns = ref - ends[rf.rank]
        rf.notes.append(f"aligned on the end of {name!r} #{occurrence}")


def merge(
    paths: Iterable[str],
    out: str,
    align: str = "clock",
    align_on: str | None = None,
    occurrence: int = 1,
    rank_from_filename: bool = False,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Merge per-rank traces into `out` (written atomically). Returns the merged metadata."""
    files = plan(paths, align, align_on, occurrence, rank_from_filename)
    # Each rank's first instant after alignment (the drift term grows with time, so a rank's
    # earliest event stays its earliest).
    base = min(rf.base_ns + rf.offset_ns + round(rf.drift * (rf.base_ns - rf.drift_at_ns)) for rf in files)
    world = max([len(files)] + [rf.world_size or 0 for rf in files])
    meta = {
        "merged": True,
        "gputrace_version": __version__,
        "ranks": [rf.rank for rf in files],
        "alignment": {
            "method": "align-on" if align_on else align,
            **({"name": align_on, "occurrence": occurrence} if align_on else {}),
            "per_rank": {
                str(rf.rank): {
                    "offset_ns": rf.offset_ns,
                    "error_ns": rf.error_ns,
                    **({"drift_ppm": rf.drift * 1e6} if rf.drift else {}),
                    "file": rf.path,
                    **({"notes": rf.notes} if rf.notes else {}),
                }
                for rf in files
            },
        },
        "rank_metadata": {str(rf.rank): rf.metadata for rf in files},
    }
    header = {
        "baseTimeNanoseconds": base,
        "distributedInfo": {"world_size": world},
        "metadata": meta,
        "displayTimeUnit": "ns",
    }
    with atomic_writer(out) as f:
        f.write(orjson.dumps(header)[:-1] + b',"traceEvents":[')
        first = True
        for i, rf in enumerate(files):
            if progress:
                progress(f"rank {rf.rank}", i, len(files))
            chunk = _rank_events(rf, base)
            if chunk:
                if not first:
                    f.write(b",")
                f.write(chunk)
                first = False
            del chunk
            _release_memory()
        f.write(b"]}")
    if progress:
        progress("done", len(files), len(files))
    return meta


def _release_memory() -> None:
    """Hand one rank's freed objects back to the OS before the next rank is read, so the peak
    stays near one rank's worth instead of growing with every rank."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _rank_events(rf: RankFile, base: int) -> bytes:
    """One rank's events, moved onto the common base, as the inside of a JSON array."""
    trace = read_trace(rf.path)
    events = trace["traceEvents"]
    pid = rf.rank + 1
    shift = rf.base_ns + rf.offset_ns - base  # ns added to each event's own ts
    drift, drift_at = rf.drift, rf.drift_at_ns - rf.base_ns  # drift is per ns of this rank's time
    kept = []
    for e in events:
        if not isinstance(e, dict):
            continue
        e["pid"] = pid
        ts = e.get("ts")
        if ts is not None and e.get("ph") != "M":
            ns = us_to_ns(ts)
            if drift:
                # Start and end through the same monotone map, so spans that nested still nest.
                moved = ns + shift + round(drift * (ns - drift_at))
                dur = e.get("dur")
                if dur is not None:
                    end = ns + us_to_ns(dur)
                    e["dur"] = (end + shift + round(drift * (end - drift_at)) - moved) / 1000
            else:
                moved = ns + shift
            e["ts"] = moved / 1000
        kept.append(e)
    if not any(e.get("ph") == "M" and e.get("name") == "process_name" for e in kept):
        kept.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"rank {rf.rank}"}})
        kept.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": rf.rank}})
    data = orjson.dumps(kept)
    return data[1:-1]
