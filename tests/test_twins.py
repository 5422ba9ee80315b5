"""The C hot path and the pure-Python one are twins: the recording tests run against both."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gputrace import record

ROOT = Path(__file__).resolve().parent.parent
RECORDING_TESTS = [
    "tests/test_api.py",
    "tests/test_clock.py",
    "tests/test_timer.py",
    "tests/test_misuse.py",
    "tests/test_properties.py",
    "tests/test_compile.py",
]


def test_the_c_hot_path_is_in_use_where_built() -> None:
    built = list((ROOT / "gputrace").glob("_hot*.so"))
    if os.environ.get("GPUTRACE_PURE_PYTHON"):
        assert record._hot is None
    elif built:
        assert record._hot is not None and record.Span is record._hot.Span


def test_the_pure_python_twin_passes_the_same_tests() -> None:
    if os.environ.get("GPUTRACE_PURE_PYTHON"):
        return  # this run is the twin already
    env = {**os.environ, "GPUTRACE_PURE_PYTHON": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *RECORDING_TESTS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout
