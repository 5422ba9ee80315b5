"""The nvtx option: one spelling (enable(nvtx=True), GPUTRACE_NVTX=1), an NVTX range pushed and
popped with every span's name through both twins, and inert, said once, where no NVTX exists."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from click.testing import CliRunner

import gputrace
from gputrace import native, nvtx, record, session
from gputrace.cli import main
from gputrace.config import Config
from gputrace.errors import ConfigError, GputraceWarning

from .conftest import TWINS, install
from .fakes import FakeDevice

pytestmark = pytest.mark.usefixtures("twins_restored")


class Tool:
    """What an NVTX tool sees: a stack of ranges per push/pop, and every range in order."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.ranges: list[str] = []
        self.max_depth = 0

    def push(self, name: str) -> int:
        self.stack.append(name)
        self.max_depth = max(self.max_depth, len(self.stack))
        return len(self.stack) - 1

    def pop(self) -> int:
        self.ranges.append(self.stack.pop())
        return len(self.stack)


@pytest.fixture
def tool(monkeypatch: pytest.MonkeyPatch) -> Tool:
    """NVTX as a recording tool: the Python functions the hot path calls where no C ones exist."""
    t = Tool()
    monkeypatch.setattr(nvtx, "find", lambda source="auto": nvtx.Ranges(t.push, t.pop, source="a test tool"))
    return t


def work(fake: FakeDevice) -> None:
    @gputrace.span("decorated")
    def f() -> None:
        fake.work(100)

    for step in range(3):
        with gputrace.span("step", step=step):
            with gputrace.span("fwd"):
                f()
            with gputrace.span("host", timer_type="cpu"):
                pass
            s = gputrace.span("started").start()
            s.end()


@pytest.mark.parametrize("c", TWINS)
def test_every_span_pushes_and_pops_a_range_of_its_name(c: bool, tool: Tool) -> None:
    with native.using(c):
        fake = FakeDevice()
        rec = install(fake, nvtx=True)
        assert rec.hot.nvtx is not None
        work(fake)
        assert tool.stack == []  # balanced
        assert tool.ranges == ["decorated", "fwd", "host", "started", "step"] * 3
        assert tool.max_depth == 3
        rec.flush(wait=True)
        assert len(rec.store) == 15  # recorded as without NVTX


@pytest.mark.parametrize("c", TWINS)
def test_off_nothing_is_pushed_and_a_span_ended_twice_pops_once(c: bool, tool: Tool) -> None:
    with native.using(c):
        fake = FakeDevice()
        rec = install(fake)
        assert rec.hot.nvtx is None
        work(fake)
        assert tool.ranges == [] and tool.max_depth == 0
        gputrace.enable(nvtx=True)  # turned on while recording
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GputraceWarning)  # the double end is said
            s = gputrace.span("twice").start()
            s.end()
            s.end()
        assert tool.ranges == ["twice"] and tool.stack == []


def test_one_spelling_for_the_api_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Config().nvtx is False
    assert Config.from_env({"GPUTRACE_NVTX": "1"}).nvtx is True
    assert Config().replace(nvtx="off").nvtx is False
    with pytest.raises(ConfigError, match="GPUTRACE_NVTX|nvtx"):
        Config.from_env({"GPUTRACE_NVTX": "maybe"})
    monkeypatch.setenv("GPUTRACE_NVTX", "maybe")  # the CLI: one line, exit 2
    result = CliRunner().invoke(main, ["demo", "--steps", "1"])
    assert result.exit_code == 2 and "Traceback" not in result.output and "nvtx" in result.output.lower()


def test_without_an_nvtx_the_option_is_said_once_and_spans_still_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine with no CUDA torch (this one, unless it has a GPU), or any without NVTX."""
    monkeypatch.setattr(nvtx, "_torch_bindings", lambda: None)
    with pytest.warns(GputraceWarning, match="no NVTX was found") as got:
        gputrace.enable(cuda=False, nvtx=True)
        for _ in range(3):
            with gputrace.span("a"):
                pass
    assert len([w for w in got if "NVTX" in str(w.message)]) == 1
    rec = record.ACTIVE
    assert rec is not None and rec.hot.nvtx is None
    assert len(session.trace().spans) == 3


# ---- real NVTX, seen by a tool NVTX loads itself (as Nsight Systems' is) -----------------------

TOOL_SCRIPT = """
import ctypes, json, os, sys
if os.environ.get("PRELOAD"):
    ctypes.CDLL(os.environ["PRELOAD"], mode=ctypes.RTLD_GLOBAL)
import gputrace
from gputrace import nvtx, record
source, cuda = sys.argv[1], sys.argv[2] == "cuda"
gputrace.enable(cuda=cuda, nvtx=True)
rec = record.ACTIVE
rec.hot.nvtx = nvtx.find(source)
assert rec.hot.nvtx is not None, source
record.set_recorder(rec, rec)
for step in range(3):
    with gputrace.span("step", step=step):
        with gputrace.span("fwd"):
            pass
        with gputrace.span("host", timer_type="cpu"):
            pass
tool = ctypes.CDLL(os.environ["NVTX_INJECTION64_PATH"])
tool.tool_names.restype = ctypes.c_char_p
print(json.dumps({"pushes": tool.tool_pushes(), "pops": tool.tool_pops(), "depth": tool.tool_max_depth(),
                  "names": tool.tool_names().decode().split(), "via": rec.hot.nvtx.source,
                  "spans": len(gputrace.session.trace().spans)}))
"""


def build_tool(tmp_path: Any) -> str | None:
    """tests/nvtx_tool.c built as a shared library, or None without a C compiler."""
    import shutil
    import subprocess
    from pathlib import Path

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    out = str(tmp_path / "nvtx_tool.so")
    src = Path(__file__).with_name("nvtx_tool.c")
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", out, str(src)], check=True)
    return out


def run_with_tool(tool: str, source: str, cuda: bool, preload: str | None = None) -> dict[str, Any]:
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "NVTX_INJECTION64_PATH": tool, **({"PRELOAD": preload} if preload else {})}
    proc = subprocess.run(
        [sys.executable, "-c", TOOL_SCRIPT, source, "cuda" if cuda else "cpu"],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def nvtx_library() -> str | None:
    """A library of NVTX v3's real symbols on this machine (the CUDA toolkit's), or None."""
    import glob

    found = sorted(glob.glob("/usr/local/cuda*/lib*/libnvtx3interop.so.1"))
    return found[-1] if found else None


def expect_balanced(got: dict[str, Any]) -> None:
    assert got["pushes"] == got["pops"] == 9 and got["depth"] == 2
    assert got["names"] == ["step", "fwd", "host"] * 3  # pushed in open order
    assert got["spans"] == 9


@pytest.mark.skipif(native.hot is None, reason="the C build is not in use")
def test_the_c_functions_push_ranges_a_tool_sees_on_a_cpu(tmp_path: Any) -> None:
    lib = nvtx_library()
    tool = build_tool(tmp_path)
    if lib is None or tool is None:
        pytest.skip("no NVTX library of real symbols or no C compiler here")
    got = run_with_tool(tool, "runtime", cuda=False, preload=lib)
    assert "libnvtx3interop" in got["via"]
    expect_balanced(got)


@pytest.mark.cuda
@pytest.mark.parametrize("source", ["auto", "torch", "runtime"])
def test_a_tool_sees_balanced_ranges_of_every_span_on_the_gpu(tmp_path: Any, source: str) -> None:
    tool = build_tool(tmp_path)
    if tool is None:
        pytest.skip("no C compiler")
    if source == "runtime" and nvtx.find("runtime") is None:
        pytest.skip("no NVTX C functions are found here")
    got = run_with_tool(tool, source, cuda=True)
    expect_balanced(got)
