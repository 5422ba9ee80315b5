"""Hostile and odd input files: every reader answers with a clear `TraceFormatError` (or reads
the file sanely), in bounded time and memory, and never hangs on a file that is not a file.

The files are built here, small; the memory bombs are read in a child process whose peak
resident memory is measured.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from gputrace import digest, merge, summary
from gputrace.cli import main
from gputrace.errors import GputraceError, TraceFormatError
from gputrace.trace import chrome, registry
from gputrace.trace.model import Process, Trace, Track
from gputrace.validate import validate_file

BASE = 1_700_000_000_000_000_000


class TookTooLong(Exception):
    pass


@contextlib.contextmanager
def within(seconds: float) -> Iterator[None]:
    """Fail (instead of hanging the suite) when the block runs longer than `seconds`."""

    def ring(signum: int, frame: Any) -> None:
        raise TookTooLong(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def rank_trace(rank: int = 0, world: int = 2, run_id: str = "run-1", steps: int = 3) -> Trace:
    meta = {"gputrace_version": "test", "rank": rank, "world_size": world, "run_id": run_id}
    t = Trace(dict(meta))
    p = t.add_process(Process(rank + 1, rank, f"rank {rank}", rank, meta))
    track = t.add_track(Track(p, 1, "cuda:0 default stream", "cuda", 0, 0))
    for k in range(steps):
        s = BASE + k * 10_000_000
        t.add_span("step", track, s, s + 9_000_000, {"step": k})
        t.add_span("fwd", track, s, s + 5_000_000)
    return t


def events_file(path: Path, events: list[Any], **top: Any) -> Path:
    meta = {"gputrace_version": "test", "rank": 0, "world_size": 1}
    doc = {"baseTimeNanoseconds": BASE, "distributedInfo": {"rank": 0, "world_size": 1}, "metadata": meta}
    doc.update(top)
    doc["traceEvents"] = events
    path.write_text(json.dumps(doc))  # json: integers past 64 bits too
    return path


# ---- files that are not files --------------------------------------------------------------------


def test_a_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "trace_rank0.json"
    os.mkfifo(fifo)
    with within(10):
        for read in (validate_file, registry.read, lambda p: merge.load([p])):
            with pytest.raises(TraceFormatError, match="not a regular file"):
                read(str(fifo))
        with pytest.raises(GputraceError, match="not a regular file"):
            summary.summary_of_files([str(tmp_path)])
    # The command, as a user runs it: one line, exit 2, no hang.
    for command in (["validate", str(fifo)], ["summary", str(tmp_path)]):
        r = subprocess.run(
            [sys.executable, "-m", "gputrace", *command], capture_output=True, text=True, timeout=60, cwd=tmp_path
        )
        assert r.returncode == 2, r.stderr
        assert "not a regular file" in r.stderr and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_link_to_dev_zero_is_refused(tmp_path: Path) -> None:
    link = tmp_path / "trace_rank0.json"
    os.symlink("/dev/zero", link)
    digest_link = tmp_path / "x.digest"
    os.symlink("/dev/zero", digest_link)
    with within(10):
        for read in (validate_file, registry.read, lambda p: merge.load([p]), lambda p: summary.summary_of_files([p])):
            with pytest.raises(TraceFormatError, match="not a regular file"):
                read(str(link))
        with pytest.raises(TraceFormatError, match="not a regular file"):
            summary.summary_of_files([str(digest_link)])
    r = CliRunner().invoke(main, ["validate", str(link)])
    assert r.exit_code == 2 and "not a regular file" in r.output and "Traceback" not in r.output


# ---- a cut file whose last event is hostile ----------------------------------------------------------


def test_repairing_a_cut_array_is_linear_and_keeps_the_complete_events(tmp_path: Path) -> None:
    event = b'{"ph":"X","name":"a","pid":1,"tid":2,"ts":1,"dur":1}'
    complete = b"[" + b",".join([event] * 500)  # another tool's compact array: no line ends
    cases = {
        "braces_in_a_string.json": complete + b',{"ph":"X","name":"' + b"}" * 8_000_000,
        "braces_as_structure.json": complete + b',{"ph":"X","args":[' + b"{}," * 2_700_000,
        "nested.json": complete + b',{"ph":"X","args":' + b'{"a":' * 100_000 + b"{}}" * 2_000_000,
    }
    for name, body in cases.items():
        path = tmp_path / name
        path.write_bytes(body)
        t0 = time.perf_counter()
        with within(30):
            trace = registry.read(str(path))
        took = time.perf_counter() - t0
        assert len(trace.spans) == 500, name
        assert trace.metadata.get("file_cut")
        assert took < 5, f"{name}: {took:.1f} s"
    # The object form, cut inside its events, repairs the same way.
    obj = tmp_path / "object.json"
    obj.write_bytes(b'{"traceEvents": ' + complete + b',{"ph":"X","name":"' + b"}" * 1_000_000)
    with within(30):
        assert len(registry.read(str(obj)).spans) == 500


# ---- memory bombs --------------------------------------------------------------------------------

CHILD = r"""
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # an old reader fails here, not the machine
from gputrace import digest, merge, summary
from gputrace.errors import GputraceError
from gputrace.validate import validate_file
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key): return int(line.split()[1]) * 1024
op, path = sys.argv[1], sys.argv[2]
before = status("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
t = time.perf_counter()
try:
    ops = {"validate": validate_file, "summary": lambda p: summary.summary_of_files([p])}
    ops.get(op, lambda p: merge.load([p]))(path)
    outcome = "ok"
except GputraceError as e:
    outcome = str(e)
print(json.dumps({"peak": status("VmHWM:") - before, "s": time.perf_counter() - t, "outcome": outcome}))
"""


def measured(op: str, path: Path) -> dict[str, Any]:
    """`op` on `path` in a fresh process: its peak memory above its imports, time and outcome."""
    r = subprocess.run([sys.executable, "-c", CHILD, op, str(path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return orjson.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_a_list_for_a_time_is_skipped_before_any_arithmetic(tmp_path: Path) -> None:
    ev = {"ph": "X", "name": "bomb", "pid": 1, "tid": 1, "ts": [0] * 600_000, "dur": 1}
    path = events_file(tmp_path / "trace_rank0.json", [ev, {**ev, "ts": 5, "dur": [0] * 600_000}, x_event(1)])
    size = path.stat().st_size
    assert size > 1_000_000
    for op in ("validate", "summary", "merge"):
        r = measured(op, path)
        assert r["outcome"] == "ok", r
        assert r["peak"] < 60 * size, f"{op}: {r['peak'] / 1e6:.0f} MB for a {size / 1e6:.1f} MB file"
    assert [registry.read(str(path)).names[i] for i in registry.read(str(path)).spans.name] == ["a"]


def test_a_zlib_bomb_is_refused_within_a_bounded_inflation(tmp_path: Path) -> None:
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    from gputrace.trace import perfetto

    path = tmp_path / "trace_rank0.pftrace"
    perfetto.write(rank_trace(), str(path))
    # Valid packets (an end event each), ~256 MB of them inflated, in ~0.3 MB.
    packet = pb.TracePacket(timestamp=1, trusted_packet_sequence_id=2, track_event=pb.TrackEvent(type=2, track_uuid=1))
    block = pb.Trace(packet=[packet]).SerializeToString() * 100_000
    z = zlib.compressobj(9)
    bomb = b"".join(z.compress(block) for _ in range((256 << 20) // len(block))) + z.flush()
    with open(path, "ab") as f:
        f.write(pb.Trace(packet=[pb.TracePacket(compressed_packets=bomb)]).SerializeToString())
    size = path.stat().st_size
    assert size < 1 << 20
    r = measured("validate", path)
    assert "decompression bomb" in r["outcome"], r
    assert r["peak"] < 2 * max(perfetto.INFLATE_FACTOR * size, perfetto.INFLATE_MIN) + (40 << 20), r
    assert r["s"] < 10, r


# ---- values that used to raise something other than a TraceFormatError ---------------------------


def x_event(ts: Any, dur: Any = 1, pid: Any = 1, tid: Any = 1, name: str = "a") -> dict[str, Any]:
    return {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}


def test_odd_ids_and_times_are_skipped_event_by_event(tmp_path: Path) -> None:
    path = events_file(
        tmp_path / "trace_rank0.json",
        [
            x_event(1, pid={"a": 1}),
            x_event(1, tid=[1, 2]),
            {"ph": "B", "name": "b", "pid": [1], "tid": 1, "ts": 1},
            {"ph": "C", "name": "c", "pid": {}, "ts": 1, "args": {"v": 1}},
            {"ph": "i", "name": "i", "pid": [], "tid": 1, "ts": 1},
            {"ph": "M", "name": "process_name", "pid": [1], "args": {"name": ["x"]}},
            x_event(2**70),
            x_event(1, dur=2**70),
            x_event(1e300),
            {"ph": "C", "name": "c", "pid": 1, "ts": 2**70, "args": {"v": 1}},
            {"ph": "C", "name": "c", "pid": 1, "ts": 1, "args": {"v": 10**400}},
            {"ph": "i", "name": "i", "pid": 1, "tid": 1, "ts": 2**70},
            {"ph": "i", "name": "i", "pid": 1, "tid": 1, "ts": 1, "dur_ns": [0], "ts_ns": {}},
            x_event("1" * 5000),
            x_event(3, name="kept"),
        ],
    )
    with within(20):
        trace = registry.read(str(path))
        assert [trace.names[i] for i in trace.spans.name] == ["kept"]
        report = validate_file(str(path))
        assert not report.ok  # Perfetto drops or misplaces these: validate says so
        assert merge.load([str(path)]).spans
        summary.summary_of_files([str(path)])
    r = CliRunner().invoke(main, ["validate", str(path)])
    assert r.exit_code == 1 and "Traceback" not in r.output


def test_a_base_time_past_64_bits_is_a_format_error(tmp_path: Path) -> None:
    path = events_file(tmp_path / "trace_rank0.json", [x_event(1)], baseTimeNanoseconds=2**64)
    with pytest.raises(TraceFormatError, match="baseTimeNanoseconds is out of range"):
        registry.read(str(path))
    r = CliRunner().invoke(main, ["summary", str(path)])
    assert r.exit_code == 2 and "out of range" in r.output and "Traceback" not in r.output
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    pf = tmp_path / "trace_rank1.pftrace"
    header = {"baseTimeNanoseconds": 2**64 - 1, "metadata": {"gputrace_version": "test", "rank": 1}}
    bundle = pb.ChromeEventBundle(metadata=[{"name": "gputrace", "json_value": json.dumps(header)}])
    pf.write_bytes(pb.Trace(packet=[pb.TracePacket(chrome_events=bundle)]).SerializeToString())
    with pytest.raises(TraceFormatError, match="baseTimeNanoseconds is out of range"):
        registry.read(str(pf))


def test_uint64_timestamps_and_deep_values_in_protobuf(tmp_path: Path) -> None:
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    from gputrace.trace import perfetto

    path = tmp_path / "trace_rank0.pftrace"
    perfetto.write(rank_trace(), str(path))
    good = registry.read(str(path))
    # A slice whose times lie past 64 bits of ns, with an argument nested deeper than Python
    # recurses, on a track of its own.
    deep = "[" * 5000 + "]" * 5000
    extra = pb.Trace(
        packet=[
            pb.TracePacket(
                trusted_packet_sequence_id=77,
                track_descriptor=pb.TrackDescriptor(
                    uuid=999, thread=pb.ThreadDescriptor(pid=1, tid=9, thread_name="x")
                ),
            ),
            pb.TracePacket(
                timestamp=2**64 - 10,
                trusted_packet_sequence_id=77,
                track_event=pb.TrackEvent(type=1, track_uuid=999, name="far"),
            ),
            pb.TracePacket(
                timestamp=2**64 - 1, trusted_packet_sequence_id=77, track_event=pb.TrackEvent(type=2, track_uuid=999)
            ),
            pb.TracePacket(
                timestamp=5,
                trusted_packet_sequence_id=77,
                track_event=pb.TrackEvent(
                    type=1,
                    track_uuid=999,
                    name="deep",
                    debug_annotations=[pb.DebugAnnotation(name="v", legacy_json_value=deep)],
                ),
            ),
            pb.TracePacket(
                timestamp=6, trusted_packet_sequence_id=77, track_event=pb.TrackEvent(type=2, track_uuid=999)
            ),
        ]
    ).SerializeToString()
    with open(path, "ab") as f:
        f.write(extra)
    with within(20):
        trace = registry.read(str(path))
        names = [trace.names[i] for i in trace.spans.name]
        assert "far" not in names and names.count("deep") == 1
        assert len(trace.spans) == len(good.spans) + 1
        assert trace.spans.args[names.index("deep")] == {"v": deep}  # kept as its text
        assert validate_file(str(path)).spans == len(trace.spans)
        merge.load([str(path)])


def test_compressed_packets_nested_deep_are_a_format_error(tmp_path: Path) -> None:
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    from gputrace.trace import perfetto

    path = tmp_path / "trace_rank0.pftrace"
    perfetto.write(rank_trace(), str(path))
    blob = pb.Trace(packet=[pb.TracePacket(timestamp=1)]).SerializeToString()
    for _ in range(2000):
        blob = pb.Trace(packet=[pb.TracePacket(compressed_packets=zlib.compress(blob))]).SerializeToString()
    with open(path, "ab") as f:
        f.write(blob)
    with within(20):
        for read in (registry.read, validate_file, lambda p: merge.load([p])):
            with pytest.raises(TraceFormatError, match="nested more than"):
                read(str(path))


@pytest.mark.parametrize(
    "field, value",
    [
        ("pid_rank", [1, 2]),
        ("pid_rank", {"1": "zero"}),
        ("rank_metadata", {"zero": {}}),
        ("ranks", 3),
        ("ranks", [{"a": 1}]),
        ("foreign_pids", 7),
        ("foreign_pids", [[1]]),
        ("alignment", {"per_rank": {"pid": {}}}),
        ("alignment", [1]),
    ],
)
def test_damaged_merged_metadata_is_a_format_error(tmp_path: Path, field: str, value: Any) -> None:
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    for r in range(2):
        chrome.write(rank_trace(r), str(ranks / f"trace_rank{r}.json"))
    merged = tmp_path / "merged.json"
    merge.merge([str(ranks)], str(merged))
    doc = orjson.loads(merged.read_bytes())
    doc["metadata"][field] = value
    merged.write_bytes(orjson.dumps(doc))
    with within(20):
        registry.read(str(merged))  # the reader reads what makes sense
        validate_file(str(merged))
        for read in (lambda p: merge.load([p]), lambda p: summary.summary_of_files([p])):
            with pytest.raises(TraceFormatError, match=f"metadata.{field} is damaged"):
                read(str(merged))
    r = CliRunner().invoke(main, ["summary", str(merged)])
    assert r.exit_code == 2 and "is damaged" in r.output and "Traceback" not in r.output


def test_bytes_that_are_not_utf8_are_replaced_not_taken_for_a_cut(tmp_path: Path) -> None:
    path = tmp_path / "trace_rank0.json"
    chrome.write(rank_trace(), str(path))
    path.write_bytes(path.read_bytes().replace(b'"name":"fwd"', b'"name":"fwd\xff\xfe"'))
    trace = registry.read(str(path))
    assert "fwd\ufffd\ufffd" in trace.names and not trace.metadata.get("file_cut")
    assert len(trace.spans) == len(rank_trace().spans)
    assert validate_file(str(path)).ok
    assert summary.summary_of_files([str(path)]).notes[0] == "read from the full traces"


# ---- digests ------------------------------------------------------------------------------------------


def digest_folder(d: Path, ranks: int = 2, run_id: str = "run-1") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for r in range(ranks):
        t = rank_trace(r, ranks, run_id)
        path = d / f"trace_rank{r}.json"
        chrome.write(t, str(path))
        assert digest.write_for_trace(t, str(path), "step") is not None
    return d


def damaged(doc: dict[str, Any], how: str) -> dict[str, Any]:
    if how == "hist":
        doc["stats"]["hist"][0] = [1, 2, 3]
    elif how == "count":
        doc["stats"]["count"][0] = "many"
    elif how == "track":
        doc["stats"]["max_track"][0] = 99
    elif how == "start":
        doc["spans"]["start"][0] = 2**70
    elif how == "warmup":
        doc["warmup"] = [1]
    elif how == "names":
        doc["stats"]["name"] = doc["stats"]["name"][:-1]
    elif how == "bucket":
        doc["stats"]["hist"][0] = [10**6, 1]
    return doc


@pytest.mark.parametrize("how", ["hist", "count", "track", "start", "warmup", "names", "bucket"])
def test_a_digest_wrong_inside_falls_back_to_its_trace_with_a_warning(tmp_path: Path, how: str) -> None:
    from gputrace.errors import GputraceWarning

    d = digest_folder(tmp_path / "run")
    expected = summary.summary_of_files([str(d)], full=True)
    dig = d / "digest_rank0.digest"
    dig.write_text(json.dumps(damaged(orjson.loads(dig.read_bytes()), how)))
    with pytest.warns(GputraceWarning, match="damaged gputrace digest.*read its trace instead"):
        s = summary.summary_of_files([str(d)])
    assert "ranks 0 had no digest as new as their trace" in s.notes[0] or "rank" in s.notes[0]
    assert s.steps is not None and expected.steps is not None and s.steps.count == expected.steps.count
    # Named alone (its trace not there to fall back to): one line, exit 2.
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "digest_rank0.digest").write_bytes(dig.read_bytes())
    r = CliRunner().invoke(main, ["summary", str(lone / "digest_rank0.digest")])
    assert r.exit_code == 2 and "damaged gputrace digest" in r.output and "Traceback" not in r.output


def test_a_digest_whose_step_name_is_not_utf8_is_read_again_from_its_trace(tmp_path: Path) -> None:
    d = digest_folder(tmp_path / "run")
    dig = d / "digest_rank0.digest"
    dig.write_bytes(dig.read_bytes().replace(b'"step_name":"step"', b'"step_name":"st\xffep"'))
    s = summary.summary_of_files([str(d)])
    assert s.steps is not None and s.steps.count == 3


def test_a_digest_is_taken_only_for_the_trace_it_was_written_for(tmp_path: Path) -> None:
    from gputrace.trace import digestfile

    one = digest_folder(tmp_path / "one", run_id="run-1")
    two = digest_folder(tmp_path / "two", run_id="run-2")  # another run, files of the same sizes
    for r in range(2):
        t1, t2 = one / f"trace_rank{r}.json", two / f"trace_rank{r}.json"
        assert t1.stat().st_size == t2.stat().st_size
    assert (one / "trace_rank0.json").stat().st_size == (one / "trace_rank1.json").stat().st_size
    d0 = digestfile.read(str(one / "digest_rank0.digest"))
    d1 = digestfile.read(str(one / "digest_rank1.digest"))
    other_run = digestfile.read(str(two / "digest_rank0.digest"))
    trace0 = str(one / "trace_rank0.json")
    assert digestfile.fresh(d0, trace0)
    assert not digestfile.fresh(d1, trace0)  # another rank's digest, same size
    assert not digestfile.fresh(other_run, trace0)  # another run's digest of this rank, same size
    # Another rank's digest put in its place: the summary computes rank 0 from its trace.
    (one / "digest_rank0.digest").write_bytes((one / "digest_rank1.digest").read_bytes())
    s = summary.summary_of_files([str(one)])
    assert "ranks 0 had no digest as new as their trace" in s.notes[0]
    # Another run's rank 0 (same size, same name): the same.
    (one / "digest_rank0.digest").write_bytes((two / "digest_rank0.digest").read_bytes())
    os.utime(one / "digest_rank0.digest")
    s = summary.summary_of_files([str(one)])
    assert "ranks 0 had no digest as new as their trace" in s.notes[0]
    # Copied without their times (cp, scp): still the digests of their traces.
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in two.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    s = summary.summary_of_files([str(copy)])
    assert "had no digest" not in s.notes[0] and "digests" in s.notes[0]


def test_another_tools_events_with_odd_times_in_protobuf_are_merged_without_them(tmp_path: Path) -> None:
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    from gputrace.trace import perfetto

    path = tmp_path / "trace_rank0.pftrace"
    perfetto.write(rank_trace(), str(path))
    extra = [
        {"ph": "i", "name": "dur a list", "pid": 1, "tid": 1, "ts_ns": BASE, "dur_ns": [0, 0]},
        {"ph": "i", "name": "ts past 64 bits", "pid": 1, "tid": 1, "ts_ns": 2**64 - 1},
        {"ph": "i", "name": "kept", "pid": 1, "tid": 1, "ts_ns": BASE + 5},
    ]
    bundle = pb.ChromeEventBundle(metadata=[{"name": "gputrace_extra", "json_value": json.dumps(extra)}])
    with open(path, "ab") as f:
        f.write(pb.Trace(packet=[pb.TracePacket(chrome_events=bundle)]).SerializeToString())
    names = {e["name"] for e in registry.read(str(path)).extra}
    assert names == {"dur a list", "kept"}
    out = tmp_path / "merged.json"
    merge.merge([str(path)], str(out))
    assert validate_file(str(out)).ok


def test_the_digest_files_histograms_are_the_digests() -> None:
    from gputrace.trace import digestfile

    assert digestfile.HIST_BUCKETS == len(digest._BOUND) - 1  # the buckets a digest reader accepts


def test_a_base_time_at_the_edge_of_64_bits_is_one_line_from_summary(tmp_path: Path) -> None:
    """A trace whose baseTimeNanoseconds is -2**63 (in range, so read) with clock syncs: their
    alignment would move times past 64 bits."""
    from gputrace.trace import chrome
    from gputrace.trace.model import Process, Trace, Track

    base = 1_764_000_000_000_000_000
    for r in range(2):
        syncs = [
            {"at_ns": base, "offset_ns": 7 + r, "error_ns": 900},
            {"at_ns": base + 3_000_000_000, "offset_ns": 2_007 + r, "error_ns": 900},
        ]
        meta = {"gputrace_version": "t", "rank": r, "world_size": 2, "run_id": "x", "clock": {"sync_to_rank0": syncs}}
        t = Trace(dict(meta))
        p = t.add_process(Process(r + 1, r, f"rank {r}", r, meta))
        tr = t.add_track(Track(p, 2, "cuda:0 stream 7", "cuda", 0, 7))
        for k in range(4):
            t.add_span("step", tr, base + 10_000_000 * k, base + 10_000_000 * k + 5_000_000)
        chrome.write(t, str(tmp_path / f"trace_rank{r}.json"))
    p0 = tmp_path / "trace_rank0.json"
    text = p0.read_text()
    assert f'"baseTimeNanoseconds": {base}' in text
    p0.write_text(text.replace(f'"baseTimeNanoseconds": {base}', '"baseTimeNanoseconds": -9223372036854775808', 1))
    run = subprocess.run(
        [sys.executable, "-m", "gputrace", "summary", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-400:]
    assert "64-bit" in run.stderr and len(run.stderr.strip().splitlines()) == 1
