"""Streaming to the output directory: flush by flush, crash-safe, finished on SIGTERM/SIGINT and
at exit; real recording processes killed at random moments."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

import gputrace
from gputrace import record, session
from gputrace.trace import chrome
from gputrace.validate import format_report, validate_file

from . import perfetto_ui
from .conftest import install
from .fakes import FakeDevice

ROOT = Path(__file__).resolve().parent.parent


def start_worker(out: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.stream_worker", str(out), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def read_counts(proc: subprocess.Popen[str], lines: int) -> int:
    """Read `lines` progress lines; the last number is how many spans were flushed."""
    n = 0
    assert proc.stdout is not None
    for _ in range(lines):
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        n = int(line)
    return n


def spans_in(path: Path) -> int:
    return len(chrome.read(str(path)).spans)


def assert_valid(path: Path) -> None:
    report = validate_file(str(path))
    assert report.ok, format_report(report)


def test_each_flush_appends_and_memory_is_released(tmp_path: Path) -> None:
    gputrace.enable(out_dir=str(tmp_path), cuda=False)
    rec = record.ACTIVE
    assert rec is not None
    for step in range(3):
        with gputrace.span("step", step=step):
            with gputrace.span("fwd"):
                pass
        gputrace.flush()
        assert len(rec.store) == 0  # written, then out of memory
        trace = chrome.read(str(tmp_path / "trace_rank0.json"))
        assert len(trace.spans) == 2 * (step + 1)
    assert (tmp_path / "trace_rank0.json").read_bytes().startswith(b"[")  # the streamed form
    path = gputrace.save()
    data = Path(path).read_bytes()
    assert data.startswith(b'{"baseTimeNanoseconds": ')
    assert b'"distributedInfo": {"rank": 0, "world_size": 1}' in data  # HTA's rank pattern
    full = orjson.loads(data)
    assert full["metadata"]["spans"] == 6
    assert full["metadata"]["run_id"]
    assert_valid(Path(path))


def test_open_spans_at_save_are_written_unfinished(tmp_path: Path) -> None:
    gputrace.enable(out_dir=str(tmp_path), cuda=False)
    outer = gputrace.span("epoch").start()
    with gputrace.span("step"):
        pass
    gputrace.flush()
    path = gputrace.save()
    trace = chrome.read(path)
    by_name = {trace.names[trace.spans.name[i]]: trace.spans.args[i] for i in range(len(trace.spans))}
    assert by_name["epoch"] == {"unfinished": True}
    assert trace.metadata["spans_unfinished"] == 1
    outer.end()


def test_device_spans_stream_and_nest_across_flushes(tmp_path: Path) -> None:
    fake = FakeDevice(rate=1.00005)  # 50 ppm drift: rounding at anchor seams
    install(fake, out_dir=str(tmp_path))
    for step in range(20):
        with gputrace.span("step"):
            for _ in range(3):
                with gputrace.span("op"):
                    fake.work(100_000)
        gputrace.flush()
        fake.advance(50_000)
    path = gputrace.save()
    trace = chrome.read(path)
    assert len(trace.spans) == 80
    assert trace.metadata["overflow_tracks"] == 0
    assert_valid(Path(path))


def test_reset_starts_a_fresh_file(tmp_path: Path) -> None:
    gputrace.enable(out_dir=str(tmp_path), cuda=False)
    with gputrace.span("before"):
        pass
    gputrace.flush()
    gputrace.reset()
    with gputrace.span("after"):
        pass
    path = gputrace.save()
    assert [n for n, *_ in chrome.read(path).iter_spans()] == ["after"]


def test_save_mid_run_then_go_on(tmp_path: Path) -> None:
    gputrace.enable(out_dir=str(tmp_path), cuda=False)
    with gputrace.span("a"):
        pass
    first = gputrace.save()
    assert orjson.loads(Path(first).read_bytes())["metadata"]["spans"] == 1
    with gputrace.span("b"):
        pass
    gputrace.flush()
    assert sorted(n for n, *_ in chrome.read(first).iter_spans()) == ["a", "b"]
    gputrace.save()
    data = orjson.loads(Path(first).read_bytes())
    assert sorted(e["name"] for e in data["traceEvents"] if e["ph"] == "X") == ["a", "b"]
    assert data["metadata"]["spans"] == 2


def test_save_elsewhere_while_streaming_copies_the_file(tmp_path: Path) -> None:
    gputrace.enable(out_dir=str(tmp_path / "live"), cuda=False)
    with gputrace.span("a"):
        pass
    gputrace.flush()
    copy = gputrace.save(str(tmp_path / "copy.json"))
    assert [n for n, *_ in chrome.read(copy).iter_spans()] == ["a"]


def test_sigkill_at_random_moments_loses_only_what_was_not_flushed(tmp_path: Path) -> None:
    rng = random.Random(1234)
    for attempt in range(8):
        out = tmp_path / f"kill{attempt}"
        proc = start_worker(out, "100000", "--sleep-ms", str(rng.choice([0, 0.2, 1])))
        flushed = read_counts(proc, rng.randint(1, 40))
        if rng.random() < 0.5:  # sometimes not right after a flush line, but mid-step
            import time

            time.sleep(rng.random() * 0.01)
        proc.kill()
        proc.wait(timeout=30)
        path = out / "trace_rank0.json"
        assert spans_in(path) >= flushed
        assert_valid(path)


def test_sigterm_finishes_the_file_then_dies_of_the_signal(tmp_path: Path) -> None:
    rng = random.Random(99)
    for attempt in range(6):
        out = tmp_path / f"term{attempt}"
        proc = start_worker(out, "100000", "--sleep-ms", "0.5")
        flushed = read_counts(proc, rng.randint(1, 30))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM  # the default action still happens
        path = out / "trace_rank0.json"
        data = path.read_bytes()
        assert data.startswith(b"{"), "SIGTERM must leave the finished object form"
        full = orjson.loads(data)
        spans = sum(1 for e in full["traceEvents"] if e.get("ph") == "X")
        assert spans >= flushed
        assert full["metadata"]["spans"] == spans
        assert_valid(path)


def test_sigterm_calls_the_programs_own_handler(tmp_path: Path) -> None:
    proc = start_worker(tmp_path, "100000", "--handler")
    flushed = read_counts(proc, 5)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert "handler ran" in out
    assert proc.returncode == 3
    path = tmp_path / "trace_rank0.json"
    assert spans_in(path) >= flushed  # the handler's sys.exit ran the exit path: finished
    assert path.read_bytes().startswith(b"{")


def test_sigint_raises_keyboardinterrupt_and_the_file_is_finished(tmp_path: Path) -> None:
    proc = start_worker(tmp_path, "100000")
    flushed = read_counts(proc, 5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert "KeyboardInterrupt" in err
    path = tmp_path / "trace_rank0.json"
    assert path.read_bytes().startswith(b"{")
    assert spans_in(path) >= flushed


def test_recorded_but_never_written_warns_at_exit(tmp_path: Path) -> None:
    code = "import gputrace\ngputrace.enable(cuda=False)\nwith gputrace.span('x'):\n    pass\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert "nothing will write" in r.stderr
    r = subprocess.run(
        [sys.executable, "-c", "import gputrace\nwith gputrace.span('x'):\n    pass\n"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
        env={**os.environ, "GPUTRACE": "1", "GPUTRACE_CUDA": "0"},
    )
    assert "nothing will write" in r.stderr


def test_enable_again_applies_new_options() -> None:
    gputrace.enable(cuda=False, max_spans=100)
    gputrace.enable(max_spans=10)
    for _ in range(20):
        with gputrace.span("x"):
            pass
    trace = gputrace.trace_dict()
    assert trace["metadata"]["spans_dropped"] == 10
    assert trace["metadata"]["options"]["max_spans"] == 10
    assert session.SESSION.config.cuda is False  # options not given stay as they were


@pytest.mark.browser
@pytest.mark.skipif(perfetto_ui.available() is not None, reason=str(perfetto_ui.available()))
def test_killed_and_terminated_files_load_in_perfetto(tmp_path: Path) -> None:
    killed = tmp_path / "killed"
    proc = start_worker(killed, "100000", "--sleep-ms", "0")
    flushed = read_counts(proc, 25)
    proc.kill()
    proc.wait(timeout=30)
    data = (killed / "trace_rank0.json").read_bytes()
    cut = tmp_path / "cut.json"  # and cut inside an event, as a kill mid-write leaves it
    cut.write_bytes(data[: len(data) - 17])
    termed = tmp_path / "termed"
    proc = start_worker(termed, "100000", "--sleep-ms", "0")
    read_counts(proc, 10)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    with perfetto_ui.perfetto_ui(tmp_path / "ui") as ui:
        for path in (killed / "trace_rank0.json", cut, termed / "trace_rank0.json"):
            report = ui.report(path)
            assert report["errors"] == [], (path, report["errors"])
            assert report["slices"] == spans_in(path)
            assert report["slices"] >= (flushed if path != termed / "trace_rank0.json" else 1) - 21


def test_a_large_protobuf_save_is_written_in_pieces_with_the_same_spans(tmp_path: Path) -> None:
    from gputrace.trace import perfetto

    gputrace.enable(cuda=False)
    for step in range(20_000):  # 80k spans: past the size saved in one pass
        with gputrace.span("step", step=step):
            with gputrace.span("fwd"):
                with gputrace.span("layer"):
                    pass
            with gputrace.span("bwd"):
                pass
    as_json = chrome.read(gputrace.save(str(tmp_path / "t.json")))
    as_proto = perfetto.read(gputrace.save(str(tmp_path / "t.pftrace")))
    assert sorted((n, s, e) for n, _, s, e, _ in as_proto.iter_spans()) == sorted(
        (n, s, e) for n, _, s, e, _ in as_json.iter_spans()
    )
    assert [t.name for t in as_proto.tracks] == ["thread MainThread (host)"]  # no overflow lane
    assert as_proto.metadata["overflow_tracks"] == 0 and as_proto.ranks == [0]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".gputrace-")]  # no temporary left


def test_spans_open_at_save_end_together_and_still_nest(tmp_path: Path) -> None:
    for fake in (None, FakeDevice()):
        if fake is None:
            gputrace.enable(cuda=False)
        else:
            session.SESSION.close()
            install(fake)
        outer = gputrace.span("outer").start()
        inner = gputrace.span("inner").start()
        if fake is not None:
            fake.work(1_000_000)
        trace = chrome.read(gputrace.save(str(tmp_path / f"t{fake is not None}.json")))
        ends = {trace.names[trace.spans.name[i]]: trace.spans.end[i] for i in range(len(trace.spans))}
        assert ends["inner"] == ends["outer"]
        assert trace.metadata["overflow_tracks"] == 0 and not any("overflow" in t.name for t in trace.tracks)
        inner.end()
        outer.end()
