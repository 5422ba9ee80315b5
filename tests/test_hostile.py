"""Hostile and odd input files: every reader answers with a clear `TraceFormatError` (or reads
the file sanely), in bounded time and memory, and never hangs on a file that is not a file.

The files are built here, small; the memory bombs are read in a child process whose peak
resident memory is measured.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
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
    path.write_bytes(orjson.dumps(doc))
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
