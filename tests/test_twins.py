"""The C hot path and the pure-Python one are twins: the recording tests run against both, and
a C build that should be in use but is not fails here instead of passing on the twin."""

from __future__ import annotations

import importlib.util
import inspect
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import gputrace
from gputrace import record
from gputrace.record import HOT_LAYOUT, HotState

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(record.__file__).resolve().parent
RECORDING_TESTS = [
    "tests/test_api.py",
    "tests/test_clock.py",
    "tests/test_timer.py",
    "tests/test_misuse.py",
    "tests/test_properties.py",
    "tests/test_compile.py",
]


# Read at import: the suite's fixtures clear GPUTRACE_* variables before each test.
PURE_PYTHON_ASKED = os.environ.get("GPUTRACE_PURE_PYTHON", "") not in ("", "0")


def setup_script() -> ModuleType:
    """setup.py as a module (its setup() call runs only as a script)."""
    spec = importlib.util.spec_from_file_location("gputrace_setup", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_c_hot_path_is_in_use_where_built() -> None:
    if PURE_PYTHON_ASKED:
        assert record._hot is None
        pytest.skip("GPUTRACE_PURE_PYTHON is set: this run tests the pure-Python twin only")
    builds = sorted(p.name for p in PACKAGE.glob("_hot*") if p.suffix in (".so", ".pyd"))
    if not builds:
        expected, why = setup_script().c_build_expected()
        if not expected:
            pytest.skip(f"no C build was attempted here ({why}): only the pure-Python path can run")
        pytest.fail(
            f"installing builds gputrace._hot here ({why}), but no build lies in {PACKAGE}: the build failed "
            "or was not run; run `pip install -e .` and read its output"
        )
    assert record._hot is not None, f"{', '.join(builds)} in {PACKAGE} did not load: {record.HOT_UNUSED_BECAUSE}"
    assert record.Span is record._hot.Span and record.span is record._hot.span


def test_the_pure_python_twin_passes_the_same_tests() -> None:
    if PURE_PYTHON_ASKED:
        pytest.skip("GPUTRACE_PURE_PYTHON is set: this run is the twin's already")
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


def _twin_check_in_a_copy(tmp_path: Path, build: bytes | None, **env: str) -> subprocess.CompletedProcess[str]:
    """Run the check above against a copy of the package whose C build is `build` (None: none)."""
    shutil.copytree(
        PACKAGE, tmp_path / "gputrace", ignore=shutil.ignore_patterns("_hot*.so", "_hot*.pyd", "__pycache__")
    )
    if build is not None:
        (tmp_path / "gputrace" / "_hot.abi3.so").write_bytes(build)
    (tmp_path / "tests").mkdir()  # no conftest (it imports torch): this check needs none
    shutil.copy(ROOT / "tests" / "test_twins.py", tmp_path / "tests" / "test_twins.py")
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    clean = {k: v for k, v in os.environ.items() if k != "GPUTRACE_PURE_PYTHON"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "tests/test_twins.py::test_the_c_hot_path_is_in_use_where_built",
        ],
        cwd=tmp_path,
        env=clean | {"PYTHONPATH": str(tmp_path)} | env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_missing_c_build_fails_the_check_where_one_is_expected(tmp_path: Path) -> None:
    r = _twin_check_in_a_copy(tmp_path, None)
    out = r.stdout + r.stderr
    if setup_script().c_build_expected()[0]:  # asked without GPUTRACE_PURE_PYTHON, as the copy runs
        assert r.returncode == 1 and "no build lies in" in out, out
    else:
        assert r.returncode == 0 and "SKIPPED" in out and "no C build was attempted" in out, out


def test_a_c_build_that_does_not_load_fails_the_check(tmp_path: Path) -> None:
    r = _twin_check_in_a_copy(tmp_path, b"not a shared object")
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "did not load" in out, out


def test_with_gputrace_pure_python_set_the_check_skips_and_says_why(tmp_path: Path) -> None:
    r = _twin_check_in_a_copy(tmp_path, b"not a shared object", GPUTRACE_PURE_PYTHON="1")
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "GPUTRACE_PURE_PYTHON is set" in out, out


# ---- one declared state ------------------------------------------------------------------------


def test_a_c_build_of_another_state_layout_is_refused_at_import() -> None:
    class Stale:
        __file__ = "stale/_hot.abi3.so"
        LAYOUT = (HOT_LAYOUT, HotState.__slots__)

    record.check_hot_layout(Stale)  # the same layout passes
    for layout in [(HOT_LAYOUT + 1, HotState.__slots__), (HOT_LAYOUT, HotState.__slots__[::-1]), None]:
        Stale.LAYOUT = layout  # type: ignore[assignment]
        with pytest.raises(ImportError, match="rebuild it with `pip install -e .`"):
            record.check_hot_layout(Stale)
    if record._hot is not None:
        assert record._hot.LAYOUT == (HOT_LAYOUT, HotState.__slots__)


def test_the_c_path_runs_from_the_declared_state_alone() -> None:
    """A HotState made by hand, no Recorder: whatever the C path needs, it finds there."""
    hot = record._hot
    if hot is None:
        pytest.skip("the C hot path is not in use in this run")
    local = threading.local()
    stack: Any = record._Stack()
    stack.track = stack.device = stack.stream = None
    opened_slowly: list[str] = []

    def open_slow(s: Any) -> None:  # the first span of a thread: make its stack
        opened_slowly.append(s.name)
        local.host = stack
        s.t0, s.parent, s.stack = -1, None, stack
        stack.append(s)

    def unexpected(*a: Any) -> Any:
        raise AssertionError("not on this path")

    state = HotState(
        local=local,
        has_device=False,
        cur_dev=unexpected,
        raw_stream=unexpected,
        capturing=unexpected,
        new_event=unexpected,
        record=unexpected,
        pools=[],
        gens=[],
        mono=lambda: 42,
        pending=[],
        check_at=1 << 30,
        open_slow=open_slow,
        close_slow=unexpected,
        close_unusual=unexpected,
        pending_full=unexpected,
        close_by_name=unexpected,
        nvtx=None,
    )
    hot.install(state, True)
    try:
        with hot.span("first"):
            with hot.span("inner"):
                pass
    finally:
        record.set_recorder(None, None)
    assert opened_slowly == ["first"]
    assert [(s.name, s.t0, s.t1) for s in state.pending] == [("inner", 42, 42), ("first", -1, 42)]
    assert state.pending[0].parent is state.pending[1]


def test_span_has_one_signature_and_a_docstring_in_both_twins() -> None:
    params = inspect.signature(gputrace.span).parameters
    assert [(p.name, p.kind) for p in params.values()] == [
        ("name", inspect.Parameter.POSITIONAL_ONLY),
        ("args", inspect.Parameter.VAR_KEYWORD),
    ]
    assert gputrace.span.__doc__ and "timer_type" in gputrace.span.__doc__
    names = [p.name for p in inspect.signature(gputrace.Span).parameters.values()]
    assert names[:2] == ["name", "args"]
