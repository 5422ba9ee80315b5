"""validate: Perfetto's own import rules on any tool's trace, gputrace's conventions on its own."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from gputrace.cli import main
from gputrace.errors import TraceFormatError
from gputrace.trace import chrome
from gputrace.trace.model import Process, Trace, Track
from gputrace.validate import Report, format_report, validate, validate_file


@pytest.fixture(scope="module")
def torch_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real torch.profiler (Kineto) trace of a small CPU workload: string pids ("Spans"), a file
    that starts with a space and a newline, ts in microseconds with three decimals."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    path = tmp_path_factory.mktemp("profile") / "profile.json"
    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            (x @ x).relu_()
    prof.export_chrome_trace(str(path))
    return path


def check(events: list[dict], **top: object) -> Report:
    return validate({"traceEvents": events, **top}, Report("<memory>"))


def x(ts: object, dur: object, pid: object = 7, tid: object = 1, name: str = "a") -> dict:
    return {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}


def test_a_real_torch_profiler_trace_passes(torch_profile: Path) -> None:
    data = torch_profile.read_bytes()
    assert not data.startswith(b'{"') and b'"pid": "Spans"' in data  # what the old validate rejected
    report = validate_file(str(torch_profile))
    assert report.ok, format_report(report)
    assert report.warnings == [] and not report.own
    n = sum(1 for e in orjson.loads(data)["traceEvents"] if e.get("ph") == "X")
    assert report.spans == n > 10


def test_real_problems_in_another_tools_trace_are_still_caught(torch_profile: Path, tmp_path: Path) -> None:
    trace = orjson.loads(torch_profile.read_bytes())
    ops = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    first, second = ops[0], ops[1]
    # An op that now ends inside the next one's span but started before it: a partial overlap.
    second["ts"] = first["ts"] + first["dur"] / 2
    second["dur"] = first["dur"]
    ops[2]["dur"] = -1.5
    bad = tmp_path / "bad.json"
    bad.write_bytes(orjson.dumps(trace))
    report = validate_file(str(bad))
    text = format_report(report)
    assert "partly overlaps" in text and "negative dur -1.5" in text
    assert len(report.errors) == 2, text


def test_perfettos_rules_event_by_event() -> None:
    ok = check(
        [
            x(0, 10),
            x("5", "1"),  # numeric strings are numbers to Perfetto
            x(2, 3, pid="Spans", tid="PyTorch Profiler"),  # string ids are names
            x(2, 30, pid="Spans", tid="other thread"),
            {},  # an empty object is skipped silently
            {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "p"}},  # M needs no ts
        ]
    )
    assert ok.ok and ok.warnings == [] and ok.spans == 4 and ok.tracks == 3
    bad = check(
        [
            x(0, 10),
            x(5, 10),  # crosses the first
            x(-1, 1, tid=2),
            x("soon", 1, tid=3),
            {"ph": "X", "name": "no dur", "pid": 7, "tid": 4, "ts": 1},
            x(1, 1, pid=2**32),
            {"name": "no ph", "ts": 1},
            [1, 2],
        ]
    )
    text = "\n".join(bad.errors)
    for expected in (
        "partly overlaps",
        "negative ts -1",
        "ts 'soon' is not a number",
        "an X event without dur",
        "pid/tid must be integers in 0..2^32-1 (or strings), got 4294967296/1",
        "no 'ph'",
        "not a JSON object",
    ):
        assert expected in text, (expected, text)
    assert len(bad.errors) == 7


def test_tid_0_is_the_processs_main_thread() -> None:
    """Perfetto puts tid 0 on the thread whose tid is the pid: spans there must nest together."""
    assert check([x(0, 10, tid=0), x(5, 10, tid=8)]).ok
    report = check([x(0, 10, tid=0), x(5, 10, tid=7)])
    assert not report.ok and "partly overlaps" in report.errors[0]


def test_nesting_is_judged_as_perfetto_sorts_and_rounds() -> None:
    # Equal starts: the longer one opens first, so the shorter nests in it whatever the order.
    assert check([x(0, 1), x(0, 5), x(1, 4)]).ok
    # Back to back is fine ([start, end)); 1 ns across is not.
    assert check([x(0, 1), x(1, 1)]).ok
    assert not check([x(0, 1.001), x(1, 1)]).ok
    # Durations are rounded to the nearest ns: 1.0004 us ends at its parent's end, 1.0006 us 1 ns past it.
    assert check([x(0, 2), x(1, 1.0004)]).ok
    assert not check([x(0, 2), x(1, 1.0006)]).ok


def test_gputraces_conventions_apply_to_its_own_files_only() -> None:
    foreign = check([x(0, 1, pid=0, tid=0)])
    assert foreign.ok and foreign.warnings == []
    own = check([x(0, 1, pid=0, tid=5), x(0, 1, pid=3, tid=3)], metadata={"gputrace_version": "x"})
    assert own.ok and own.own
    text = "\n".join(own.warnings)
    assert "pid 0 is the kernel's swapper" in text and "no process_name" in text and "main thread" in text


def own_trace(rank: int = 2) -> Trace:
    meta = {"gputrace_version": "x", "rank": rank, "world_size": 4}
    t = Trace(dict(meta))
    p = t.add_process(Process(rank + 1, rank, f"rank {rank}", rank, meta))
    track = t.add_track(Track(p, 1, "thread MainThread (host)", "cpu", None, 1))
    t.add_span("step", track, 1_000, 5_000)
    t.add_span("fwd", track, 2_000, 3_000)
    return t


def test_files_the_chrome_writer_makes_pass_and_hta_can_find_their_rank(tmp_path: Path) -> None:
    path = tmp_path / "trace_rank2.json"
    chrome.write(own_trace(), str(path))
    report = validate_file(str(path))
    assert report.ok and report.warnings == [] and report.own, format_report(report)
    compact = tmp_path / "compact.json"
    compact.write_bytes(orjson.dumps(orjson.loads(path.read_bytes())))  # "rank":2, no space
    assert any("HTA will not find" in w for w in validate_file(str(compact)).warnings)


def test_file_level_rules(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    chrome.write(own_trace(), str(path))
    data = path.read_bytes()
    cut = tmp_path / "cut.json"
    cut.write_bytes(data[: len(data) - 10])
    report = validate_file(str(cut))
    assert not report.ok and "ends before its closing brackets" in report.errors[0]
    # The array form may end anywhere: that is how a streamed file looks while it is written.
    stream = tmp_path / "stream.json"
    stream.write_bytes(b'[{"ph": "X", "name": "a", "pid": 1, "tid": 2, "ts": 1, "dur": 1},\n{"ph": "X", "na')
    assert validate_file(str(stream)).ok
    # Perfetto detects JSON by `{"` or `[{"` once whitespace is dropped: a byte-order mark or a
    # leading array of something else is not JSON to it.
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf" + data)
    with pytest.raises(TraceFormatError):
        validate_file(str(bom))
    spaced = tmp_path / "spaced.json"
    spaced.write_bytes(b' \n [ \n {"ph": "X", "name": "a", "pid": 1, "tid": 2, "ts": 1, "dur": 1}]')
    assert validate_file(str(spaced)).ok
    nested = tmp_path / "nested.json"
    nested.write_bytes(b'[[{"ph": "X"}], {"ph": "X", "name": "a", "pid": 1, "tid": 2, "ts": 1, "dur": 1}]')
    report = validate_file(str(nested))
    assert "will not recognise it as JSON" in report.errors[0]


def test_protobuf_files_are_read_and_checked(tmp_path: Path) -> None:
    perfetto = pytest.importorskip("gputrace.trace.perfetto")
    path = tmp_path / "trace_rank2.pftrace"
    perfetto.write(own_trace(), str(path))
    report = validate_file(str(path))
    assert report.ok and report.spans == 2 and report.own, format_report(report)


def test_the_command_exits_1_on_errors_and_2_on_unreadable_input(tmp_path: Path, torch_profile: Path) -> None:
    good = tmp_path / "good.json"
    chrome.write(own_trace(), str(good))
    bad = tmp_path / "bad.json"
    bad.write_bytes(orjson.dumps({"traceEvents": [x(0, 10), x(5, 10)]}))
    r = CliRunner().invoke(main, ["validate", str(good), str(torch_profile)])
    assert r.exit_code == 0 and r.output.count(": ok: ") == 2, r.output
    r = CliRunner().invoke(main, ["validate", str(good), str(bad)])
    assert r.exit_code == 1 and "INVALID" in r.output and "partly overlaps" in r.output
    r = CliRunner().invoke(main, ["validate", str(tmp_path / "missing.json")])
    assert r.exit_code == 2 and "no such file" in r.output and "Traceback" not in r.output
