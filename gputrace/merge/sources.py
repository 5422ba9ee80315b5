"""Merge's sources: what each input file holds, and the checks of the files against each other.

Takes: trace files of any registered format (`gputrace.trace.registry`): gputrace's per-rank
files (finished, streamed, cut off by a crash), one merged file, or another tool's trace of one
rank. Gives: a `Source` per file (its kind, ranks, their metadata and run ids, world size, where
its times start; from the header alone when the format says the header is complete, else from
the whole trace, which the `Source` keeps), and a checked `Plan`: the sources in output order,
the ranks kept, and the pid and sort index of every other tool's process.

Checks, because a wrong merge looks plausible: the same rank twice (also the same file under two
names, or a per-rank file beside a merged file), files of different runs (`run_id`) or world
sizes, a trace that does not say its rank. Each is a `MergeError` that names the fix;
`allow_mixed` turns the run and world-size checks into notes.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

from gputrace.errors import MergeError, TraceFormatError
from gputrace.merge.select import format_ranks
from gputrace.trace import registry
from gputrace.trace.model import Trace
from gputrace.trace.registry import expand

_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)")

#: In a merged trace that carries another tool's processes, rank R sorts at R * SORT_SLOTS and
#: those processes of rank R right after it (Perfetto orders processes by this index).
SORT_SLOTS = 100


def files_of(paths: Iterable[str | os.PathLike[str]] | str | os.PathLike[str]) -> list[str]:
    """The trace files behind a user's paths (files, directories, globs), each once."""
    if isinstance(paths, (str, os.PathLike)):
        return expand([os.fspath(paths)])
    return expand([os.fspath(p) for p in paths])


def read_trace(path: str, module: str | None = None) -> Trace:
    """One trace file of any registered format, as a `Trace` (no alignment, no checks); `module`:
    its format's module, as `describe` found it (what a worker process needs to read a format
    registered in its parent)."""
    return registry.read(path, module=module)


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
    module: str | None = None  # its format's module (workers read with it)
    #: Where a trace read whole was put aside (`merge.spool`): loads it instead of reading the file
    #: again. Only in the process that described the file.
    stashed: Callable[[], Trace] | None = dataclasses.field(default=None, repr=False, compare=False)


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


def _rank_key(k: Any) -> bool:
    return (type(k) is int and k >= 0) or (isinstance(k, str) and k.isascii() and k.isdigit() and len(k) < 19)


def check_merged(path: str, meta: Mapping[str, Any]) -> None:
    """A merged file's own fields (`pid_rank`, `rank_metadata`, `ranks`, `foreign_pids`,
    `alignment.per_rank`) as merge writes them, else a `TraceFormatError` that says which is
    damaged: merge places ranks by them."""

    def bad(what: str) -> TraceFormatError:
        return TraceFormatError(path, f"a merged trace whose metadata.{what} is damaged")

    table = meta.get("pid_rank")
    if table is not None and not (
        isinstance(table, Mapping) and all(v is None or (type(v) is int and v >= 0) for v in table.values())
    ):
        raise bad("pid_rank")
    rank_meta = meta.get("rank_metadata")
    if rank_meta is not None and not (isinstance(rank_meta, Mapping) and all(_rank_key(k) for k in rank_meta)):
        raise bad("rank_metadata")
    ranks = meta.get("ranks")
    if ranks is not None and not (isinstance(ranks, list) and all(_rank_key(r) for r in ranks)):
        raise bad("ranks")
    foreign = meta.get("foreign_pids")
    if foreign is not None and not (isinstance(foreign, list) and all(isinstance(p, (int, str)) for p in foreign)):
        raise bad("foreign_pids")
    align = meta.get("alignment")
    per = align.get("per_rank") if isinstance(align, Mapping) else None
    if align is not None and not (
        isinstance(align, Mapping) and (per is None or (isinstance(per, Mapping) and all(_rank_key(k) for k in per)))
    ):
        raise bad("alignment")


def describe_header(path: str, header: Mapping[str, Any], rank_from_filename: bool = False) -> Source | None:
    """A gputrace file described from its header alone (None when the header is not enough:
    another tool's trace, whose processes and times are known only from its events)."""
    meta = _mapping(header.get("metadata"))
    info = _mapping(header.get("distributedInfo"))
    base = _int(header.get("baseTimeNanoseconds"))
    world = _int(info.get("world_size", meta.get("world_size")))
    if meta.get("merged"):
        check_merged(path, meta)
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
        check_merged(path, meta)
        ranks_of = merged_ranks(trace)
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


def merged_ranks(trace: Trace) -> list[tuple[int | None, bool]]:
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
    """Describe one file: from its header when its format says the header is complete (a
    finished gputrace JSON file), else from the whole trace, which stays on the `Source` with
    `keep` (read once, not twice)."""
    module = registry.detect(path).module
    header = _complete_header(path)
    src = describe_header(path, header, rank_from_filename) if header is not None else None
    if src is None:
        src = describe_trace(path, read_trace(path, module), rank_from_filename)
        if not keep:
            src.trace = None
    src.module = module
    return src


def _complete_header(path: str) -> dict[str, Any] | None:
    """The file's header when its format can say, without reading the events, that the header
    holds everything the file knows (a format's optional `complete_header(path)`)."""
    try:
        complete = registry.detect(path).capability("complete_header", path)
    except TraceFormatError:
        return None  # reading the whole file says what is missing
    return cast("dict[str, Any] | None", complete(path)) if complete is not None else None


class MixedRunsError(MergeError):
    """Files of different runs or world sizes: `problem` says which, `stale` names the files of
    the earlier run(s), most likely left over from before, and `fix` what to do (a command that
    has no --allow-mixed gives its own: `with_fix`)."""

    FIX = "merge one run at a time, or pass --allow-mixed"

    def __init__(self, problem: str, stale: list[str], fix: str = FIX) -> None:
        self.problem = problem
        self.stale = stale
        self.fix = fix
        super().__init__(f"{problem}{_stale_text(stale)}; {fix}")

    def with_fix(self, fix: str) -> MixedRunsError:
        return MixedRunsError(self.problem, self.stale, fix)

    def __reduce__(self) -> tuple[Any, ...]:  # across a worker process, with its parts
        return (MixedRunsError, (self.problem, self.stale, self.fix))


def _stale_text(stale: list[str]) -> str:
    if not stale:
        return ""
    shown = ", ".join(stale[:4]) + (f" and {len(stale) - 4} more" if len(stale) > 4 else "")
    return f"; {shown} {'is' if len(stale) == 1 else 'are'} of the earlier run (left from before?)"


def _earlier(groups: Mapping[Any, list[Source]]) -> list[str]:
    """The files of every group but the one that started last (by the times the files hold,
    then by when they were written)."""

    def when(src: Source) -> tuple[int, float]:
        try:
            mtime = os.stat(src.path).st_mtime
        except OSError:
            mtime = 0.0
        return (src.start_ns if src.start_ns is not None else -1, mtime)

    latest = max(groups, key=lambda g: max(when(src) for src in groups[g]))
    return sorted({src.path for g, members in groups.items() if g != latest for src in members})


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
            f"{m.path} is already a merged trace (ranks {format_ranks(m.ranks)}); "
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

    def problem(message: str, groups: Mapping[Any, list[Source]] | None = None) -> None:
        if not allow_mixed:
            raise MixedRunsError(message, _earlier(groups) if groups else [])
        notes.append(message)

    runs: dict[str, list[int]] = {}
    run_files: dict[str, list[Source]] = {}
    for s in sources:
        for r, run in s.run_ids.items():
            runs.setdefault(run, []).append(r)
            run_files.setdefault(run, []).append(s)
    if len(runs) > 1:
        desc = "; ".join(
            f"run {run} has rank{'s' if len(rs) > 1 else ''} {format_ranks(rs)} ({owner.get(min(rs), '?')})"
            for run, rs in sorted(runs.items(), key=lambda kv: min(kv[1]))
        )
        problem(f"these files come from different runs: {desc}", run_files)
    worlds: dict[int, list[str]] = {}
    world_files: dict[int, list[Source]] = {}
    for s in sources:
        if s.world_size is not None:
            worlds.setdefault(s.world_size, []).append(s.path)
            world_files.setdefault(s.world_size, []).append(s)
    if len(worlds) > 1:
        desc = "; ".join(f"world size {w} in {', '.join(ps[:3])}" for w, ps in sorted(worlds.items()))
        problem(f"these files come from runs of different sizes: {desc}", world_files)
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
                f"--ranks: no rank {format_ranks(missing)} in these traces (they hold ranks {format_ranks(present)})"
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
