"""Merge as a package by stage: its worker processes never re-run the caller's script, the output
format comes from the registry (a format that streams merged parts is written part by part, any
other loaded whole and written by its writer), and the CLI's selection options are one set."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import orjson
import pytest
from click.testing import CliRunner

from gputrace import merge as merge_mod
from gputrace.cli import main
from gputrace.errors import TraceFormatError
from gputrace.trace import chrome, registry
from gputrace.trace.model import Trace

from .test_merge import BASE, spans, write_ranks


def test_workers_do_not_rerun_the_callers_script(tmp_path: Path) -> None:
    """A script that merges at its top level, without `if __name__ == "__main__"`: spawn's
    workers would run it again (and fail to bootstrap); these do not."""
    paths = write_ranks(tmp_path / "r", world=4)
    marker = tmp_path / "ran.txt"
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
            with open({str(marker)!r}, "a") as f:
                f.write("x")  # the training this script stands for
            from gputrace import merge
            merge.merge({paths!r}, {str(tmp_path / "merged.json")!r}, workers=2)
            print("merged")
            """
        )
    )
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "merged"
    assert marker.read_text() == "x"
    one = tmp_path / "one.json"
    merge_mod.merge(paths, str(one), workers=1)
    assert (tmp_path / "merged.json").read_bytes() == one.read_bytes()


def test_a_worker_error_keeps_its_type_and_fields(tmp_path: Path) -> None:
    paths = write_ranks(tmp_path / "r", world=4)
    bad = Path(paths[2])
    bad.write_bytes(b"{not json at all")
    with pytest.raises(TraceFormatError) as info:
        merge_mod.load(paths, workers=2)
    assert info.value.path == str(bad) and info.value.reason


@pytest.fixture
def toy_format() -> Iterator[types.SimpleNamespace]:
    """A format registered for the test: `.toy` files, written as the JSON of (rank, name, start,
    end) rows; `calls` records what merge handed its writer."""
    seen: dict[str, Any] = {"writes": []}
    module = types.ModuleType("gputrace_toy_format")

    def write(trace: Trace, path: str, **options: Any) -> None:
        seen["writes"].append(trace)
        ranks = trace.track_rank()
        rows = sorted((ranks[t], n, s, e) for n, t, s, e, _ in trace.iter_spans())
        Path(path).write_bytes(b"TOY" + orjson.dumps(rows))

    module.write = write  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    fmt = registry.register(registry.Format("toy", (".toy",), lambda head: head[:3] == b"TOY", module.__name__))
    try:
        yield types.SimpleNamespace(format=fmt, module=module, seen=seen)
    finally:
        registry.unregister("toy")
        del sys.modules[module.__name__]


def test_a_format_without_a_merged_writer_is_loaded_and_written_whole(tmp_path: Path, toy_format: Any) -> None:
    paths = write_ranks(tmp_path / "r", world=3, syncs=[(BASE, 1_234, 1)])
    meta = merge_mod.merge(paths, str(tmp_path / "out.toy"))
    (written,) = toy_format.seen["writes"]
    assert spans(written) == spans(merge_mod.load(paths))
    assert meta["ranks"] == [0, 1, 2] and set(meta["alignment"]["per_rank"]) == {"0", "1", "2"}
    rows = orjson.loads((tmp_path / "out.toy").read_bytes()[3:])
    assert [tuple(r) for r in rows] == spans(written)
    merge_mod.merge(paths, str(tmp_path / "named.bin"), fmt="toy")
    assert (tmp_path / "named.bin").read_bytes() == (tmp_path / "out.toy").read_bytes()


def test_a_format_with_a_merged_writer_is_written_part_by_part(tmp_path: Path, toy_format: Any) -> None:
    parts: list[set[int]] = []  # the pids of each write's events

    class MergedWriter(chrome.MergedWriter):
        def write(self, data: bytes) -> None:
            parts.append({orjson.loads(line.rstrip(b","))["pid"] for line in data.splitlines() if line.strip()})
            super().write(data)

    toy_format.module.MergedWriter = MergedWriter
    paths = write_ranks(tmp_path / "r", world=3)
    merge_mod.merge(paths, str(tmp_path / "out.toy"), workers=1)
    # Rank by rank, each rank's lines in pieces as they are made; the whole writer unused.
    pids = [min(p) for p in parts if p]
    assert all(len(p) <= 1 for p in parts) and pids == sorted(pids) and set(pids) == {1, 2, 3}
    assert not toy_format.seen["writes"]
    json_out = tmp_path / "out.json"
    merge_mod.merge(paths, str(json_out), workers=1)
    assert (tmp_path / "out.toy").read_bytes() == json_out.read_bytes()


# ---- the CLI's selection options ------------------------------------------------------------------


def _options(name: str) -> dict[str, click.Option]:
    command = main.commands[name]  # type: ignore[attr-defined]
    return {p.name: p for p in command.params if isinstance(p, click.Option)}


SHARED = {"ranks", "steps", "window", "step", "skip_steps", "allow_mixed"}


def test_selection_options_are_one_set() -> None:
    merge, summary, view = _options("merge"), _options("summary"), _options("view")
    assert SHARED - set(merge) == {"skip_steps"}  # merge summarizes nothing
    assert SHARED - set(summary) == {"window"}
    assert SHARED - set(view) == {"allow_mixed"}
    for name in SHARED:
        declared = [opts[name] for opts in (merge, summary, view) if name in opts]
        assert len({(o.default, o.help, o.metavar, tuple(o.opts)) for o in declared}) == 1, name
    assert merge["step"].default is None


def test_merge_marks_steps_with_step_by_default(tmp_path: Path) -> None:
    d = tmp_path / "r"
    write_ranks(d, world=2)
    out = tmp_path / "m.json"
    r = CliRunner().invoke(main, ["merge", str(d), "-o", str(out), "--steps", "2:4", "-q"])
    assert r.exit_code == 0, r.output
    meta = orjson.loads(out.read_bytes())["metadata"]
    assert meta["selection"]["step_name"] == "step" and meta["selection"]["steps"] == [2, 4]


@pytest.mark.parametrize("command", ["merge", "summary", "view"])
@pytest.mark.parametrize("option", [["--ranks", "3-1"], ["--steps", "x:y"]])
def test_a_bad_selection_is_one_line(tmp_path: Path, command: str, option: list[str]) -> None:
    d = tmp_path / "r"
    write_ranks(d, world=2)
    extra = ["-o", str(tmp_path / "m.json")] if command == "merge" else []
    extra += ["--export", str(tmp_path / "v.html")] if command == "view" else []
    r = CliRunner().invoke(main, [command, str(d), *extra, *option])
    assert r.exit_code == 2
    assert r.stderr.startswith("gputrace: error: ") and r.stderr.count("\n") == 1 and "Traceback" not in r.output
