"""Launch arrows: each span's host entry (`SpanColumns.entry`) is written by both formats as a flow
arrow from the host moment of entry to the span on its stream, read back into the column, kept
by merge and the viewer's window, drawn by the real Perfetto UI (one flow row per span), and the
C and Python encoders write the same bytes.

Traces are built in memory with `entry` set, as the recorder fills it for CUDA spans."""

from __future__ import annotations

import random
import re
import subprocess
import sys
from array import array
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from gputrace import native
from gputrace.cli import main
from gputrace.trace import chrome, perfetto, registry
from gputrace.trace.layout import ENTRY_ARG, LAUNCH_TRACK
from gputrace.trace.model import Process, Trace, Track, _NoCats
from gputrace.validate import validate_file
from viewer import data as viewer_data

from . import perfetto_ui

BASE = 1_764_000_000_000_000_000
ROOT = Path(__file__).resolve().parent.parent
TWINS = [pytest.param(True, id="c"), pytest.param(False, id="python")]
FORMATS = ["json", "pftrace"]


def twin(c: bool) -> Any:
    if c and native.hot is None and native.UNUSED_BECAUSE is not None and not native._build:
        pytest.skip(f"no C build: {native.UNUSED_BECAUSE}")
    return native.using(c)


def cuda_rank(
    rank: int = 0,
    steps: int = 20,
    seed: int = 0,
    trace: Trace | None = None,
    syncs: list[dict[str, Any]] | None = None,
    world: int = 2,
) -> Trace:
    """A rank as the recorder makes it with host entries: steps of nested CUDA spans on two
    streams, each entered on the host some microseconds before it runs (a queue that grows within
    a step), a few whose measured entry lies at or after their start (clocks that meet only within
    the anchors' error), the first entered before any span starts, host spans without an entry."""
    rng = random.Random(seed)
    own = trace is None
    if trace is None:
        meta: dict[str, Any] = {"gputrace_version": "test", "run_id": "run-1", "world_size": world}
        meta["clock"] = {"sync_to_rank0": syncs or []}
        trace = Trace(meta)
    p = trace.add_process(Process(rank + 1, rank, f"rank {rank}", rank, trace.metadata if own else {}))
    main_s = trace.add_track(Track(p, 1, "cuda:0 default stream", "cuda", 0, 0))
    side = trace.add_track(Track(p, 2, "cuda:0 stream 7", "cuda", 0, 7))
    host = trace.add_track(Track(p, 3, "thread MainThread (host)", "cpu", None, 100))
    entries: list[int] = []
    t = BASE + 1_000_000 + rank * 3_000
    for k in range(steps):
        trace.add_span("step", host, t - 20_000, t + 60_000, {"step": k})
        entries.append(0)
        lag = 10_000
        for j in range(4):
            s = t + j * 12_000
            trace.add_span(f"layer{j}", main_s, s, s + 11_000)
            entries.append(s - lag)
            lag += rng.randint(1_000, 9_000)
            trace.add_span("kernel", main_s, s, s + rng.choice([0, 4_000]))  # shares its parent's start
            entries.append(s - lag + (rng.choice([0, 0, 0, lag, lag + 3]) if j else 0))  # some at/after it
        trace.add_span("all_reduce", side, t + 1_000, t + 40_000, {"collective": True})
        entries.append(t + 1_000 - 25_000)
        t += 100_000
    entries[1] = BASE + 5  # before everything else: the written trace's base moves to it
    if trace.spans.entry is None:
        trace.spans.entry = array("q", bytes(8 * (len(trace.spans) - len(entries))))
    trace.spans.entry.extend(entries)
    return trace


def rows(trace: Trace) -> list[tuple[Any, ...]]:
    """(rank, track name, name, start, end, entry) of every span, sorted; a span the writer put
    on an overflow lane of its track (streamed spans that open where one of an earlier flush
    opens) counts as on its track."""
    sp = trace.spans
    entry = sp.entry if sp.entry is not None else [0] * len(sp)
    rank = trace.track_rank()
    track = [re.sub(r" \(overflow \d+\)$", "", t.name) for t in trace.tracks]
    return sorted(
        (rank[sp.track[i]], track[sp.track[i]], trace.names[sp.name[i]], sp.start[i], sp.end[i], entry[i])
        for i in range(len(sp))
    )


def with_entries(trace: Trace) -> int:
    assert trace.spans.entry is not None
    return sum(1 for e in trace.spans.entry if e > 0)


def stream_to(path: Path, trace: Trace, pieces: int = 5, finish: bool = True) -> None:
    """Write a one-rank trace through its format's stream writer the way the session does: a
    new trace per flush (over one name table), spans in the order they ended."""
    fmt = registry.for_path(str(path))
    proc = trace.processes[0]
    world = trace.metadata.get("world_size", 2)
    header = {"distributedInfo": {"rank": proc.rank, "world_size": world}, "metadata": dict(trace.metadata)}
    w = fmt.stream_writer(str(path), BASE, proc, header)
    sp = trace.spans
    assert sp.entry is not None
    order = sorted(range(len(sp)), key=lambda i: (sp.end[i], -sp.start[i]))
    step = -(-len(order) // pieces)
    for lo in range(0, len(order), step):
        part = Trace(trace.metadata)
        part.names, part._name_index = trace.names, trace._name_index
        part.add_process(proc)
        for tr in trace.tracks:
            part.add_track(tr)
        part.spans.entry = array("q")
        for i in order[lo : lo + step]:
            part.spans.append(sp.name[i], sp.track[i], sp.start[i], sp.end[i], sp.args[i])
            part.spans.entry.append(sp.entry[i])
        w.append(part, range(len(part.spans)))
    if finish:
        w.finish(header)


# ---- round trips ----------------------------------------------------------------------------------


@pytest.mark.parametrize("c", TWINS)
@pytest.mark.parametrize("ext", FORMATS)
@pytest.mark.parametrize("ordered", [True, False])
def test_whole_file_reads_back_every_entry(c: bool, ext: str, ordered: bool, tmp_path: Path) -> None:
    trace = cuda_rank()
    path = tmp_path / f"rank0.{ext}"
    with twin(c):
        registry.for_path(str(path)).write(trace, str(path), ordered=ordered)
        back = registry.read(str(path))
    assert rows(back) == rows(trace)
    assert with_entries(back) == with_entries(trace) == 20 * 9
    assert LAUNCH_TRACK not in {t.name for t in back.tracks}  # the arrows' track is not a track of spans
    report = validate_file(str(path))
    assert report.ok, report.errors


@pytest.mark.parametrize("c", TWINS)
@pytest.mark.parametrize("ext", FORMATS)
def test_streamed_file_reads_back_every_entry_finished_or_not(c: bool, ext: str, tmp_path: Path) -> None:
    trace = cuda_rank(steps=12, seed=3)
    with twin(c):
        stream_to(tmp_path / f"done.{ext}", trace)
        stream_to(tmp_path / f"open.{ext}", trace, finish=False)  # a run still going, or killed
        done, running = registry.read(str(tmp_path / f"done.{ext}")), registry.read(str(tmp_path / f"open.{ext}"))
    assert rows(done) == rows(trace) == rows(running)
    assert validate_file(str(tmp_path / f"done.{ext}")).ok


def test_a_file_cut_between_an_arrow_and_its_span_loses_only_that_entry(tmp_path: Path) -> None:
    trace = cuda_rank(steps=3)
    path = tmp_path / "rank0.json"
    stream_to(path, trace, finish=False)
    data = path.read_bytes()
    cut = data.rstrip(b"\n").rfind(b"\n")  # the last line (a span) cut off: its arrow's source stays
    back = chrome.read("cut", data[: cut + 1] + data[cut + 1 : cut + 20])
    assert len(back.spans) == len(trace.spans) - 1
    assert with_entries(back) in (with_entries(trace) - 1, with_entries(trace))


def test_a_trace_without_entries_is_written_as_before() -> None:
    trace = cuda_rank(steps=2)
    trace.spans.entry = None
    data = chrome.encode(trace)
    assert b"bind_id" not in data and LAUNCH_TRACK.encode() not in data
    assert chrome.read("x", data).spans.entry is None and perfetto.read("x", perfetto.encode(trace)).spans.entry is None


def test_an_entry_drawn_before_its_span_keeps_its_exact_value() -> None:
    """Perfetto drops an arrow whose source is not before its span: such a source is drawn 1 ns
    before the span and carries the measured entry."""
    trace = cuda_rank(steps=1)
    data = chrome.encode(trace)
    events = orjson.loads(data)["traceEvents"]
    sources = {e["bind_id"]: e for e in events if e.get("cat") == "launch"}
    spans = {e["bind_id"]: e for e in events if e.get("flow_in")}
    assert sources.keys() == spans.keys() and len(spans) == 9
    for k, s in sources.items():
        assert s["ts"] < spans[k]["ts"] and s["dur"] == 0 and s["tid"] != spans[k]["tid"]
    late = [s for s in sources.values() if "args" in s]
    assert late and all(s["args"][ENTRY_ARG] >= BASE + round(s["ts"] * 1000) for s in late)


# ---- C and Python write the same bytes -------------------------------------------------------------


@pytest.mark.skipif(native.UNUSED_BECAUSE is not None and native._build is None, reason="no C build")
def test_twins_write_the_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trace = cuda_rank(steps=8, seed=5)
    late = trace.add_track(Track(0, 9, "cuda:0 stream 9", "cuda", 0, 9))
    trace.add_span("a", late, BASE + 2_000_000, BASE + 2_050_000)  # two that cross: an overflow lane
    trace.add_span("b", late, BASE + 2_010_000, BASE + 2_090_000)
    assert trace.spans.entry is not None
    trace.spans.entry.extend([BASE + 1_990_000, BASE + 2_000_000])
    plain = cuda_rank(steps=8, seed=6)
    plain.spans.cat = _NoCats(len(plain.spans))  # as a recorder's columns: the C loop from the columns
    merged = Trace({"merged": True, "world_size": 2})
    cuda_rank(0, steps=3, trace=merged)
    cuda_rank(1, steps=3, seed=1, trace=merged)
    out: dict[bool, list[bytes]] = {}
    calls: list[str] = []
    for c in (True, False):
        with native.using(c):
            for name in ("_encode_rows", "_encode_events") if c else ():  # both C loops run, with arrows
                real = getattr(chrome, name)
                monkeypatch.setattr(chrome, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
            got = [chrome.encode(trace, ordered=o) for o in (True, False)] + [chrome.encode(merged)]
            got.append(chrome.encode(plain, ordered=True))
            got.append(chrome.encode_part(merged, base_ns=BASE))
            stream_to(tmp_path / f"s{c}.json", trace, pieces=3)
            got.append((tmp_path / f"s{c}.json").read_bytes())
            got.append(perfetto.encode(trace))
            out[c] = got
            monkeypatch.undo()
    assert set(calls) == {"_encode_rows", "_encode_events"}
    assert out[True] == out[False]
    assert all(b"bind_id" in b for b in out[True][:-1])


# ---- merge and the viewer's window ------------------------------------------------------------------


@pytest.mark.parametrize("ext,workers", [("json", "1"), ("pftrace", "1"), ("json", "2")])
def test_merge_keeps_each_entry_on_its_ranks_host_clock(ext: str, workers: str, tmp_path: Path) -> None:
    offset = 7_000
    syncs = [{"at_ns": BASE + 1_000_000, "offset_ns": offset, "error_ns": 10}]
    ranks = [cuda_rank(0), cuda_rank(1, seed=1, syncs=syncs)]
    paths = []
    for r, t in enumerate(ranks):
        paths.append(str(tmp_path / f"trace_rank{r}.{ext}"))
        registry.for_path(paths[-1]).write(t, paths[-1], ordered=True)
    dest = tmp_path / f"merged.{ext}"
    res = CliRunner().invoke(main, ["merge", *paths, "-o", str(dest), "--workers", workers])
    assert res.exit_code == 0, res.output
    merged = registry.read(str(dest))
    assert with_entries(merged) == with_entries(ranks[0]) + with_entries(ranks[1])
    got = rows(merged)
    # Rank 0 is the reference; rank 1's host entries move as its host spans move.
    assert [r for r in got if r[0] == 0] == rows(ranks[0])
    host_before = [r[3] for r in rows(ranks[1]) if r[1].endswith("(host)")]
    host_after = [r[3] for r in got if r[0] == 1 and r[1].endswith("(host)")]
    shift = host_after[0] - host_before[0]
    assert shift != 0 and [b - a for a, b in zip(host_before, host_after)] == [shift] * len(host_before)
    want = sorted((r[2], r[5] + shift if r[5] else 0) for r in rows(ranks[1]))
    assert sorted((r[2], r[5]) for r in got if r[0] == 1) == want
    assert validate_file(str(dest)).ok
    # Merged again with a step selection: the spans kept keep their entries.
    dest2 = tmp_path / f"steps.{ext}"
    res = CliRunner().invoke(main, ["merge", *paths, "-o", str(dest2), "--steps", "2:4"])
    assert res.exit_code == 0, res.output
    part = registry.read(str(dest2))
    kept = {(r[0], r[2], r[3]): r[5] for r in got}
    assert 0 < len(part.spans) < len(merged.spans)
    assert all(kept[(r[0], r[2], r[3])] == r[5] for r in rows(part))
    assert with_entries(part) > 0


def test_viewer_window_keeps_the_entries_of_the_spans_it_keeps() -> None:
    trace = cuda_rank()
    lo, hi = BASE + 1_300_000, BASE + 1_600_000
    w = viewer_data.window(trace, lo, hi)
    assert 0 < len(w.spans) < len(trace.spans)
    assert rows(w) == [r for r in rows(trace) if r[3] < hi and (r[4] > lo or r[3] >= lo)]
    assert b"flow_in" in viewer_data.timeline_trace(trace, BASE, lo, hi)


# ---- other tools' flows -----------------------------------------------------------------------------


def test_another_tools_flows_are_carried_as_before(tmp_path: Path) -> None:
    """A foreign trace's flow events (v1 `s`/`f`, and v2 fields on its slices, even of a category
    named like gputrace's sources) stay what they were: events carried and slices kept."""
    events = [
        {
            "ph": "X",
            "cat": "launch",
            "name": "cudaLaunchKernel",
            "pid": 7,
            "tid": 1,
            "ts": 10,
            "dur": 0,
            "bind_id": 5,
            "flow_out": True,
        },
        {
            "ph": "X",
            "cat": "kernel",
            "name": "gemm",
            "pid": 7,
            "tid": 2,
            "ts": 20,
            "dur": 5,
            "bind_id": 5,
            "flow_in": True,
        },
        {"ph": "s", "cat": "ac2g", "name": "launch", "id": 9, "pid": 7, "tid": 1, "ts": 11},
        {"ph": "f", "cat": "ac2g", "name": "launch", "id": 9, "pid": 7, "tid": 2, "ts": 21, "bp": "e"},
    ]
    src = tmp_path / "kineto.json"
    src.write_bytes(orjson.dumps({"traceEvents": events}))
    t = chrome.read(str(src))
    assert len(t.spans) == 2 and t.spans.entry is None
    assert sorted(e["ph"] for e in t.extra) == ["f", "s"]
    again = chrome.read("again", chrome.encode(t))
    assert len(again.spans) == 2 and again.spans.entry is None
    assert sorted((e["ph"], e["id"]) for e in again.extra) == [("f", 9), ("s", 9)]
    back = perfetto.read("p", perfetto.encode(t))
    assert len(back.spans) == 2 and sorted(e["ph"] for e in back.extra) == ["f", "s"]


def test_validate_cli_accepts_a_file_with_arrows(tmp_path: Path) -> None:
    path = tmp_path / "trace_rank0.json"
    chrome.write(cuda_rank(steps=2), str(path))
    proc = subprocess.run(
        [sys.executable, "-m", "gputrace", "validate", str(path)], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0 and " ok" in proc.stdout, proc.stdout + proc.stderr


# ---- what the real Perfetto UI shows ---------------------------------------------------------------


@pytest.fixture(scope="module")
def ui(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    why_not = perfetto_ui.available()
    if why_not:
        pytest.skip(why_not)
    with perfetto_ui.perfetto_ui(tmp_path_factory.mktemp("ui")) as u:
        yield u


FLOWS = """select p.pid, ti.name as to_thread, so.ts as from_ts, so.dur as from_dur, si.ts as to_ts,
  si.name as to_name, so.name as from_name, tout.name as from_thread
  from flow f join slice so on so.id = f.slice_out join slice si on si.id = f.slice_in
  join thread_track tti on si.track_id = tti.id join thread ti on ti.utid = tti.utid
  join thread_track tto on so.track_id = tto.id join thread tout on tout.utid = tto.utid
  join process p on p.upid = ti.upid order by p.pid, to_ts, to_name"""


def drawn(ui: Any, path: Path) -> dict[str, Any]:
    page = ui.load(path)
    try:
        return {
            "errors": ui.query(
                page, "select name, idx, value from stats where severity in ('error', 'data_loss') and value > 0"
            ),
            "flows": ui.query(page, FLOWS),
            "slices": ui.query(page, "select count(*) as n from slice")[0]["n"],
        }
    finally:
        page.close()


def expected_arrows(trace: Trace, base_ns: int) -> list[tuple[int, str, int, str]]:
    sp = trace.spans
    assert sp.entry is not None
    out = []
    for i in range(len(sp)):
        if sp.entry[i] > 0:
            p = trace.processes[trace.tracks[sp.track[i]].process]
            out.append((p.rank + 1, trace.tracks[sp.track[i]].name, sp.start[i] - base_ns, trace.names[sp.name[i]]))
    return sorted(out)


@pytest.mark.browser
@pytest.mark.parametrize("ext", FORMATS)
def test_ui_draws_one_arrow_per_span_with_an_entry(ui: Any, ext: str, tmp_path: Path) -> None:
    trace = cuda_rank(steps=6, seed=2)
    path = tmp_path / f"trace_rank0.{ext}"
    registry.for_path(str(path)).write(trace, str(path), ordered=True)
    base = registry.for_path(str(path)).read_header(str(path))["baseTimeNanoseconds"]
    shown = drawn(ui, path)
    assert shown["errors"] == []
    assert shown["slices"] == len(trace.spans) + with_entries(trace)
    flows = shown["flows"]
    assert sorted((f["pid"], f["to_thread"], f["to_ts"], f["to_name"]) for f in flows) == expected_arrows(trace, base)
    assert all(f["from_thread"] == LAUNCH_TRACK and f["from_dur"] == 0 and f["from_ts"] < f["to_ts"] for f in flows)
    assert all(f["from_name"] == f["to_name"] for f in flows)
    sp = trace.spans
    on_time = {
        (sp.start[i] - base, trace.names[sp.name[i]], sp.entry[i] - base)
        for i in range(len(sp))
        if 0 < sp.entry[i] < sp.start[i]
    }
    assert on_time <= {(f["to_ts"], f["to_name"], f["from_ts"]) for f in flows}  # drawn at the entry itself


@pytest.mark.browser
@pytest.mark.parametrize("ext", FORMATS)
def test_ui_draws_the_arrows_of_every_rank_of_a_merged_and_a_streamed_file(ui: Any, ext: str, tmp_path: Path) -> None:
    ranks = [cuda_rank(r, steps=4, seed=r, world=3) for r in range(3)]
    paths = []
    for r, t in enumerate(ranks):
        paths.append(str(tmp_path / f"trace_rank{r}.{ext}"))
        stream_to(Path(paths[-1]), t, pieces=3)
    dest = tmp_path / f"merged.{ext}"
    res = CliRunner().invoke(main, ["merge", *paths, "-o", str(dest)])
    assert res.exit_code == 0, res.output
    shown = drawn(ui, dest)
    assert shown["errors"] == []
    per_rank = {r + 1: sum(1 for f in shown["flows"] if f["pid"] == r + 1) for r in range(3)}
    assert per_rank == {r + 1: with_entries(t) for r, t in enumerate(ranks)}
    assert all(f["from_thread"] == LAUNCH_TRACK and f["from_ts"] < f["to_ts"] for f in shown["flows"])
    streamed = drawn(ui, Path(paths[1]))
    assert streamed["errors"] == [] and len(streamed["flows"]) == with_entries(ranks[1])


def test_validate_warns_of_arrows_perfetto_would_not_draw(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    chrome.write(cuda_rank(steps=3), str(good))
    assert validate_file(str(good)).warnings == []
    events = [
        {"ph": "X", "name": "src", "pid": 1, "tid": 1, "ts": 30, "dur": 0, "bind_id": 1, "flow_out": True},
        {"ph": "X", "name": "late", "pid": 1, "tid": 2, "ts": 20, "dur": 5, "bind_id": 1, "flow_in": True},
        {"ph": "X", "name": "alone", "pid": 1, "tid": 2, "ts": 40, "dur": 5, "bind_id": 2, "flow_in": True},
        {"ph": "X", "name": "fine", "pid": 1, "tid": 2, "ts": 50, "dur": 5, "bind_id": 3, "flow_in": True},
        {"ph": "X", "name": "src", "pid": 1, "tid": 1, "ts": 45, "dur": 0, "bind_id": 3, "flow_out": True},
    ]
    bad = tmp_path / "bad.json"
    bad.write_bytes(orjson.dumps({"traceEvents": events}))
    report = validate_file(str(bad))
    assert report.ok and len(report.warnings) == 2
    assert "event 1" in report.warnings[0] and "starts at or after it" in report.warnings[0]
    assert "event 2" in report.warnings[1] and "no source" in report.warnings[1]


@pytest.mark.parametrize("ext", FORMATS)
def test_reads_a_batch_at_a_time_keep_every_entry(ext: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Small batches, so arrows' sources and their spans fall in different batches.
    monkeypatch.setattr(chrome, "BATCH_BYTES", 4096)
    monkeypatch.setattr(chrome, "HEADER_BYTES", 512)
    monkeypatch.setattr(perfetto, "PACKET_BATCH_BYTES", 512)
    monkeypatch.setattr(perfetto, "INFLATED_BATCH_BYTES", 512)
    trace = cuda_rank(steps=60, seed=5)
    whole, streamed = tmp_path / f"whole.{ext}", tmp_path / f"streamed.{ext}"
    registry.for_path(str(whole)).write(trace, str(whole))
    stream_to(streamed, trace, pieces=7, finish=False)
    assert whole.stat().st_size > 8 * (4096 if ext == "json" else 512)
    for path in (whole, streamed):
        back = registry.read(str(path))
        assert rows(back) == rows(trace)
        assert with_entries(back) == with_entries(trace) == 60 * 9
        if ext == "json":  # the same as the file parsed whole
            at_once = chrome._build(str(path), *chrome.parse(str(path), path.read_bytes()))
            assert at_once.spans.entry is not None and back.spans.entry is not None
            assert list(back.spans.entry) == list(at_once.spans.entry)


def test_validate_a_batch_at_a_time_warns_of_the_same_arrows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An arrow's source and end many batches apart, either way round.
    filler = [{"ph": "X", "name": "pad", "pid": 1, "tid": 3, "ts": 100 + k, "dur": 0.5} for k in range(400)]
    events = [
        {"ph": "X", "name": "src", "pid": 1, "tid": 1, "ts": 30, "dur": 0, "bind_id": 1, "flow_out": True},
        *filler,
        {"ph": "X", "name": "late", "pid": 1, "tid": 2, "ts": 20, "dur": 5, "bind_id": 1, "flow_in": True},
        {"ph": "X", "name": "alone", "pid": 1, "tid": 2, "ts": 40, "dur": 5, "bind_id": 2, "flow_in": True},
        {"ph": "X", "name": "fine", "pid": 1, "tid": 2, "ts": 50, "dur": 5, "bind_id": 3, "flow_in": True},
        *filler,
        {"ph": "X", "name": "src", "pid": 1, "tid": 1, "ts": 45, "dur": 0, "bind_id": 3, "flow_out": True},
    ]
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'{"traceEvents":[\n' + b",\n".join(orjson.dumps(e) for e in events) + b"\n]}")
    whole = validate_file(str(bad))
    monkeypatch.setattr(chrome, "BATCH_BYTES", 2048)
    monkeypatch.setattr(chrome, "HEADER_BYTES", 512)
    batched = validate_file(str(bad))
    assert batched.warnings == whole.warnings and len(batched.warnings) == 2
    assert "event 401" in batched.warnings[0] and "starts at or after it" in batched.warnings[0]
    assert "event 402" in batched.warnings[1] and "no source" in batched.warnings[1]
