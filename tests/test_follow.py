"""`gputrace view DIR --follow` without a browser: the follower on real streamed traces (the
session's own stream writer), its window and memory bounds, a finished or rewritten file read
again, a line cut by a kill left out; the CLI's errors through CliRunner and the server as a real
subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

import gputrace
from gputrace.cli import main
from gputrace.demo import free_port
from gputrace.viewer.follow import Follower

ROOT = Path(__file__).resolve().parent.parent


def record(out: Path, steps: int, slow: float = 0.0) -> None:
    for i in range(steps):
        with gputrace.span("step", step=i):
            with gputrace.span("work"):
                time.sleep(0.001 + slow)
            with gputrace.span("all_reduce", collective=True):
                time.sleep(0.001)
        gputrace.flush()


def test_the_follower_reads_what_each_flush_appends(tmp_path: Path) -> None:
    gputrace.enable(cuda=False, out_dir=str(tmp_path))
    f = Follower(str(tmp_path))
    assert f.snapshot()["count"] == 0
    record(tmp_path, 3)
    doc = f.snapshot()
    assert doc["ranks"] == [0] and doc["count"] == 3 and not doc["state"]["0"]["finished"]
    read_at = f.tails[0].offset
    record(tmp_path, 4)
    doc = f.snapshot()
    assert doc["count"] == 7 and f.tails[0].offset > read_at  # read on from where it stopped
    busy, length = doc["busy"]["0"], doc["step_ns"]["0"]
    # Busy: the step less its all_reduce, which takes ~1 ms of each step.
    assert all(0 < b < n for b, n in zip(busy, length))
    gputrace.save()  # the file is rewritten whole, as the object form: read again, finished
    doc = f.snapshot()
    assert doc["count"] == 7 and doc["state"]["0"]["finished"]


def test_the_window_keeps_only_recent_steps(tmp_path: Path) -> None:
    gputrace.enable(cuda=False, out_dir=str(tmp_path))
    f = Follower(str(tmp_path), window=5)
    record(tmp_path, 12)
    doc = f.snapshot()
    assert doc["count"] == 12 and doc["first"] == 7 and len(doc["busy"]["0"]) == 5
    assert len(f.tails[0].steps) == 5
    # Collective spans older than the window's first step are let go.
    assert all(e >= f.tails[0].steps[0][0] for _, e in f.tails[0].colls)


def test_a_line_cut_short_is_left_until_it_is_whole(tmp_path: Path) -> None:
    gputrace.enable(cuda=False, out_dir=str(tmp_path))
    record(tmp_path, 2)
    path = tmp_path / "trace_rank0.json"
    f = Follower(str(tmp_path))
    whole = path.read_bytes()
    line = b'{"ph":"X","cat":"cpu","name":"step","pid":1,"tid":2,"ts":99999.0,"dur":5.0,"args":{"step":2}},\n'
    with open(path, "ab") as out:
        out.write(line[:30])  # what a kill mid-write can leave
    assert f.snapshot()["count"] == 2
    with open(path, "ab") as out:
        out.write(line[30:])
    assert f.snapshot()["count"] == 3
    assert path.read_bytes().startswith(whole)


def test_the_slowest_rank_of_each_step(tmp_path: Path) -> None:
    """Two ranks' streams (one process plays each in turn): rank 1 works 100 ms more a step."""
    for rank, slow in ((0, 0.0), (1, 0.1)):
        gputrace.enable(cuda=False, out_dir=str(tmp_path), rank=rank)
        record(tmp_path, 4, slow)
        gputrace.save()
        from gputrace import session

        session.SESSION.close()
    doc = Follower(str(tmp_path)).snapshot()
    assert doc["ranks"] == [0, 1] and doc["count"] == 4
    assert doc["slowest"] == [1, 1, 1, 1]


def test_cli_errors_are_one_line_and_exit_2(tmp_path: Path) -> None:
    runner = CliRunner()
    f = tmp_path / "trace_rank0.json"
    f.write_text("[]")
    cases = [
        ([str(f), "--follow"], "not a directory"),
        ([str(tmp_path / "missing"), "--follow"], "not a directory"),
        ([str(tmp_path), str(tmp_path), "--follow"], "--follow takes one folder"),
        ([str(tmp_path), "--follow", "--ranks", "0"], "leave out --export and the selections"),
        ([str(tmp_path), "--follow", "--export", str(tmp_path / "x.html")], "leave out --export"),
    ]
    for args, message in cases:
        r = runner.invoke(main, ["view", *args, "--no-browser"])
        assert r.exit_code == 2, (args, r.output)
        lines = r.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("gputrace: error: ") and message in lines[0], r.output
    pf = tmp_path / "pf"
    pf.mkdir()
    (pf / "trace_rank0.pftrace").write_bytes(b"")
    r = runner.invoke(main, ["view", str(pf), "--follow", "--no-browser"])
    assert r.exit_code == 2 and "record with format=json" in r.output and len(r.output.strip().splitlines()) == 1


def test_the_cli_serves_the_follow_page_as_a_real_subprocess(tmp_path: Path) -> None:
    gputrace.enable(cuda=False, out_dir=str(tmp_path))
    record(tmp_path, 3)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen(
        [sys.executable, "-m", "gputrace", "view", str(tmp_path), "--follow", "--no-browser", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = p.stdout.readline() if p.stdout else ""
        assert f"http://127.0.0.1:{port}/" in line and "following the run" in line
        base = f"http://127.0.0.1:{port}/"
        page = urllib.request.urlopen(base, timeout=30).read()
        assert b"follow.js" in page
        doc = orjson.loads(urllib.request.urlopen(base + "follow.json", timeout=30).read())
        assert doc["count"] == 3
        record(tmp_path, 2)
        doc = orjson.loads(urllib.request.urlopen(base + "follow.json", timeout=30).read())
        assert doc["count"] == 5
    finally:
        p.terminate()
        p.wait(timeout=30)


def test_a_long_file_followed_late_counts_its_early_steps_without_reading_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gputrace.viewer import follow

    gputrace.enable(cuda=False, out_dir=str(tmp_path))
    record(tmp_path, 40)
    whole = Follower(str(tmp_path), window=10).snapshot()
    monkeypatch.setattr(follow, "TAIL_BYTES", 1500)  # the last ~4 steps read, the rest counted
    monkeypatch.setattr(follow, "READ_BYTES", 1000)  # in pieces: the needle across their seams
    late = Follower(str(tmp_path), window=10)
    doc = late.snapshot()
    assert late.tails[0].offset > 0 and len(late.tails[0].steps) < 10
    assert doc["count"] == whole["count"] == 40
    kept = len(late.tails[0].steps)
    assert doc["busy"]["0"][-kept:] == whole["busy"]["0"][-kept:]
    record(tmp_path, 2)
    assert late.snapshot()["count"] == 42
