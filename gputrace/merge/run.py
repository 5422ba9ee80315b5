"""Merge's running: files in, one merged trace out, in memory (`load`) or on disk (`merge`).

Takes: the user's paths, how to align, a selection, and for `merge` the output path and format.
Gives: `load` -> one `Trace` (every rank its own process, pid = rank + 1; the alignment in its
metadata); `merge` -> that trace written atomically in the format the registry chooses for the
output (`registry.for_path`), and the merged metadata as written. A format whose module offers a
`MergedWriter` (JSON) is written rank by rank, memory about one rank's worth whatever the number
of ranks; one that offers a `MergedPartsWriter` (protobuf: its file begins with what only the
whole merged trace knows) takes each rank's part, which waits on disk (`merge.spool`) until the
last is read, then writes them one at a time; any other is loaded whole and written with its
writer.

The stages, in order: describe and check the files (`merge.sources`), align them and place each
group of files (a rank's own, then other tools' files of that rank) onto the output
(`merge.place`), here or in worker processes (`merge.pool`) for inputs big enough that reading
dominates. Between ranks freed memory goes back to the OS (`release_memory`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from gputrace.cpus import usable_cpus
from gputrace.errors import GputraceError, MergeError, TraceFormatError
from gputrace.merge.place import (
    Context,
    Maps,
    Taken,
    Tally,
    alignment,
    append_part,
    json_metadata,
    merged_metadata,
    merged_start,
    string_keys,
    take,
)
from gputrace.merge.select import Selection
from gputrace.merge.sources import Plan, Source, describe, files_of, plan, read_trace
from gputrace.merge.spool import Spool
from gputrace.trace import registry
from gputrace.trace.files import atomic_writer
from gputrace.trace.model import Trace

Progress = Callable[[str, int, int], None]  # (what, done, total)
#: A part's event lines, encoded by the output format (`MergedWriter.encoder()`; picklable): its
#: bytes, or its pieces as they are made (written one by one here; joined in a worker).
Encode = Callable[[Trace, "set[int] | frozenset[int]"], "bytes | Iterable[bytes]"]

#: A worker's task holds whole ranks adding up to at least this much input (many small ranks
#: in one task: each task costs a few ms of pickling and bookkeeping).
BATCH_BYTES = 8 << 20
#: Freed memory is handed back to the OS after about this much input (not after every small rank:
#: a collection costs milliseconds).
RELEASE_BYTES = 32 << 20


class _Releaser:
    """`release_memory` once every RELEASE_BYTES of input taken: a full collection a rank would
    make a merge of many small ranks quadratic in them."""

    def __init__(self) -> None:
        self.since = 0

    def took(self, nbytes: int, release: bool = True) -> None:
        self.since += nbytes
        if release and self.since >= RELEASE_BYTES:
            release_memory()
            self.since = 0


#: Inputs smaller than this are read in this process (see `workers_for`).
PARALLEL_MIN_BYTES = 64 << 20


@dataclasses.dataclass
class Job:
    """A checked, aligned merge about to run: the plan, the maps, and the files grouped by rank."""

    plan: Plan
    maps: Maps
    selection: Selection
    start: int
    context: Context
    groups: list[list[Source]]


def prepare(
    files: list[str],
    align: str,
    align_on: str | None,
    occurrence: int,
    rank_from_filename: bool,
    allow_mixed: bool,
    sel: Selection,
    keep: bool,
    stash: Spool | None = None,
) -> Job:
    """Describe, check and align `files` (`keep`: traces read whole stay in memory for placing;
    `stash`: they are put aside there instead, and loaded from it when wanted)."""
    sources = []
    releaser = _Releaser()
    for f in files:
        s = describe(f, rank_from_filename, keep=keep or stash is not None)
        if stash is not None and s.trace is not None and not keep:
            s.stashed = functools.partial(stash.get, stash.put(s.trace))
            s.trace = None
            releaser.took(_file_bytes(f))
        sources.append(s)
    p = plan(sources, allow_mixed, sel.ranks)
    maps = alignment(p, align, align_on, occurrence, _read_and_keep if keep else read_source)
    start = merged_start(p, maps)
    return Job(p, maps, sel, start, Context.make(p, maps, sel, sel.absolute(start)), groups(p))


def groups(p: Plan) -> list[list[Source]]:
    """Sources in output order, a rank's own file together with other tools' files of it (its
    step windows select theirs)."""
    out: list[list[Source]] = []
    by_rank: dict[int | None, list[Source]] = {}
    for s in p.sources:
        key = s.rank if s.kind != "merged" else None
        if key not in by_rank:
            by_rank[key] = []
            out.append(by_rank[key])
        by_rank[key].append(s)
    return out


def _group_label(group: list[Source]) -> str:
    s = group[0]
    return f"rank {s.rank}" if s.kind != "merged" else os.path.basename(s.path)


def read_source(s: Source) -> Trace:
    """The source's trace: the one kept on it or put aside, else read from its file."""
    if s.trace is not None:
        return s.trace
    return s.stashed() if s.stashed is not None else read_trace(s.path, s.module)


def _read_and_keep(s: Source) -> Trace:
    if s.trace is None:
        s.trace = read_trace(s.path, s.module)
    return s.trace


def run_batch(
    batch: list[list[Source]], ctx: Context, out: Trace | None, encode: Encode | None
) -> tuple[Any, list[Taken]]:
    """Groups of files (a rank's own, then other tools' of it) read, mapped and selected into
    `out` (a new trace when None); with `encode`, encoded group by group instead (so memory
    holds one group's trace at a time) and the bytes returned."""
    part = Trace() if out is None else out
    chunks: list[bytes] = []
    results: list[Taken] = []
    for group in batch:
        taken = take_group(group, ctx, part)
        results += taken
        if encode is not None:
            data = encode(part, {p for r in taken for p in r.nested})
            chunks.append(data if isinstance(data, bytes) else b"".join(data))
            part = Trace()
    return (b"".join(chunks) if encode is not None else part), results


def take_group(group: list[Source], ctx: Context, part: Trace) -> list[Taken]:
    """One group's files read and taken into `part`, each file's trace dropped once taken (its
    columns move into an empty `part` rather than being copied)."""
    windows: dict[int, tuple[int, int] | None] = {}  # a rank's step windows, for its other files
    taken = []
    for s in group:
        trace = read_source(s)
        s.trace = None
        taken.append(take(part, s, trace, ctx, windows, consume=True))
        del trace
    return taken


def _encoded_here(group: list[Source], ctx: Context, encode: Encode) -> tuple[bytes | Iterable[bytes], list[Taken]]:
    """One group taken in this process, its event lines as pieces made while they are written
    (memory: the group's trace and one piece)."""
    part = Trace()
    taken = take_group(group, ctx, part)
    return encode(part, {p for r in taken for p in r.nested}), taken


def _task(task: tuple[list[list[Source]], Context, Encode | None]) -> tuple[Any, list[Taken]]:
    """One worker task: a batch run, then this process's freed memory handed back (a task
    holds several MB of input)."""
    try:
        batch, ctx, encode = task
        return run_batch(batch, ctx, None, encode)
    finally:
        release_memory()


def _file_bytes(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _group_bytes(group: list[Source]) -> int:
    total = 0
    for s in group:
        try:
            total += os.path.getsize(s.path)
        except OSError:
            pass
    return total


def run_groups(
    job: Job, out: Trace | None, encode: Encode | None, workers: int, progress: Progress | None
) -> Iterator[tuple[Any, list[Taken]]]:
    """Each group's result in order: here, or in `workers` processes (each reads and converts
    whole ranks, several small ones to a task; at most a few results wait in memory)."""
    all_groups = job.groups
    sizes = [_group_bytes(g) for g in all_groups]
    if workers <= 1 or len(all_groups) < 2:
        releaser = _Releaser()
        for i, g in enumerate(all_groups):
            if progress:
                progress(_group_label(g), i, len(all_groups))
            yield run_batch([g], job.context, out, None) if encode is None else _encoded_here(g, job.context, encode)
            releaser.took(sizes[i], encode is not None)
        return
    for g in all_groups:
        for s in g:
            s.trace = s.stashed = None  # each worker reads its own files
    batches: list[list[int]] = [[]]
    size = 0
    for i in range(len(all_groups)):
        if batches[-1] and size >= BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(i)
        size += sizes[i]

    def tasks() -> Iterator[tuple[list[list[Source]], Context, Encode | None]]:
        for batch in batches:
            gs = [all_groups[i] for i in batch]
            yield gs, job.context.for_group([s for g in gs for s in g]), encode

    from gputrace.merge import pool  # multiprocessing's modules, only when workers are wanted

    # One task beyond one a worker: a worker that finishes ahead of the one whose result is due
    # next starts another, and this process holds at most workers + 1 results (they come back
    # as soon as they are done). Run to its end (not cut short by a zip), the pool then waits
    # for its workers as it closes.
    results = pool.ordered(_task, tasks(), workers, ahead=workers + 1, initializer=gc.disable)
    for k, result in enumerate(results):
        first = batches[k][0]
        if progress:
            progress(_group_label(all_groups[first]), first, len(all_groups))
        yield result


def workers_for(files: list[str], workers: int | None) -> int:
    """Worker processes for reading, when none were asked for: only for inputs big enough that
    reading dominates (below that, starting the workers costs more than they save), and only as
    many as there are idle CPUs. Workers spend about 10% more CPU in all (pickling, a second
    copy of each rank) and win only by using cores that would otherwise idle: on a machine whose
    cores are busy (measured on a shared 2-core box at load average 7: 64 ranks x 40k spans
    loaded 0.4-1.0x the one-process time, merged 1.0-1.2x) they lose."""
    if workers is not None:
        return max(1, workers)
    cpus = usable_cpus()
    if cpus < 2 or len(files) < 4:
        return 1
    if sum(os.path.getsize(f) for f in files if os.path.isfile(f)) < PARALLEL_MIN_BYTES:
        return 1
    try:
        idle = cpus - os.getloadavg()[0]
    except OSError:
        idle = 0.0
    return max(1, min(round(idle), 8)) if idle >= 1.5 else 1


@contextlib.contextmanager
def no_cycle_collection() -> Iterator[None]:
    """Python's cycle collector off while traces are read: parsing a rank allocates ~10^5
    containers, each batch of them sets off a collection, and the older collections walk every
    span's arguments read so far (a tenth to a quarter of a 64-rank load's CPU time, measured).
    Traces hold no reference cycles; `release_memory` still collects between ranks of a merge."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def release_memory() -> None:
    """Hand one rank's freed objects back to the OS before the next rank is read, so the peak
    stays near one rank's worth instead of growing with every rank."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ---- load and merge -----------------------------------------------------------------------------


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
    aligned `Trace` in memory. See `gputrace.merge` for the checks; `Trace.metadata` holds
    "merged": True, "alignment" ({method, per_rank: {rank: {offset_ns, error_ns, drift_ppm?,
    device?, file, notes?}}}), "ranks", "world_size", "run_id" (when known), "rank_metadata",
    "base_ns" (the merged trace's first instant), and "selection" / "notes" when there are any.
    `workers`: processes that read files (None: several only for large inputs)."""
    sel = Selection.make(ranks, steps, window, step_name)
    files = files_of(paths)
    n_workers = workers_for(files, workers)
    with no_cycle_collection():
        job = prepare(files, align, align_on, occurrence, rank_from_filename, allow_mixed, sel, keep=n_workers <= 1)
        out = Trace()
        tally = Tally()
        for part, results in run_groups(job, out if n_workers <= 1 else None, None, n_workers, None):
            if part is not out:
                append_part(out, part)
            tally.add(results)
    out.metadata = merged_metadata(job.plan, job.maps, sel, job.start, job.plan.notes + tally.notes(sel))
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
    """Merge traces into `out` (written atomically); in a format that is written part by part
    (JSON), rank by rank: memory is about one rank's trace and its encoded events (per worker),
    whatever the number of ranks. Returns the merged metadata as written (rank keys as strings),
    plus notes found while writing. `fmt`: a registered format's name (default: by the
    extension of `out`)."""
    sel = Selection.make(ranks, steps, window, step_name)
    out = os.fspath(out)
    kind = registry.for_path(out, fmt)
    files = files_of(paths)
    if os.path.abspath(out) in {os.path.abspath(f) for f in files}:
        raise MergeError(f"{out} is one of the inputs; write the merged trace to another file")
    try:
        writer = kind.capability("MergedWriter")
        parts_writer = kind.capability("MergedPartsWriter") if writer is None else None
    except TraceFormatError as e:
        raise GputraceError(
            f"writing {kind.name} traces needs {kind.module} ({e.reason}); write JSON (-o x.json)"
        ) from None
    if parts_writer is not None or writer is not None:
        m = _Merge(files, out, align, align_on, occurrence, rank_from_filename, allow_mixed, sel, progress)
        with no_cycle_collection():
            if parts_writer is not None:
                return _merge_by_spool(parts_writer, m, workers_for(files, workers))
            return _merge_by_part(writer, m, workers_for(files, workers))
    # A format written whole: the merged trace in memory, then written.
    trace = load(files, align, align_on, occurrence, rank_from_filename, allow_mixed, *_selection_args(sel))
    if progress:
        progress("done", 1, 1)
    kind.write(trace, out)
    return string_keys(trace.metadata)


def _selection_args(sel: Selection) -> tuple[Any, ...]:
    return sel.ranks, sel.steps, sel.window, sel.step_name


@dataclasses.dataclass(frozen=True)
class _Merge:
    """What a merge written part by part was asked: its inputs, output, alignment and selection."""

    files: list[str]
    out: str
    align: str
    align_on: str | None
    occurrence: int
    rank_from_filename: bool
    allow_mixed: bool
    sel: Selection
    progress: Progress | None

    def prepare(self, keep: bool, stash: Spool | None = None) -> Job:
        return prepare(
            self.files, self.align, self.align_on, self.occurrence, self.rank_from_filename, self.allow_mixed,
            self.sel, keep, stash,
        )  # fmt: skip


def _merge_by_part(writer: Any, m: _Merge, n_workers: int) -> dict[str, Any]:
    """The merged trace written group by group through the format's `MergedWriter`."""
    out, sel, progress = m.out, m.sel, m.progress
    job = m.prepare(keep=False)
    meta = merged_metadata(job.plan, job.maps, sel, job.start, list(job.plan.notes))
    header = json_metadata(meta, job.plan)
    tally = Tally()
    with atomic_writer(out) as f:
        w = writer(f, job.start, header, meta["world_size"])
        for data, results in run_groups(job, None, w.encoder(), n_workers, progress):
            for piece in [data] if isinstance(data, bytes) else data:
                w.write(piece)
            del data
            tally.add(results)
        late = tally.notes(sel)  # raises before the file is published when a selection found nothing
        w.close()
    if progress:
        progress("done", len(job.groups), len(job.groups))
    if late:
        header.setdefault("notes", []).extend(late)
    return header


def _merge_by_spool(writer: Any, m: _Merge, n_workers: int) -> dict[str, Any]:
    """The merged trace written through the format's `MergedPartsWriter` (a file that begins with
    what only the whole merged trace knows: protobuf's): each group read and taken, noted by the
    writer and spooled to disk (the last one kept in memory), then the file written from the
    spool a part at a time. Memory: about one group's trace, whatever the number of ranks, and
    every group's counters and other tools' events, which the writer keeps until it closes."""
    files, out, sel, progress = m.files, m.out, m.sel, m.progress
    folder = os.path.dirname(os.path.abspath(out))
    # The spool lies beside the output (as its temporary file does): the folder is made first,
    # and a folder that refuses the spool is the command's one line, as a refused output is.
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise GputraceError(f"cannot write {out}: {e.strerror or e}") from None
    # A file read whole to be described is read once: kept (one file) or put aside on disk
    # (`stash`, when the groups are taken here) until it is taken.
    stash = Spool(folder) if n_workers <= 1 and len(files) > 1 else None
    spool = Spool(folder)
    try:
        job = m.prepare(len(files) == 1, stash)
        tally = Tally()
        # The last group's part is the last result when the groups are taken here (as
        # `run_groups` decides); workers' parts are all spooled.
        here = n_workers <= 1 or len(job.groups) < 2
        with atomic_writer(out) as f:
            w = writer(f)
            k = 0
            releaser = _Releaser()
            # Not `enumerate`: its reused result tuple would hold the part through the next read.
            for part, results in run_groups(job, None, None, n_workers, progress):
                tally.add(results)
                w.note(part)
                last = here and k == len(job.groups) - 1
                spool.add(part, keep=last)
                del part
                releaser.took(_group_bytes(job.groups[k]), not last)
                k += 1
            # Raises before the file is published when a selection found nothing.
            meta = merged_metadata(job.plan, job.maps, sel, job.start, job.plan.notes + tally.notes(sel))
            w.close(meta, spool.parts())
    finally:
        spool.close()
        if stash is not None:
            stash.close()
    if progress:
        progress("done", len(job.groups), len(job.groups))
    return string_keys(meta)
