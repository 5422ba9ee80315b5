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
     "counts": {"steps": 30, "collectives": {"": 30}}}

`stack` is every open span of the rank, outermost first (its threads' host and device stacks
merged by open time). `since_ns` of a host span is its start; of a CUDA span, its host entry
when the recorder keeps one, else when this thread first saw it open (within one period). A
collective is a span marked `collective=True`, or one named like a collective
(`stats.WAIT_NAMES`) and not marked `collective=False`; its `group` is its `group` argument ("" by
default) and its ordinal counts the collectives of that group this rank opened before it, from 0
(Flight Recorder's sequence number): ranks at the same ordinal of a group are in the same
collective. `device` is where the GPU is: the innermost CUDA span whose start event has
completed and whose end event has not (asked with `query()`, safe from another thread; a span
resolved and its event recorded again between two reads can mislead one rewrite). `finished`:
the trace was finished (a save); its stack is what was open then (empty for a clean run, the
hung spans for a run ended by SIGTERM).

Cost on the training thread: the watcher takes the session's and the recorder's locks only by
trying (never waiting; a busy tick is tried again 50 ms later), holds them while it copies lists,
and gives up the interpreter between slices of its work, so a span or a flush waits on it for
well under a millisecond (benchmarks/live.py measures the worst wait and the CPU per rank).
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from gputrace.errors import GputraceError, TraceFormatError
from gputrace.stats import WAIT_NAMES

VERSION = 1
#: A rank's open file in a folder.
RANK_GLOB = "open_rank*.open"
#: How often the watcher looks, at most (a rewrite happens only when something changed).
PERIOD_S = 1.0
#: Device events asked per stream per look (a host far ahead of its GPU leaves many in flight).
MAX_QUERIES = 64
_SLICE = 2048  # pending spans classified between two yields of the interpreter


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
    out: dict[int, OpenState] = {}
    for f in find(paths):
        s = read(f)
        if s.rank in out:
            raise GputraceError(f"two open files of rank {s.rank}: {out[s.rank].path} and {f}")
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
    run), else who waits in which collective for whom, or the first collective (by ordinal, per
    group) where the ranks disagree."""
    if not states:
        return []
    now = time.time_ns() if now_ns is None else now_ns
    if all(s.finished and not s.stack for s in states.values()):
        return []
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
            lines.append(
                f"desync: ranks sit in different collectives; the first where they disagree is collective "
                f"#{first}{label}: {'; '.join(parts)}"
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
                text += " for " + "; ".join(
                    f"{_ranks([r])}, which is {_where(others[r], now, step)}" for r in blockers
                )
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
    """Steps and collectives per group among rows of resolved spans (name ids and args)."""

    __slots__ = ("steps", "groups")

    def __init__(self) -> None:
        self.steps = 0
        self.groups: Counter[str] = Counter()

    def add_rows(self, names: Sequence[str], name_ids: Iterable[int], args: Sequence[Any], step_name: str) -> None:
        per_name = Counter(name_ids)  # C speed: the flush path pays for this one pass only
        marked: Counter[tuple[int, str]] = Counter()
        unmarked: Counter[int] = Counter()
        ids: Any = None
        # Rows with arguments are few (steps, collectives); only they are looked at one by one.
        with_args = list(itertools.compress(range(len(args)), args))
        if with_args:
            ids = name_ids if hasattr(name_ids, "__getitem__") else list(name_ids)
            for i in with_args:
                a = args[i]
                n = ids[i]
                c = a.get("collective")
                if c is not None or "group" in a:
                    unmarked[n] += 1
                    if is_collective(names[n], a):
                        marked[(n, _group(a))] += 1
        for n, k in per_name.items():
            name = names[n]
            if name == step_name:
                self.steps += k
            rest = k - unmarked.get(n, 0)
            if rest and WAIT_NAMES.search(name):
                self.groups[""] += rest
        for (_, g), k in marked.items():
            self.groups[g] += k

    def add_span(self, name: str, args: Any, step_name: str) -> None:
        if name == step_name:
            self.steps += 1
        if is_collective(name, args):
            self.groups[_group(args)] += 1

    def plus(self, other: Counts) -> Counts:
        out = Counts()
        out.steps = self.steps + other.steps
        out.groups = self.groups + other.groups
        return out


class OpenWatcher:
    """The daemon thread that keeps one rank's open file. `session` is the `Session` (its lock,
    config, recorder, run id); `counted` the steps and collectives its streamed chunks held
    (`OpenSink` adds to it)."""

    def __init__(self, session: Any, rec: Any, period_s: float = PERIOD_S) -> None:
        self.session = session
        self.rec = rec
        self.period_s = period_s
        self.written = Counts()  # rows the sinks were given
        self._store_arr: Any = None  # the store's name column last counted, and how far
        self._store_n = 0
        self._store_counts = Counts()
        self._seen: dict[int, tuple[Any, int]] = {}  # id(span) -> (span, first seen epoch ns)
        self._last: bytes | None = None
        self._write_lock = threading.Lock()
        self._stop = threading.Event()
        self._finished = False
        self.path: str | None = None
        self.thread = threading.Thread(target=self._run, name="gputrace-open", daemon=True)
        self.ticks = 0
        self.writes = 0

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        period = self.period_s
        while not self._stop.wait(period):
            if self._finished:
                continue
            try:
                done = self.write()
            except Exception:  # noqa: BLE001 - a status file is never worth the training run
                done = True
            period = self.period_s if done else 0.05

    def rearm(self) -> None:
        """Recording went on after a save: the file is kept again."""
        self._finished = False

    def finish(self) -> None:
        """The trace was finished: the file says so, with what was open then (the training thread
        holds the locks; they are re-entrant)."""
        try:
            self.write(finished=True)
        except Exception:  # noqa: BLE001 - the trace is what counts
            pass
        self._finished = True

    def write(self, finished: bool = False) -> bool:
        """Look, and rewrite the file when what it says changed. False: the locks were busy."""
        with self._write_lock:
            snap = self._snapshot()
            if snap is None:
                return False
            doc = self._document(*snap, finished=finished)
            body = orjson.dumps(doc, option=orjson.OPT_SORT_KEYS)
            self.ticks += 1
            if body == self._last and self.path is not None:
                return True
            from gputrace.dist import rank_info

            rank = rank_info(self.session.config.rank).rank
            out_dir = self.session.config.out_dir
            if not out_dir:
                return True
            path = open_path(out_dir, rank)
            full = dict(doc)
            full.update(self._identity(rank))
            from gputrace.trace.files import atomic_writer

            # Not fsynced: a killed process's page cache survives it; a fsync costs milliseconds.
            with atomic_writer(path, durable=False) as f:
                f.write(orjson.dumps(full))
            self.path, self._last = path, body
            self.writes += 1
            return True

    def _identity(self, rank: int) -> dict[str, Any]:
        from gputrace.dist import rank_info

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

    def _snapshot(self) -> tuple[Counts, list[Any], list[tuple[Any, list[Any]]]] | None:
        """Counts of resolved and pending spans, the pending list and the open stacks, all of one
        moment: the session's lock (a flush between taking rows and handing them to the sinks)
        and the recorder's (a resolve moving pending spans into the store), both only tried."""
        session, rec = self.session, self.rec
        if not session.lock.acquire(blocking=False):
            return None
        try:
            if not rec._lock.acquire(blocking=False):
                return None
            try:
                written = self.written.plus(Counts())
                store = rec.store
                arr = store.name
                if arr is not self._store_arr:  # taken to the sinks: they counted it
                    self._store_arr, self._store_n, self._store_counts = arr, 0, Counts()
                n = len(arr)
                new_ids = arr[self._store_n : n]
                new_args = store.args[self._store_n : n]
                self._store_n = n
                names = store.names
                pending = list(rec.hot.pending)
                stacks = [(st, list(st)) for st in list(rec._stacks) if st]
            finally:
                rec._lock.release()
        finally:
            session.lock.release()
        step = session.config.step_name
        if len(new_ids):
            self._store_counts.add_rows(names, new_ids, new_args, step)
        counts = written.plus(self._store_counts)
        for k in range(0, len(pending), _SLICE):
            if k:
                time.sleep(0)  # let the training thread have the interpreter
            for s in pending[k : k + _SLICE]:
                counts.add_span(s.name, s.args, step)
        return counts, pending, stacks

    def _document(
        self, counts: Counts, pending: list[Any], stacks: list[tuple[Any, list[Any]]], finished: bool
    ) -> dict[str, Any]:
        rec = self.rec
        now = rec.clock.now()
        step_name = self.session.config.step_name
        seen: dict[int, tuple[Any, int]] = {}
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
                        prev = self._seen.get(id(s))
                        since = prev[1] if prev is not None and prev[0] is s else now
                    seen[id(s)] = (s, since)
                opened.append((since, order, depth, s, st))
        self._seen = seen
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
            "finished": finished,
            "step_name": step_name,
            "step": step_ord,
            "stack": out_stack,
            "device": self._device(pending, stacks, now),
            "collective": coll,
            "counts": {"steps": counts.steps, "collectives": dict(counts.groups)},
        }

    def _device(self, pending: list[Any], stacks: list[tuple[Any, list[Any]]], now: int) -> dict[str, Any] | None:
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
        prev = self._seen.get(id(s))
        since = prev[1] if prev is not None and prev[0] is s else now
        self._seen[id(s)] = (s, since)
        return {"name": s.name, "track": st.track.name, "since_ns": since}


def _query(event: Any) -> bool:
    return bool(event.query())


class OpenSink:
    """The open file's part in the stream: counts the steps and collectives of each chunk
    written (their ordinals go on from there) and writes the file last when the trace is
    finished."""

    def __init__(self, watcher: OpenWatcher) -> None:
        self.watcher = watcher

    def add(self, chunk: Any, update: dict[str, Any] | None = None) -> None:
        sp = chunk.spans
        if len(sp.args) and sp.args[0] and sp.args[0].get("unfinished"):
            return  # the open spans at a save (a chunk of their own): still open, counted as such
        self.watcher.written.add_rows(chunk.names, sp.name, sp.args, self.watcher.session.config.step_name)
        self.watcher.rearm()

    def finish(self, header: dict[str, Any]) -> None:
        self.watcher.finish()

    def abandon(self) -> None:
        pass
