"""Merging: many ranks' traces -> one aligned timeline, in memory (`load`) or on disk (`merge`).

Takes: trace files (gputrace's per-rank files in any registered format: finished, streamed, cut
off by a crash; one merged file; another tool's traces such as torch.profiler's, placed with the
rank they belong to), how to align them (`clock`: the offsets the ranks measured, with drift;
`none`; or the ends of the n-th occurrence of a named collective span), and optionally a
selection (ranks, steps, a time window). Gives: one `Trace` with every rank its own process
(pid = rank + 1) and the alignment applied recorded in its metadata (`load`), or the same
written in the output's format (`merge`: JSON and protobuf rank by rank, memory about one rank's
worth).

Checks before anything is merged, because a wrong merge looks plausible: the same rank twice
(also the same file under two names, or a per-rank file beside a merged file), files of different
runs (their `run_id`) or world sizes, a merged file mixed with per-rank files, a trace that does
not say its rank. Each is a `MergeError` that names the fix; `allow_mixed` turns the run and
world-size checks into notes in the metadata.

The stages, one module each: `sources` (reading and describing files, the checks and the plan),
`select` (selections and their text forms), `place` (alignment maps, moving spans and counters
onto the merged timeline, step windows, the merged metadata), `run` (load, merge, the groups of
files and their reading, here or in the worker processes of `pool`), `spool` (parts kept on disk
for a format that writes them after the last is read).
"""

from __future__ import annotations

from gputrace.merge.place import (
    Context,
    Maps,
    Taken,
    Tally,
    alignment,
    append_part,
    merged_metadata,
    merged_start,
    take,
)
from gputrace.merge.run import Progress, groups, load, merge, read_source
from gputrace.merge.select import EPOCH_MIN_NS, Selection, parse_ranks, parse_steps, parse_window
from gputrace.merge.sources import Plan, Source, describe, describe_header, describe_trace, plan, read_trace
from gputrace.trace.registry import expand

__all__ = [
    "load",
    "merge",
    "expand",
    "parse_ranks",
    "parse_steps",
    "parse_window",
    "read_trace",
    "Selection",
    "EPOCH_MIN_NS",
    "Progress",
    # The stages, for code that merges other inputs the same way (the digest's summary).
    "Source",
    "Plan",
    "Maps",
    "Context",
    "Taken",
    "Tally",
    "describe",
    "describe_header",
    "describe_trace",
    "plan",
    "alignment",
    "merged_start",
    "groups",
    "read_source",
    "take",
    "append_part",
    "merged_metadata",
]
