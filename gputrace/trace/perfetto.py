"""Perfetto protobuf traces (.pftrace): the one reader and the one writer of the format.

Takes: a `Trace` (`write`, `encode`, or `StreamWriter` flush by flush), or a file (`read`: what
these write, also cut off at any byte). Gives: the trace as TracePackets built with the
`perfetto` package's generated protos and serialized by protobuf, or a `Trace`.

A protobuf trace is a sequence of length-delimited packets, so appending is natural: each flush
appends whole packets, and a file cut off anywhere loses only its last, partial packet, which
both Perfetto and `read` drop. What the file holds, packet by packet:

- Sequence 1, the trace's own: gputrace's header (the JSON format's header: base time, rank,
  world size, metadata, plus each process's rank), as Chrome metadata `gputrace` (see
  `_metadata_packet` for why there); a clock snapshot that maps the trace's times to REALTIME,
  so the UI can show wall-clock time; a process track per process (pid = rank + 1 for ranks,
  named like the JSON's `process_name`, in rank order).
- A sequence per written track: each CUDA stream, host thread and overflow lane is a thread
  track with the JSON's pid, tid and name; each counter is a counter track on its process. The
  sequence's first packet (SEQ_INCREMENTAL_STATE_CLEARED) describes the track and sets the
  sequence's defaults: events go to that track, and timestamps are deltas on an incremental
  clock, so an event costs no track id and a few bytes of time. Event names, argument names and
  categories are interned per sequence; every later packet says SEQ_NEEDS_INCREMENTAL_STATE.
- Spans are begin/end track events, arguments debug annotations. Times are ns after the base,
  as the JSON's `ts`, so both formats show the same times.
- Other tools' events that gputrace carries without interpreting them (`Trace.extra`: instants,
  flows) travel as JSON in Chrome metadata `gputrace_extra`: read back, not drawn.

Nesting: Perfetto nests begin/end events by time, and events of one timestamp by their place in
the file, while the JSON importer orders complete events of one timestamp by duration. So the
writer emits each track's events in the order the JSON importer would nest the same spans, and
`Layout` (shared with the JSON writer, so both formats make the same overflow tracks) puts a
streamed span that would open or close at the same instant as a span of an earlier flush on an
overflow lane (`_StreamLayout`).

After the first packets (header, clock, processes), packets travel zlib-compressed in
`compressed_packets` (a flush, or about a megabyte, each), which Perfetto inflates as it reads:
a span takes ~30 bytes as plain packets, a few compressed.

Speed: protobuf's Python messages cost ~0.3 us an object and ~0.1 us a field set. The writer
builds each sequence's events from a few serialized template packets (one per event name),
parsed into a `Trace` message in one call, sets only each packet's timestamp, and serializes the
batch once.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import os
import zlib
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import compress, islice, repeat
from operator import add, gt
from typing import Any, BinaryIO, Protocol

import orjson
from google.protobuf.message import DecodeError
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

from gputrace.errors import TraceFormatError
from gputrace.trace import files
from gputrace.trace.files import AppendFile, atomic_writer, read_bytes
from gputrace.trace.layout import (
    CUDA_TRACK,
    ENTRY_ARG,
    LAUNCH_TRACK,
    Layout,
    ProcessLayout,
    WritePlan,
    clean,
    dumps,
    iter_layout_pieces,
    lane_name,
    launch_at,
    launch_rows,
    nest_in_end_order,
    plan_write,
    process_facts,
    safe_repr,
    update_header,
)
from gputrace.trace.model import CounterColumns, PackedArgs, Process, Trace, Track, _NoCats, intern

_BEGIN = pb.TrackEvent.TYPE_SLICE_BEGIN
_END = pb.TrackEvent.TYPE_SLICE_END
_COUNTER = pb.TrackEvent.TYPE_COUNTER
_INSTANT = pb.TrackEvent.TYPE_INSTANT
_FLOW_MARK = 0x5A5A_F10F_0123_4567  # a flow id's place in a template packet (see `_Encoder._flowed`)
_CLEARED = pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
_NEEDS = pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
_BOOTTIME = pb.ClockSnapshot.Clock.BOOTTIME
_REALTIME = pb.ClockSnapshot.Clock.REALTIME
_DELTA_CLOCK = 64  # the first sequence-scoped clock id; ours counts ns in deltas
_TRACE_SEQ = 1
_BATCH = 4096  # packets parsed and serialized at a time: small batches stay in cache
_CHUNK = 1 << 20  # bytes of packets in one compressed packet
_LEVEL = 1  # zlib's fastest: most of what higher levels save, at a fraction of the time
_SPILL = 1 << 20  # lanes past the layout's, for spans that still cannot nest (never expected)
_WHOLE_MAX = 4 * 16384  # spans of a rank's trace written in one pass; more go piece by piece

#: Chrome metadata names: the whole header (replaces any before it), an update merged into it
#: (streamed clock syncs, run id), and carried events of other tools.
HEADER, UPDATE, EXTRA = "gputrace", "gputrace_update", "gputrace_extra"


# ---- writing ------------------------------------------------------------------------------------


def write(
    trace: Trace,
    path: str,
    base_ns: int | None = None,
    ordered: bool = False,
    meanwhile: Callable[[], object] | None = None,
) -> None:
    """Write the trace to `path` atomically (`ordered` as for the JSON writer); `meanwhile` runs
    first. A large trace of one process in the order its spans ended (a rank's, as a save writes
    it) is written piece by piece, the way a streamed run writes it, so memory stays near the
    spans held; others in one pass, which compresses a small file better."""
    if meanwhile is not None:
        meanwhile()
    if ordered and base_ns is None and len(trace.processes) == 1 and len(trace.spans) > _WHOLE_MAX:
        _write_in_pieces(trace, path)
        return
    with atomic_writer(path) as f:
        for piece in iter_encode(trace, base_ns, ordered):
            f.write(piece)


def _write_in_pieces(trace: Trace, path: str, piece: int = 16384) -> None:
    """A rank's trace as protobuf, written the way a streamed run writes it: piece by piece in
    the order the spans ended, so memory stays near the spans held (the whole-trace writer
    orders each track at once). Atomic: a temporary file renamed over `path` when finished."""
    rng = trace.time_range()
    base = rng[0] if rng else 0
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = files.temp_file(directory)
    os.close(fd)
    info = trace.metadata.get("world_size")
    process = trace.processes[0]
    header = {
        "distributedInfo": {"rank": process.rank, "world_size": info},
        "metadata": {k: v for k, v in trace.metadata.items() if k != "base_ns"},
    }
    try:
        writer = StreamWriter(tmp, base, process, header)
        n = len(trace.spans)
        for lo in range(0, max(n, 1), piece):
            counters = range(len(trace.counters)) if lo == 0 else ()
            writer.append(trace, range(lo, min(lo + piece, n)), counters)
        header["metadata"]["overflow_tracks"] = writer.overflow_tracks()
        writer.finish(header)
        files.publish(tmp, path)  # through the module: a test's check of published files sees it
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def encode(trace: Trace, base_ns: int | None = None, ordered: bool = False) -> bytes:
    """The whole trace as protobuf bytes (for small traces and tests)."""
    return b"".join(iter_encode(trace, base_ns, ordered))


def iter_encode(trace: Trace, base_ns: int | None = None, ordered: bool = False) -> Iterator[bytes]:
    """The whole trace in pieces of whole packets (memory: one batch of packets at a time beyond
    the columns, the layout and each track's span order)."""
    # The same base, pids, tids and lanes as the JSON writer (its tracks' descriptions aside).
    plan = plan_write(trace, base_ns, ordered, writer=ProcessLayout)
    base_ns, pid_of, pieces = plan.base_ns, plan.pid_of, plan.pieces
    enc = _Encoder(base_ns)
    yield _head(enc, _header(plan, trace.processes), trace.processes, pid_of)
    # Each written track's spans, in the order the JSON writer lays them out (its tids too).
    groups = _track_rows(trace, pieces)
    # The pieces' rows and lanes are the groups' now: let them go before the events are made.
    del plan, pieces
    out = _Out()
    yield from _encode_tracks(enc, trace, groups, out)
    enc.counters(trace, range(len(trace.counters)), pid_of, out)
    for k in range(0, len(trace.extra), 10_000):
        out.append(_serialize([_metadata_packet(EXTRA, _extra_json(trace, pid_of, k, k + 10_000))]))
    out.end()
    yield out.take()


def _header(plan: WritePlan[ProcessLayout], processes: Sequence[Process]) -> dict[str, Any]:
    """gputrace's header of a whole trace (as the JSON format's header), with each process's facts."""
    info = {k: v for k, v in (("rank", plan.rank), ("world_size", plan.world_size)) if v is not None}
    header = {"baseTimeNanoseconds": plan.base_ns, "distributedInfo": info, "metadata": plan.metadata}
    header["processes"] = process_facts(processes, plan.pid_of)
    return header


def _head(enc: _Encoder, header: dict[str, Any], processes: Sequence[Process], pid_of: dict[int, int]) -> bytes:
    """The file's first packets: the header, the clock, the processes in their sort order."""
    head = [_metadata_packet(HEADER, header), enc.clock_packet()]
    order = sorted(range(len(processes)), key=lambda i: (_sort_key(processes[i]), i))
    head += [_process_packet(pid_of[i], processes[i]) for i in order]
    return _serialize(head)


def _track_rows(
    trace: Trace, pieces: Iterable[tuple[ProcessLayout, Sequence[int], list[int]]]
) -> dict[ProcessLayout, dict[int, array[int]]]:
    """The laid-out pieces' rows grouped by written track ((track << 24) | lane), per process, in
    the order the JSON writer meets them; tids are given in that order."""
    sp = trace.spans
    groups: dict[ProcessLayout, dict[int, array[int]]] = {}
    for w, rows, lanes in pieces:
        g = groups.setdefault(w, {})
        keys = [(t << 24) | k for t, k in zip([sp.track[r] for r in rows], lanes)]
        if sp.entry is not None and launch_rows(sp.entry, rows):
            w.launch_tid([])  # asked where the JSON writer asks it: the same tids
        for key in dict.fromkeys(keys):
            if key not in g:
                w.tid(trace, key >> 24, key & 0xFFFFFF, [])  # tids in the JSON writer's order
                g[key] = array("q")  # 8 bytes a row: a save needs little beyond the spans
        if len(g) == 1:
            g[keys[0]].extend(rows)
        else:
            for r, key in zip(rows, keys):
                g[key].append(r)
    return groups


def _laid_out_rows(trace: Trace, writers: dict[int, ProcessLayout]) -> dict[ProcessLayout, dict[int, array[int]]]:
    """`_track_rows` of `iter_layout_pieces`: the same groups, tids given in the same order. A
    written track that is the whole of its track (every span on its lane 0, the usual case) is
    that track's rows as the layout ordered them, not a copy; lanes are kept per span only for
    tracks where one is not 0."""
    sp = trace.spans
    track_col = sp.track
    rows_of: dict[int, array[int]] = {}
    lanes_of: dict[int, array[int]] = {}  # track -> each row's lane, in `rows_of` order
    placed: dict[int, int] = {}  # track -> rows laid out so far
    groups: dict[ProcessLayout, dict[int, Any]] = {}
    for w, rows, lanes in iter_layout_pieces(trace, writers, track_rows=rows_of):
        g = groups.setdefault(w, {})
        tracks = [track_col[r] for r in rows]
        if sp.entry is not None and launch_rows(sp.entry, rows):
            w.launch_tid([])  # asked where the JSON writer asks it: the same tids
        if any(lanes):
            for t, k in zip(tracks, lanes):
                key = (t << 24) | k
                if key not in g:
                    w.tid(trace, t, k, [])  # tids in the JSON writer's order
                    g[key] = None
                la = lanes_of.get(t)
                if la is None and k:
                    la = lanes_of[t] = array("q", bytes(8 * placed.get(t, 0)))
                if la is not None:
                    la.append(k)
                placed[t] = placed.get(t, 0) + 1
        else:
            for t, n in Counter(tracks).items():  # tracks in the order the piece meets them
                if t << 24 not in g:
                    w.tid(trace, t, 0, [])
                    g[t << 24] = None
                if t in lanes_of:
                    lanes_of[t].extend(array("q", bytes(8 * n)))
                placed[t] = placed.get(t, 0) + n
    for g in groups.values():
        for key in g:
            t, k = key >> 24, key & 0xFFFFFF
            la = lanes_of.get(t)
            g[key] = rows_of[t] if la is None else array("q", compress(rows_of[t], map(k.__eq__, la)))
    return groups


def _encode_tracks(
    enc: _Encoder, trace: Trace, groups: dict[ProcessLayout, dict[int, array[int]]], out: _Out
) -> Iterator[bytes]:
    """Each written track's events into `out`; what it has compressed is given back after each
    track (the rest stays in `out` for what follows)."""
    cats = any(c is not None for c in trace.spans.cat)
    for w, g in groups.items():
        for key, rows in g.items():
            enc.track(trace, w, key >> 24, key & 0xFFFFFF, rows, cats, out)
            out.track_end()
            if out.ready:
                yield out.take()
        g.clear()


class _Parts(Protocol):
    """Where the encoder puts serialized packets: a list, or `_Out`."""

    def append(self, part: bytes, /) -> None: ...


class _Out:
    """Serialized packets compressed as they come, into the same compressed packets as a list of
    them given to `_compressed` after each track once it held `_CHUNK` bytes (and at the end):
    a compressed packet closes when its parts reach `_CHUNK` bytes, and at the end of a track
    once the parts since the last such point do. So a track of any length holds a chunk of
    packets, not all of its own, and the file's bytes are the same."""

    def __init__(self) -> None:
        self.group: list[bytes] = []
        self.size = 0  # bytes in `group`
        self.since = 0  # bytes appended since everything was last compressed
        self.ready: list[bytes] = []  # serialized compressed packets, not yet taken

    def append(self, part: bytes) -> None:
        self.group.append(part)
        self.size += len(part)
        self.since += len(part)
        if self.size >= _CHUNK:
            self._close()

    def _close(self) -> None:
        packet = pb.TracePacket(compressed_packets=zlib.compress(b"".join(self.group), _LEVEL))
        self.ready.append(_serialize([packet]))
        self.group, self.size = [], 0

    def track_end(self) -> None:
        if self.since >= _CHUNK:
            self.end()

    def end(self) -> None:
        """Everything appended so far compressed."""
        if self.group:
            self._close()
        self.since = 0

    def take(self) -> bytes:
        data = b"".join(self.ready)
        self.ready.clear()
        return data


class MergedPartsWriter:
    """A merged trace written part by part (a part: one or more ranks' `Trace`, in the merged
    trace's order), the same bytes as `write` of the whole merged trace.

    The file begins with what only the whole trace knows: its base (the first instant of every
    part, which every track's first time counts from), every process, the notes found while
    merging. So each part is first `note`d (its processes, names, first instant, and its counter
    samples and other tools' events, taken out of it: they go last in the file), then `close`
    writes the header and encodes the parts again given in the same order, one at a time, and
    the counters and other events after them. Memory: one part's columns, each of its tracks'
    rows in the order the layout and the encoder walk them (8 bytes a span), and a batch of
    events (`_Encoder.track`)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.processes: list[Process] = []
        self.names: list[str] = []
        self._name_index: dict[str, int] = {}
        self.counters = Trace()  # every part's counter tracks (processes: global indices) and samples
        self.extra: list[dict[str, Any]] = []
        self._first: int | None = None  # the first instant over spans, counters, other events
        self._entry: int | None = None  # the least host entry (not 0) of any span

    def note(self, part: Trace) -> None:
        """What the file's beginning needs from `part`; its counters and other events move here."""
        p0 = len(self.processes)
        self.processes += part.processes
        for name in part.names:
            intern(self.names, self._name_index, name)
        firsts = [] if self._first is None else [self._first]
        if len(part.spans):
            firsts.append(min(part.spans.start))
        entry = part.spans.entry
        if entry is not None and len(entry):
            least = min(filter(None, entry), default=0)  # filter(None): at C speed, past the zeros
            if least:
                self._entry = least if self._entry is None else min(self._entry, least)
        c = part.counters
        if len(c):
            firsts.append(min(c.ts))
            moved: dict[int, int] = {}
            for t in dict.fromkeys(c.track):
                track = part.tracks[t]
                moved[t] = self.counters.add_track(dataclasses.replace(track, process=p0 + track.process))
            self.counters.counters.track.extend(array("l", map(moved.__getitem__, c.track)))
            self.counters.counters.ts.extend(c.ts)
            self.counters.counters.value.extend(c.value)
            part.counters = CounterColumns()
        for e in part.extra:
            firsts.append(e["ts_ns"])
            e["process"] += p0
        self.extra += part.extra
        part.extra = []
        self._first = min(firsts) if firsts else None

    def base_ns(self, metadata: dict[str, Any]) -> int:
        """The base `write` takes for the whole trace: its first instant, or the first host entry
        where that is earlier (the launch arrows start there)."""
        if self._first is None:
            return int(metadata.get("base_ns", 0) or 0)
        if self._entry is not None and 0 < self._entry < self._first:
            return self._entry
        return self._first

    def close(self, metadata: dict[str, Any], parts: Iterable[Trace]) -> None:
        """The file: the header (`metadata`: the merged trace's), then `parts` (every part noted,
        in the same order, each dropped once written), then the counters and other events."""
        whole = Trace(metadata)  # the merged trace's processes, for the whole writer's plan
        whole.processes = self.processes
        plan = plan_write(whole, self.base_ns(metadata), writer=ProcessLayout)
        pid_of, writers = plan.pid_of, plan.writers
        enc = _Encoder(plan.base_ns)
        self.f.write(_head(enc, _header(plan, self.processes), self.processes, pid_of))
        out = _Out()
        p0 = 0
        for part in parts:
            n = len(part.processes)
            remap = array("l", [self._name_index[name] for name in part.names])
            sp = part.spans
            if list(remap) != list(range(len(remap))):
                sp.name = array("l", map(remap.__getitem__, sp.name))
            part.names = self.names
            groups = _laid_out_rows(part, {i: writers[p0 + i] for i in range(n)})
            for data in _encode_tracks(enc, part, groups, out):
                self.f.write(data)
            del part, groups, sp
            p0 += n
        counters = self.counters
        counters.processes = self.processes
        enc.counters(counters, range(len(counters.counters)), pid_of, out)
        holder = Trace()
        holder.extra = self.extra
        for k in range(0, len(self.extra), 10_000):
            out.append(_serialize([_metadata_packet(EXTRA, _extra_json(holder, pid_of, k, k + 10_000))]))
        out.end()
        self.f.write(out.take())


def _compressed(parts: list[bytes]) -> bytes:
    """Whole packets (serialized `Trace` messages) as compressed packets of about `_CHUNK` bytes
    each: Perfetto inflates them and reads what they hold as if it were written out. Protobuf
    events of a trace compress well (a few bytes each), so files stay small for long runs."""
    packets = []
    group: list[bytes] = []
    size = 0
    for i, part in enumerate(parts):
        group.append(part)
        size += len(part)
        if size >= _CHUNK or i == len(parts) - 1:
            packets.append(pb.TracePacket(compressed_packets=zlib.compress(b"".join(group), _LEVEL)))
            group, size = [], 0
    return _serialize(packets)


def _sort_key(p: Process) -> int:
    return p.sort_index if isinstance(p.sort_index, int) else 1 << 30


def _extra_json(trace: Trace, pid_of: dict[int, int], lo: int, hi: int) -> list[dict[str, Any]]:
    out = []
    for e in trace.extra[lo:hi]:
        ev = {k: v for k, v in e.items() if k != "process"}
        ev["pid"] = pid_of[e["process"]]
        out.append(ev)
    return out


def _serialize(packets: list[pb.TracePacket]) -> bytes:
    data: bytes = pb.Trace(packet=packets).SerializeToString()
    return data


def _metadata_packet(name: str, value: Any) -> pb.TracePacket:
    """gputrace's header as Chrome metadata: a JSON string under a name gputrace owns. Perfetto
    keeps it in its `metadata` table (`cr-gputrace`, shown in the UI's trace info) and writes it
    back into the JSON it exports, no event or track is made from it, and appending one more
    updates the header in a file that is only ever appended to."""
    p = pb.TracePacket(trusted_packet_sequence_id=_TRACE_SEQ)
    p.chrome_events.metadata.add(name=name, json_value=dumps(value).decode())
    return p


def _process_packet(pid: int, process: Process) -> pb.TracePacket:
    p = pb.TracePacket(trusted_packet_sequence_id=_TRACE_SEQ)
    d = p.track_descriptor
    d.uuid = _uuid(pid)
    d.process.pid = pid
    d.process.process_name = _text(process.label)
    if isinstance(process.sort_index, int) and -(1 << 31) <= process.sort_index < 1 << 31:
        d.process.legacy_sort_index = process.sort_index  # what the JSON's process_sort_index is
    return p


def _uuid(pid: int, low: int = 0) -> int:
    # Unique in the file; derived from pid and tid so that the same track keeps its uuid.
    return (pid << 32) | low


def _text(s: str) -> str:
    """A string protobuf accepts (valid UTF-8: lone surrogates replaced)."""
    try:
        s.encode()
        return s
    except UnicodeEncodeError:
        return s.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


class _Lane:
    """A written track's sequence: its id and track, the names interned on it, the incremental
    clock's value (ns after the base; None before the first snapshot), and the packets it reuses."""

    __slots__ = ("seq", "uuid", "last", "names", "keys", "cats", "begin", "end", "flowed")

    def __init__(self, seq: int, uuid: int) -> None:
        self.seq = seq
        self.uuid = uuid
        self.last: int | None = None
        self.names: set[int] = set()
        self.keys: set[int] = set()
        self.cats: set[int] = set()
        self.begin: dict[int, bytes] = {}  # name iid -> a serialized one-packet Trace
        self.end = _serialize([_event(seq, _END)])
        self.flowed: dict[tuple[int, int], tuple[bytes, bytes]] = {}  # see _Encoder._flowed


def _event(seq: int, kind: int, name_iid: int = 0) -> pb.TracePacket:
    te = pb.TrackEvent(type=kind, name_iid=name_iid) if name_iid else pb.TrackEvent(type=kind)
    return pb.TracePacket(trusted_packet_sequence_id=seq, sequence_flags=_NEEDS, track_event=te)


class _Encoder:
    """Packets for one file: sequences, interned strings (one iid per string in the file, so a
    string keeps its iid on every sequence and across flushes) and the timestamps' clock."""

    def __init__(self, base_ns: int) -> None:
        self.base = base_ns
        self.next_seq = _TRACE_SEQ + 1
        self.lanes: dict[tuple[int, int, int], _Lane] = {}  # (pid, track, lane) -> sequence
        self.counter_lanes: dict[tuple[int, str], _Lane] = {}
        self.name_iid: dict[str, int] = {}
        self.key_iid: dict[str, int] = {}
        self.cat_iid: dict[str, int] = {}
        self.spilled: dict[tuple[int, int], int] = {}  # (pid, track) -> spill lanes made

    def clock_packet(self) -> pb.TracePacket:
        p = pb.TracePacket(trusted_packet_sequence_id=_TRACE_SEQ)
        p.clock_snapshot.clocks.add(clock_id=_BOOTTIME, timestamp=0)
        p.clock_snapshot.clocks.add(clock_id=_REALTIME, timestamp=max(self.base, 0))
        return p

    def _new_lane(self, descriptor: pb.TrackDescriptor, out: _Parts) -> _Lane:
        lane = _Lane(self.next_seq, descriptor.uuid)
        self.next_seq += 1
        p = pb.TracePacket(trusted_packet_sequence_id=lane.seq, sequence_flags=_CLEARED)
        p.track_descriptor.CopyFrom(descriptor)
        p.trace_packet_defaults.timestamp_clock_id = _DELTA_CLOCK
        p.trace_packet_defaults.track_event_defaults.track_uuid = lane.uuid
        out.append(_serialize([p]))
        return lane

    def _clock_reset(self, lane: _Lane) -> bytes:
        """The sequence's clock back to 0 (= the base), so the next delta is an absolute time: a
        later flush can hold events earlier than the last one written (a parent after its
        children). Both clocks stay monotonic: every snapshot is (0, 0)."""
        p = pb.TracePacket(trusted_packet_sequence_id=lane.seq)
        p.clock_snapshot.clocks.add(clock_id=_DELTA_CLOCK, timestamp=0, is_incremental=True)
        p.clock_snapshot.clocks.add(clock_id=_BOOTTIME, timestamp=0)
        lane.last = 0
        return _serialize([p])

    def _deltas(self, lane: _Lane, times: list[int], out: _Parts) -> list[int]:
        """Timestamps (epoch ns, ascending) as deltas on the lane's clock, resetting it first when
        they begin before its last value."""
        first = times[0] - self.base
        if first < 0:
            raise ValueError("a span or counter sample lies before the trace's base")
        if lane.last is None or first < lane.last:
            out.append(self._clock_reset(lane))
        prev = lane.last + self.base  # type: ignore[operator]
        deltas = [t - p for p, t in zip([prev, *times], times)]
        lane.last = times[-1] - self.base
        return deltas

    def _intern(self, lane: _Lane, names: list[tuple[int, str]], keys: list[tuple[int, str]], cats: Any) -> bytes:
        p = pb.TracePacket(trusted_packet_sequence_id=lane.seq, sequence_flags=_NEEDS)
        d = p.interned_data
        for iid, s in names:
            d.event_names.add(iid=iid, name=s)
        for iid, s in keys:
            d.debug_annotation_names.add(iid=iid, name=s)
        for iid, s in cats:
            d.event_categories.add(iid=iid, name=s)
        return _serialize([p])

    def _iid(self, table: dict[str, int], s: str) -> int:
        i = table.get(s)
        if i is None:
            i = table[s] = len(table) + 1
        return i

    def thread_lane(self, trace: Trace, w: ProcessLayout, track: int, k: int, out: _Parts) -> _Lane:
        key = (w.pid, track, k)
        lane = self.lanes.get(key)
        if lane is None:
            tid = w.tid(trace, track, k, [])
            name = trace.tracks[track].name
            if k >= _SPILL:
                name = f"{name} (overflow {w.layout.lanes_used(track) + k - _SPILL})"
            else:
                name = lane_name(trace.tracks[track], k)  # as the JSON writer names it
            d = pb.TrackDescriptor(uuid=_uuid(w.pid, tid), parent_uuid=_uuid(w.pid))
            d.thread.pid = w.pid
            d.thread.tid = tid
            d.thread.thread_name = _text(name)
            lane = self.lanes[key] = self._new_lane(d, out)
        return lane

    def spans(
        self, trace: Trace, w: ProcessLayout, track: int, k: int, rows: Sequence[int], cats: bool, out: _Parts
    ) -> None:
        """The begin/end events of `rows` (spans of one written track, in the JSON writer's
        order) appended to `out`, after the track's descriptor if it is new. Spans that cannot
        nest there (the layout lets none through; this is a guard) go to a further lane."""
        lane = self.thread_lane(trace, w, track, k, out)
        sp = trace.spans
        start, end, name_col, args_col, cat_col = sp.start, sp.end, sp.name, sp.args, sp.cat
        # The JSON importer nests spans of one track by start, the longer first, then by their
        # place in the file: the same order here gives the same slices the same parents. Times
        # are ns after the base from here on.
        base = self.base
        S = [start[r] - base for r in rows]
        E = [end[r] - base for r in rows]
        if min(S) < 0:
            raise ValueError("a span starts before the trace's base")
        order = sorted(range(len(rows)), key=[(s << 64) - (e - s) for s, e in zip(S, E)].__getitem__)
        rows = [rows[i] for i in order]
        S = [S[i] for i in order]
        # Ends as 2*end, +1 for a zero-length span: an open span closes before a span at s when
        # its end*2 <= s*2, i.e. when it ended before s or at s, unless both are zero-length at
        # s (those stack, like instants), as the JSON importer closes them.
        E = [(E[i] << 1) | (E[i] == s) for i, s in zip(order, S)]
        names = [name_col[r] for r in rows]
        templates = self._begin_templates(lane, trace.names, set(names), out)
        T = [templates[n] for n in names]
        if cats:
            A: list[Any] = [(args_col[r], cat_col[r]) if args_col[r] or cat_col[r] is not None else None for r in rows]
        else:
            A = [args_col[r] for r in rows]
        reset = lane.last is None or S[0] < lane.last
        prev = 0 if reset or lane.last is None else lane.last
        end_t = lane.end
        parts: list[bytes] = []
        deltas: list[int] = []
        fixes: list[tuple[int, Any]] = []
        spill: list[int] = []
        stack: list[int] = []  # the open spans' ends, as in E
        begins: list[int] = []  # per row written here (not spilled), its begin packet's place in parts
        part, delta = parts.append, deltas.append
        for s, e2, t, a, r in zip(S, E, T, A, rows):
            s2 = s << 1
            while stack and stack[-1] <= s2:
                v = stack.pop() >> 1
                delta(v - prev)
                prev = v
                part(end_t)
            if stack and e2 > stack[-1]:
                spill.append(r)  # it would cross the open span
                continue
            stack.append(e2)
            delta(s - prev)
            prev = s
            if a:
                fixes.append((len(parts), a))
            begins.append(len(parts))
            part(t)
        while stack:
            v = stack.pop() >> 1
            delta(v - prev)
            prev = v
            part(end_t)
        if sp.entry is not None and parts:
            for j, flow, iid in self._launches(trace, w, rows, begins, spill, out):
                pre, post = self._flowed(lane, _BEGIN, iid)  # the begin packet that ends the arrow
                parts[j] = pre + flow.to_bytes(8, "little") + post
        if parts:
            if reset:
                out.append(self._clock_reset(lane))
            lane.last = prev
            self._intern_args(lane, fixes, out)
            self._emit(parts, deltas, fixes, out)
        if spill:
            made = self.spilled.get((w.pid, track), 0)
            self.spilled[(w.pid, track)] = made + 1
            self.spans(trace, w, track, _SPILL + made, spill, cats, out)

    def track(
        self, trace: Trace, w: ProcessLayout, track: int, k: int, rows: Sequence[int], cats: bool, out: _Parts
    ) -> None:
        """`spans` for all the spans of a written track at once, whatever their number: the same
        packets, made a batch at a time. The rows are walked twice in the JSON importer's order:
        first for what goes before the events (the names and argument names the track interns,
        the spans that spill, the launch arrows' sources), then for the events themselves. It
        holds the rows in that order, the spilled ones and the arrows' rows and times (8 to 24
        bytes a span, where `spans` holds lists of ~300) and one batch of packets."""
        lane = self.thread_lane(trace, w, track, k, out)
        sp = trace.spans
        start, end, name_col, args_col, cat_col, entry = sp.start, sp.end, sp.name, sp.args, sp.cat, sp.entry
        base = self.base
        order = _start_order(start, end, rows)
        if min(map(start.__getitem__, order)) < base:
            raise ValueError("a span starts before the trace's base")
        templates = self._begin_templates(lane, trace.names, set(map(name_col.__getitem__, order)), out)
        # First walk. Times stay epoch ns here; an end is 2*end, +1 for a zero-length span (see
        # `spans`), which keeps the comparisons of the ns after the base.
        reset = lane.last is None or start[order[0]] - base < lane.last
        spill = array("q")
        keys: dict[str, None] = {}  # argument names, in the order `_intern_args` meets them
        cat_names: dict[str, None] = {}
        arrows = array("q")  # rows written with a host entry, in order
        stack: list[int] = []
        for r in order:
            s = start[r]
            s2 = s << 1
            while stack and stack[-1] <= s2:
                stack.pop()
            e = end[r]
            e2 = (e << 1) | (e == s)
            if stack and e2 > stack[-1]:
                spill.append(r)  # it would cross the open span
                continue
            stack.append(e2)
            a: Any = args_col[r]
            if a:
                for key in a:
                    keys[str(key)] = None
            c = cat_col[r]
            if c is not None:
                cat_names[c] = None
            if entry is not None and entry[r] > 0:
                arrows.append(r)
        flow = self._arrows(trace, w, arrows, out) if arrows else 0
        del arrows
        prev = 0 if reset or lane.last is None else lane.last
        if reset:
            out.append(self._clock_reset(lane))
        fixes: list[tuple[int, Any]] = [(0, (keys, None))] + [(0, (None, c)) for c in cat_names]
        self._intern_args(lane, fixes, out)
        del keys, cat_names, fixes
        # Second walk: the events, a batch at a time.
        prev += base
        end_t = lane.end
        flowed: dict[int, tuple[bytes, bytes]] = {}  # name index -> the begin packet around a flow id
        names = trace.names
        parts: list[bytes] = []
        deltas: list[int] = []
        fixes = []
        part, delta = parts.append, deltas.append
        stack = []
        for r in order:
            s = start[r]
            s2 = s << 1
            while stack and stack[-1] <= s2:
                v = stack.pop() >> 1
                delta(v - prev)
                prev = v
                part(end_t)
            e = end[r]
            e2 = (e << 1) | (e == s)
            if stack and e2 > stack[-1]:
                continue
            stack.append(e2)
            delta(s - prev)
            prev = s
            a = args_col[r]
            if cats:
                c = cat_col[r]
                a = (a, c) if a or c is not None else None
            if a:
                fixes.append((len(parts), a))
            n = name_col[r]
            if entry is not None and entry[r] > 0:
                cut = flowed.get(n)
                if cut is None:
                    cut = flowed[n] = self._flowed(lane, _BEGIN, self.name_iid[names[n]])
                part(cut[0] + flow.to_bytes(8, "little") + cut[1])
                flow += 1
            else:
                part(templates[n])
            if len(parts) >= _BATCH:
                self._emit_batch(parts[:_BATCH], deltas[:_BATCH], [f for f in fixes if f[0] < _BATCH], out)
                del parts[:_BATCH], deltas[:_BATCH]
                fixes = [(j - _BATCH, a) for j, a in fixes if j >= _BATCH]
                part, delta = parts.append, deltas.append
        while stack:
            v = stack.pop() >> 1
            delta(v - prev)
            prev = v
            part(end_t)
        self._emit(parts, deltas, fixes, out)
        lane.last = prev - base
        if spill:
            made = self.spilled.get((w.pid, track), 0)
            self.spilled[(w.pid, track)] = made + 1
            self.track(trace, w, track, _SPILL + made, spill, cats, out)

    def _arrows(self, trace: Trace, w: ProcessLayout, rows: array[int], out: _Parts) -> int:
        """`_launches` for `track`: the sources of the launch arrows of `rows` (written spans with
        a host entry, in order) as instants on the process's launch track; gives the first flow
        id (the next row's is one more)."""
        entry, start, name_col = trace.spans.entry, trace.spans.start, trace.spans.name
        assert entry is not None
        first = w.flow_ids(len(rows))
        lane = self.launch_lane(w, out)
        base = self.base
        names = trace.names
        self._names_on(lane, names, set(map(name_col.__getitem__, rows)), out)
        at = array("q", [launch_at(entry[r], start[r], base) for r in rows])
        # In time order, the earlier flow first at equal times (as `_launches` sorts its marks).
        order: Sequence[int] = range(len(rows))
        if any(map(gt, at, islice(at, 1, None))):
            order = array("q", sorted(order, key=at.__getitem__))
        times = at[order[0]]
        if times - base < 0:
            raise ValueError("a span or counter sample lies before the trace's base")
        if lane.last is None or times - base < lane.last:
            out.append(self._clock_reset(lane))
        prev = lane.last + base  # type: ignore[operator]
        if any(entry[r] != t for r, t in zip(rows, at)):
            self._intern_args(lane, [(0, {ENTRY_ARG: 0})], out)
        parts: list[bytes] = []
        deltas: list[int] = []
        fixes: list[tuple[int, Any]] = []
        for i in order:
            r, t = rows[i], at[i]
            pre, post = self._flowed(lane, _INSTANT, self.name_iid[names[name_col[r]]])
            e = entry[r]
            if t != e:  # drawn before the span, not at its entry: the entry itself
                fixes.append((len(parts), {ENTRY_ARG: e}))
            parts.append(pre + (first + i).to_bytes(8, "little") + post)
            deltas.append(t - prev)
            prev = t
            if len(parts) == _BATCH:
                self._emit_batch(parts, deltas, fixes, out)
                parts, deltas, fixes = [], [], []
        if parts:
            self._emit_batch(parts, deltas, fixes, out)
        lane.last = prev - base
        return first

    def _launches(
        self, trace: Trace, w: ProcessLayout, rows: list[int], begins: list[int], spill: list[int], out: _Parts
    ) -> list[tuple[int, int, int]]:
        """The sources of the launch arrows of `rows` (those written, not `spill`ed, with a host
        entry: see layout.py) as instants on the process's launch track, appended to `out`; gives
        (place of the span's begin packet in its parts, flow id, name iid) of each arrow."""
        entry, start, name_col = trace.spans.entry, trace.spans.start, trace.spans.name
        assert entry is not None
        skip = set(spill)
        written = [r for r in rows if r not in skip] if skip else rows
        todo = [(r, b) for r, b in zip(written, begins) if entry[r] > 0]
        if not todo:
            return []
        first = w.flow_ids(len(todo))
        lane = self.launch_lane(w, out)
        base = self.base
        names = trace.names
        iids = self._names_on(lane, names, {name_col[r] for r, _ in todo}, out)
        marks = []
        for k, (r, _) in enumerate(todo):
            e = entry[r]
            at = launch_at(e, start[r], base)
            marks.append((at, first + k, iids[name_col[r]], e if at != e else 0))
        marks.sort()
        deltas = self._deltas(lane, [m[0] for m in marks], out)
        parts: list[bytes] = []
        fixes: list[tuple[int, Any]] = []
        for at, flow, iid, exact in marks:
            pre, post = self._flowed(lane, _INSTANT, iid)
            if exact:  # drawn before the span, not at its entry: the entry itself
                fixes.append((len(parts), {ENTRY_ARG: exact}))
            parts.append(pre + flow.to_bytes(8, "little") + post)
        self._intern_args(lane, fixes, out)
        self._emit(parts, deltas, fixes, out)
        return [(b, first + k, iids[name_col[r]]) for k, (r, b) in enumerate(todo)]

    def _flowed(self, lane: _Lane, kind: int, iid: int) -> tuple[bytes, bytes]:
        """A serialized one-packet `Trace` of an event of `kind` named `iid` on the lane that
        starts (an instant: `flow_ids`) or ends (a begin: `terminating_flow_ids`) one flow, split
        around the flow id's 8 bytes (a fixed64: any id fits the same place)."""
        key = (kind, iid)
        cut = lane.flowed.get(key)
        if cut is None:
            p = _event(lane.seq, kind, iid)
            te = p.track_event
            (te.flow_ids if kind == _INSTANT else te.terminating_flow_ids).append(_FLOW_MARK)
            data = _serialize([p])
            mark = _FLOW_MARK.to_bytes(8, "little")
            at = data.index(mark)
            assert data.count(mark) == 1
            cut = lane.flowed[key] = (data[:at], data[at + 8 :])
        return cut

    def launch_lane(self, w: ProcessLayout, out: _Parts) -> _Lane:
        """The sequence of the process's launch track (new: described into `out` first)."""
        key = (w.pid, -1, 0)
        lane = self.lanes.get(key)
        if lane is None:
            tid = w.launch_tid([])
            d = pb.TrackDescriptor(uuid=_uuid(w.pid, tid), parent_uuid=_uuid(w.pid))
            d.thread.pid = w.pid
            d.thread.tid = tid
            d.thread.thread_name = LAUNCH_TRACK
            lane = self.lanes[key] = self._new_lane(d, out)
        return lane

    def _names_on(self, lane: _Lane, names: list[str], used: set[int], out: _Parts) -> dict[int, int]:
        """Per name index used, its iid, interned on the lane first where new to it."""
        iids: dict[int, int] = {}
        new: list[tuple[int, str]] = []
        for n in used:
            name = names[n]
            iid = self.name_iid.get(name)
            if iid is None:
                iid = self.name_iid[name] = len(self.name_iid) + 1
            if iid not in lane.names:
                lane.names.add(iid)
                new.append((iid, _text(name)))
            iids[n] = iid
        if new:
            out.append(self._intern(lane, sorted(new), [], []))
        return iids

    def _begin_templates(self, lane: _Lane, names: list[str], used: set[int], out: _Parts) -> list[bytes]:
        """Per name index of the trace, the lane's begin packet for it (serialized); names new to
        the lane are interned first."""
        templates = [b""] * len(names)
        new: list[tuple[int, str]] = []
        for n in used:
            name = names[n]
            iid = self.name_iid.get(name)
            if iid is None:
                iid = self.name_iid[name] = len(self.name_iid) + 1
            t = lane.begin.get(iid)
            if t is None:
                t = lane.begin[iid] = _serialize([_event(lane.seq, _BEGIN, iid)])
                new.append((iid, _text(name)))
            templates[n] = t
        if new:
            out.append(self._intern(lane, sorted(new), [], []))
        return templates

    def _intern_args(self, lane: _Lane, fixes: list[tuple[int, Any]], out: _Parts) -> None:
        keys: list[tuple[int, str]] = []
        cats: list[tuple[int, str]] = []
        for _, a in fixes:
            a, cat = a if isinstance(a, tuple) else (a, None)
            for key in a or ():
                i = self._iid(self.key_iid, str(key))
                if i not in lane.keys:
                    lane.keys.add(i)
                    keys.append((i, _text(str(key))))
            if cat is not None:
                i = self._iid(self.cat_iid, cat)
                if i not in lane.cats:
                    lane.cats.add(i)
                    cats.append((i, _text(cat)))
        if keys or cats:
            out.append(self._intern(lane, [], keys, cats))

    def _emit(self, parts: list[bytes], deltas: list[int], fixes: list[tuple[int, Any]], out: _Parts) -> None:
        """Template packets -> one `Trace` message per batch (parsed in one call), each packet's
        timestamp set, arguments added where spans have them, serialized once."""
        f = 0
        for lo in range(0, len(parts), _BATCH):
            hi = min(lo + _BATCH, len(parts))
            mine = []
            while f < len(fixes) and fixes[f][0] < hi:
                mine.append((fixes[f][0] - lo, fixes[f][1]))
                f += 1
            self._emit_batch(parts[lo:hi], deltas[lo:hi], mine, out)

    def _emit_batch(self, parts: list[bytes], deltas: list[int], fixes: list[tuple[int, Any]], out: _Parts) -> None:
        """One batch of `_emit` (`fixes`: places in this batch)."""
        key_iid, cat_iid = self.key_iid, self.cat_iid
        batch = pb.Trace()
        batch.MergeFromString(b"".join(parts))
        packets = batch.packet
        for p, d in zip(packets, deltas):
            p.timestamp = d
        for j, a in fixes:
            a, cat = a if isinstance(a, tuple) else (a, None)
            te = packets[j].track_event
            try:
                _annotate(te, a, key_iid)
            except Exception:  # noqa: BLE001 - a value that cannot be written: its placeholder
                del te.debug_annotations[:]
                _annotate(te, {k: clean(v) for k, v in (a or {}).items()}, key_iid)
            if cat is not None:
                te.category_iids.append(cat_iid[cat])
        out.append(batch.SerializeToString())

    def counters(self, trace: Trace, rows: Sequence[int], pid_of: dict[int, int], out: _Parts) -> None:
        """Counter samples, a sequence per counter track (a counter track on its process)."""
        c = trace.counters
        by_track: dict[int, list[int]] = {}
        for i in rows:
            by_track.setdefault(c.track[i], []).append(i)
        for t, idx in by_track.items():
            track = trace.tracks[t]
            pid = pid_of[track.process]
            key = (pid, track.name)
            lane = self.counter_lanes.get(key)
            if lane is None:
                d = pb.TrackDescriptor(uuid=_uuid(pid, (1 << 31) | len(self.counter_lanes)), parent_uuid=_uuid(pid))
                d.name = _text(track.name)
                if " memory " in track.name:
                    d.counter.unit = pb.CounterDescriptor.UNIT_SIZE_BYTES  # the model's memory is in bytes
                else:
                    d.counter.SetInParent()
                lane = self.counter_lanes[key] = self._new_lane(d, out)
            idx.sort(key=c.ts.__getitem__)
            deltas = self._deltas(lane, [c.ts[i] for i in idx], out)
            batch = pb.Trace()
            for i, d in zip(idx, deltas):
                p = batch.packet.add(trusted_packet_sequence_id=lane.seq, sequence_flags=_NEEDS, timestamp=d)
                te = p.track_event
                te.type = _COUNTER
                v = c.value[i]
                if v.is_integer() and -(2**63) <= v < 2**63:
                    te.counter_value = int(v)
                else:
                    te.double_counter_value = v
            out.append(batch.SerializeToString())


#: Rows whose sort keys are made at a time while checking an order.
_SLICE = 65536


def _start_order(start: Sequence[int], end: Sequence[int], rows: Sequence[int]) -> Sequence[int]:
    """`rows` stably sorted by start, the longer first at equal starts (the JSON importer's order
    of a track's spans): `rows` itself where it is so already (spans that follow each other, as
    a CUDA stream's do), else a new array."""
    last = None
    for lo in range(0, len(rows), _SLICE):
        chunk = rows[lo : lo + _SLICE]
        keys = [(s << 64) - (e - s) for s, e in zip(map(start.__getitem__, chunk), map(end.__getitem__, chunk))]
        if (last is not None and keys[0] < last) or any(map(gt, keys, islice(keys, 1, None))):
            break
        last = keys[-1]
    else:
        return rows
    keys = [(s << 64) - (e - s) for s, e in zip(map(start.__getitem__, rows), map(end.__getitem__, rows))]
    return array("q", map(rows.__getitem__, sorted(range(len(rows)), key=keys.__getitem__)))


def _annotate(te: Any, args: dict[str, Any] | None, key_iid: dict[str, int]) -> None:
    """A span's arguments as its debug annotations."""
    for key, value in (args or {}).items():
        d = te.debug_annotations.add()
        d.name_iid = key_iid[str(key)]
        _set_value(d, value)


def _set_value(a: pb.DebugAnnotation, value: Any) -> None:
    """A JSON-like value as a debug annotation. None is an annotation without a value (Perfetto
    shows none; a JSON `null` would stop its importer), an empty container a nested value of that
    kind, an integer past 64 bits its decimal as JSON text."""
    if isinstance(value, bool):
        a.bool_value = value
    elif isinstance(value, int):
        if -(2**63) <= value < 2**63:
            a.int_value = value
        elif 0 <= value < 2**64:
            a.uint_value = value
        else:
            a.legacy_json_value = str(value)
    elif isinstance(value, float):
        a.double_value = value
    elif isinstance(value, str):
        a.string_value = _text(value)
    elif isinstance(value, dict):
        if not value:
            a.nested_value.nested_type = pb.DebugAnnotation.NestedValue.DICT
        for k, v in value.items():
            e = a.dict_entries.add()
            e.name = _text(str(k))
            _set_value(e, v)
    elif isinstance(value, (list, tuple)):
        if not value:
            a.nested_value.nested_type = pb.DebugAnnotation.NestedValue.ARRAY
        for v in value:
            _set_value(a.array_values.add(), v)
    elif value is not None:
        a.string_value = _text(safe_repr(value))


# ---- streaming ----------------------------------------------------------------------------------


class _StreamLayout(Layout):
    """The JSON writer's layout plus one rule for begin/end events appended flush by flush.

    Perfetto orders events of one timestamp by their place in the file, and an end event closes
    the innermost open slice of its track. A span of a later flush that began where a span of an
    earlier flush on its lane begins would open inside that one, and one that ended where such a
    span begins would close it. Such spans go to an overflow lane. Checking the kept outermost
    spans is enough: a span that fits contains or misses every earlier one, so an earlier span
    starting at its start or end is itself outermost (or inside a joined one, which the span
    could not fit anyway)."""

    fast_path = False  # the general path goes through `fits`; `place` has its own fast path

    def place(self, tracks: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> list[int]:
        """The JSON layout's one pass for spans that come in the order they ended and all nest,
        taken when no span of this piece begins or ends where a kept span begins; else the
        general path."""
        by_track: dict[int, list[int]] = {}
        for i, t in enumerate(tracks):
            by_track.setdefault(t, []).append(i)
        lane = [0] * len(starts)
        slow: list[int] = []
        for t, rows in by_track.items():
            lanes = self._lanes.setdefault(t, [])
            if not lanes:
                lanes.append(([], []))
            ss, es = [starts[i] for i in rows], [ends[i] for i in rows]
            taken = {s for s, e in zip(*lanes[0]) if e > s}
            if taken.isdisjoint(ss) and taken.isdisjoint(es):
                kept = nest_in_end_order(lanes[0], ss, es, self.MAX_KEPT)
                if kept is not None:
                    lanes[0] = kept
                    continue
            slow += rows
        if slow:
            for i, k in zip(
                slow, super().place([tracks[i] for i in slow], [starts[i] for i in slow], [ends[i] for i in slow])
            ):
                lane[i] = k
        return lane

    def fits(self, lane: tuple[list[int], list[int]], s: int, e: int) -> bool:
        if not super().fits(lane, s, e):
            return False
        if s == e:
            return True  # opens and closes at once: nests in whatever is open then
        starts, ends = lane
        for t in (s, e):
            i = bisect.bisect_left(starts, t)
            while i < len(starts) and starts[i] == t:
                if ends[i] > t:
                    return False
                i += 1
        return True


class StreamWriter(AppendFile):
    """One rank's trace, appended to its file flush by flush (the interface of the JSON
    format's `StreamWriter`).

    Each append is one `write()` of whole packets; a kill can cut only the last one, which
    Perfetto and `read` drop. `finish()` appends the final header and closes the file: a
    protobuf trace needs no closing bracket, so there is nothing to rewrite."""

    def __init__(self, path: str, base_ns: int, process: Process, header: dict[str, Any]) -> None:
        super().__init__(path, base_ns, process, header)
        self.writer = ProcessLayout(self.pid, process, _StreamLayout())
        self._enc = _Encoder(base_ns)
        head = [_metadata_packet(HEADER, self._header_json()), self._enc.clock_packet()]
        head.append(_process_packet(self.pid, process))
        self._write(_serialize(head))

    def _header_json(self) -> dict[str, Any]:
        facts = process_facts([self.process], {0: self.pid})
        return {"baseTimeNanoseconds": self.base_ns, **self.header, "processes": facts}

    def overflow_tracks(self) -> int:
        return self.writer.layout.overflow_tracks() + sum(self._enc.spilled.values())

    def append(self, trace: Trace, rows: Sequence[int], counters: Sequence[int] = (), update: Any = None) -> None:
        """Append spans `rows` and counter samples `counters` of `trace` (one process, index 0),
        and, if given, a header update (new metadata), in one write."""
        out: list[bytes] = []
        # The update goes before the compressed packets, uncompressed: `read_header` finds it.
        head = _serialize([_metadata_packet(UPDATE, update)]) if update else b""
        if rows:
            sp = trace.spans
            tracks = [sp.track[i] for i in rows]
            lanes = self.writer.layout.place(tracks, [sp.start[i] for i in rows], [sp.end[i] for i in rows])
            if sp.entry is not None and launch_rows(sp.entry, rows):
                self.writer.launch_tid([])  # asked where the JSON writer asks it: the same tids
            groups: dict[tuple[int, int], list[int]] = {}
            for r, t, k in zip(rows, tracks, lanes):
                groups.setdefault((t, k), []).append(r)
            cats = any(c is not None for c in sp.cat)
            for (t, k), g in groups.items():
                self._enc.spans(trace, self.writer, t, k, g, cats, out)
        if counters:
            self._enc.counters(trace, counters, {i: self.pid for i in range(len(trace.processes))}, out)
        if out or head:
            self._write(head + (_compressed(out) if out else b""))
        self.spans_written += len(rows)

    def finish(self, header: dict[str, Any] | None = None) -> None:
        """Append the final header and close the file."""
        if self._fd < 0:
            return
        if header is not None:
            self.header = header
        try:
            self._write(_serialize([_metadata_packet(HEADER, self._header_json())]))
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = -1

    def resume(self) -> None:
        """After `finish()`: go on appending (the file needs no change to take more packets)."""
        if self._fd < 0:
            self._reopen()


# ---- reading ------------------------------------------------------------------------------------


#: Compressed packets inflate to at most this many times the file's size, or INFLATE_MIN bytes,
#: whichever is larger (gputrace's own files inflate up to about 50 times; zlib reaches 1000): a
#: file past that is refused as a decompression bomb before it takes the machine's memory.
INFLATE_FACTOR = 128
INFLATE_MIN = 32 << 20
#: Compressed packets inside compressed packets, at most (gputrace writes one level).
MAX_NESTING = 4


def read(path: str, data: bytes | None = None) -> Trace:
    """Parse a Perfetto protobuf trace into a `Trace`: gputrace's own files fully; of other
    tools' files, the process, thread and counter tracks, slices and counters. A file cut off
    mid-write loses only its last, partial packet (and spans whose end was in it). Memory is
    bounded by the file's size: see INFLATE_FACTOR. The spans' arguments are a `PackedArgs`
    column (no dict a span is held: a dict is made when a span's arguments are read), their
    categories a list only where some span has one (else a column of None of no memory)."""
    if data is None:
        data = read_bytes(path)
    if not data:
        raise TraceFormatError(path, "empty file")
    reader = _Reader(path, max(INFLATE_FACTOR * len(data), INFLATE_MIN))
    batches = _packet_batches(path, data)
    del data  # the file's bytes go with the last batch, before the columns are made
    return reader.build(batches)


def read_spans(path: str, data: bytes | None = None, keys: Iterable[str] | None = None) -> Trace:
    """`read`, keeping of the spans' arguments only those named in `keys`, and no categories: for
    a stage that looks at nothing else (the statistics: `collective`, `unfinished`, `cover`).
    Each span's args is a dict of the named ones it has, else None, in a plain list, and its
    category None, in a column of no memory (merge moves both into its trace rather than
    copying). `keys` None: neither column takes memory (columns of None), for a check that looks
    only at names, tracks and times (validate), a third of the columns' bytes."""
    if data is None:
        data = read_bytes(path)
    if not data:
        raise TraceFormatError(path, "empty file")
    kept = frozenset(keys) if keys is not None else False
    reader = _Reader(path, max(INFLATE_FACTOR * len(data), INFLATE_MIN), args=kept)
    batches = _packet_batches(path, data)
    del data  # the file's bytes go with the last batch, before the columns are made
    return reader.build(batches)


def read_header(path: str) -> dict[str, Any]:
    """The header of a trace (baseTimeNanoseconds, distributedInfo, metadata, processes) as the
    last one written with the updates after it, without inflating or reading its events: gputrace
    writes headers as uncompressed packets between the compressed ones."""
    reader = _Reader(path)
    data = read_bytes(path)
    if not data:
        raise TraceFormatError(path, "empty file")
    for p in _parse(path, data).packet:
        if p.HasField("chrome_events"):
            reader._metadata(p.chrome_events)
    return reader.header


def _parse(path: str, data: bytes) -> pb.Trace:
    msg = pb.Trace()
    try:
        msg.ParseFromString(data)
        return msg
    except DecodeError:
        pass
    whole = _whole_packets(data)
    if whole == 0:
        raise TraceFormatError(path, "not a Perfetto protobuf trace, or cut off before its first packet")
    msg = pb.Trace()
    try:
        msg.ParseFromString(data[:whole])
    except DecodeError:
        raise TraceFormatError(path, "not a Perfetto protobuf trace (a packet does not parse)") from None
    return msg


#: Bytes of packets parsed at a time by `_packet_batches`.
PACKET_BATCH_BYTES = 4 << 20
#: Inflated bytes of packets parsed at a time (protobuf's messages take ~40 times their bytes).
INFLATED_BATCH_BYTES = 128 << 10
_PACKET_TAG = 0x0A  # Trace.packet: field 1, length-delimited


def _packet_batches(path: str, data: bytes) -> Iterator[Any]:
    """The file's packets, PACKET_BATCH_BYTES of them parsed at a time (memory holds the file and
    one batch's messages, not a message per packet of the whole file); a file of anything but
    whole packets (cut off, or other fields) is parsed whole, as `_parse` does."""
    pos, n, start = 0, len(data), 0
    cuts = []
    while pos < n:
        tag, p = _varint(data, pos)
        if tag != _PACKET_TAG:
            break
        size, p = _varint(data, p)
        if size < 0 or p + size > n:
            break
        pos = p + size
        if pos - start >= PACKET_BATCH_BYTES:
            cuts.append((start, pos))
            start = pos
    if pos != n or not cuts:
        yield _parse(path, data).packet
        return
    cuts.append((start, n))
    for lo, hi in cuts:
        msg = pb.Trace()
        try:
            msg.ParseFromString(data[lo:hi])
        except DecodeError:
            raise TraceFormatError(path, "not a Perfetto protobuf trace (a packet does not parse)") from None
        yield msg.packet
        del msg


def _packet_prefix(data: bytes, pos: int, most: int) -> int:
    """Where the whole packets of `data` from `pos` end, at the first packet end `most` bytes
    on or the last whole packet (`pos`: none, or something other than a packet comes first)."""
    n, start = len(data), pos
    while pos < n and pos - start < most:
        tag, p = _varint(data, pos)
        if tag != _PACKET_TAG:
            return start if pos == start else pos
        size, p = _varint(data, p)
        if size < 0 or p + size > n:
            return pos
        pos = p + size
    return pos


def _whole_packets(data: bytes) -> int:
    """How many leading bytes of `data` are whole length-delimited fields (the packets): where a
    file cut off mid-packet ends."""
    pos, n = 0, len(data)
    while pos < n:
        tag, p = _varint(data, pos)
        if tag < 0 or tag & 7 != 2:
            break
        size, p = _varint(data, p)
        if size < 0 or p + size > n:
            break
        pos = p + size
    return pos


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while pos < len(data) and shift < 64:
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
    return -1, pos


class _Seq:
    """A sequence's state while reading: its interned strings, default track and clock."""

    __slots__ = ("names", "keys", "cats", "track", "clock", "value", "offset")

    def __init__(self) -> None:
        self.names: dict[int, str] = {}
        self.keys: dict[int, str] = {}
        self.cats: dict[int, str] = {}
        self.track = 0
        self.clock = 0  # the default clock id (0: the trace's own)
        self.value = 0  # the incremental clock's value
        self.offset = 0  # trace time - incremental clock


class _Spans:
    """One track's finished spans while reading, in columns: names (as the reader numbers them,
    `_Reader.name_code`), start and end as read (before the base), args and categories (a whole read:
    each span's row in the reader's `PackedArgs` and its category's code, 4 bytes each; a read
    of named arguments: their dicts, and no categories)."""

    __slots__ = ("name", "start", "end", "args", "cat")

    def __init__(self, packed: bool) -> None:
        self.name: Any = array("i")
        self.start: Any = array("q")
        self.end: Any = array("q")
        self.args: Any = array("i") if packed else []
        self.cat: Any = array("i")

    def widen(self, start: int, end: int) -> None:
        """Append a span whose times do not fit 64 bits: the columns become lists of ints."""
        if len(self.start) > len(self.end):  # the start went in, the end did not
            self.start.pop()
        self.start, self.end = list(self.start), list(self.end)
        self.start.append(start)
        self.end.append(end)


class _Reader:
    def __init__(self, path: str, inflate: int = INFLATE_MIN, args: bool | frozenset[str] = True) -> None:
        self.path = path
        # Keep the spans' arguments and categories (True), neither (False), or the arguments
        # named in a set and no categories.
        self.args = args
        self.inflate = inflate  # bytes that compressed packets may still inflate to
        self.header: dict[str, Any] = {}
        self.extra: list[dict[str, Any]] = []
        self.descriptors: dict[int, pb.TrackDescriptor] = {}  # uuid -> descriptor, in file order
        self.incremental: set[tuple[int, int]] = set()  # (sequence, clock id)
        self.spans: dict[int, _Spans] = {}  # uuid -> its finished spans, as columns
        self.samples: dict[int, list[tuple[int, float]]] = {}
        self.launches: dict[int, int] = {}  # flow id -> host entry (the launch arrows' sources)
        self.launch_tracks: set[int] = set()  # uuids of tracks holding them
        self.flows_in: dict[int, list[tuple[int, int]]] = {}  # uuid -> (row in spans[uuid], flow id)
        # A whole read's arguments, packed as the spans end (no dict a span is kept), and its
        # categories, interned (code 0: none).
        self.packed = PackedArgs()
        self.name_code: dict[str, int] = {}  # span names, numbered as first met (the file's order)
        self.cat_names: list[str | None] = [None]
        self.cat_code: dict[str, int] = {}

    def build(self, batches: Iterable[Any]) -> Trace:
        """The trace of the file's packets, given a batch of them at a time."""
        self.seqs: dict[int, _Seq] = {}
        self.open: dict[int, list[tuple[int, int, Any, Any, int]]] = {}
        for packets in batches:
            self._packets(packets)
        # Spans still open at the end were cut off mid-write (their end never came): left out.
        return self._trace()

    def _packets(self, packets: Any, depth: int = 0) -> None:
        seqs, open_, spans, incremental = self.seqs, self.open, self.spans, self.incremental
        keep = self.args is not False
        named = self.args if isinstance(self.args, frozenset) else None
        pack, cat_names, cat_code, name_code = self.packed.pack, self.cat_names, self.cat_code, self.name_code
        for p in packets:
            sid = p.trusted_packet_sequence_id
            st = seqs.get(sid)
            if st is None:
                st = seqs[sid] = _Seq()
            kind = p.WhichOneof("data")
            flags = p.sequence_flags
            if flags & _CLEARED or (not flags and p.incremental_state_cleared):
                st.names, st.keys, st.cats = {}, {}, {}
            # Defaults come with a cleared state or on a packet of their own (an event packet that
            # carries them is taken too, at the cost of a check per event only there).
            if (flags & _CLEARED or kind != "track_event") and p.HasField("trace_packet_defaults"):
                dflt = p.trace_packet_defaults
                st.clock = dflt.timestamp_clock_id
                st.track = dflt.track_event_defaults.track_uuid
            if p.HasField("interned_data"):
                self._intern(st, p.interned_data)
            if kind == "track_event":
                te = p.track_event
                clock = p.timestamp_clock_id or st.clock
                if clock and (sid, clock) in incremental:
                    st.value += p.timestamp
                    ts = st.value + st.offset
                else:
                    ts = p.timestamp
                uuid = te.track_uuid or st.track
                t = te.type
                if t == _BEGIN:
                    text = st.names.get(te.name_iid, "") if te.name_iid else _str(te.name)
                    name = name_code.get(text)
                    if name is None:
                        name = name_code[text] = len(name_code)
                    a = None
                    cat = 0
                    if named is not None:
                        if te.debug_annotations:
                            a = {k: _value(d) for d in te.debug_annotations if (k := _key(st, d)) in named} or None
                    elif keep:
                        if te.debug_annotations:
                            a = {_key(st, d): _value(d) for d in te.debug_annotations}
                        c = None
                        if te.category_iids:
                            c = ",".join(st.cats.get(i, "") for i in te.category_iids)
                        elif te.categories:
                            c = ",".join(map(_str, te.categories))
                        if c is not None:
                            cat = cat_code.get(c, 0)
                            if not cat:
                                cat = cat_code[c] = len(cat_names)
                                cat_names.append(c)
                    stack = open_.get(uuid)
                    if stack is None:
                        stack = open_[uuid] = []
                    stack.append((name, ts, a, cat, te.terminating_flow_ids[0] if te.terminating_flow_ids else 0))
                elif t == _END:
                    stack = open_.get(uuid)
                    if stack:
                        code, t0, a, cat, flow = stack.pop()
                        done = spans.get(uuid)
                        if done is None:
                            done = spans[uuid] = _Spans(keep and named is None)
                        if flow:
                            self.flows_in.setdefault(uuid, []).append((len(done.name), flow))
                        # The one place a span's fields become columns.
                        done.name.append(code)
                        try:
                            done.start.append(t0)
                            done.end.append(ts)
                        except OverflowError:  # uint64 past int64: this track's times as Python ints
                            done.widen(t0, ts)
                        if named is not None:
                            done.args.append(a)
                        elif keep:
                            done.args.append(-1 if a is None else pack(a))
                            done.cat.append(cat)
                elif t == _INSTANT and te.flow_ids:
                    self._launch(st, uuid, ts, te)
                elif t == _COUNTER:
                    v = te.double_counter_value if te.HasField("double_counter_value") else te.counter_value
                    self.samples.setdefault(uuid, []).append((ts, float(v)))
            elif kind == "track_descriptor":
                self.descriptors.setdefault(p.track_descriptor.uuid, p.track_descriptor)
            elif kind == "clock_snapshot":
                self._clock(sid, st, p.clock_snapshot)
            elif kind == "chrome_events":
                self._metadata(p.chrome_events)
            elif kind == "compressed_packets":
                if depth >= MAX_NESTING:
                    raise TraceFormatError(self.path, f"compressed packets nested more than {MAX_NESTING} deep")
                for inner in self._inflate(p.compressed_packets):
                    self._packets(inner, depth + 1)
                    del inner  # its messages go before the next batch is parsed

    def _launch(self, st: _Seq, uuid: int, ts: int, te: pb.TrackEvent) -> None:
        """A launch arrow's source (see layout.py): its host entry (the exact one where it was
        drawn elsewhere), by flow id; the span that ends the arrow takes it in `_entries`."""
        entry = ts
        for d in te.debug_annotations:
            if _key(st, d) == ENTRY_ARG and d.WhichOneof("value") == "int_value":
                entry = d.int_value - self._base()
        self.launches[te.flow_ids[0]] = entry
        self.launch_tracks.add(uuid)

    def _base(self) -> int:
        base = self.header.get("baseTimeNanoseconds", 0)
        return base if type(base) is int else 0

    def _entries(self, uuid: int, first_row: int, n: int, entry: array[int] | None, base: int) -> array[int] | None:
        """The `entry` column after the spans of track `uuid` (rows first_row..first_row + n - 1 of
        the trace) joined it: their host entries from the launch arrows that end at them, 0 for the
        rest. None while no span has one."""
        flows = self.flows_in.get(uuid)
        if not flows or not self.launches:
            if entry is not None:
                entry.extend(array("q", bytes(8 * n)))
            return entry
        if entry is None:
            entry = array("q", bytes(8 * first_row))
        mine = array("q", bytes(8 * n))
        for row, flow in flows:
            at = self.launches.get(flow)
            if at is not None and row < n:
                mine[row] = base + at
        entry.extend(mine)  # in place: a copy per track would cost the whole column each time
        return entry

    def _inflate(self, data: bytes) -> Iterator[Any]:
        """Compressed packets, inflated within what is left of the file's allowance (refused
        before any of them is read when they pass it), and given a batch of whole packets at a
        time (INFLATED_BATCH_BYTES of inflated bytes): memory holds their bytes and one batch's
        messages, not a message for every packet they hold."""
        z = zlib.decompressobj()
        try:
            raw = z.decompress(data, self.inflate + 1)
            if len(raw) > self.inflate or z.unconsumed_tail:
                raise TraceFormatError(
                    self.path,
                    f"its compressed packets inflate to more than {INFLATE_FACTOR} times the file's size "
                    "(a decompression bomb?)",
                )
            self.inflate -= len(raw)
            pos, n = 0, len(raw)
            while pos < n:
                end = _packet_prefix(raw, pos, INFLATED_BATCH_BYTES)
                if end <= pos:  # not whole packets from here: the rest at once, as a Trace
                    yield pb.Trace.FromString(raw[pos:]).packet
                    return
                yield pb.Trace.FromString(raw[pos:end]).packet
                pos = end
        except (zlib.error, DecodeError):
            raise TraceFormatError(self.path, "a compressed packet does not inflate to packets") from None

    def _intern(self, st: _Seq, d: pb.InternedData) -> None:
        for e in d.event_names:
            st.names[e.iid] = _str(e.name)
        for e in d.debug_annotation_names:
            st.keys[e.iid] = _str(e.name)
        for e in d.event_categories:
            st.cats[e.iid] = _str(e.name)

    def _clock(self, sid: int, st: _Seq, snap: pb.ClockSnapshot) -> None:
        trace_time = None
        for c in snap.clocks:
            if c.clock_id == _BOOTTIME:
                trace_time = c.timestamp
        for c in snap.clocks:
            if c.clock_id >= _DELTA_CLOCK and c.is_incremental:
                self.incremental.add((sid, c.clock_id))
                st.value = c.timestamp
                st.offset = (trace_time or 0) - c.timestamp

    def _metadata(self, bundle: pb.ChromeEventBundle) -> None:
        for m in bundle.metadata:
            if m.name not in (HEADER, UPDATE, EXTRA) or not m.HasField("json_value"):
                continue
            try:
                value = orjson.loads(m.json_value)
            except orjson.JSONDecodeError:
                raise TraceFormatError(self.path, f"its {m.name} metadata is not JSON") from None
            if m.name == HEADER and isinstance(value, dict):
                self.header = value
            elif m.name == UPDATE:
                update_header(self.header, value)
            elif m.name == EXTRA and isinstance(value, list):
                self.extra += [e for e in value if isinstance(e, dict)]

    def _trace(self) -> Trace:
        header = self.header
        meta: dict[str, Any] = header["metadata"] if isinstance(header.get("metadata"), dict) else {}
        info: dict[str, Any] = header["distributedInfo"] if isinstance(header.get("distributedInfo"), dict) else {}
        base = header.get("baseTimeNanoseconds", 0)
        if isinstance(base, bool) or not isinstance(base, int):
            raise TraceFormatError(self.path, "baseTimeNanoseconds is not an integer")
        if not _in_range(base):
            raise TraceFormatError(self.path, "baseTimeNanoseconds is out of range (a 64-bit integer of ns)")
        trace = Trace(dict(meta))
        trace.metadata["base_ns"] = base
        if "world_size" in info:
            trace.metadata.setdefault("world_size", info["world_size"])
        merged = bool(meta.get("merged"))
        rank_meta: dict[str, Any] = (
            meta["rank_metadata"] if merged and isinstance(meta.get("rank_metadata"), dict) else {}
        )
        facts: dict[str, Any] = header["processes"] if isinstance(header.get("processes"), dict) else {}

        proc_index: dict[int, int] = {}

        def process_of(pid: int, name: str = "", sort: int | None = None) -> int:
            i = proc_index.get(pid)
            if i is None:
                f = facts.get(str(pid)) if isinstance(facts.get(str(pid)), dict) else None
                rank = f.get("rank") if f else None
                rank = rank if isinstance(rank, int) and not isinstance(rank, bool) else None
                foreign = bool(f.get("foreign")) if f else True
                if foreign:
                    pmeta: Any = {}
                elif merged:
                    pmeta = rank_meta.get(str(rank), {}) if rank is not None else {}
                else:
                    pmeta = meta
                label = name or (f"rank {rank}" if rank is not None and not foreign else f"process {pid}")
                s = sort if sort is not None else (rank if rank is not None else 1 << 20)
                i = proc_index[pid] = trace.add_process(Process(pid, rank, label, s, pmeta, foreign))
            return i

        track_of: dict[int, int] = {}
        for uuid, d in self.descriptors.items():
            if d.HasField("process"):
                pr = d.process
                sort = pr.legacy_sort_index if pr.HasField("legacy_sort_index") else None
                process_of(pr.pid, _str(pr.process_name), sort)
        for uuid, d in self.descriptors.items():
            if d.HasField("thread") and uuid in self.launch_tracks and uuid not in self.spans:
                continue  # the launch arrows' track: its instants are the spans' `entry`
            if d.HasField("thread"):
                th = d.thread
                name = _str(th.thread_name) or f"thread {th.tid}"
                m = CUDA_TRACK.match(name)
                kind, device = ("cuda", int(m.group(1))) if m else ("cpu" if name.endswith("(host)") else "other", None)
                track_of[uuid] = trace.add_track(Track(process_of(th.pid), th.tid, name, kind, device, th.tid))
            elif d.HasField("counter") or uuid in self.samples:
                parent = self.descriptors.get(d.parent_uuid)
                pid = parent.process.pid if parent is not None and parent.HasField("process") else 0
                name = _str(d.name)
                m = CUDA_TRACK.match(name)
                track = Track(process_of(pid), name, name, "counter", int(m.group(1)) if m else None)
                track_of[uuid] = trace.add_track(track)
        intern, spans = trace.intern, trace.spans
        keep = self.args is not False
        named = isinstance(self.args, frozenset)
        # Columns of None that take no memory where nothing was kept; a whole read's arguments
        # stay packed (the tracks' rows join its `at`), its categories a list only where it has one.
        cat_names = self.cat_names
        text = list(self.name_code)  # by the reader's number
        with_cats = keep and not named and len(cat_names) > 1
        args_col: Any = self.packed if keep and not named else spans.args if keep else _NoCats(0)
        cat_col: Any = [] if with_cats else _NoCats(0)
        spans.args, spans.cat = args_col, cat_col
        entry: array[int] | None = None
        for uuid in list(self.spans):
            c = self.spans.pop(uuid)  # let go of each track's columns once they are the trace's
            t = track_of.get(uuid)
            if t is None:
                t = track_of[uuid] = trace.add_track(Track(process_of(0), uuid, f"track {uuid}"))
            names, args, cats = c.name, c.args, c.cat
            try:
                starts = array("q", map(add, c.start, repeat(base)))
                ends = array("q", map(add, c.end, repeat(base)))
            except OverflowError:  # times past 64 bits of ns (uint64 timestamps): not placed
                self.flows_in.pop(uuid, None)
                kept = [i for i in range(len(names)) if _in_range(base + c.start[i]) and _in_range(base + c.end[i])]
                if not kept:
                    continue
                starts = array("q", [base + c.start[i] for i in kept])
                ends = array("q", [base + c.end[i] for i in kept])
                names = [names[i] for i in kept]
                if keep:
                    args = [args[i] for i in kept]
                    cats = [cats[i] for i in kept] if with_cats else cats
            del c
            n = len(names)
            # The trace numbers names as each track first has them, tracks in order: the same
            # numbering every run.
            ids = {k: intern(text[k]) for k in dict.fromkeys(names)}
            entry = self._entries(uuid, len(spans), n, entry, base)
            same = all(k == i for k, i in ids.items())
            spans.name.extend(array("l", names) if same else array("l", map(ids.__getitem__, names)))
            del names
            spans.track.extend(array("l", [t]) * n)
            spans.start.extend(starts)
            spans.end.extend(ends)
            del starts, ends
            if not keep:
                args_col.extend(range(n))  # counted: a column of None
            elif named:
                args_col.extend(args)
            else:
                args_col.at.extend(args)
            if with_cats:
                cat_col.extend(map(cat_names.__getitem__, cats))
            else:
                cat_col.extend(range(n))
            del args, cats
        spans.entry = entry
        counters = trace.counters
        for uuid, samples in self.samples.items():
            t = track_of.get(uuid)
            if t is None:
                t = track_of[uuid] = trace.add_track(Track(process_of(0), uuid, f"counter {uuid}", "counter"))
            for ts, v in samples:
                if _in_range(base + ts):
                    counters.append(t, base + ts, v)
        for e in self.extra:
            e = dict(e)
            pid = e.pop("pid", None)
            if type(e.get("ts_ns")) is not int or not _in_range(e["ts_ns"]) or not isinstance(pid, int):
                continue
            if "dur_ns" in e and (type(e["dur_ns"]) is not int or not _in_range(e["dur_ns"])):
                del e["dur_ns"]
            e["process"] = process_of(pid)
            trace.extra.append(e)
        return trace


def _str(v: str | bytes) -> str:
    """A string field as text: protobuf gives the bytes of one that is not UTF-8."""
    return v if isinstance(v, str) else v.decode("utf-8", "replace")


def _in_range(ns: int) -> bool:
    return -(2**63) <= ns < 2**63


def _key(st: _Seq, d: pb.DebugAnnotation) -> str:
    return st.keys.get(d.name_iid, "") if d.name_iid else _str(d.name)


def _value(d: pb.DebugAnnotation) -> Any:
    kind = d.WhichOneof("value")
    if kind is None:
        if len(d.dict_entries):
            return {_str(e.name): _value(e) for e in d.dict_entries}
        if len(d.array_values):
            return [_value(v) for v in d.array_values]
        return None
    if kind == "nested_value":
        return _nested(d.nested_value)
    if kind == "legacy_json_value":
        text = _str(d.legacy_json_value)
        try:
            return json.loads(text)
        except (ValueError, RecursionError):  # not JSON, or nested deeper than Python goes: its text
            return text
    value = getattr(d, kind)
    return _str(value) if type(value) is bytes and kind != "bytes_value" else value


def _nested(n: pb.DebugAnnotation.NestedValue) -> Any:
    if n.nested_type == pb.DebugAnnotation.NestedValue.DICT:
        return {_str(k): _nested(v) for k, v in zip(n.dict_keys, n.dict_values)}
    if n.nested_type == pb.DebugAnnotation.NestedValue.ARRAY:
        return [_nested(v) for v in n.array_values]
    for kind in ("bool_value", "int_value", "double_value", "string_value"):
        if n.HasField(kind):
            value = getattr(n, kind)
            return _str(value) if type(value) is bytes else value
    return None
