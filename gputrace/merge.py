"""Merging: many ranks' traces -> one aligned timeline, in memory (`load`) or on disk (`merge`).

Takes: trace files (gputrace's per-rank files in any form: finished, streamed, cut off by a crash;
one merged file; another tool's traces such as torch.profiler's, placed with the rank they
belong to), how to align them (`clock`: the offsets the ranks measured, with drift; `none`; or
the ends of the n-th occurrence of a named collective span), and optionally a selection (ranks,
steps, a time window). Gives: one `Trace` with every rank its own process (pid = rank + 1) and
the alignment applied recorded in its metadata (`load`), or the same written as Chrome JSON rank
by rank (`merge`: memory about one rank's worth, not all of them).

Checks before anything is merged, because a wrong merge looks plausible: the same rank twice
(also the same file under two names, or a per-rank file beside a merged file), files of different
runs (their `run_id`) or world sizes, a merged file mixed with per-rank files, a trace that does
not say its rank. Each is a `MergeError` that names the fix; `allow_mixed` turns the run and
world-size checks into notes in the metadata.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import re
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from gputrace import align as al
from gputrace.errors import GputraceError, MergeError, TraceFormatError
from gputrace.trace import chrome
from gputrace.trace.files import atomic_writer, detect, expand, format_for_path
from gputrace.trace.model import Process, Trace
from gputrace.version import __version__

__all__ = ["load", "merge", "expand", "parse_ranks", "parse_steps", "parse_window", "read_trace", "Selection"]

Progress = Callable[[str, int, int], None]  # (what, done, total)
_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)")

#: Window bounds at or above this are epoch ns (1973 onwards); smaller ones are ns after the
#: merged trace's start.
EPOCH_MIN_NS = 10**17

#: In a merged trace that carries another tool's processes, rank R sorts at R * SORT_SLOTS and
#: those processes of rank R right after it (Perfetto orders processes by this index).
SORT_SLOTS = 100


# ---- reading ------------------------------------------------------------------------------------


def read_trace(path: str) -> Trace:
    """One trace file of either format, as a `Trace` (no alignment, no checks)."""
    if detect(path) == "perfetto":
        try:
            from gputrace.trace import perfetto
        except ImportError:
            raise TraceFormatError(path, "a Perfetto protobuf trace, which this gputrace cannot read") from None
        return perfetto.read(path)
    return chrome.read(path)


@dataclasses.dataclass
class Source:
    """What one file holds, as far as checking and planning need: its kind ("rank": gputrace's
    file of one rank; "merged": a merged file; "foreign": another tool's trace of one rank), the
    ranks in it, their metadata and run ids, its world size, and where its times start."""

    path: str
    kind: str
    ident: tuple[int, int] | None
    rank: int | None = None  # "rank" and "foreign": the file's rank
    ranks: list[int] = dataclasses.field(default_factory=list)  # gputrace ranks inside
    rank_meta: dict[int, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    run_ids: dict[int, str] = dataclasses.field(default_factory=dict)
    world_size: int | None = None
    start_ns: int | None = None  # no time of the file lies before this
    foreign: list[tuple[Any, int | None]] = dataclasses.field(default_factory=list)  # (pid, rank)
    merged_meta: Mapping[str, Any] | None = None
    trace: Trace | None = None  # kept when the file was read whole and is wanted again


def _ident(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _rank_from_name(path: str) -> int:
    m = _RANK_IN_NAME.search(os.path.basename(path))
    if m is None:
        raise MergeError(f"{path}: --rank-from-filename, but the name has no 'rank<N>' in it")
    return int(m.group(1))


def _no_rank(path: str) -> MergeError:
    return MergeError(
        f"{path}: the trace does not say which rank it is (no distributedInfo.rank); "
        "name the files ..._rank<N>.json and pass --rank-from-filename"
    )


def _mapping(v: Any) -> Mapping[str, Any]:
    return v if isinstance(v, Mapping) else {}


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def describe_header(path: str, header: Mapping[str, Any], rank_from_filename: bool = False) -> Source | None:
    """A gputrace file described from its header alone (None when the header is not enough:
    another tool's trace, whose processes and times are known only from its events)."""
    meta = _mapping(header.get("metadata"))
    info = _mapping(header.get("distributedInfo"))
    base = _int(header.get("baseTimeNanoseconds"))
    world = _int(info.get("world_size", meta.get("world_size")))
    if meta.get("merged"):
        pid_rank = {str(k): _int(v) for k, v in (meta.get("pid_rank") or {}).items()}
        rank_meta = {int(k): v for k, v in (meta.get("rank_metadata") or {}).items() if isinstance(v, Mapping)}
        ranks = sorted(int(r) for r in meta.get("ranks") or rank_meta)
        run_ids = {r: m["run_id"] for r, m in rank_meta.items() if isinstance(m.get("run_id"), str)}
        if isinstance(meta.get("run_id"), str):
            run_ids = {r: run_ids.get(r, meta["run_id"]) for r in ranks}
        foreign = [(p, pid_rank.get(str(p))) for p in meta.get("foreign_pids") or ()]
        return Source(path, "merged", _ident(path), None, ranks, rank_meta, run_ids, world, base, foreign, dict(meta))
    if "gputrace_version" not in meta or base is None:
        return None
    rank = _rank_from_name(path) if rank_from_filename else _int(info.get("rank", meta.get("rank")))
    if rank is None or rank < 0:
        raise _no_rank(path)
    run = meta.get("run_id")
    return Source(
        path, "rank", _ident(path), rank, [rank], {rank: meta}, {rank: run} if isinstance(run, str) else {}, world, base
    )


def describe_trace(path: str, trace: Trace, rank_from_filename: bool = False) -> Source:
    """A file described from its whole `Trace` (the trace is kept on the `Source`)."""
    meta = trace.metadata
    world = _int(meta.get("world_size"))
    rng = trace.time_range()
    first = rng[0] if rng else None
    base = _int(meta.get("base_ns")) or None
    if meta.get("merged"):
        ranks_of = _merged_ranks(trace)
        rank_meta = {
            r: q.metadata for q, (r, foreign) in zip(trace.processes, ranks_of) if r is not None and not foreign
        }
        for r in rank_meta:
            if not rank_meta[r] and isinstance(meta.get("rank_metadata"), Mapping):
                rank_meta[r] = meta["rank_metadata"].get(str(r)) or {}
        run_ids = {r: m["run_id"] for r, m in rank_meta.items() if isinstance(m.get("run_id"), str)}
        if isinstance(meta.get("run_id"), str):
            run_ids = {r: run_ids.get(r, meta["run_id"]) for r in rank_meta}
        foreign = [(q.pid, r) for q, (r, f) in zip(trace.processes, ranks_of) if f]
        start = min(x for x in (base, first) if x is not None) if (base or first) else None
        return Source(
            path,
            "merged",
            _ident(path),
            None,
            sorted(rank_meta),
            rank_meta,
            run_ids,
            world,
            start,
            foreign,
            meta,
            trace,
        )
    own_process = next((p for p in trace.processes if not p.foreign), None)
    if "gputrace_version" in meta:
        rank = own_process.rank if own_process is not None else _int(meta.get("rank"))
        if rank_from_filename:
            rank = _rank_from_name(path)
        if rank is None:
            raise _no_rank(path)
        run = meta.get("run_id")
        foreign = [(p.pid, rank) for p in trace.processes if p.foreign]
        start = base if base is not None else first
        if start is not None and first is not None:
            start = min(start, first)
        return Source(
            path,
            "rank",
            _ident(path),
            rank,
            [rank],
            {rank: meta},
            {rank: run} if isinstance(run, str) else {},
            world,
            start,
            foreign,
            None,
            trace,
        )
    # Another tool's trace (torch.profiler / Kineto): every process of it belongs to one rank.
    ranks = {p.rank for p in trace.processes if p.rank is not None}
    rank = _rank_from_name(path) if rank_from_filename else (ranks.pop() if len(ranks) == 1 else None)
    if rank is None:
        raise _no_rank(path)
    foreign = [(p.pid, rank) for p in trace.processes]
    return Source(path, "foreign", _ident(path), rank, [], {}, {}, world, first, foreign, None, trace)


def _merged_ranks(trace: Trace) -> list[tuple[int | None, bool]]:
    """(rank, foreign) of each process of a merged trace. Merged files of older gputrace versions
    carry no pid -> rank table: there, pid = rank + 1 for the ranks the metadata lists."""
    listed = set(trace.metadata.get("ranks") or ()) if "pid_rank" not in trace.metadata else set()
    out: list[tuple[int | None, bool]] = []
    for q in trace.processes:
        if q.rank is None and isinstance(q.pid, int) and q.pid - 1 in listed:
            out.append((q.pid - 1, False))
        else:
            out.append((q.rank, q.foreign or q.rank is None))
    return out


def describe(path: str, rank_from_filename: bool = False, keep: bool = True) -> Source:
    """Describe one file: from its header when that is enough (a finished gputrace JSON file),
    else from the whole trace, which stays on the `Source` with `keep` (read once, not twice)."""
    if detect(path) == "chrome" and _first_byte(path) == b"{":
        # A streamed file (array form) carries later clock syncs and its run id in events after
        # its first line, so only the object form's header says everything.
        src = describe_header(path, chrome.read_header(path), rank_from_filename)
        if src is not None:
            return src
    src = describe_trace(path, read_trace(path), rank_from_filename)
    if not keep:
        src.trace = None
    return src


def _first_byte(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(4096).lstrip()[:1]
    except OSError:
        return b""


# ---- selections ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Selection:
    """What to keep: `ranks` (None: all), `steps` ([first, stop) indices of each rank's
    `step_name` spans, either end open), `window` ([t0, t1) ns; a bound >= EPOCH_MIN_NS is an
    epoch time, a smaller one is relative to the merged trace's start)."""

    ranks: frozenset[int] | None = None
    steps: tuple[int | None, int | None] | None = None
    window: tuple[int | None, int | None] | None = None
    step_name: str = "step"

    @classmethod
    def make(
        cls,
        ranks: Iterable[int] | None = None,
        steps: range | tuple[int | None, int | None] | int | None = None,
        window: tuple[int | None, int | None] | None = None,
        step_name: str = "step",
    ) -> Selection:
        bounds: tuple[int | None, int | None] | None
        if isinstance(steps, range):
            if steps.step != 1:
                raise MergeError("steps: a range with step 1 (every step from first to last)")
            bounds = (steps.start, steps.stop)
        elif isinstance(steps, int):
            bounds = (steps, steps + 1)
        else:
            bounds = steps
        if bounds is not None:
            a, b = bounds
            if (a is not None and a < 0) or (b is not None and b < 0):
                raise MergeError("steps: indices count from 0 (the first step is 0)")
            if a is not None and b is not None and b <= a:
                raise MergeError(f"steps {a}:{b} select nothing: the end is exclusive (e.g. {a}:{a + 1})")
        if window is not None:
            lo, hi = window
            if lo is not None and hi is not None and (lo >= EPOCH_MIN_NS) == (hi >= EPOCH_MIN_NS) and hi <= lo:
                raise MergeError(f"window {lo}:{hi} selects nothing: its end is not after its start")
        return cls(frozenset(ranks) if ranks is not None else None, bounds, window, step_name)

    @property
    def by_time(self) -> bool:
        return self.steps is not None or self.window is not None

    def absolute(self, start_ns: int) -> tuple[int | None, int | None] | None:
        if self.window is None:
            return None
        return tuple(None if t is None else t if t >= EPOCH_MIN_NS else start_ns + t for t in self.window)  # type: ignore[return-value]

    def metadata(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.ranks is not None:
            out["ranks"] = sorted(self.ranks)
        if self.steps is not None:
            out["steps"] = list(self.steps)
            out["step_name"] = self.step_name
        if self.window is not None:
            out["window_ns"] = list(self.window)
        return out


def parse_ranks(text: str) -> frozenset[int]:
    """ "0-3,7" -> {0, 1, 2, 3, 7}."""
    out: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if m is None:
            raise MergeError(f"--ranks {text!r}: use ranks and ranges such as 0-3,7")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise MergeError(f"--ranks {text!r}: the range {part} runs backwards")
        out.update(range(lo, hi + 1))
    if not out:
        raise MergeError(f"--ranks {text!r}: no ranks in it")
    return frozenset(out)


def parse_steps(text: str) -> tuple[int | None, int | None]:
    """ "A:B" (B exclusive; either may be left out) or "N" (that step alone)."""
    m = re.fullmatch(r"\s*(\d*)\s*(:?)\s*(\d*)\s*", text)
    if m is None or (not m.group(2) and not m.group(1)):
        raise MergeError(f"--steps {text!r}: use FIRST:STOP (stop exclusive, e.g. 10:20) or one step index")
    a = int(m.group(1)) if m.group(1) else None
    if not m.group(2):
        return (a, a + 1) if a is not None else (None, None)
    return a, int(m.group(3)) if m.group(3) else None


_UNITS = {"ns": 1, "us": 1_000, "ms": 1_000_000, "s": 1_000_000_000}


def parse_window(text: str) -> tuple[int | None, int | None]:
    """ "T0:T1" with units (ns, us, ms, s; plain numbers are ns): "2s:3.5s" is relative to the
    trace's start, an epoch time in ns is absolute."""

    def one(part: str) -> int | None:
        part = part.strip()
        if not part:
            return None
        m = re.fullmatch(r"(\d+(?:\.\d*)?)(ns|us|ms|s)?", part)
        if m is None:
            raise MergeError(f"--window {text!r}: use T0:T1 with units ns, us, ms or s (e.g. 2s:3.5s)")
        unit = _UNITS[m.group(2) or "ns"]
        num = m.group(1)
        if "." in num:
            whole, frac = num.split(".")
            frac = (frac + "000000000")[:9]
            return int(whole or 0) * unit + int(frac) * unit // 1_000_000_000
        return int(num) * unit

    if ":" not in text:
        raise MergeError(f"--window {text!r}: use T0:T1 (either may be left out)")
    lo, hi = text.split(":", 1)
    return one(lo), one(hi)


def _fmt_ranks(ranks: Iterable[int]) -> str:
    rs = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(parts)


# ---- checking and planning ----------------------------------------------------------------------


@dataclasses.dataclass
class Plan:
    """The checked sources in output order, and where each process goes."""

    sources: list[Source]
    ranks: list[int]  # gputrace ranks kept
    all_ranks: list[int]  # every rank kept, including ranks known only from another tool's trace
    world_size: int | None
    run_id: str | None
    notes: list[str]
    pids: dict[tuple[str, Any], int]  # (file, pid in it) -> output pid, for other tools' processes
    sorts: dict[tuple[str, Any], int]
    rank_sort: dict[int, int]
    spare: dict[str, int]  # per file: pids for processes nothing planned (a header said too little)


def plan(sources: list[Source], allow_mixed: bool = False, ranks: frozenset[int] | None = None) -> Plan:
    """Check the sources against each other and order them; raise `MergeError` naming the fix."""
    if not sources:
        raise MergeError("nothing to merge")
    seen: dict[tuple[int, int], str] = {}
    for s in sources:
        if s.ident is not None:
            if s.ident in seen:
                raise MergeError(f"{seen[s.ident]} and {s.path} are the same file; give it once")
            seen[s.ident] = s.path
    merged = [s for s in sources if s.kind == "merged"]
    if merged and len(sources) > 1:
        m = merged[0]
        raise MergeError(
            f"{m.path} is already a merged trace (ranks {_fmt_ranks(m.ranks)}); "
            "give it alone, or the per-rank files without it"
        )
    owner: dict[int, str] = {}
    for s in sources:
        for r in s.ranks:
            if r in owner:
                raise MergeError(
                    f"rank {r} appears twice: {owner[r]} and {s.path}; merge one run at a time "
                    "(or use --rank-from-filename if the files name their ranks)"
                )
            owner[r] = s.path
    notes: list[str] = []

    def problem(message: str) -> None:
        if not allow_mixed:
            raise MergeError(message + "; merge one run at a time, or pass --allow-mixed")
        notes.append(message)

    runs: dict[str, list[int]] = {}
    for s in sources:
        for r, run in s.run_ids.items():
            runs.setdefault(run, []).append(r)
    if len(runs) > 1:
        desc = "; ".join(
            f"run {run} has rank{'s' if len(rs) > 1 else ''} {_fmt_ranks(rs)} ({owner.get(min(rs), '?')})"
            for run, rs in sorted(runs.items(), key=lambda kv: min(kv[1]))
        )
        problem(f"these files come from different runs: {desc}")
    worlds: dict[int, list[str]] = {}
    for s in sources:
        if s.world_size is not None:
            worlds.setdefault(s.world_size, []).append(s.path)
    if len(worlds) > 1:
        desc = "; ".join(f"world size {w} in {', '.join(ps[:3])}" for w, ps in sorted(worlds.items()))
        problem(f"these files come from runs of different sizes: {desc}")
    world = max(worlds) if worlds else None
    if world is not None:
        beyond = sorted((r, s.path) for s in sources for r in [*s.ranks, s.rank] if r is not None and r >= world)
        if beyond and len(worlds) == 1:
            problem(f"rank {beyond[0][0]} ({beyond[0][1]}) is beyond the world size {world} of these files")
    present = sorted(
        {r for s in sources for r in s.ranks} | {r for s in sources for _, r in s.foreign if r is not None}
    )
    if ranks is not None:
        missing = sorted(set(ranks) - set(present))
        if missing:
            raise MergeError(
                f"--ranks: no rank {_fmt_ranks(missing)} in these traces (they hold ranks {_fmt_ranks(present)})"
            )
    keep = set(present) if ranks is None else set(ranks)
    kept = [
        s
        for s in sources
        if s.kind == "merged" or (s.rank is not None and s.rank in keep) or any(r in keep for r in s.ranks)
    ]
    kept.sort(key=lambda s: (s.rank if s.rank is not None else -1, s.kind != "rank"))
    own = sorted(r for s in kept for r in s.ranks if r in keep)
    all_ranks = sorted(keep)
    # Other tools' processes: numbered after every rank's pid, in rank order.
    foreign = [
        (r if r is not None else (max(all_ranks, default=-1) + 1), i, j, pid)
        for i, s in enumerate(kept)
        for j, (pid, r) in enumerate(s.foreign)
        if (r is None and ranks is None) or r in keep
    ]
    foreign.sort()
    scale = SORT_SLOTS if foreign else 1
    pids: dict[tuple[str, Any], int] = {}
    sorts: dict[tuple[str, Any], int] = {}
    nxt = max(all_ranks, default=-1) + 2
    per_rank: dict[int, int] = {}
    for r, i, _, pid in foreign:
        pids[(kept[i].path, pid)] = nxt
        nxt += 1
        per_rank[r] = per_rank.get(r, 0) + 1
        sorts[(kept[i].path, pid)] = r * scale + min(per_rank[r], SORT_SLOTS - 1)
    spare = {s.path: nxt + 1000 * i for i, s in enumerate(kept)}
    run_ids = {run for s in kept for r, run in s.run_ids.items() if r in keep}
    return Plan(
        kept,
        own,
        all_ranks,
        world,
        run_ids.pop() if len(run_ids) == 1 else None,
        notes,
        pids,
        sorts,
        {r: r * scale for r in all_ranks},
        spare,
    )


# ---- alignment ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Maps:
    """The maps to apply now, per rank (host, and device for CUDA tracks), and the alignment
    metadata to record."""

    host: dict[int, al.ClockMap]
    device: dict[int, al.ClockMap]
    metadata: dict[str, Any]


def _alignment(p: Plan, align: str, align_on: str | None, occurrence: int, read: Callable[[Source], Trace]) -> Maps:
    if align not in ("clock", "none"):
        raise MergeError(f"unknown alignment {align!r}: use clock or none")
    if occurrence < 1:
        raise MergeError("--occurrence counts from 1")
    ident = al.ClockMap()
    merged = p.sources[0] if p.sources and p.sources[0].kind == "merged" else None
    files = {r: s.path for s in p.sources for r in (s.ranks or ([s.rank] if s.rank is not None else []))}
    per: dict[int, al.RankAlignment] = {}
    host: dict[int, al.ClockMap] = {}
    device: dict[int, al.ClockMap] = {}
    if align_on is not None:
        ends = _collective_ends(p, align_on, occurrence, read)
        per = al.from_collective_ends(ends, align_on, occurrence)
        per = {r: dataclasses.replace(a, file=files.get(r, "")) for r, a in per.items()}
        host = {r: a.map for r, a in per.items()}
        meta = al.Alignment("align-on", per, align_on, occurrence).metadata()
        if merged is not None:
            meta["before"] = _merged_alignment(merged)
        return Maps(host, device, meta)
    if merged is not None:
        # Its alignment was applied when it was merged: its times stay as they are.
        recorded = _merged_alignment(merged)
        host = {r: ident for r in p.all_ranks}
        recorded["per_rank"] = {r: v for r, v in recorded.get("per_rank", {}).items() if r in p.all_ranks}
        return Maps(host, device, recorded)
    own = {s.rank: s for s in p.sources if s.kind == "rank"}
    for r in p.all_ranks:
        src = own.get(r)
        if align == "none":
            per[r] = al.identity(r, files.get(r, ""))
        elif src is None:
            per[r] = al.identity(r, files.get(r, ""), "no gputrace trace of this rank: its times are taken as they are")
        else:
            per[r] = al.from_metadata(r, src.rank_meta.get(r, {}), src.path)
        host[r] = per[r].map
        if per[r].device_map is not None:
            device[r] = per[r].device_map  # type: ignore[assignment]
    return Maps(host, device, al.Alignment(align, per).metadata())


def _merged_alignment(src: Source) -> dict[str, Any]:
    meta = dict((src.merged_meta or {}).get("alignment") or {})
    meta["per_rank"] = {int(k): v for k, v in (meta.get("per_rank") or {}).items()}
    return meta


def _collective_ends(p: Plan, name: str, occurrence: int, read: Callable[[Source], Trace]) -> dict[int, int]:
    """Each rank's end of the n-th `name` span (by start), from its own process, else from the
    other tool's trace of that rank."""
    found: dict[int, tuple[int, list[tuple[int, int]]]] = {}  # rank -> (priority, [(start, end)])
    for s in p.sources:
        trace = read(s)
        try:
            idx = trace.names.index(name)
        except ValueError:
            idx = -1
        if s.kind == "merged":
            proc_rank = [(r, 1 if f else 0) for r, f in _merged_ranks(trace)]
        else:
            proc_rank = [(s.rank, 0 if (not q.foreign and s.kind != "foreign") else 1) for q in trace.processes]
        track_info = [proc_rank[t.process] for t in trace.tracks]
        hits: dict[tuple[int, int], list[tuple[int, int]]] = {}
        if idx >= 0:
            sp = trace.spans
            for i, n in enumerate(sp.name):
                if n == idx:
                    r, prio = track_info[sp.track[i]]
                    if r is not None:
                        hits.setdefault((r, prio), []).append((sp.start[i], sp.end[i]))
        for (r, prio), spans in hits.items():
            if r not in p.all_ranks:
                continue
            have = found.get(r)
            if have is None or prio < have[0]:
                found[r] = (prio, spans)
            elif prio == have[0]:
                have[1].extend(spans)
    ends: dict[int, int] = {}
    for r in p.all_ranks:
        spans = sorted(found.get(r, (0, []))[1])
        if len(spans) < occurrence:
            where = next((s.path for s in p.sources if r in s.ranks or s.rank == r), f"rank {r}")
            raise MergeError(
                f"{where}: --align-on {name!r}: rank {r} has {len(spans)} such spans, occurrence {occurrence} asked"
            )
        ends[r] = spans[occurrence - 1][1]
    return ends


# ---- moving one file's spans onto the merged timeline -------------------------------------------


@dataclasses.dataclass
class Context:
    """Everything `take` needs besides the file itself: what the plan decided, cut down to the
    files at hand (`for_group`) so that handing it to a worker process costs little."""

    keep_ranks: frozenset[int]
    rank_sort: dict[int, int]
    pids: dict[tuple[str, Any], int]
    sorts: dict[tuple[str, Any], int]
    spare: dict[str, int]
    maps: Maps
    selection: Selection
    window: tuple[int | None, int | None] | None  # absolute

    @classmethod
    def make(cls, p: Plan, maps: Maps, sel: Selection, window: tuple[int | None, int | None] | None) -> Context:
        return cls(frozenset(p.all_ranks), p.rank_sort, p.pids, p.sorts, p.spare, maps, sel, window)

    def for_group(self, group: list[Source]) -> Context:
        if any(s.kind == "merged" for s in group):
            return self
        ranks = {s.rank for s in group}
        paths = {s.path for s in group}
        m = self.maps
        return Context(
            frozenset(r for r in ranks if r in self.keep_ranks),
            {r: v for r, v in self.rank_sort.items() if r in ranks},
            {k: v for k, v in self.pids.items() if k[0] in paths},
            {k: v for k, v in self.sorts.items() if k[0] in paths},
            {k: v for k, v in self.spare.items() if k in paths},
            Maps(
                {r: v for r, v in m.host.items() if r in ranks},
                {r: v for r, v in m.device.items() if r in ranks},
                {},
            ),
            self.selection,
            self.window,
        )


@dataclasses.dataclass
class Taken:
    spans: int = 0
    step_names: set[str] = dataclasses.field(default_factory=set)  # names seen, when no step span was
    steps_found: dict[int, int] = dataclasses.field(default_factory=dict)  # rank -> steps it has
    negative: int = 0
    windows: dict[int, tuple[int, int] | None] = dataclasses.field(default_factory=dict)
    nested: list[int] = dataclasses.field(default_factory=list)  # processes whose spans nest as written
    cut: list[str] = dataclasses.field(default_factory=list)  # files read only up to where they were cut


def take(out: Trace, src: Source, trace: Trace, ctx: Context, windows: dict[int, tuple[int, int] | None]) -> Taken:
    """Append `trace` (the file `src`) to `out`: its kept processes, tracks and spans, times
    mapped onto the merged timeline and selected. `windows` carries each rank's step window
    from its own file to the other tools' files of that rank (filled in as ranks are taken)."""
    sel = ctx.selection
    keep_ranks = ctx.keep_ranks
    res = Taken()
    if trace.metadata.get("file_cut"):
        res.cut.append(src.path)
    # Processes.
    proc_map: list[int] = []
    proc_rank: list[int | None] = []
    spare = ctx.spare.get(src.path, 1 << 24)
    merged_ranks = _merged_ranks(trace) if src.kind == "merged" else []
    for k, q in enumerate(trace.processes):
        if src.kind == "merged":
            rank, foreign = merged_ranks[k]
        else:
            rank, foreign = src.rank, q.foreign or src.kind == "foreign"
        if (rank is not None and rank not in keep_ranks) or (rank is None and sel.ranks is not None):
            proc_map.append(-1)
            proc_rank.append(rank)
            continue
        if not foreign:
            assert rank is not None
            meta = src.rank_meta.get(rank, q.metadata)
            new = Process(rank + 1, rank, q.label, ctx.rank_sort.get(rank, rank), meta, False)
        else:
            pid = ctx.pids.get((src.path, q.pid))
            sort = ctx.sorts.get((src.path, q.pid))
            if pid is None:  # not planned (a gputrace file described by its header alone)
                pid, spare = spare, spare + 1
                sort = (ctx.rank_sort.get(rank, 0) if rank is not None else 1 << 30) + SORT_SLOTS - 1
            label = q.label if rank is None or f"rank {rank}" in q.label else f"{q.label} [rank {rank}]"
            new = Process(pid, rank, label, sort if sort is not None else 0, q.metadata, True)
        proc_map.append(out.add_process(new))
        proc_rank.append(rank)
        if src.kind != "foreign":
            # gputrace's writer laid these out so that every track nests, and the maps are
            # monotone per track: they still nest, no need to check again.
            res.nested.append(proc_map[-1])
    # Tracks, and the map each track's times go through.
    track_map = array("l")
    track_fn: list[al.ClockMap | None] = []
    for t in trace.tracks:
        np_ = proc_map[t.process]
        if np_ < 0:
            track_map.append(-1)
            track_fn.append(None)
            continue
        track_map.append(out.add_track(dataclasses.replace(t, process=np_)))
        r = proc_rank[t.process]
        fn = ctx.maps.host.get(r) if r is not None else None
        if t.kind == "cuda" and r is not None and r in ctx.maps.device and not out.processes[np_].foreign:
            fn = ctx.maps.device[r]
        track_fn.append(fn or _IDENTITY)
    sp = trace.spans
    n = len(sp)
    starts, ends = _map_columns(sp.start, sp.end, sp.track, track_fn)
    # Which rows to keep.
    dropped_tracks = any(m < 0 for m in track_map)
    rows: Sequence[int] | None = None
    # Perfetto drops a span that ends before it starts (and the writer refuses one): `map` over
    # the two arrays finds any at C speed, the per-row loop runs only then.
    inverted = n > 0 and min(map(int.__sub__, ends, starts)) < 0
    negative = [i for i in range(n) if ends[i] < starts[i]] if inverted else []
    if sel.by_time:
        track_rank = [proc_rank[t.process] for t in trace.tracks]
        own_track = [proc_map[t.process] >= 0 and not out.processes[proc_map[t.process]].foreign for t in trace.tracks]
        if sel.steps is not None:
            _step_windows(trace, sp, starts, ends, track_rank, own_track, sel, res, windows)
        rank_window: dict[int | None, tuple[int, int] | None] = {}
        for r in set(track_rank):
            rank_window[r] = _intersect(windows.get(r) if sel.steps is not None else (None, None), ctx.window)  # type: ignore[arg-type]
        win = [rank_window[r] if track_map[ti] >= 0 else None for ti, r in enumerate(track_rank)]
        rows = [
            i
            for i in range(n)
            if (w := win[sp.track[i]]) is not None
            and starts[i] < w[1]
            and (ends[i] > w[0] or starts[i] >= w[0])
            and ends[i] >= starts[i]
        ]
    elif dropped_tracks or negative:
        bad = set(negative)
        rows = [i for i in range(n) if track_map[sp.track[i]] >= 0 and i not in bad]
    res.negative = len(negative)
    # Columns.
    remap = [out.intern(nm) for nm in trace.names]
    o = out.spans
    if rows is None:
        # Ranks of one program intern their names in the same order: then no remapping at all.
        same_names = remap == list(range(len(remap)))
        o.name.extend(
            sp.name if same_names and isinstance(sp.name, array) else array("l", map(remap.__getitem__, sp.name))
        )
        first = track_map[0] if len(track_map) else 0
        same_tracks = first == 0 and list(track_map) == list(range(len(track_map)))
        o.track.extend(
            sp.track
            if same_tracks and isinstance(sp.track, array)
            else array("l", map(track_map.__getitem__, sp.track))
        )
        o.start.extend(starts)
        o.end.extend(ends)
        o.args.extend(sp.args if isinstance(sp.args, list) else [sp.args[i] for i in range(n)])
        o.cat.extend(sp.cat if type(sp.cat) is list else [sp.cat[i] for i in range(n)])
        res.spans = n
    else:
        names, tracks, args, cats = sp.name, sp.track, sp.args, sp.cat
        o.name.extend(array("l", [remap[names[i]] for i in rows]))
        o.track.extend(array("l", [track_map[tracks[i]] for i in rows]))
        o.start.extend(array("q", [starts[i] for i in rows]))
        o.end.extend(array("q", [ends[i] for i in rows]))
        o.args.extend([args[i] for i in rows])
        o.cat.extend([cats[i] for i in rows])
        res.spans = len(rows)
    _take_counters(out, trace, track_map, track_fn, sel, ctx, windows, proc_rank)
    _take_extra(out, trace, proc_map, proc_rank, sel, ctx, windows)
    return res


_IDENTITY = al.ClockMap()


def _map_columns(
    start: Sequence[int], end: Sequence[int], track: Sequence[int], fns: list[al.ClockMap | None]
) -> tuple[array[int], array[int]]:
    used = {id(f): f for f in fns if f is not None}
    if len(used) <= 1:
        only = next(iter(used.values()), _IDENTITY)
        if not only.knots:
            return (start if isinstance(start, array) else array("q", start)), (
                end if isinstance(end, array) else array("q", end)
            )
        return only.column(start), only.column(end)
    # Tracks that go through different maps (a rank's device spans, another rank's process):
    # each group of rows through its own map, in one pass per map.
    s_out, e_out = array("q", start), array("q", end)
    groups: dict[int, list[int]] = {}
    fid = [id(f) if f is not None else 0 for f in fns]
    for i, t in enumerate(track):
        groups.setdefault(fid[t], []).append(i)
    for key, idx in groups.items():
        f = used.get(key)
        if f is None or not f.knots:
            continue
        ms = f.column([start[i] for i in idx])
        me = f.column([end[i] for i in idx])
        for k, i in enumerate(idx):
            s_out[i] = ms[k]
            e_out[i] = me[k]
    return s_out, e_out


def _intersect(
    a: tuple[int | None, int | None] | None, b: tuple[int | None, int | None] | None
) -> tuple[int, int] | None:
    if a is None:
        return None
    lo, hi = a
    if b is not None:
        lo = b[0] if lo is None else (lo if b[0] is None else max(lo, b[0]))
        hi = b[1] if hi is None else (hi if b[1] is None else min(hi, b[1]))
    lo = -(1 << 62) if lo is None else lo
    hi = 1 << 62 if hi is None else hi
    return (lo, hi) if hi > lo else None


def _step_windows(
    trace: Trace,
    sp: Any,
    starts: Sequence[int],
    ends: Sequence[int],
    track_rank: list[int | None],
    own_track: list[bool],
    sel: Selection,
    res: Taken,
    windows: dict[int, tuple[int, int] | None],
) -> None:
    """Each rank's [start of step first, end of step stop - 1], from its own `step_name` spans."""
    assert sel.steps is not None
    ranks_here = {r for r, own in zip(track_rank, own_track) if own and r is not None}
    try:
        idx = trace.names.index(sel.step_name)
    except ValueError:
        idx = -1
    per: dict[int, list[tuple[int, int]]] = {r: [] for r in ranks_here}
    if idx >= 0:
        for i, nm in enumerate(sp.name):
            if nm == idx:
                t = sp.track[i]
                r = track_rank[t]
                if own_track[t] and r is not None:
                    per[r].append((starts[i], ends[i]))
    if idx < 0 and ranks_here:
        res.step_names.update(trace.names)
    a, b = sel.steps
    for r, steps in per.items():
        steps.sort()
        res.steps_found[r] = len(steps)
        chosen = steps[a or 0 : b]
        windows[r] = (chosen[0][0], max(e for _, e in chosen)) if chosen else None


def _take_counters(
    out: Trace,
    trace: Trace,
    track_map: array[int],
    track_fn: list[al.ClockMap | None],
    sel: Selection,
    ctx: Context,
    windows: dict[int, tuple[int, int] | None],
    proc_rank: list[int | None],
) -> None:
    c = trace.counters
    if not len(c):
        return
    last_before: dict[int, tuple[int, float]] = {}
    for i in range(len(c)):
        t = c.track[i]
        nt = track_map[t]
        if nt < 0:
            continue
        fn = track_fn[t] or _IDENTITY
        ts = fn(c.ts[i])
        if sel.by_time:
            r = proc_rank[trace.tracks[t].process]
            w = _intersect(windows.get(r) if sel.steps is not None else (None, None), ctx.window)  # type: ignore[arg-type]
            if w is None or ts >= w[1]:
                continue
            if ts < w[0]:
                # The value in force when the window opens: restated at its start.
                last_before[nt] = (w[0], c.value[i])
                continue
            if nt in last_before:
                out.counters.append(nt, *last_before.pop(nt))
        out.counters.append(nt, ts, c.value[i])
    for nt, (ts, v) in last_before.items():
        out.counters.append(nt, ts, v)


def _take_extra(
    out: Trace,
    trace: Trace,
    proc_map: list[int],
    proc_rank: list[int | None],
    sel: Selection,
    ctx: Context,
    windows: dict[int, tuple[int, int] | None],
) -> None:
    for e in trace.extra:
        pi = e.get("process")
        if not isinstance(pi, int) or proc_map[pi] < 0:
            continue
        r = proc_rank[pi]
        fn = ctx.maps.host.get(r, _IDENTITY) if r is not None else _IDENTITY
        ts = fn(e["ts_ns"])
        if sel.by_time:
            w = _intersect(windows.get(r) if sel.steps is not None else (None, None), ctx.window)  # type: ignore[arg-type]
            if w is None or not (w[0] <= ts < w[1]):
                continue
        moved = dict(e)
        moved["ts_ns"] = ts
        if "dur_ns" in e:
            moved["dur_ns"] = max(0, fn(e["ts_ns"] + e["dur_ns"]) - ts)
        moved["process"] = proc_map[pi]
        out.extra.append(moved)


# ---- the merged trace's metadata -----------------------------------------------------------------


def _metadata(p: Plan, maps: Maps, sel: Selection, base_ns: int, notes: list[str]) -> dict[str, Any]:
    files = {r: s.path for s in p.sources for r in s.ranks}
    align = dict(maps.metadata)
    per = align.get("per_rank") or {}
    for r, entry in per.items():
        if isinstance(entry, dict) and "file" not in entry and r in files:
            entry["file"] = files[r]
    meta: dict[str, Any] = {
        "merged": True,
        "gputrace_version": __version__,
        "ranks": p.ranks,
        "world_size": p.world_size if p.world_size is not None else (max(p.all_ranks) + 1 if p.all_ranks else 0),
        "alignment": align,
        "rank_metadata": {r: s.rank_meta[r] for s in p.sources for r in s.ranks if r in s.rank_meta and r in p.ranks},
        "base_ns": base_ns,
    }
    if p.run_id is not None:
        meta["run_id"] = p.run_id
    if sel.ranks is not None or sel.by_time:
        meta["selection"] = sel.metadata()
    if notes:
        meta["notes"] = notes
    return meta


def _start(p: Plan, maps: Maps) -> int:
    """The merged trace's first instant: each file's start through every map its times use (the
    maps are monotone, so nothing of the file maps before)."""
    firsts = []
    for s in p.sources:
        if s.start_ns is None:
            continue
        rs = s.ranks or ([s.rank] if s.rank is not None else [])
        fns = [maps.host.get(r, _IDENTITY) for r in rs] + [maps.device[r] for r in rs if r in maps.device]
        if s.kind == "merged" or not fns:
            fns.append(_IDENTITY)
        firsts += [f(s.start_ns) for f in fns]
    return min(firsts) if firsts else 0


def _finish_checks(sel: Selection, found: dict[int, int], names: set[str], any_steps: bool) -> list[str]:
    notes: list[str] = []
    if sel.steps is None:
        return notes
    if not any_steps:
        shown = ", ".join(sorted(names)[:12]) + (", ..." if len(names) > 12 else "")
        raise MergeError(
            f"--steps: no span is named {sel.step_name!r} in these traces; name the step span with --step"
            + (f" (spans there: {shown})" if names else "")
        )
    a, b = sel.steps
    short = sorted(r for r, k in found.items() if k <= (a or 0))
    if short and len(short) == len(found):
        raise MergeError(
            f"--steps {a}:{'' if b is None else b}: no rank has that many {sel.step_name!r} spans "
            f"(most: {max(found.values())})"
        )
    if short:
        notes.append(f"ranks {_fmt_ranks(short)} have no {sel.step_name!r} step {a or 0}: left out")
    return notes


# ---- load and merge -----------------------------------------------------------------------------


@dataclasses.dataclass
class _Job:
    """A checked, aligned merge about to run: the plan, the maps, and the files grouped by rank."""

    plan: Plan
    maps: Maps
    selection: Selection
    start: int
    context: Context
    groups: list[list[Source]]


def _prepare(
    files: list[str],
    align: str,
    align_on: str | None,
    occurrence: int,
    rank_from_filename: bool,
    allow_mixed: bool,
    sel: Selection,
    keep: bool,
) -> _Job:
    sources = [describe(f, rank_from_filename, keep=keep) for f in files]
    p = plan(sources, allow_mixed, sel.ranks)
    maps = _alignment(p, align, align_on, occurrence, _read_and_keep if keep else _read_source)
    start = _start(p, maps)
    return _Job(p, maps, sel, start, Context.make(p, maps, sel, sel.absolute(start)), _groups(p))


def _groups(p: Plan) -> list[list[Source]]:
    """Sources in output order, a rank's own file together with other tools' files of it (its
    step windows select theirs)."""
    groups: list[list[Source]] = []
    by_rank: dict[int | None, list[Source]] = {}
    for s in p.sources:
        key = s.rank if s.kind != "merged" else None
        if key not in by_rank:
            by_rank[key] = []
            groups.append(by_rank[key])
        by_rank[key].append(s)
    return groups


def _group_label(group: list[Source]) -> str:
    s = group[0]
    return f"rank {s.rank}" if s.kind != "merged" else os.path.basename(s.path)


def _read_source(s: Source) -> Trace:
    return s.trace if s.trace is not None else read_trace(s.path)


def _read_and_keep(s: Source) -> Trace:
    if s.trace is None:
        s.trace = read_trace(s.path)
    return s.trace


def _run_batch(
    groups: list[list[Source]], ctx: Context, out: Trace | None, base_ns: int | None
) -> tuple[Any, list[Taken]]:
    """Groups of files (a rank's own, then other tools' of it) read, mapped and selected into
    `out` (a new trace when None); with `base_ns`, encoded as Chrome event lines group by group
    instead (so memory holds one group's trace at a time)."""
    part = Trace() if out is None else out
    chunks: list[bytes] = []
    results: list[Taken] = []
    for group in groups:
        windows: dict[int, tuple[int, int] | None] = {}  # a rank's step windows, for its other files
        taken = []
        for s in group:
            trace = _read_source(s)
            s.trace = None
            taken.append(take(part, s, trace, ctx, windows))
            del trace
        results += taken
        if base_ns is not None:
            chunks.append(encode_part(part, base_ns, {p for r in taken for p in r.nested}))
            part = Trace()
    return (b"".join(chunks) if base_ns is not None else part), results


#: A worker's task holds whole ranks adding up to at least this much input (many small ranks
#: in one task: each task costs a few ms of pickling and bookkeeping).
BATCH_BYTES = 8 << 20
#: Freed memory is handed back to the OS after about this much input (not after every small rank:
#: a collection costs milliseconds).
RELEASE_BYTES = 32 << 20


def _group_bytes(group: list[Source]) -> int:
    total = 0
    for s in group:
        try:
            total += os.path.getsize(s.path)
        except OSError:
            pass
    return total


def _run_groups(
    job: _Job, out: Trace | None, base_ns: int | None, workers: int, progress: Progress | None
) -> Iterable[tuple[Any, list[Taken]]]:
    """Each group's result in order: here, or in `workers` processes (each reads and converts
    whole ranks, several small ones to a task; at most a few results wait in memory)."""
    groups = job.groups
    sizes = [_group_bytes(g) for g in groups]
    if workers <= 1 or len(groups) < 2:
        since = 0
        for i, g in enumerate(groups):
            if progress:
                progress(_group_label(g), i, len(groups))
            yield _run_batch([g], job.context, out, base_ns)
            since += sizes[i]
            if base_ns is not None and since >= RELEASE_BYTES:
                _release_memory()
                since = 0
        return
    for g in groups:
        for s in g:
            s.trace = None  # each worker reads its own files
    batches: list[list[int]] = [[]]
    size = 0
    for i in range(len(groups)):
        if batches[-1] and size >= BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(i)
        size += sizes[i]
    with _Pool(workers) as pool:
        ahead = 2 * workers
        sent = 0
        for k, batch in enumerate(batches):
            while sent < len(batches) and sent < k + ahead:
                gs = [groups[i] for i in batches[sent]]
                pool.send(sent, (gs, job.context.for_group([s for g in gs for s in g]), base_ns))
                sent += 1
            if progress:
                progress(_group_label(groups[batch[0]]), batch[0], len(groups))
            yield pool.receive(k)


class _Pool:
    """Worker processes that each run `_run_batch` on the tasks sent to them, in order. They are
    fresh interpreters (`python -c`), not forks: a fork of a process with threads (a viewer, a
    training script) can hang, and multiprocessing's spawn would re-run the caller's script."""

    def __init__(self, n: int) -> None:
        import subprocess
        import sys

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-c", "from gputrace.merge import _worker_main; _worker_main()"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
            )
            for _ in range(n)
        ]

    def __enter__(self) -> _Pool:
        return self

    def __exit__(self, *exc: Any) -> None:
        for p in self.procs:
            try:
                assert p.stdin is not None
                p.stdin.close()
            except OSError:
                pass
        for p in self.procs:
            if exc[0] is not None:
                p.kill()
            try:
                p.wait(timeout=10)
            except Exception:
                p.kill()
                p.wait()
            if p.stdout is not None:
                p.stdout.close()

    def send(self, k: int, task: Any) -> None:
        p = self.procs[k % len(self.procs)]
        assert p.stdin is not None
        _put(p.stdin, task)

    def receive(self, k: int) -> Any:
        p = self.procs[k % len(self.procs)]
        assert p.stdout is not None
        kind, value = _get(p.stdout)
        if kind == "ok":
            return value
        raise _rebuild_error(value)


def _put(f: Any, obj: Any) -> None:
    import pickle

    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(len(data).to_bytes(8, "little") + data)
    f.flush()


def _get(f: Any) -> Any:
    import pickle

    head = f.read(8)
    if len(head) < 8:
        raise GputraceError("a merge worker process ended unexpectedly (out of memory?); try --workers 1")
    n = int.from_bytes(head, "little")
    return pickle.loads(f.read(n))


def _rebuild_error(value: tuple[str, str, str]) -> Exception:
    kind, message, extra = value
    if kind == "TraceFormatError":
        path, _, reason = extra.partition("\0")
        return TraceFormatError(path, reason)
    if kind == "MergeError":
        return MergeError(message)
    if kind == "GputraceError":
        return GputraceError(message)
    return RuntimeError(f"a merge worker failed: {extra}")


def _worker_main() -> None:
    """The loop of a worker process: tasks in on stdin, results out on stdout."""
    import sys
    import traceback

    src, dst = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write into the result stream
    gc.disable()  # see _no_cycle_collection; each task ends with a collection
    while True:
        try:
            groups, ctx, base_ns = _get(src)
        except GputraceError:
            return  # the parent closed the pipe: no more work
        try:
            _put(dst, ("ok", _run_batch(groups, ctx, None, base_ns)))
        except TraceFormatError as e:
            _put(dst, ("error", ("TraceFormatError", str(e), f"{e.path}\0{e.reason}")))
        except GputraceError as e:
            _put(dst, ("error", (type(e).__name__ if isinstance(e, MergeError) else "GputraceError", str(e), "")))
        except Exception:
            _put(dst, ("error", ("", "", traceback.format_exc())))
        _release_memory()  # once per task: a task holds several MB of input


def _files(paths: Iterable[str | os.PathLike[str]] | str | os.PathLike[str]) -> list[str]:
    if isinstance(paths, (str, os.PathLike)):
        return expand([os.fspath(paths)])
    return expand([os.fspath(p) for p in paths])


def _workers(files: list[str], workers: int | None) -> int:
    """Worker processes for reading, when none were asked for: only for inputs big enough that
    reading dominates (below that, starting the workers costs more than they save), and only as
    many as there are idle CPUs. Workers spend about 10% more CPU in all (pickling, a second
    copy of each rank) and win only by using cores that would otherwise idle: on a machine whose
    cores are busy (measured on a shared 2-core box at load average 7: 64 ranks x 40k spans
    loaded 0.4-1.0x the one-process time, merged 1.0-1.2x) they lose."""
    if workers is not None:
        return max(1, workers)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cpus < 2 or len(files) < 4:
        return 1
    if sum(os.path.getsize(f) for f in files if os.path.isfile(f)) < PARALLEL_MIN_BYTES:
        return 1
    try:
        idle = cpus - os.getloadavg()[0]
    except OSError:
        idle = 0.0
    return max(1, min(round(idle), 8)) if idle >= 1.5 else 1


#: Inputs smaller than this are read in this process (see `_workers`).
PARALLEL_MIN_BYTES = 64 << 20


def _append_part(out: Trace, part: Trace) -> None:
    """Append a trace built elsewhere (a worker's rank) to `out`: indices moved, names re-interned."""
    procs = [out.add_process(q) for q in part.processes]
    t0 = len(out.tracks)
    for t in part.tracks:
        out.add_track(dataclasses.replace(t, process=procs[t.process]))
    remap = [out.intern(nm) for nm in part.names]
    sp, o = part.spans, out.spans
    o.name.extend(sp.name if remap == list(range(len(remap))) else array("l", map(remap.__getitem__, sp.name)))
    o.track.extend(sp.track if t0 == 0 else array("l", map(t0.__add__, sp.track)))
    o.start.extend(sp.start)
    o.end.extend(sp.end)
    o.args.extend(sp.args)
    o.cat.extend(sp.cat)
    c = part.counters
    out.counters.track.extend(array("l", map(t0.__add__, c.track)))
    out.counters.ts.extend(c.ts)
    out.counters.value.extend(c.value)
    p0 = procs[0] if procs else 0
    for e in part.extra:
        e["process"] += p0
        out.extra.append(e)


class _Tally:
    def __init__(self) -> None:
        self.found: dict[int, int] = {}
        self.names: set[str] = set()
        self.negative = 0
        self.cut: list[str] = []

    def add(self, results: list[Taken]) -> None:
        for r in results:
            self.found.update(r.steps_found)
            self.names |= r.step_names
            self.negative += r.negative
            self.cut += r.cut

    def notes(self, sel: Selection) -> list[str]:
        notes = _finish_checks(sel, self.found, self.names, any(self.found.values()))
        if self.negative:
            notes.append(f"{self.negative} spans that end before they start were left out (Perfetto drops them too)")
        if self.cut:
            shown = ", ".join(self.cut[:3]) + (f" and {len(self.cut) - 3} more" if len(self.cut) > 3 else "")
            notes.append(
                f"{shown}: not finished (the recording was killed, or the file was cut): read up to the last "
                "complete event"
            )
        return notes


def load(
    paths: Iterable[str | os.PathLike[str]] | str | os.PathLike[str],
    align: str = "clock",
    align_on: str | None = None,
    occurrence: int = 1,
    rank_from_filename: bool = False,
    allow_mixed: bool = False,
    ranks: Iterable[int] | None = None,
    steps: range | tuple[int | None, int | None] | int | None = None,
    window: tuple[int | None, int | None] | None = None,
    step_name: str = "step",
    *,
    workers: int | None = None,
) -> Trace:
    """Per-rank files (or one merged file, or other tools' traces of known ranks) as ONE merged,
    aligned `Trace` in memory. See the module docstring for the checks; `Trace.metadata` holds
    "merged": True, "alignment" ({method, per_rank: {rank: {offset_ns, error_ns, drift_ppm?,
    device?, file, notes?}}}), "ranks", "world_size", "run_id" (when known), "rank_metadata",
    "base_ns" (the merged trace's first instant), and "selection" / "notes" when there are any.
    `workers`: processes that read files (None: several only for large inputs)."""
    sel = Selection.make(ranks, steps, window, step_name)
    files = _files(paths)
    n_workers = _workers(files, workers)
    with _no_cycle_collection():
        job = _prepare(files, align, align_on, occurrence, rank_from_filename, allow_mixed, sel, keep=n_workers <= 1)
        out = Trace()
        tally = _Tally()
        for part, results in _run_groups(job, out if n_workers <= 1 else None, None, n_workers, None):
            if part is not out:
                _append_part(out, part)
            tally.add(results)
    out.metadata = _metadata(job.plan, job.maps, sel, job.start, job.plan.notes + tally.notes(sel))
    return out


def merge(
    paths: Iterable[str | os.PathLike[str]] | str | os.PathLike[str],
    out: str | os.PathLike[str],
    align: str = "clock",
    align_on: str | None = None,
    occurrence: int = 1,
    rank_from_filename: bool = False,
    progress: Progress | None = None,
    *,
    fmt: str | None = None,
    allow_mixed: bool = False,
    ranks: Iterable[int] | None = None,
    steps: range | tuple[int | None, int | None] | int | None = None,
    window: tuple[int | None, int | None] | None = None,
    step_name: str = "step",
    workers: int | None = None,
) -> dict[str, Any]:
    """Merge traces into `out` (written atomically), rank by rank: memory is about one rank's
    trace and its encoded events (per worker), whatever the number of ranks. Returns the merged
    metadata as written (rank keys as strings), plus notes found while writing. `fmt`: "json"
    or "perfetto" (default: by the extension of `out`)."""
    sel = Selection.make(ranks, steps, window, step_name)
    out = os.fspath(out)
    kind = format_for_path(out, fmt)
    files = _files(paths)
    if os.path.abspath(out) in {os.path.abspath(f) for f in files}:
        raise MergeError(f"{out} is one of the inputs; write the merged trace to another file")
    if kind == "perfetto":
        return _merge_perfetto(files, out, align, align_on, occurrence, rank_from_filename, allow_mixed, sel, progress)
    n_workers = _workers(files, workers)
    with _no_cycle_collection():
        return _merge_json(
            files, out, align, align_on, occurrence, rank_from_filename, allow_mixed, sel, n_workers, progress
        )


def _merge_json(
    files: list[str],
    out: str,
    align: str,
    align_on: str | None,
    occurrence: int,
    rank_from_filename: bool,
    allow_mixed: bool,
    sel: Selection,
    n_workers: int,
    progress: Progress | None,
) -> dict[str, Any]:
    job = _prepare(files, align, align_on, occurrence, rank_from_filename, allow_mixed, sel, keep=False)
    meta = _metadata(job.plan, job.maps, sel, job.start, list(job.plan.notes))
    header = _json_metadata(meta, job.plan)
    tally = _Tally()
    with atomic_writer(out) as f:
        f.write(chrome.header_bytes(job.start, header, None, meta["world_size"]))
        for data, results in _run_groups(job, None, job.start, n_workers, progress):
            f.write(data)
            del data
            tally.add(results)
        late = tally.notes(sel)  # raises before the file is published when a selection found nothing
        _close(f)
    if progress:
        progress("done", len(job.groups), len(job.groups))
    if late:
        header.setdefault("notes", []).extend(late)
    return header


def encode_part(part: Trace, base_ns: int, nested: set[int] | frozenset[int] = frozenset()) -> bytes:
    """Event lines (each ending ",\\n") for every process of `part`, through the Chrome writer:
    each process with its own writer, its spans laid out once over all of them (`nested`:
    processes known to nest on every track already, which are written as they are)."""
    chunks: list[bytes] = []
    pid_of = {i: q.pid for i, q in enumerate(part.processes)}
    rows_of: dict[int, list[int]] = {i: [] for i in range(len(part.processes))}
    if len(part.processes) == 1:
        rows_of[0] = list(range(len(part.spans)))
    else:
        proc_of_track = [t.process for t in part.tracks]
        for i, t in enumerate(part.spans.track):
            rows_of[proc_of_track[t]].append(i)
    sp = part.spans
    tid_of: dict[tuple[int, Any], int] = {}
    wanted = {(e["process"], e["tid"]) for e in part.extra if "tid" in e}
    for pi, q in enumerate(part.processes):
        w = chrome.ProcessWriter(q.pid, q)  # type: ignore[arg-type]
        chunks.append(w.process_events())
        rows = rows_of[pi]
        layout = _CheckedLayout(sp, rows, pi in nested)
        w.layout = layout  # type: ignore[assignment]
        if layout.fallback is not None:
            # The Chrome writer's layout judges nesting across pieces when they come in the
            # order spans ended (children before their parents).
            rows.sort(key=sp.start.__getitem__, reverse=True)
            rows.sort(key=sp.end.__getitem__)
        for k in range(0, len(rows), 65536):
            chrome.encode_spans(part, rows[k : k + 65536], w, base_ns, chunks)
        for ti, track in enumerate(part.tracks):
            if track.process == pi and (pi, track.tid) in wanted:
                meta: list[bytes] = []
                tid_of[(pi, track.tid)] = w.tid(part, ti, 0, meta)
                chunks.extend(meta)
    # Other tools' instants and flows point at threads by tid: give them the tids written.
    for e in part.extra:
        if "tid" in e:
            e["tid"] = tid_of.get((e["process"], e["tid"]), e["tid"])
    chrome.encode_counters(part, range(len(part.counters)), pid_of, base_ns, chunks)  # type: ignore[arg-type]
    chrome.encode_extra(part, pid_of, base_ns, chunks)  # type: ignore[arg-type]
    return b"".join(chunks)


class _CheckedLayout:
    """Lanes for spans that already nest on every track (a gputrace file, moved through monotone
    maps): all on lane 0, after one check over the whole process; if any two cross, the Chrome
    writer's own layout decides."""

    def __init__(self, sp: Any, rows: list[int], known: bool = False) -> None:
        self.fallback: chrome.Layout | None = None if known or _nested(sp, rows) else chrome.Layout()

    def place(self, tracks: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> list[int]:
        if self.fallback is not None:
            return self.fallback.place(tracks, starts, ends)
        return [0] * len(starts)

    def lanes_used(self, track: int) -> int:
        return self.fallback.lanes_used(track) if self.fallback is not None else 1


def _nested(sp: Any, rows: list[int]) -> bool:
    """Do the spans `rows` nest on each track the way Perfetto reads them (sorted by start, the
    longest first at equal starts; [start, end))?"""
    order = list(rows)
    order.sort(key=sp.end.__getitem__, reverse=True)
    order.sort(key=sp.start.__getitem__)
    stacks: dict[int, list[int]] = {}
    start, end, track = sp.start, sp.end, sp.track
    for i in order:
        st = stacks.get(track[i])
        if st is None:
            st = stacks[track[i]] = []
        s, e = start[i], end[i]
        while st and st[-1] <= s:
            st.pop()
        if st and e > st[-1]:
            return False
        st.append(e)
    return True


def _string_keys(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The metadata as JSON holds it: rank keys as strings."""
    out = {k: v for k, v in meta.items() if k != "base_ns"}
    align = dict(out.get("alignment") or {})
    align["per_rank"] = {str(r): v for r, v in align.get("per_rank", {}).items()}
    out["alignment"] = align
    out["rank_metadata"] = {str(r): v for r, v in (out.get("rank_metadata") or {}).items()}
    return out


def _json_metadata(meta: dict[str, Any], p: Plan) -> dict[str, Any]:
    """The metadata as written into a merged JSON file, with which pid is which rank (the
    reader needs it before it sees any event)."""
    out = _string_keys(meta)
    pid_rank = {str(r + 1): r for r in p.all_ranks if r in p.ranks}
    by_path = {s.path: s for s in p.sources}
    for (path, pid), new in p.pids.items():
        r = next((rr for pp, rr in by_path[path].foreign if pp == pid), None)
        if r is not None:
            pid_rank[str(new)] = r
    out["pid_rank"] = pid_rank
    out["foreign_pids"] = sorted(p.pids.values())
    return out


def _close(f: Any) -> None:
    """Every event line ends with `,\\n`: the last one's comma becomes the closing `]}`."""
    f.flush()
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(max(size - 2, 0))
    if f.read(2) == b",\n":
        f.seek(size - 2)
        f.write(b"\n]}")
    else:
        f.seek(0, os.SEEK_END)
        f.write(b"]}")
    f.truncate()


@contextlib.contextmanager
def _no_cycle_collection() -> Iterator[None]:
    """Python's cycle collector off while traces are read: parsing a rank allocates ~10^5
    containers, each batch of them sets off a collection, and the older collections walk every
    span's arguments read so far (a tenth to a quarter of a 64-rank load's CPU time, measured). Traces hold
    no reference cycles; `_release_memory` still collects between ranks of a merge."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _release_memory() -> None:
    """Hand one rank's freed objects back to the OS before the next rank is read, so the peak
    stays near one rank's worth instead of growing with every rank."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _merge_perfetto(
    files: list[str],
    out: str,
    align: str,
    align_on: str | None,
    occurrence: int,
    rank_from_filename: bool,
    allow_mixed: bool,
    sel: Selection,
    progress: Progress | None,
) -> dict[str, Any]:
    try:
        from gputrace.trace import perfetto
    except ImportError:
        raise GputraceError("writing Perfetto protobuf needs gputrace.trace.perfetto; write JSON (-o x.json)") from None
    trace = load(
        files,
        align,
        align_on,
        occurrence,
        rank_from_filename,
        allow_mixed,
        sel.ranks,
        sel.steps,
        sel.window,
        sel.step_name,
    )
    if progress:
        progress("done", 1, 1)
    perfetto.write(trace, out)
    return _string_keys(trace.metadata)
