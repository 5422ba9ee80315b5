"""The command line: through click's CliRunner, and once as a real subprocess."""

from __future__ import annotations

import subprocess
import sys

from click.testing import CliRunner

from gputrace.cli import main

from .conftest import spans_of


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
    from .conftest import read_json as read_trace

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
