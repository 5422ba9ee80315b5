"""Where every rank is, while it runs and after it hangs: the open file, its writer and reader,
and the verdict in words.

Takes (writing): the session's recorder (its open stacks, its pending spans, its store) and the
chunks a streaming session writes (through `OpenSink`, one of the session's sinks). Gives: beside
the rank's streamed trace, `open_rank{R}.open` (JSON; a name no `trace_rank*` or `digest_rank*`
glob picks up, nor a tool that reads every `*.json` of a folder), rewritten atomically by a
daemon thread (`OpenWatcher`) at most once every `period_s` (1 s) and only when what it says
changed, so that it is right after a hang and after SIGKILL. Without an output directory (no
stream) nothing is written: there is no folder the run is known to write to.

Takes (reading): files, folders and globs. Gives: `read` (one file -> `OpenState`), `find` and
`read_all` (rank -> `OpenState`), `as_json` (what `summary --json` and the viewer show as `open`)
and `verdict` (lines in words: who waits in which collective of which step for whom, or the first
collective where ranks disagree).

The file (version 1)::

    {"gputrace_open": 1, "rank": 2, "world_size": 4, "pid": 123, "hostname": "h", "run_id": "..",
     "written_ns": epoch ns, "finished": false, "step_name": "step",
     "step": 30,                        # ordinal (from 0) of the open step span, or null
     "stack": [{"name": "step", "since_ns": .., "track": "thread 1", "collective": null}, ...],
     "device": {"name": "matmul", "track": "cuda:0 stream 7", "since_ns": ..} or null,
     "collective": {"name": "all_reduce", "group": "", "ordinal": 30, "since_ns": ..} or null,
     "counts": {"steps": 30, "collectives": {"": 30}}}   # as of the last rewrite

`stack` is every open span of the rank, outermost first (its threads' host and device stacks
merged by open time). `since_ns` of a host span is its start; of a CUDA span, its host entry
when the recorder keeps one, else the watcher's look before the one that first saw it open (at
most one period early; so it sorts outside the host spans opened meanwhile). The GPU's position
is dated the same way. A collective is a span marked `collective=True`, or one named like a
collective (`stats.WAIT_NAMES`) and not marked `collective=False`; its `group` is its `group`
argument ("" by default). Its ordinal counts the collectives of that group this rank opened
before it, from 0 (Flight Recorder's sequence number): ranks at the same ordinal of a group are
in the same collective. Resolved and pending spans are counted by name (at C speed), a name
deciding by its first span seen: a name is a collective, or not, for all its spans.
`device` is where the GPU is: the innermost CUDA span whose start event has completed and whose
end event has not (asked with `query()`, safe from another thread; a span
resolved and its event recorded again between two reads can mislead one rewrite). `finished`:
the trace was finished (a save); its stack is what was open then (empty for a clean run, the
hung spans for a run ended by SIGTERM).

Cost on the training thread: the watcher takes the recorder's lock only by trying (never
waiting; a busy look is tried again 10 ms later) and holds it while it copies a few lists; a
flush only hands it the rows it takes (a reference). It counts what it copied afterwards, in
slices, giving the interpreter back between them, and counts a pending list that only grew
since its last look from where it left off; so a span waits on it for well under a millisecond
(benchmarks/live.py measures the worst wait and the CPU per rank).
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
import operator
import os
import socket
import sys
import threading
import time
import warnings
from array import array
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from gputrace.dist import rank_info
from gputrace.errors import GputraceError, GputraceWarning, TraceFormatError
from gputrace.stats import WAIT_NAMES
from gputrace.trace.files import atomic_writer

VERSION = 1
#: A rank's open file in a folder.
RANK_GLOB = "open_rank*.open"
#: How often the watcher looks, at most (a rewrite happens only when something changed).
PERIOD_S = 1.0
#: The verdict calls ranks waiting or in disagreement once each has sat in its innermost span this
#: long (its open file is at most a period old); before that the ranks are moving.
SETTLED_S = 3.0
#: Device events asked per stream per look (a host far ahead of its GPU leaves many in flight).
MAX_QUERIES = 64
_SLICE = 4096  # pending spans counted between two yields of the interpreter
_RECENT = 1024  # pending spans, the last closed, looked at for where the GPU is
_ROWS = 4096  # resolved rows counted between two yields
_STORES = 32  # stores a flush took, counted between two yields


def open_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"open_rank{rank}.open")


def is_open_path(path: str) -> bool:
    base = os.path.basename(path)
    return base.startswith("open_rank") and base.endswith(".open")


def is_collective(name: str, args: Any) -> bool:
    """The rule of this module (see its docstring): marked, or named like one and not unmarked."""
    if args:
        marked = args.get("collective")
        if marked is not None:
            return bool(marked)
    return WAIT_NAMES.search(name) is not None


def _group(args: Any) -> str:
    g = args.get("group") if args else None
    return "" if g is None else str(g)


# ---- reading ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OpenSpan:
    name: str
    since_ns: int
    track: str
    collective: int | None  # its ordinal in its group, when it is a collective


@dataclasses.dataclass(frozen=True)
class OpenState:
    """One rank's open file as read."""

    path: str
    rank: int
    written_ns: int
    finished: bool
    step_name: str
    step: int | None
    stack: tuple[OpenSpan, ...]
    device: dict[str, Any] | None
    collective: dict[str, Any] | None
    hostname: str
    pid: int
    run_id: str | None = None
    world_size: int | None = None


def read(path: str) -> OpenState:
    """One open file, or `TraceFormatError` saying what is wrong with it."""
    try:
        with open(path, "rb") as f:
            doc = orjson.loads(f.read())
    except OSError as e:
        raise GputraceError(f"cannot read {path}: {e.strerror or e}") from None
    except orjson.JSONDecodeError as e:
        raise TraceFormatError(path, f"not an open file (not JSON: {e})") from None
    try:
        if not isinstance(doc, dict) or doc.get("gputrace_open") != VERSION:
            raise ValueError(f"not a gputrace open file of version {VERSION}")
        stack = tuple(
            OpenSpan(str(s["name"]), _int(s["since_ns"]), str(s.get("track", "")), _opt_int(s.get("collective")))
            for s in doc["stack"]
        )
        device = doc.get("device")
        collective = doc.get("collective")
        if device is not None and not (isinstance(device, dict) and isinstance(device.get("name"), str)):
            raise ValueError("device is not an object with a name")
        if collective is not None and not (
            isinstance(collective, dict)
            and isinstance(collective.get("name"), str)
            and _int(collective["ordinal"]) >= 0
        ):
            raise ValueError("collective is not an object with a name and an ordinal")
        return OpenState(
            path,
            _int(doc["rank"]),
            _int(doc["written_ns"]),
            bool(doc.get("finished", False)),
            str(doc.get("step_name", "step")),
            _opt_int(doc.get("step")),
            stack,
            device,
            collective,
            str(doc.get("hostname", "")),
            _int(doc.get("pid", 0)),
            None if doc.get("run_id") is None else str(doc["run_id"]),
            _opt_int(doc.get("world_size")),
        )
    except (KeyError, TypeError, ValueError) as e:
        reason = f"missing field {e}" if isinstance(e, KeyError) else str(e)
        raise TraceFormatError(path, f"not an open file ({reason})") from None


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{v!r} is not an integer")
    return v


def _opt_int(v: Any) -> int | None:
    return None if v is None else _int(v)


def find(paths: Iterable[str]) -> list[str]:
    """The open files among `paths` and in the folders among them (beside a folder's traces)."""
    found: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            found.extend(sorted(glob.glob(os.path.join(p, RANK_GLOB))))
        else:
            directory = os.path.dirname(p) or "."
            if is_open_path(p):
                found.append(p)
            elif os.path.isfile(p):
                # A rank's trace named as a file: its open file beside it, when there is one.
                base = os.path.basename(p)
                if base.startswith("trace_rank"):
                    rank = base[len("trace_rank") :].split(".", 1)[0]
                    if rank.isdigit() and os.path.isfile(open_path(directory, int(rank))):
                        found.append(open_path(directory, int(rank)))
    return list(dict.fromkeys(found))


def read_all(paths: Iterable[str]) -> dict[int, OpenState]:
    """rank -> its open state, from the open files among and beside `paths` (empty when none)."""
    states = [read(f) for f in find(paths)]
    # A folder that held an earlier run: the files of the newest run only (by run id).
    newest = max(states, key=lambda x: x.written_ns, default=None)
    if newest is not None and newest.run_id is not None:
        stale = [x for x in states if x.run_id is not None and x.run_id != newest.run_id]
        if stale:
            warnings.warn(
                f"left out {len(stale)} open file(s) of another run than the newest ({newest.run_id}): "
                f"{', '.join(x.path for x in stale[:3])}{', ...' if len(stale) > 3 else ''}",
                GputraceWarning,
                stacklevel=2,
            )
            states = [x for x in states if x not in stale]
    out: dict[int, OpenState] = {}
    for s in states:
        if s.rank in out:
            raise GputraceError(f"two open files of rank {s.rank}: {out[s.rank].path} and {s.path}")
        out[s.rank] = s
    return dict(sorted(out.items()))


def as_json(states: dict[int, OpenState]) -> dict[str, Any]:
    """rank -> {"step", "stack": [names, outermost first], "since_ns", "device", ...}."""
    out: dict[str, Any] = {}
    for r, s in states.items():
        inner = s.stack[-1] if s.stack else None
        out[str(r)] = {
            "step": s.step,
            "stack": [sp.name for sp in s.stack],
            "since_ns": inner.since_ns if inner is not None else None,
            "stack_since_ns": [sp.since_ns for sp in s.stack],
            "device": s.device,
            "collective": s.collective,
            "finished": s.finished,
            "written_ns": s.written_ns,
        }
    return out


# ---- the verdict ---------------------------------------------------------------------------------


def _ranks(rs: Sequence[int]) -> str:
    rs = sorted(rs)
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {', '.join(map(str, rs))}"


def _clock(ns: int) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ns / 1e9))


def _age(ns: int, now_ns: int) -> str:
    s = max(0, now_ns - ns) / 1e9
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def _of_step(s: OpenState) -> str:
    return f" of {s.step_name} {s.step}" if s.step is not None else ""


def _where(s: OpenState, now_ns: int, step: int | None = None) -> str:
    if not s.stack:
        return "in no span" + (" (finished)" if s.finished else "")
    inner = s.stack[-1]
    of_step = _of_step(s) if s.step != step or step is None else ""
    text = f"in {inner.name}{of_step} since {_clock(inner.since_ns)} ({_age(inner.since_ns, now_ns)})"
    if s.device is not None and s.device.get("name") != inner.name:
        text += f", its GPU in {s.device['name']}"
    return text


def verdict(states: dict[int, OpenState], now_ns: int | None = None) -> list[str]:
    """Where the ranks are, in words: empty when every rank finished with nothing open (a clean
    run); a line a rank while they move (some rank entered its innermost span less than
    `SETTLED_S` ago: each file is up to a period old, so ranks a period apart would seem to
    wait or disagree); once they sit still, who waits in which collective for whom, or the first
    collective (by ordinal, per group) where the ranks disagree."""
    if not states:
        return []
    now = time.time_ns() if now_ns is None else now_ns
    if all(s.finished and not s.stack for s in states.values()):
        return []
    still = all(now - s.stack[-1].since_ns >= SETTLED_S * 1e9 for s in states.values() if s.stack)
    lines = _where_they_are(states, now) if still else [f"{_ranks([r])} is {_where(s, now)}" for r, s in states.items()]
    worlds = {s.world_size for s in states.values()} - {None}
    if len(worlds) == 1:
        missing = sorted(set(range(worlds.pop() or 0)) - set(states))
        if missing:
            lines.append(f"no open file from {_ranks(missing)}: not streaming, or it never started recording")
    return lines


def _where_they_are(states: dict[int, OpenState], now: int) -> list[str]:
    lines: list[str] = []
    in_coll = {r: s for r, s in states.items() if s.collective is not None}
    others = {r: s for r, s in states.items() if s.collective is None}
    # Per group: the ranks at each ordinal, and what they call it.
    groups: dict[str, dict[int, dict[str, list[int]]]] = {}
    for r, s in in_coll.items():
        c = s.collective
        assert c is not None
        groups.setdefault(str(c.get("group", "")), {}).setdefault(int(c["ordinal"]), {}).setdefault(
            str(c["name"]), []
        ).append(r)
    desync = False
    for g, by_ordinal in sorted(groups.items()):
        first = min(by_ordinal)
        names = by_ordinal[first]
        label = f" of group {g}" if g else ""
        if len(names) > 1 or len(by_ordinal) > 1:
            desync = True
            parts = [f"{_ranks(rs)} in {n}" for n, rs in sorted(names.items(), key=lambda kv: min(kv[1]))]
            later = sorted(r for o, ns in by_ordinal.items() if o != first for rs in ns.values() for r in rs)
            if later:
                parts.append(f"{_ranks(later)} already past it, in a later collective")
            at = [states[r] for rs in names.values() for r in rs]
            steps = {s.step for s in at}
            of_step = f" (in {at[0].step_name} {at[0].step})" if len(steps) == 1 and None not in steps else ""
            lines.append(
                f"desync: ranks sit in different collectives; the first where they disagree is collective "
                f"#{first}{label}{of_step}: {'; '.join(parts)}"
            )
    if desync:
        return lines
    if in_coll:
        (g, by_ordinal), *_ = groups.items()
        ordinal, names = next(iter(by_ordinal.items()))
        name = next(iter(names))
        steps = {s.step for s in in_coll.values()}
        step_name = next(iter(in_coll.values())).step_name
        of_step = f" of {step_name} {steps.pop()}" if len(steps) == 1 and None not in steps else ""
        if others:
            blockers = [r for r, s in others.items() if not (s.finished and not s.stack)]
            gone = [r for r, s in others.items() if s.finished and not s.stack]
            step = next(iter(in_coll.values())).step if of_step else None
            text = f"{_ranks(list(in_coll))} wait in {name}{of_step}"
            if blockers:
                text += " for " + "; ".join(f"{_ranks([r])}, which is {_where(others[r], now, step)}" for r in blockers)
            if gone:
                text += f"; {_ranks(gone)} finished"
            lines.append(text)
        else:
            since = min(int(s.collective["since_ns"]) for s in in_coll.values() if s.collective)
            lines.append(
                f"every rank is in {name}{of_step} (collective #{ordinal}) since {_clock(since)} ({_age(since, now)})"
            )
        return lines
    for r, s in others.items():
        lines.append(f"{_ranks([r])} is {_where(s, now)}")
    return lines


def text(states: dict[int, OpenState], now_ns: int | None = None) -> str:
    """The `open` section of the text summary: the verdict, then one line per rank; empty for a
    clean run (every rank finished with nothing open)."""
    lines = verdict(states, now_ns)
    if not lines:
        return ""
    now = time.time_ns() if now_ns is None else now_ns
    written = [s.written_ns for s in states.values()]
    out = [f"open: where each rank is (its open file, written {_clock(min(written))}-{_clock(max(written))})"]
    out += [f"  {line}" for line in lines]
    for r, s in states.items():
        stack = " > ".join(sp.name for sp in s.stack) or "-"
        since = f"  since {_clock(s.stack[-1].since_ns)} ({_age(s.stack[-1].since_ns, now)})" if s.stack else ""
        gpu = f"  gpu: {s.device['name']}" if s.device else ""
        step = f"{s.step_name} {s.step}" if s.step is not None else "no step"
        state = "  (finished)" if s.finished else ""
        out.append(f"  rank {r:<4} {step:<12} {stack}{since}{gpu}{state}")
    return "\n".join(out)


def add_to_json(doc: dict[str, Any], states: dict[int, OpenState], now_ns: int | None = None) -> dict[str, Any]:
    """`doc` (a summary's JSON) with `open` (rank -> where it is) and `open_verdict` (lines)."""
    if states:
        doc["open"] = as_json(states)
        doc["open_verdict"] = verdict(states, now_ns)
    return doc


# ---- writing -------------------------------------------------------------------------------------


class Counts:
    """Steps and collectives per group."""

    __slots__ = ("steps", "groups")

    def __init__(self) -> None:
        self.steps = 0
        self.groups: Counter[str] = Counter()

    def plus(self, other: Counts) -> Counts:
        out = Counts()
        out.steps = self.steps + other.steps
        out.groups = self.groups + other.groups
        return out


_MISSING = object()


class _Kinds:
    """Which spans count (the step, each collective and its group), by name, decided from each
    name's first span seen (its arguments: `is_collective`); and the counting of resolved rows
    (by name id) and pending spans (by name) at C speed, reading no row's arguments one by one
    (a name is a collective, or not, for all its spans, as the name rule of `stats` has it)."""

    def __init__(self, step_name: str, names: Sequence[str]) -> None:
        self.step_name = step_name
        self.names = names  # the name table the ids index
        self.known = 0  # names[:known] are decided or waiting in `unknown`
        self.unknown: set[int] = set()
        self.counted: dict[int, tuple[bool, str | None]] = {}  # id -> (is the step, group if a collective)
        self.by_name: dict[str, tuple[bool, str | None] | None] = {}  # None: does not count
        self.counted_names: dict[str, tuple[bool, str | None]] = {}

    def _decide(self, name: str, args: Any) -> tuple[bool, str | None] | None:
        kind = self.by_name.get(name, _MISSING)
        if kind is _MISSING:
            coll = is_collective(name, args)
            kind = (name == self.step_name, _group(args) if coll else None) if name == self.step_name or coll else None
            self.by_name[name] = kind
            if kind is not None:
                self.counted_names[name] = kind
        return kind  # type: ignore[return-value]

    def count(self, counts: Counts, names: Sequence[str], ids: Any, args: Sequence[Any]) -> None:
        """Rows of resolved spans: `ids` (an array of name ids into `names`) and their `args`."""
        if self.known < len(names):
            self.unknown.update(range(self.known, len(names)))
            self.known = len(names)
        # Name ids below 256 are the ids' low bytes (little-endian): counted by bytes.count.
        low = ids.tobytes()[:: ids.itemsize] if len(names) <= 256 and sys.byteorder == "little" else None
        how_many = low.count if low is not None else ids.count
        for n in [n for n in self.unknown if how_many(n)]:
            self.unknown.discard(n)
            kind = self._decide(names[n], args[ids.index(n)])
            if kind is not None:
                self.counted[n] = kind
        for n, kind in self.counted.items():
            _add(counts, kind, how_many(n))

    def count_spans(self, counts: Counts, spans: list[Any]) -> None:
        """Spans themselves (pending ones): their names listed in C, then counted by name."""
        names = list(map(_NAME, spans))
        for name in set(names).difference(self.by_name):
            self._decide(name, spans[names.index(name)].args)
        for name, kind in self.counted_names.items():
            _add(counts, kind, names.count(name))


_NAME = operator.attrgetter("name")


def _add(counts: Counts, kind: tuple[bool, str | None], k: int) -> None:
    if k:
        if kind[0]:
            counts.steps += k
        if kind[1] is not None:
            counts.groups[kind[1]] += k


class OpenWatcher:
    """The daemon thread that keeps one rank's open file. `session` is the `Session` (its config,
    run id); `rec` its recorder. The ordinals count the spans resolved and taken from the store
    (`count_taken`, called by the session under the recorder's lock as it takes them), those
    still in the store, and those pending."""

    def __init__(self, session: Any, rec: Any, period_s: float = PERIOD_S) -> None:
        self.session = session
        self.rec = rec
        self.period_s = period_s
        self._taken: list[Any] = []  # stores taken since the last look (`count_taken`)
        self._gen = self._gen_counted = 0  # streams begun (`restart`), and the one counted
        self._total = Counts()  # the rows of every store taken
        self._store_arr: Any = None  # the store's name column last counted, how far, and what
        self._store_n = 0
        self._store_counts = Counts()
        self._pending_seen: tuple[Any, int, Any, Counts] | None = None
        self._kinds: _Kinds | None = None
        self._counts_written: dict[str, Any] = {"steps": 0, "collectives": {}}
        self._last_look_ns = rec.clock.now()  # spans first seen open at a look opened after it
        self._seen: dict[Any, tuple[Any, int]] = {}  # id(span) -> (span, first seen epoch ns)
        self._last: bytes | None = None
        self._write_lock = threading.Lock()
        self._stop = threading.Event()
        self._finished = False  # the file as last written says finished
        self.path: str | None = None
        self.thread = threading.Thread(target=self._run, name="gputrace-open", daemon=True)
        self.ticks = 0  # looks made, and how many rewrote the file
        self.writes = 0
        self.cpu_ns = 0  # this thread's CPU time in its looks, all and the longest (benchmarks/live.py)
        self.cpu_max_ns = 0
        self.hold_max_ns = 0  # the longest stretch of it without giving up the interpreter
        self._mark = 0

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """No more looks; a rewrite under way ends first (no temporary file is left behind)."""
        self._stop.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout=5)

    def _run(self) -> None:
        period = self.period_s
        cpu = time.thread_time_ns
        while not self._stop.wait(period):
            t = self._mark = cpu()
            try:
                done = self.write()
            except Exception:  # noqa: BLE001 - a status file is never worth the training run
                done = True
            end = cpu()
            self.hold_max_ns = max(self.hold_max_ns, end - self._mark)
            self.cpu_ns += end - t
            self.cpu_max_ns = max(self.cpu_max_ns, end - t)
            # A busy lock (a flush running) is tried again soon: most of a step is not a flush.
            period = self.period_s if done else min(self.period_s, 0.01)

    def finish(self) -> None:
        """The trace was finished: the file says so, with what was open then (the training thread
        holds the recorder's lock or none; it is re-entrant)."""
        try:
            for _ in range(50):  # another thread's resolve holds the recorder's lock: briefly
                if self.write(finished=True):
                    break
                time.sleep(0.002)
        except Exception:  # noqa: BLE001 - the trace is what counts
            pass

    def write(self, finished: bool = False) -> bool:
        """Look, and rewrite the file when what it says changed. False: the locks were busy."""
        with self._write_lock:
            if finished and not any(list(self.rec._stacks)):
                # A clean end: nothing open, nothing to count (a save pays for no counting).
                doc = {
                    "step_name": self.session.config.step_name,
                    "step": None,
                    "stack": [],
                    "device": None,
                    "collective": None,
                    "counts": self._counts_written,
                }
            else:
                snap = self._snapshot()
                if snap is None:
                    return False
                self._yield()
                doc = self._document(*snap)
                self._counts_written = doc["counts"]
            # What is open, without the running counts (informational: a change in them alone
            # is no reason to write, and a finished file's are those of its last look).
            body = orjson.dumps({**doc, "counts": None}, option=orjson.OPT_SORT_KEYS)
            self.ticks += 1
            # Unchanged: not written again. A finished file stays finished until what is open
            # changes (recording went on after the save).
            if body == self._last and self.path is not None and (self._finished or not finished):
                return True
            doc["finished"] = finished
            self._yield()
            rank = rank_info(self.session.config.rank).rank
            out_dir = self.session.config.out_dir
            if not out_dir:
                return True
            path = open_path(out_dir, rank)
            full = dict(doc)
            full.update(self._identity(rank))
            # Not fsynced: a killed process's page cache survives it; a fsync costs milliseconds.
            with atomic_writer(path, durable=False) as f:
                f.write(orjson.dumps(full))
            self.path, self._last, self._finished = path, body, finished
            self.writes += 1
            return True

    def _identity(self, rank: int) -> dict[str, Any]:
        info = rank_info(self.session.config.rank)
        return {
            "gputrace_open": VERSION,
            "rank": rank,
            "world_size": info.world_size,
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "run_id": self.session.run_id,
            "written_ns": self.rec.clock.now(),
        }

    def count_taken(self, store: Any) -> None:
        """`store`'s rows were just taken from the recorder's store (to be written): the next look
        counts them. The caller holds the recorder's lock, so that no look finds them in neither
        place; keeping references to two of its columns is all the flush pays (they live until
        the next look: at most a period's spans, 16 bytes each)."""
        self._taken.append((store.name, store.args))

    def restart(self) -> None:
        """A new stream (a reset, a new file): its ordinals count from 0 again (the caller holds
        the recorder's lock)."""
        self._taken = []
        self._gen += 1

    def _snapshot(self) -> tuple[Counts, list[Any], list[tuple[Any, list[Any]]]] | None:
        """Counts of resolved and pending spans, the pending list and the open stacks, all of one
        moment: the lists are copied under the recorder's lock (a resolve moves pending spans
        into the store, a flush takes the store's rows), which is only tried; the counting is
        done after, in slices, giving the interpreter back between them."""
        session, rec = self.session, self.rec
        if not rec._lock.acquire(blocking=False):
            return None
        try:
            taken, self._taken = self._taken, []
            gen = self._gen
            store = rec.store
            arr = store.name
            n = len(arr)
            same = arr is self._store_arr and n >= self._store_n
            k = self._store_n if same else 0
            # Not copied here: rows below n stay as they are (a take swaps the columns for new
            # ones, a resolve appends), so they are read after the lock is given back.
            store_args = store.args
            names = store.names
            # The pending list only grows at its end between flushes: what was counted at the last
            # look is not copied again (a look during a hang, or in a run that never flushes).
            held = rec.hot.pending
            seen = self._pending_seen
            m = 0
            if (
                seen is not None
                and held
                and held[0] is seen[0]
                and len(held) >= seen[1]
                and held[seen[1] - 1] is seen[2]
            ):
                m = seen[1]
            new_pending = held[m:]
            recent = held[-_RECENT:]  # where the GPU is: the spans closed last
            pending_now = (held[0], len(held), held[-1]) if held else None
            stacks = [(st, list(st)) for st in list(rec._stacks) if st]
        finally:
            rec._lock.release()
        self._yield()
        step = session.config.step_name
        if gen != self._gen_counted:  # a new stream: what was counted belongs to the last one
            self._gen_counted, self._total = gen, Counts()
            if not same:
                self._store_counts = Counts()
        # The taken rows not counted yet: a flush a step leaves many small stores, counted a
        # batch at a time, each joined into one pair of columns in C (a bytes join, a chain).
        while taken:
            batch = taken[:_STORES]
            del taken[:_STORES]
            part_ids, part_args = [], []
            for t_ids, t_args in batch:
                k0 = 0
                if t_ids is self._store_arr:  # the rows counted while it was the store, then the rest
                    self._total = self._total.plus(self._store_counts)
                    k0, self._store_arr = self._store_n, None
                if len(t_ids) - k0 > _ROWS:  # a large one (flushes far apart): a slice at a time
                    self._count_rows(self._total, names, t_ids, t_args, k0, step)
                    self._yield()
                    continue
                part_ids.append(t_ids[k0:] if k0 else t_ids)
                part_args.append(t_args[k0:] if k0 else t_args)
            if part_ids:
                ids = array("l")
                ids.frombytes(b"".join(map(array.tobytes, part_ids)))
                self._count_rows(self._total, names, ids, list(itertools.chain.from_iterable(part_args)), 0, step)
                del ids
                self._yield()
            # Freed here, a batch at a time, not all at once as the look ends.
            del batch, part_ids, part_args, t_ids, t_args
            self._yield()
        if not same:
            self._store_counts = Counts()
        self._count_rows(self._store_counts, names, arr, store_args, k, step, n)
        self._store_arr, self._store_n = arr, n
        counts = self._total.plus(self._store_counts)
        self._yield()
        counts = counts.plus(self._count_pending(new_pending, m, pending_now, names, step))
        return counts, recent, stacks

    def _kinds_for(self, names: list[str], step: str) -> _Kinds:
        kinds = self._kinds
        if kinds is None or kinds.step_name != step or kinds.names is not names:
            kinds = self._kinds = _Kinds(step, names)
        return kinds

    def _yield(self) -> None:
        """Give the interpreter to the training thread, noting the longest stretch of this
        thread's CPU time without doing so (`hold_max_ns`: what a span can wait on a look)."""
        now = time.thread_time_ns()
        self.hold_max_ns = max(self.hold_max_ns, now - self._mark)
        time.sleep(0)
        self._mark = time.thread_time_ns()

    def _count_rows(
        self, counts: Counts, names: list[str], ids: Any, args: Any, k: int, step: str, n: int | None = None
    ) -> None:
        kinds = self._kinds_for(names, step)
        end = len(ids) if n is None else n
        for i in range(k, end, _ROWS):
            if i > k:
                self._yield()  # let the training thread have the interpreter
            j = min(i + _ROWS, end)
            kinds.count(counts, names, ids[i:j], args[i:j])

    def _count_pending(
        self, new: list[Any], m: int, now: tuple[Any, int, Any] | None, names: list[str], step: str
    ) -> Counts:
        """The pending spans' steps and collectives: those counted at the last look (its first
        `m`, when the list kept them) and the `new` ones."""
        seen = self._pending_seen
        counts = seen[3].plus(Counts()) if m and seen is not None else Counts()
        kinds = self._kinds_for(names, step)
        for i in range(0, len(new), _SLICE):
            if i:
                self._yield()
            kinds.count_spans(counts, new[i : i + _SLICE])
        self._pending_seen = (*now, counts) if now is not None else None
        return counts

    def _document(self, counts: Counts, pending: list[Any], stacks: list[tuple[Any, list[Any]]]) -> dict[str, Any]:
        rec = self.rec
        now = rec.clock.now()
        step_name = self.session.config.step_name
        old, seen = self._seen, {}
        opened: list[tuple[int, int, int, Any, Any]] = []  # (since, stack order, depth, span, stack)
        for order, (st, spans) in enumerate(stacks):
            for depth, s in enumerate(spans):
                if st.device is None:
                    since = rec.clock.to_epoch(s.t0)
                else:
                    entry = getattr(s, "entry", None)
                    if isinstance(entry, int):
                        since = rec.clock.to_epoch(entry)
                    else:
                        # Opened since the last look (no host entry time is kept): the earliest it
                        # can have opened, so that it sorts outside the host spans opened meanwhile.
                        prev = old.get(id(s))
                        since = prev[1] if prev is not None and prev[0] is s else self._last_look_ns
                    seen[id(s)] = (s, since)
                opened.append((since, order, depth, s, st))
        self._seen = seen
        last_look, self._last_look_ns = self._last_look_ns, now
        device = self._device(pending, stacks, old, last_look)
        opened.sort(key=lambda t: (t[0], t[2], t[1]))
        out_stack = []
        step_ord: int | None = None
        steps_open = 0
        group_open: Counter[str] = Counter()
        coll: dict[str, Any] | None = None
        for since, _, _, s, st in opened:
            ordinal = None
            if s.name == step_name:
                step_ord = counts.steps + steps_open
                steps_open += 1
            if is_collective(s.name, s.args):
                g = _group(s.args)
                ordinal = counts.groups[g] + group_open[g]
                group_open[g] += 1
                coll = {"name": s.name, "group": g, "ordinal": ordinal, "since_ns": since}
            out_stack.append({"name": s.name, "since_ns": since, "track": st.track.name, "collective": ordinal})
        return {
            "step_name": step_name,
            "step": step_ord,
            "stack": out_stack,
            "device": device,
            "collective": coll,
            "counts": {"steps": counts.steps, "collectives": dict(counts.groups)},
        }

    def _device(
        self, pending: list[Any], stacks: list[tuple[Any, list[Any]]], old: dict[Any, Any], last_look: int
    ) -> dict[str, Any] | None:
        """The innermost CUDA span the GPU is inside: its start event done, its end not."""
        device = self.rec.device
        if device is None:
            return None
        query = getattr(device, "query", None) or _query
        best: tuple[int, Any, Any] | None = None  # (depth, span, stack)

        def consider(s: Any, st: Any) -> None:
            nonlocal best
            depth = 0
            p = s.parent
            while p is not None:
                depth += 1
                p = p.parent
            if best is None or depth > best[0]:
                best = (depth, s, st)

        asked: Counter[int] = Counter()
        # Pending spans, newest first: on one stream their end events complete in this order, so
        # the first done end ends the stream's look.
        done_streams: set[int] = set()
        for s in reversed(pending):
            st = getattr(s, "stack", None)
            if st is None or st.device is None or id(st) in done_streams:
                continue
            if asked[id(st)] >= MAX_QUERIES:
                continue
            asked[id(st)] += 1
            if query(s.t1):
                done_streams.add(id(st))
                continue
            if query(s.t0):
                consider(s, st)
        for st, spans in stacks:
            if st.device is None:
                continue
            for s in reversed(spans):  # the innermost open span that has started on the GPU
                if query(s.t0):
                    consider(s, st)
                    break
        if best is None:
            return None
        _, s, st = best
        key = ("device", id(s))
        prev = old.get(key)
        since = prev[1] if prev is not None and prev[0] is s else last_look
        self._seen[key] = (s, since)
        return {"name": s.name, "track": st.track.name, "since_ns": since}


def _query(event: Any) -> bool:
    return bool(event.query())


class OpenSink:
    """The open file's part in the stream: written last when the trace is finished (and again,
    unfinished, by the watcher if recording goes on after that)."""

    def __init__(self, watcher: OpenWatcher) -> None:
        self.watcher = watcher

    def add(self, chunk: Any, update: dict[str, Any] | None = None) -> None:
        pass

    def finish(self, header: dict[str, Any]) -> None:
        self.watcher.finish()

    def abandon(self) -> None:
        pass
