"""The format registry: a path with a registered extension is a file in that format (the `.proto`
bug: it was a folder holding a JSON-named file of protobuf bytes), and adding a format is one
module plus its registration (a toy format, tests/toy_format.py, through save, streaming,
validate and merge)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import gputrace
from gputrace.trace import registry
from gputrace.validate import format_report, validate_file

from . import toy_format


def record(steps: int = 3) -> None:
    for step in range(steps):
        with gputrace.span("step", step=step):
            with gputrace.span("fwd"):
                pass
            with gputrace.span("bwd"):
                pass


def spans_of(trace: object) -> list[tuple[str, int, int]]:
    return sorted((n, s, e) for n, _, s, e, _ in trace.iter_spans())  # type: ignore[attr-defined]


# ---- a path with a registered extension is a file in that format ----------------------------------


@pytest.mark.parametrize(
    "name,fmt",
    [("t.proto", "perfetto"), ("t.pftrace", "perfetto"), ("t.perfetto-trace", "perfetto"), ("t.pb", "perfetto")]
    + [("T.PROTO", "perfetto"), ("t.json", "json")],
)
@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streamed"])
def test_a_path_with_a_registered_extension_is_a_file_in_that_format(
    tmp_path: Path, name: str, fmt: str, streaming: bool
) -> None:
    gputrace.enable(cuda=False, **({"out_dir": str(tmp_path / "stream")} if streaming else {}))
    record()
    target = tmp_path / name
    written = gputrace.save(str(target))
    assert written == str(target)
    assert target.is_file()
    assert registry.detect(written).name == fmt
    trace = registry.read(written)
    assert [n for n, *_ in spans_of(trace)].count("step") == 3
    report = validate_file(written)
    assert report.ok, format_report(report)


@pytest.mark.parametrize("fmt,ext", [(None, ".json"), ("json", ".json"), ("perfetto", ".pftrace")])
def test_a_folder_path_gets_the_ranks_file(tmp_path: Path, fmt: str | None, ext: str) -> None:
    gputrace.enable(cuda=False)
    record()
    for folder in (tmp_path / "new", tmp_path / "new.d"):  # made, or there already
        written = gputrace.save(str(folder), format=fmt)
        assert written == str(folder / f"trace_rank0{ext}")
        assert registry.detect(written).extension == ext
        assert len(registry.read(written).spans) == 9


def test_the_registry_knows_the_formats_by_name_extension_and_first_bytes(tmp_path: Path) -> None:
    assert registry.names()[:2] == ["json", "perfetto"]
    assert registry.get("chrome") is registry.get("json")
    assert registry.for_path("x.proto").name == "perfetto"
    assert registry.for_path("x.proto", "json").name == "json"
    assert registry.for_path("x.txt").name == "json"  # the default
    with pytest.raises(gputrace.GputraceError, match="unknown trace format 'xml': use json or perfetto"):
        registry.get("xml")
    proto = tmp_path / "looks.json"
    proto.write_bytes(b"\x0a\x00")  # a protobuf packet, whatever the name says
    assert registry.detect(str(proto)).name == "perfetto"
    with pytest.raises(gputrace.GputraceError, match="cannot be removed"):
        registry.unregister("json")


# ---- a new format: one module plus its registration ------------------------------------------------


# The `toy` fixture (tests/conftest.py) registers tests/toy_format.py for a test.


def test_a_toy_format_is_saved_read_and_validated_as_the_json_of_the_same_recording(
    tmp_path: Path, toy: registry.Format
) -> None:
    gputrace.enable(cuda=False)
    record()
    as_json = registry.read(gputrace.save(str(tmp_path / "t.json")))
    path = gputrace.save(str(tmp_path / "t.toy"))
    assert path == str(tmp_path / "t.toy") and Path(path).read_bytes().startswith(toy_format.MAGIC)
    assert registry.detect(path) is toy
    got = registry.read(path)
    assert spans_of(got) == spans_of(as_json)
    assert [t.name for t in got.tracks] == [t.name for t in as_json.tracks]
    assert got.ranks == [0] and got.metadata["gputrace_version"] == gputrace.__version__
    assert toy.read_header(path)["distributedInfo"] == {"rank": 0, "world_size": 1}
    report = validate_file(path)
    assert report.ok and report.spans == 9 and report.tracks == 1, format_report(report)
    # A folder and the format's name: the rank's file with the format's extension.
    assert gputrace.save(str(tmp_path / "d"), format="toy") == str(tmp_path / "d" / "trace_rank0.toy")
    assert registry.expand([str(tmp_path / "d")]) == [str(tmp_path / "d" / "trace_rank0.toy")]


def test_a_toy_format_streams_to_the_output_directory(tmp_path: Path, toy: registry.Format) -> None:
    gputrace.enable(cuda=False, out_dir=str(tmp_path), format="toy")
    stream = tmp_path / "trace_rank0.toy"
    for n in range(1, 4):
        record(1)
        gputrace.flush()
        assert len(registry.read(str(stream)).spans) == 3 * n  # on disk flush by flush
    path = gputrace.save()
    assert path == str(stream)
    got = registry.read(path)
    assert [n for n, *_ in spans_of(got)] == ["bwd"] * 3 + ["fwd"] * 3 + ["step"] * 3
    assert got.metadata["spans"] == 9 and got.metadata["run_id"]
    report = validate_file(path)
    assert report.ok and report.spans == 9, format_report(report)
    assert registry.expand([str(tmp_path)]) == [path]


def test_a_bad_format_name_is_refused_where_it_is_given(tmp_path: Path, toy: registry.Format) -> None:
    with pytest.raises(gputrace.ConfigError, match="expected json or perfetto or toy"):
        gputrace.enable(format="xml")
    gputrace.enable(cuda=False)
    record(1)
    with pytest.raises(gputrace.GputraceError, match="unknown trace format 'xml'"):
        gputrace.save(str(tmp_path / "t.json"), format="xml")


@pytest.mark.parametrize("out, workers", [("merged.toy", 1), ("merged.json", 1), ("merged.json", 2)])
def test_a_toy_format_merges(
    tmp_path: Path, toy: registry.Format, out: str, workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also in worker processes, which start knowing the built-in formats only."""
    from gputrace.merge import merge

    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in (0, 1):
        gputrace.enable(cuda=False, rank=rank, run_id="toyrun")
        gputrace.reset()
        record(2)
        gputrace.save(str(tmp_path / f"trace_rank{rank}.toy"))
    gputrace.disable()
    paths = [str(tmp_path / "trace_rank0.toy"), str(tmp_path / "trace_rank1.toy")]
    meta = merge(paths, str(tmp_path / out), workers=workers)
    assert meta["ranks"] == [0, 1]
    merged = registry.read(str(tmp_path / out))
    assert registry.detect(str(tmp_path / out)).extension == Path(out).suffix
    assert merged.ranks == [0, 1]
    assert len(merged.spans) == 2 * 6
    report = validate_file(str(tmp_path / out))
    assert report.ok, format_report(report)


def test_the_perfetto_format_and_the_layout_import_nothing_of_the_json_format() -> None:
    """The layout every writer shares is format-neutral: neither it nor the Perfetto writer
    reaches into chrome.py (which once held the layout, and lent perfetto.py its private names)."""
    import ast

    from gputrace.trace import layout, perfetto

    for module in (layout, perfetto):
        assert module.__file__ is not None
        tree = ast.parse(Path(module.__file__).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert not {m for m in imported if m and m.endswith("chrome")}, module.__name__


def test_a_format_whose_read_spans_takes_no_keys_is_read_whole_for_the_statistics(
    tmp_path: Path, toy: registry.Format, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`read_spans(path, data=None)`, as formats offered it before it took the arguments to keep:
    `gputrace summary` reads such a file whole (its collectives and steps counted), rather than
    calling it with keys it does not take, or through a read that keeps no argument."""
    from click.testing import CliRunner

    from gputrace.cli import main

    calls: list[str] = []

    def read_spans(path: str, data: bytes | None = None) -> Any:
        calls.append(path)
        return toy_format.read(path, data)

    monkeypatch.setattr(toy_format, "read_spans", read_spans, raising=False)
    gputrace.enable(cuda=False)
    for _ in range(3):
        with gputrace.span("step"):
            with gputrace.span("all_reduce", collective=True):
                pass
    path = gputrace.save(str(tmp_path / "t.toy"))
    res = CliRunner().invoke(main, ["summary", "--json", path])
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)
    assert got["steps"]["count"] == 3 and got["collectives"], got.keys()
    assert calls == []  # read whole, through `read`
