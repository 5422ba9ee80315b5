"""The command line: through click's CliRunner, and once as a real subprocess."""

from __future__ import annotations

import subprocess
import sys

import orjson
from click.testing import CliRunner

import gputrace
from gputrace.cli import main

from .conftest import spans_of


def make_trace(tmp_path, name: str = "t") -> str:  # type: ignore[no-untyped-def]
    gputrace.enable(cuda=False)
    for i in range(4):
        with gputrace.span("step", i=i):
            with gputrace.span("fwd"):
                pass
    return gputrace.save(tmp_path / name)


def test_summary_table_and_json(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = make_trace(tmp_path)
    r = CliRunner().invoke(main, ["summary", path])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].split()[:3] == ["name", "count", "total"]
    assert lines[1].split()[:2] == ["step", "4"] and lines[2].split()[:2] == ["fwd", "4"]
    r = CliRunner().invoke(main, ["summary", "--json", path])
    rows = orjson.loads(r.output)["names"]
    assert [(x["name"], x["count"]) for x in rows] == [("step", 4), ("fwd", 4)]
    assert rows[0]["total_ns"] >= rows[1]["total_ns"]


def test_bad_input_is_one_line_and_exit_2(tmp_path) -> None:  # type: ignore[no-untyped-def]
    runner = CliRunner()
    r = runner.invoke(main, ["summary", str(tmp_path / "missing.json")])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "no such file" in r.output
    bad = tmp_path / "cut.json"
    bad.write_bytes(b'{"traceEvents": [{"ph": "X", "na')
    r = runner.invoke(main, ["summary", str(bad)])
    assert r.exit_code == 2 and "truncated" in r.output and "Traceback" not in r.output
    notrace = tmp_path / "other.json"
    notrace.write_bytes(b'{"hello": 1}')
    r = runner.invoke(main, ["summary", str(notrace)])
    assert r.exit_code == 2 and "not a Chrome trace" in r.output


def test_array_form_cut_off_by_a_crash_is_read(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "crashed.json"
    path.write_bytes(
        b'[{"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 0, "dur": 5},\n'
        b'{"ph": "X", "name": "b", "pid": 1, "tid": 1, "ts": 6, "dur": 1},\n{"ph": "X", "na'
    )
    r = CliRunner().invoke(main, ["summary", "--json", str(path)])
    assert r.exit_code == 0, r.output
    assert sorted(x["name"] for x in orjson.loads(r.output)["names"]) == ["a", "b"]


def test_demo_as_a_real_subprocess(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "demo"
    r = subprocess.run(
        [sys.executable, "-m", "gputrace", "demo", "--out", str(out), "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout and "forward" in r.stdout
    from gputrace.traceio import read_trace

    trace = read_trace(str(out / "trace_rank0.json"))
    names = [e["name"] for e in spans_of(trace)]
    for name in ("step", "data", "forward", "block", "backward", "optimizer"):
        assert name in names
    assert names.count("step") == 2


def test_help_is_fast_and_lists_commands() -> None:
    r = subprocess.run([sys.executable, "-m", "gputrace", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "demo" in r.stdout and "summary" in r.stdout


def test_demo_refuses_an_unwritable_output_before_training(tmp_path) -> None:  # type: ignore[no-untyped-def]
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = CliRunner().invoke(main, ["demo", "--out", str(blocker / "sub"), "--steps", "1"])
    assert r.exit_code == 2 and "cannot write" in r.output and r.output.count("\n") == 1
