"""The Perfetto protobuf format: what `perfetto.write` and `perfetto.StreamWriter` write is what
`perfetto.read` reads back and what the Perfetto UI shows, the same slices, depths and tracks as
the JSON of the same trace; streamed files load when cut at any byte.

Two models of Perfetto's importers (`proto_import`, `json_import`, from its source: events of one
timestamp in file order for protobuf, complete events by duration for JSON) check the nesting on
many random traces quickly; the browser tests check the same things in the real UI."""

from __future__ import annotations

import functools
import os
import random
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import orjson
import pytest
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

import gputrace
from gputrace.errors import TraceFormatError
from gputrace.trace import chrome, layout, perfetto
from gputrace.trace.layout import LAUNCH_TRACK
from gputrace.trace.model import Process, Trace, Track
from gputrace.trace.registry import detect

from . import perfetto_ui
from .conftest import install
from .fakes import FakeDevice

BASE = 1_764_000_000_123_456_789
ROOT = Path(__file__).resolve().parent.parent


# ---- traces -------------------------------------------------------------------------------------


def rank_trace(rank: int = 0, steps: int = 6, seed: int = 0, trace: Trace | None = None) -> Trace:
    """A rank as the recorder makes them: steps of nested spans on two CUDA streams and a host
    thread, plus what real runs also hold: spans that cross (misuse), zero-length spans (some
    at one instant), spans that share a start or an end, arguments of every JSON type, a
    category, names that need escaping, memory counters."""
    rng = random.Random(seed)
    own = trace is None
    if trace is None:
        meta = {"gputrace_version": "test", "run_id": "run-1", "world_size": 2, "clock": {"sync_to_rank0": []}}
        trace = Trace(meta)
    p = trace.add_process(
        Process(rank + 1, rank, f"rank {rank} (node0, fake GPU)", rank, trace.metadata if own else {})
    )
    main = trace.add_track(Track(p, 1, "cuda:0 default stream", "cuda", 0, 0))
    side = trace.add_track(Track(p, 2, "cuda:0 stream 7", "cuda", 0, 7))
    host = trace.add_track(Track(p, 3, "thread MainThread (host)", "cpu", None, 100))
    alloc = trace.add_track(Track(p, "cuda:0 memory allocated", "cuda:0 memory allocated", "counter", 0))
    t = BASE + rank * 1_000
    for k in range(steps):
        n = rng.randint(2, 5)
        step_end = t + 1_000 * (n + 2)
        trace.add_span("step", main, t, step_end, {"step": k, "rank": rank})
        trace.add_span("step", host, t, t + 300)
        for j in range(n):
            s = t + j * 1_000
            trace.add_span(f"layer{j}", main, s, s + rng.choice([900, 1_000]))  # some end where the next begins
            if rng.random() < 0.5:
                trace.add_span("kernel", main, s, s + 400)  # shares its parent's start
        trace.add_span("all_reduce", side, t + 100, t + 5_000, {"collective": True, "bytes": 1 << 33})
        trace.add_span("mark", main, t + 500, t + 500)  # zero-length
        trace.add_span("mark", main, t + 500, t + 500)  # and another at the same instant
        if k % 2:
            trace.add_span("late", main, t + 1_500, step_end + 2_000)  # crosses "step": an overflow lane
        trace.counters.append(alloc, t, float((k + 1) << 30))
        t = step_end + 10_000
    a = {
        "f": 0.25,
        "s": 'q"uote\nnl \u2713',
        "none": None,
        "empty": [],
        "nested": {"a": [1, {"b": False}]},
    }
    trace.add_span("args \u2713 </script>", host, t, t + 50, a, cat="user")
    return trace


def merged_trace() -> Trace:
    """Three ranks and another tool's process, as `gputrace merge` makes them."""
    trace = Trace({"merged": True, "world_size": 3, "alignment": {"method": "clock_sync"}})
    for r in (2, 0, 1):
        rank_trace(r, steps=3, seed=r, trace=trace)
    trace.metadata["rank_metadata"] = {str(r): {"rank": r, "run_id": "run-1"} for r in range(3)}
    gpu = trace.add_process(Process("GPU 0", 0, "GPU 0 (kineto)", 50, {}, foreign=True))
    stream = trace.add_track(Track(gpu, "stream 7", "stream 7", "other", None, 7))
    trace.add_span("ampere_sgemm", stream, BASE + 200, BASE + 900, {"grid": [1, 2, 3]})
    trace.extra.append({"ph": "i", "name": "marker", "s": "t", "tid": 7, "ts_ns": BASE + 300, "process": gpu})
    return trace


def recorded_run(tmp_path: Path) -> tuple[Path, Path]:
    """A recorder's run (fake GPU), saved as JSON and as Perfetto protobuf."""
    fake = FakeDevice(read_ns=500)
    install(fake)
    side = fake.new_stream()
    for i in range(8):
        with gputrace.span("step", step=i):
            with gputrace.span("fwd"):
                fake.work(2_000_000)
            with fake.stream(side), gputrace.span("copy"):
                fake.work(500_000)
            with gputrace.span("host", timer_type="cpu"):
                fake.advance(1_000)
    outer = gputrace.span("outer", timer_type="cpu").start()
    inner = gputrace.span("inner", timer_type="cpu").start()
    with pytest.warns(gputrace.GputraceWarning):
        outer.end()  # closed before the span inside it: the two cross
    fake.advance(10_000)
    inner.end()
    fake.advance(50_000_000)
    json_path = Path(gputrace.save(tmp_path / "run.json"))
    proto_path = Path(gputrace.save(tmp_path / "run.pftrace"))
    return json_path, proto_path


# ---- models of Perfetto's importers ---------------------------------------------------------------


def packets(data: bytes) -> list[pb.TracePacket]:
    """The file's whole packets, compressed ones inflated in place."""
    out = []
    for p in pb.Trace.FromString(data[: perfetto._whole_packets(data)]).packet:
        out += packets(zlib.decompress(p.compressed_packets)) if p.HasField("compressed_packets") else [p]
    return out


def proto_import(data: bytes) -> list[tuple[Any, ...]]:
    """Slices as Perfetto's protobuf importer makes them from gputrace's packets: timestamps per
    sequence (deltas on its clock, reset by a snapshot), events ordered by time and then by place
    in the file, an end closing the innermost open slice of its track.
    -> sorted (pid, thread, ts, dur, depth, name)."""
    names: dict[int, dict[int, str]] = {}
    track: dict[int, int] = {}
    clock: dict[int, int] = {}
    threads: dict[int, tuple[int, str]] = {}
    events = []
    for i, p in enumerate(packets(data)):
        seq = p.trusted_packet_sequence_id
        if p.HasField("trace_packet_defaults"):
            track[seq] = p.trace_packet_defaults.track_event_defaults.track_uuid
            assert p.trace_packet_defaults.timestamp_clock_id == 64
        for e in p.interned_data.event_names:
            names.setdefault(seq, {})[e.iid] = e.name
        if p.HasField("track_descriptor") and p.track_descriptor.HasField("thread"):
            th = p.track_descriptor.thread
            threads[p.track_descriptor.uuid] = (th.pid, th.thread_name)
        if p.HasField("clock_snapshot") and seq > 1:
            clock[seq] = 0
        if p.HasField("track_event") and p.track_event.type in (1, 2):
            clock[seq] += p.timestamp
            te = p.track_event
            events.append((clock[seq], i, track[seq], te.type, names.get(seq, {}).get(te.name_iid)))
    events.sort(key=lambda e: (e[0], e[1]))
    stacks: dict[int, list[tuple[int, str | None]]] = {}
    out = []
    for ts, _, uuid, kind, name in events:
        st = stacks.setdefault(uuid, [])
        if kind == 1:
            st.append((ts, name))
        else:
            t0, n = st.pop()
            out.append((*threads[uuid], t0, ts - t0, len(st), n))
    return sorted(out)


def json_import(data: bytes) -> list[tuple[Any, ...]]:
    """Slices as Perfetto's JSON importer makes them from complete events: ordered by time, then
    the longer first, then by place in the file; an open slice closes before a slice that starts
    after it ends, or where it ends unless both are zero-length. Crossing slices are dropped."""
    trace = orjson.loads(data)
    threads = {}
    events = []
    for i, e in enumerate(trace["traceEvents"]):
        if e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
        elif e["ph"] == "X":
            events.append((round(e["ts"] * 1000), round(e["dur"] * 1000), i, e["pid"], e["tid"], e["name"]))
    events.sort(key=lambda e: (e[0], -e[1], e[2]))
    stacks: dict[tuple[int, int], list[tuple[int, int]]] = {}
    out = []
    for ts, dur, _, pid, tid, name in events:
        st = stacks.setdefault((pid, tid), [])
        while st and (st[-1][0] + st[-1][1] < ts or (st[-1][0] + st[-1][1] == ts and not (st[-1][1] == 0 == dur))):
            st.pop()
        if st and ts + dur > st[-1][0] + st[-1][1]:
            continue
        out.append((pid, threads[(pid, tid)], ts, dur, len(st), name))
        st.append((ts, dur))
    return sorted(out)


def spans_of(trace: Trace) -> list[tuple[Any, ...]]:
    """Every span with its process, track name, times, arguments and category, sorted."""
    out = []
    s = trace.spans
    for i in range(len(s)):
        t = trace.tracks[s.track[i]]
        p = trace.processes[t.process]
        a = orjson.dumps(s.args[i], option=orjson.OPT_SORT_KEYS, default=repr) if s.args[i] else None
        out.append((p.label, t.name, trace.names[s.name[i]], s.start[i], s.end[i], a, s.cat[i]))
    return sorted(out, key=repr)


def triples(t: Trace) -> list[tuple[str, int, int]]:
    return sorted((t.names[n], s, e) for n, s, e in zip(t.spans.name, t.spans.start, t.spans.end))


def counters_of(trace: Trace) -> list[tuple[Any, ...]]:
    c = trace.counters
    return sorted(
        (trace.processes[trace.tracks[c.track[i]].process].label, trace.tracks[c.track[i]].name, c.ts[i], c.value[i])
        for i in range(len(c))
    )


def small_pieces(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """Both writers lay out in pieces of `step` spans (through layout.plan_write): nesting across pieces."""
    piece = functools.partial(layout.layout_pieces, step=step)
    monkeypatch.setattr(layout, "layout_pieces", piece)


# ---- the file -----------------------------------------------------------------------------------


def test_reads_back_what_the_json_format_reads_back(tmp_path: Path) -> None:
    trace = rank_trace(seed=3)
    perfetto.write(trace, str(tmp_path / "t.pftrace"))
    chrome.write(trace, str(tmp_path / "t.json"))
    assert detect(str(tmp_path / "t.pftrace")).name == "perfetto"
    got, want = perfetto.read(str(tmp_path / "t.pftrace")), chrome.read(str(tmp_path / "t.json"))
    assert spans_of(got) == spans_of(want)
    assert len(got.spans) == len(trace.spans)
    assert any(t.name.endswith("(overflow 1)") for t in got.tracks)  # "late" crosses "step"
    assert counters_of(got) == counters_of(want) and len(got.counters) == 6
    assert got.metadata == want.metadata and got.metadata["overflow_tracks"] >= 1
    assert [(p.pid, p.rank, p.label, p.sort_index, p.foreign, p.metadata) for p in got.processes] == [
        (p.pid, p.rank, p.label, p.sort_index, p.foreign, p.metadata) for p in want.processes
    ]
    key = lambda t: (t.name, t.kind, t.device, str(t.tid))  # noqa: E731
    assert sorted(map(key, got.tracks)) == sorted(map(key, want.tracks))
    assert perfetto.encode(trace) == (tmp_path / "t.pftrace").read_bytes()


def test_merged_trace_keeps_ranks_foreign_processes_and_other_events(tmp_path: Path) -> None:
    trace = merged_trace()
    path = str(tmp_path / "merged.pftrace")
    perfetto.write(trace, path)
    got = perfetto.read(path)
    assert got.ranks == [0, 1, 2]
    by_label = {p.label: p for p in got.processes}
    assert by_label["GPU 0 (kineto)"].foreign and by_label["GPU 0 (kineto)"].rank == 0
    assert by_label["rank 1 (node0, fake GPU)"].metadata == {"rank": 1, "run_id": "run-1"}
    assert [p.pid for p in got.processes if not p.foreign] == [1, 2, 3]  # pid = rank + 1, in rank order
    assert got.metadata["alignment"] == {"method": "clock_sync"}
    assert len(got.spans) == len(trace.spans)
    assert [(e["name"], e["ts_ns"], got.processes[e["process"]].label) for e in got.extra] == [
        ("marker", BASE + 300, "GPU 0 (kineto)")
    ]
    chrome.write(trace, str(tmp_path / "merged.json"))
    assert spans_of(got) == spans_of(chrome.read(str(tmp_path / "merged.json")))


@pytest.mark.parametrize("seed", range(40))
def test_nests_as_the_json_of_the_same_trace(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random spans on a few tracks, laid out in pieces of a few spans: every slice of the
    protobuf file has the time, duration, depth and thread it has in the JSON file."""
    small_pieces(monkeypatch, 1 + seed % 7)
    rng = random.Random(seed)
    trace = Trace({"gputrace_version": "test"})
    p = trace.add_process(Process(1, 0, "rank 0", 0))
    tracks = [trace.add_track(Track(p, k + 1, f"cuda:0 stream {k}", "cuda", 0, k)) for k in range(3)]
    for _ in range(rng.randint(1, 60)):
        s = BASE + rng.randrange(0, 40) * 10
        e = s + rng.choice([0, 0, 10, 10, 20, 50, 100, 300])
        trace.add_span(rng.choice("abcd"), rng.choice(tracks), s, e)
    ordered = seed % 2 == 0
    got = proto_import(perfetto.encode(trace, ordered=ordered))
    want = json_import(chrome.encode(trace, ordered=ordered))
    assert got == want
    assert len(got) == len(trace.spans)


def test_recorded_run_nests_as_its_json(tmp_path: Path) -> None:
    json_path, proto_path = recorded_run(tmp_path)

    # The spans; the launch arrows' sources (instants in protobuf, zero-length slices in JSON) are
    # checked in Perfetto's own UI by test_flows.
    def spans(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        return [r for r in rows if r[1] != LAUNCH_TRACK]

    assert spans(proto_import(proto_path.read_bytes())) == spans(json_import(json_path.read_bytes()))
    assert any(r[1] == LAUNCH_TRACK for r in json_import(json_path.read_bytes()))  # the recording has CUDA spans
    assert spans_of(perfetto.read(str(proto_path))) == spans_of(chrome.read(str(json_path)))


def test_at_least_three_times_smaller_than_json(tmp_path: Path) -> None:
    json_path, proto_path = recorded_run(tmp_path)
    assert json_path.stat().st_size / proto_path.stat().st_size >= 3
    trace = rank_trace(steps=400)
    rng = random.Random(0)
    for i in range(len(trace.spans)):  # durations as irregular as measured ones
        trace.spans.end[i] += rng.randrange(0, 97) * (trace.spans.end[i] > trace.spans.start[i])
    proto, json = len(perfetto.encode(trace)), len(chrome.encode(trace))
    assert json / proto >= 3, (json, proto)


def test_argument_values_round_trip() -> None:
    values = [0, -5, 1 << 62, 1 << 64, -(1 << 70), 1.5, float("inf"), True, False, "", "\u2713", None, [], {}]
    values += [[1, "a", None], {"x": {"y": [True, 2.5]}}, "lone \ud800 surrogate"]
    trace = Trace()
    p = trace.add_process(Process(1, 0, "rank 0", 0))
    t = trace.add_track(Track(p, 1, "thread MainThread (host)", "cpu"))
    for i, v in enumerate(values):
        trace.add_span("s", t, BASE + i, BASE + i + 1, {"v": v, "k\u2713": i})
    got = perfetto.read("x", perfetto.encode(trace))
    back = [got.spans.args[i] for i in sorted(range(len(got.spans)), key=got.spans.start.__getitem__)]
    want = [{"v": v, "k\u2713": i} for i, v in enumerate(values)]
    want[-1]["v"] = "lone \ufffd\ufffd\ufffd surrogate"  # protobuf strings are UTF-8, as JSON's
    assert back == want


def test_spans_that_cannot_nest_go_to_an_overflow_lane_even_past_the_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layout never puts crossing spans on one lane; if it did, the writer still would not
    write a file whose ends close the wrong slices."""
    monkeypatch.setattr(chrome.Layout, "place", lambda self, tracks, starts, ends: [0] * len(starts))
    trace = Trace()
    p = trace.add_process(Process(1, 0, "rank 0", 0))
    t = trace.add_track(Track(p, 1, "thread MainThread (host)", "cpu"))
    for s, e in [(0, 100), (50, 150), (60, 70), (120, 200), (140, 160)]:
        trace.add_span("s", t, BASE + s, BASE + e)
    data = perfetto.encode(trace)
    slices = proto_import(data)
    assert sorted((ts, dur) for *_, ts, dur, _, _ in slices) == [(0, 100), (50, 100), (60, 10), (120, 80), (140, 20)]
    assert {th for _, th, *_ in slices} == {"thread MainThread (host)", "thread MainThread (host) (overflow 1)"}
    assert len(perfetto.read("x", data).spans) == 5


def test_reads_track_events_of_other_writers() -> None:
    """Packets as Perfetto's SDK writes them: absolute times, a track on every event, names
    inline or interned on the event packet itself."""
    t = pb.Trace()
    t.packet.add(trusted_packet_sequence_id=7).track_descriptor.CopyFrom(
        pb.TrackDescriptor(uuid=10, process=pb.ProcessDescriptor(pid=42, process_name="trainer"))
    )
    d = pb.TrackDescriptor(uuid=11, parent_uuid=10, thread=pb.ThreadDescriptor(pid=42, tid=43, thread_name="worker"))
    t.packet.add(trusted_packet_sequence_id=7).track_descriptor.CopyFrom(d)
    p = t.packet.add(trusted_packet_sequence_id=7, sequence_flags=1, timestamp=1_000)
    p.interned_data.event_names.add(iid=1, name="outer")
    p.track_event.CopyFrom(pb.TrackEvent(type=1, track_uuid=11, name_iid=1))
    t.packet.add(trusted_packet_sequence_id=7, sequence_flags=2, timestamp=1_500).track_event.CopyFrom(
        pb.TrackEvent(type=1, track_uuid=11, name="inner", categories=["c"])
    )
    for ts in (1_700, 2_000):
        t.packet.add(trusted_packet_sequence_id=7, sequence_flags=2, timestamp=ts).track_event.CopyFrom(
            pb.TrackEvent(type=2, track_uuid=11)
        )
    got = perfetto.read("other", t.SerializeToString())
    assert [(p.pid, p.label, p.rank, p.foreign) for p in got.processes] == [(42, "trainer", None, True)]
    assert triples(got) == [("inner", 1_500, 1_700), ("outer", 1_000, 2_000)]
    assert [got.tracks[i].name for i in got.spans.track] == ["worker", "worker"]
    assert sorted(c for c in got.spans.cat if c) == ["c"]


def test_bad_files_and_spans_are_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "empty.pftrace").write_bytes(b"")
    with pytest.raises(TraceFormatError, match="empty file"):
        perfetto.read(str(tmp_path / "empty.pftrace"))
    (tmp_path / "text.pftrace").write_bytes(b"{not a protobuf trace")
    with pytest.raises(TraceFormatError, match="not a Perfetto protobuf trace"):
        perfetto.read(str(tmp_path / "text.pftrace"))
    trace = rank_trace(steps=1)
    with pytest.raises(ValueError, match="before the trace's base"):
        perfetto.encode(trace, base_ns=BASE + 10)


# ---- streaming ----------------------------------------------------------------------------------


def stream(path: Path, flushes: list[list[tuple[str, int, int, int]]], cut_after: int | None = None) -> Trace:
    """Write `flushes` (name, track 0/1, start, end, ns after BASE) through a StreamWriter the way
    the session does (a new trace per flush over one growing name table); returns all spans."""
    header: dict[str, Any] = {
        "distributedInfo": {"rank": 1, "world_size": 2},
        "metadata": {"gputrace_version": "t", "run_id": "r"},
    }
    proc = Process(2, 1, "rank 1", 1)
    w = perfetto.StreamWriter(str(path), BASE, proc, header)
    names = Trace()
    everything = Trace()
    for k, flush in enumerate(flushes):
        t = Trace()
        t.names, t._name_index = names.names, names._name_index
        for tr in (t, everything) if k == 0 else (t,):
            p = tr.add_process(proc)
            tr.add_track(Track(p, 1, "cuda:0 default stream", "cuda", 0, 0))
            tr.add_track(Track(p, 2, "thread MainThread (host)", "cpu", None, 1))
            tr.add_track(Track(p, "cuda:0 memory allocated", "cuda:0 memory allocated", "counter", 0))
        for name, track, s, e in flush:
            t.add_span(name, track, BASE + s, BASE + e, {"flush": k})
            everything.add_span(name, track, BASE + s, BASE + e, {"flush": k})
        t.counters.append(2, BASE + 100 * k, float(k << 20))
        update = {"metadata": {"run_id": "r", "clock_syncs": [{"flush": k}]}} if k in (1, 2) else None
        w.append(t, range(len(t.spans)), range(len(t.counters)), update)
        if k == cut_after:
            w.abandon()
            return everything
    w.finish({**header, "metadata": {**header["metadata"], "spans": w.spans_written}})
    return everything


# Children flushed before their parents; parents that start where a child of an earlier flush
# starts, spans that end where one of an earlier flush begins, zero-length spans at one instant.
FLUSHES = [
    [("k1", 0, 0, 100), ("k2", 0, 100, 400), ("fwd", 0, 0, 400), ("host", 1, 5, 6)],
    [("bwd", 0, 400, 1_000), ("step", 0, 0, 1_000), ("z", 0, 1_000, 1_000), ("host", 1, 6, 9)],
    [("opt", 0, 1_000, 1_200), ("next", 0, 2_000, 2_100)],
    [("step", 0, 1_000, 2_000), ("late", 0, 1_500, 2_500), ("zz", 0, 2_500, 2_500), ("zz", 0, 2_500, 2_500)],
]


def test_stream_reads_back_every_span_flush_by_flush(tmp_path: Path) -> None:
    path = tmp_path / "trace_rank1.pftrace"
    everything = stream(path, FLUSHES)
    got = perfetto.read(str(path))
    assert triples(got) == triples(everything)
    assert [p.rank for p in got.processes] == [1] and got.metadata["spans"] == 14
    assert got.metadata["run_id"] == "r" and got.metadata["world_size"] == 2
    assert len(got.counters) == 4
    # Perfetto makes every span the slice it is: nothing closed by another span's end.
    slices = proto_import(path.read_bytes())
    assert sorted((n, ts, dur) for *_, ts, dur, _, n in slices) == sorted(
        (n, s - BASE, e - s) for n, s, e in triples(got)
    )
    # "step" [0, 1000) starts where "fwd" of the first flush starts: it would open inside it.
    assert ("cuda:0 default stream (overflow 1)", "step", 0) in {(th, n, ts) for _, th, ts, _, _, n in slices}


@pytest.mark.parametrize("seed", range(40))
def test_streamed_spans_are_the_slices_perfetto_makes(seed: int, tmp_path: Path) -> None:
    """Random nested spans on a coarse clock (many equal times), flushed in the order they ended
    in random cuts: Perfetto gives every span its own start and end, nothing closes the wrong
    slice, whatever earlier flushes wrote at the same instants."""
    rng = random.Random(seed)
    spans: list[tuple[str, int, int, int]] = []

    def nest(lo: int, hi: int, depth: int) -> None:
        t = lo
        while t < hi and len(spans) < 80:
            e = min(hi, t + rng.choice([0, 10, 20, 40, 80]))
            if depth < 3 and e > t and rng.random() < 0.5:
                nest(t, e, depth + 1)
            spans.append((rng.choice("abc"), rng.randrange(2), t, e))
            t = e + rng.choice([0, 0, 10])

    nest(0, 400, 0)
    cuts = sorted(rng.sample(range(1, len(spans)), min(5, len(spans) - 1))) if len(spans) > 1 else []
    flushes = [spans[a:b] for a, b in zip([0, *cuts], [*cuts, len(spans)])]
    path = tmp_path / "t.pftrace"
    stream(path, flushes)
    made = sorted((n, ts, dur) for *_, ts, dur, _, n in proto_import(path.read_bytes()))
    assert made == sorted((n, s, e - s) for n, _, s, e in spans)
    assert len(perfetto.read(str(path)).spans) == len(spans)


def test_stream_header_updates_and_resume(tmp_path: Path) -> None:
    path = tmp_path / "t.pftrace"
    stream(path, FLUSHES[:3], cut_after=2)
    got = perfetto.read(str(path))  # killed: no final header, the streamed updates count
    assert got.metadata["clock"]["sync_to_rank0"] == [{"flush": 1}, {"flush": 2}]
    header = perfetto.read_header(str(path))
    assert header["metadata"] == {k: v for k, v in got.metadata.items() if k not in ("base_ns", "world_size")}
    assert header["baseTimeNanoseconds"] == BASE and header["distributedInfo"] == {"rank": 1, "world_size": 2}
    header = {"distributedInfo": {"rank": 0}, "metadata": {"run_id": "x"}}
    w = perfetto.StreamWriter(str(path), BASE, Process(1, 0, "rank 0", 0), header)
    t = Trace()
    tr = t.add_track(Track(t.add_process(Process(1, 0, "rank 0", 0)), 1, "thread MainThread (host)", "cpu"))
    t.add_span("a", tr, BASE + 10, BASE + 20)
    w.append(t, [0])
    w.finish({**header, "metadata": {"run_id": "x", "spans": 1}})
    assert w.closed
    w.resume()
    t.spans.start[0], t.spans.end[0] = BASE + 5, BASE + 30  # earlier than the last written time
    w.append(t, [0])
    w.abandon()
    got = perfetto.read(str(path))
    assert sorted(zip(got.spans.start, got.spans.end)) == [(BASE + 5, BASE + 30), (BASE + 10, BASE + 20)]
    assert got.metadata == {"run_id": "x", "spans": 1, "base_ns": BASE}
    assert perfetto.read_header(str(path))["metadata"] == {"run_id": "x", "spans": 1}
    assert w.spans_written == 2


def test_stream_cut_at_any_byte_reads_the_spans_before_the_cut(tmp_path: Path) -> None:
    path = tmp_path / "t.pftrace"
    stream(path, FLUSHES)
    data = path.read_bytes()
    whole = {(n, s, e) for n, _, s, e, _ in perfetto.read(str(path)).iter_spans()}
    counts: list[int] = []
    for cut in range(len(data) + 1):
        try:
            got = perfetto.read("cut", data[:cut])
        except TraceFormatError:
            assert counts == [], f"cut at {cut} after a loadable cut"  # only before the first packet
            continue
        counts.append(len(got.spans))
        assert {(n, s, e) for n, _, s, e, _ in got.iter_spans()} <= whole
    assert counts[0] == 0 and counts[-1] == 14 and counts == sorted(counts)


# ---- the real Perfetto UI -----------------------------------------------------------------------

SLICES = """select p.pid, t.name as thread, s.ts, s.dur, s.depth, s.name from slice s
  join thread_track tt on s.track_id = tt.id join thread t using(utid) join process p using(upid)
  order by p.pid, thread, s.ts, s.depth, s.name"""
COUNTERS = """select p.pid, t.name, c.ts, c.value from counter c join process_counter_track t on c.track_id = t.id
  join process p using(upid) order by p.pid, t.name, c.ts"""


@pytest.fixture(scope="module")
def ui(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    why_not = perfetto_ui.available()
    if why_not:
        pytest.skip(why_not)
    with perfetto_ui.perfetto_ui(tmp_path_factory.mktemp("ui")) as u:
        yield u


def shown(ui: Any, path: Path) -> dict[str, Any]:
    page = ui.load(path)
    try:
        return {
            "errors": ui.query(
                page, "select name, idx, value from stats where severity in ('error', 'data_loss') and value > 0"
            ),
            "slices": ui.query(page, SLICES),
            "counters": ui.query(page, COUNTERS),
            "processes": ui.query(page, "select pid, name from process where name is not null order by pid"),
        }
    finally:
        page.close()


@pytest.mark.browser
def test_ui_shows_what_it_shows_for_the_json(ui: Any, tmp_path: Path) -> None:
    trace = merged_trace()
    trace.extra.clear()  # other tools' instants: drawn from the JSON, only carried in protobuf
    rank_trace(3, steps=4, seed=9, trace=trace)  # a rank with misuse beside the merged ones
    perfetto.write(trace, str(tmp_path / "t.pftrace"))
    chrome.write(trace, str(tmp_path / "t.json"))
    got, want = shown(ui, tmp_path / "t.pftrace"), shown(ui, tmp_path / "t.json")
    assert got["errors"] == [] and want["errors"] == []
    assert got["slices"] == want["slices"] and len(got["slices"]) == len(trace.spans)
    assert {r["thread"] for r in got["slices"]} >= {"cuda:0 default stream (overflow 1)", "stream 7"}
    assert got["processes"] == want["processes"]
    assert got["counters"] == want["counters"] and {r["name"] for r in got["counters"]} == {"cuda:0 memory allocated"}


@pytest.mark.browser
def test_ui_recorded_run_and_streamed_file_cut_mid_packet(ui: Any, tmp_path: Path) -> None:
    json_path, proto_path = recorded_run(tmp_path)
    got, want = shown(ui, proto_path), shown(ui, json_path)
    assert got["errors"] == [] and got["slices"] == want["slices"] and got["processes"] == want["processes"]
    path = tmp_path / "streamed.pftrace"
    stream(path, FLUSHES)
    data = path.read_bytes()
    full = shown(ui, path)
    assert full["errors"] == [] and len(full["slices"]) == 14
    for cut in (len(data) // 3, len(data) // 2 + 1, len(data) - 2):
        (tmp_path / f"cut{cut}.pftrace").write_bytes(data[:cut])
        r = shown(ui, tmp_path / f"cut{cut}.pftrace")
        assert r["errors"] == [], cut
        complete = [s for s in r["slices"] if s["dur"] >= 0]
        assert len(complete) >= len(perfetto.read("cut", data[:cut]).spans)


@pytest.mark.browser
def test_ui_loads_the_file_of_a_recording_killed_mid_run(ui: Any, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.stream_worker", str(tmp_path), "100000", "--format", "perfetto"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    flushed = 0
    for _ in range(30):
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        flushed = int(line)
    time.sleep(random.Random(os.getpid()).uniform(0, 0.02))
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    path = tmp_path / "trace_rank0.pftrace"
    assert len(perfetto.read(str(path)).spans) >= flushed
    r = shown(ui, path)
    assert r["errors"] == [] and len(r["slices"]) >= flushed
