"""Merging: per-rank files (written by the Chrome writer, streamed, cut, merged, or recorded by
torch.profiler) into one aligned trace, in memory (`load`) and on disk (`merge`)."""

from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from gputrace import merge as merge_mod
from gputrace.cli import main
from gputrace.errors import MergeError, TraceFormatError
from gputrace.merge import run as merge_run
from gputrace.trace import chrome
from gputrace.trace.model import Process, Trace, Track
from gputrace.validate import format_report, validate_file

from . import perfetto_ui
from .conftest import run_py

BASE = 1_700_000_000_000_000_000
STEP_NS = 10_000


def rank_trace(
    rank: int,
    world: int = 4,
    steps: int = 20,
    run_id: str | None = "run-a",
    syncs: list[tuple[int, int, int]] | None = None,
    start: int = BASE,
    skew_ns: int = 0,
) -> Trace:
    """One rank of a training loop: per step a host `step` span, and on a CUDA stream forward,
    backward and an all_reduce whose end is where every rank's would be, `skew_ns` later on this
    rank's clock. `syncs`: (at, offset, error) clock syncs in the rank's metadata."""
    meta: dict[str, Any] = {"gputrace_version": "test", "rank": rank, "world_size": world}
    if run_id is not None:
        meta["run_id"] = run_id
    if syncs is not None:
        meta["clock"] = {"sync_to_rank0": [{"at_ns": a, "offset_ns": o, "error_ns": e} for a, o, e in syncs]}
    t = Trace(dict(meta, world_size=world))
    p = t.add_process(Process(rank + 1, rank, f"rank {rank}", rank, meta))
    host = t.add_track(Track(p, 1, "thread MainThread (host)", "cpu", None, 1))
    cuda = t.add_track(Track(p, 2, "cuda:0 stream 7", "cuda", 0, 0))
    for k in range(steps):
        s = start + k * STEP_NS + skew_ns
        t.add_span("step", host, s, s + 9_000 - rank * 100, {"step": k})
        t.add_span("forward", cuda, s + 100, s + 3_000)
        t.add_span("backward", cuda, s + 3_000, s + 7_000 - rank * 100)
        t.add_span("all_reduce", cuda, s + 7_000 - rank * 100, s + 8_900)
    return t


def write_ranks(directory: Path, world: int = 4, **kw: Any) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for r in range(world):
        path = str(directory / f"trace_rank{r}.json")
        chrome.write(rank_trace(r, world, **kw), path)
        paths.append(path)
    return paths


def spans(trace: Trace) -> list[tuple[int | None, str, int, int]]:
    ranks = trace.track_rank()
    return sorted((ranks[t], name, s, e) for name, t, s, e, _ in trace.iter_spans())


def assert_valid(path: str | Path) -> None:
    report = validate_file(str(path))
    assert report.ok, format_report(report)


# ---- load ----------------------------------------------------------------------------------------


def test_load_places_each_rank_with_its_measured_offset(tmp_path: Path) -> None:
    paths = []
    for r in range(3):
        path = tmp_path / f"trace_rank{r}.json"
        # Rank r's clock is r ms behind rank 0's: rank 0's time = ours + r ms.
        chrome.write(rank_trace(r, 3, syncs=[(BASE, r * 1_000_000, 100 + r)]), str(path))
        paths.append(str(path))
    trace = merge_mod.load(paths)
    assert trace.ranks == [0, 1, 2]
    assert [(p.pid, p.rank, p.foreign) for p in trace.processes] == [(1, 0, False), (2, 1, False), (3, 2, False)]
    meta = trace.metadata
    assert (
        meta["merged"] is True and meta["world_size"] == 3 and meta["run_id"] == "run-a" and meta["ranks"] == [0, 1, 2]
    )
    assert meta["alignment"]["method"] == "clock"
    assert meta["alignment"]["per_rank"][2] == {"offset_ns": 2_000_000, "error_ns": 102, "file": paths[2]}
    assert meta["rank_metadata"][1]["rank"] == 1
    for r in range(3):
        want = spans(rank_trace(r, 3))
        got = [x for x in spans(trace) if x[0] == r]
        assert got == [(r, n, s + r * 1_000_000, e + r * 1_000_000) for _, n, s, e in want]
    assert meta["base_ns"] == BASE


def test_load_of_a_merged_file_gives_the_same_trace(tmp_path: Path) -> None:
    paths = write_ranks(tmp_path / "r", syncs=[(BASE, 5_000, 10)])
    merged = tmp_path / "merged.json"
    merge_mod.merge(paths, str(merged))
    a, b = merge_mod.load(paths), merge_mod.load(str(merged))
    assert spans(a) == spans(b)
    assert b.metadata["alignment"]["per_rank"] == a.metadata["alignment"]["per_rank"]
    assert b.ranks == a.ranks and b.metadata["run_id"] == "run-a" and b.metadata["world_size"] == 4
    assert [p.label for p in b.processes] == [p.label for p in a.processes]


# ---- merge: what it writes -----------------------------------------------------------------------


def test_merged_json_keeps_exact_integer_ns_and_one_process_per_rank(tmp_path: Path) -> None:
    paths = write_ranks(tmp_path / "r", syncs=[(BASE, 1_234_567, 10)])
    out = tmp_path / "merged.json"
    meta = merge_mod.merge(paths, str(out))
    assert_valid(out)
    data = out.read_bytes()
    x_lines = [ln for ln in data.split(b"\n") if b'"ph":"X"' in ln]
    assert len(x_lines) == 4 * 20 * 4
    assert all(re.search(rb'"ts":\d+\.\d{3},"dur":\d+\.\d{3}', ln) for ln in x_lines)
    back = chrome.read(str(out))
    assert spans(back) == spans(merge_mod.load(paths))
    assert sorted({p.pid for p in back.processes}) == [1, 2, 3, 4]
    assert back.metadata["alignment"]["per_rank"]["3"]["offset_ns"] == 1_234_567
    assert meta["alignment"]["per_rank"]["3"]["offset_ns"] == 1_234_567
    assert data.startswith(b'{"baseTimeNanoseconds": ')


def test_drift_between_two_syncs_maps_start_and_end_alike_so_nesting_survives(tmp_path: Path) -> None:
    for rank, syncs in [(0, []), (1, [(BASE, 1_000_000, 500), (BASE + 100_000_000_000, 1_100_000, 500)])]:
        # Rank 1's clock loses 1 us per second against rank 0's: 100 us over the 100 s run. Each
        # inner span starts half a second into its outer one and ends 1 ns before it: shifted by
        # its start alone, it would stick out of its parent by half a microsecond.
        t = Trace({"gputrace_version": "test", "rank": rank, "world_size": 2})
        meta = {"gputrace_version": "test", "rank": rank, "world_size": 2}
        meta["clock"] = {"sync_to_rank0": [{"at_ns": a, "offset_ns": o, "error_ns": e} for a, o, e in syncs]}
        t.metadata = meta
        p = t.add_process(Process(rank + 1, rank, f"rank {rank}", rank, meta))
        track = t.add_track(Track(p, 1, "thread MainThread (host)", "cpu", None, 1))
        for k in range(100):
            s = BASE + k * 1_000_000_000
            t.add_span("outer", track, s, s + 999_999_999)
            t.add_span("inner", track, s + 500_000_000, s + 999_999_998)
        chrome.write(t, str(tmp_path / f"trace_rank{rank}.json"))
    out = tmp_path / "m.json"
    meta = merge_mod.merge([str(tmp_path)], str(out))
    assert abs(meta["alignment"]["per_rank"]["1"]["drift_ppm"] - 1.0) < 1e-6
    assert_valid(out)
    merged = chrome.read(str(out))
    r0 = sorted(s for r, n, s, _ in spans(merged) if r == 0 and n == "outer")
    r1 = sorted(s for r, n, s, _ in spans(merged) if r == 1 and n == "outer")
    # Same local times; after the offset (+1 ms) and the drift (+1 us/s): 1 ms later at the
    # start, 1.099 ms later at the end.
    assert r1[0] - r0[0] == 1_000_000 and abs((r1[-1] - r0[-1]) - 1_099_000) <= 1
    rows = spans(merged)
    outer = {s: e for r, n, s, e in rows if r == 1 and n == "outer"}
    for r, n, s, e in rows:
        if r == 1 and n == "inner":
            parent = max(k for k in outer if k <= s)
            assert parent <= s and e <= outer[parent]


def test_align_on_makes_the_ends_of_the_nth_collective_equal(tmp_path: Path) -> None:
    d = tmp_path / "r"
    d.mkdir()
    for r in range(3):
        # No clock syncs; rank r's clock runs r * 37 us ahead.
        chrome.write(rank_trace(r, 3, skew_ns=r * 37_000), str(d / f"trace_rank{r}.json"))
    out = tmp_path / "on.json"
    meta = merge_mod.merge([str(d)], str(out), align_on="all_reduce", occurrence=3)
    merged = chrome.read(str(out))
    ends: dict[int | None, list[int]] = {}
    for r, n, _, e in spans(merged):
        if n == "all_reduce":
            ends.setdefault(r, []).append(e)
    assert ends[0] == ends[1] == ends[2]
    assert meta["alignment"]["method"] == "align-on" and meta["alignment"]["occurrence"] == 3
    assert meta["alignment"]["per_rank"]["2"]["offset_ns"] == -74_000
    with pytest.raises(MergeError, match="occurrence 21 asked"):
        merge_mod.load([str(d)], align_on="all_reduce", occurrence=21)


def test_streamed_and_cut_files_merge(tmp_path: Path) -> None:
    """A recording killed mid-write leaves the array form cut anywhere; merge takes every complete
    event. The object form cut off loses only its tail too."""
    full = rank_trace(1, 2, steps=50)
    streamed = tmp_path / "streamed_rank1.json"
    w = chrome.StreamWriter(
        str(streamed),
        BASE,
        full.processes[0],
        {"distributedInfo": {"rank": 1, "world_size": 2}, "metadata": {**full.metadata, "run_id": "run-a"}},
    )
    w.append(full, range(len(full.spans)))
    w.abandon()
    chrome.write(rank_trace(0, 2, steps=50), str(tmp_path / "trace_rank0.json"))
    data = streamed.read_bytes()
    obj = tmp_path / "object_rank1.json"
    chrome.write(full, str(obj))
    obj_data = obj.read_bytes()
    for cut in (len(data), len(data) - 3, len(data) * 2 // 3, len(data) // 2 + 17):
        streamed.write_bytes(data[:cut])
        out = tmp_path / f"m{cut}.json"
        merge_mod.merge([str(tmp_path / "trace_rank0.json"), str(streamed)], str(out))
        assert_valid(out)
        got = [x for x in spans(chrome.read(str(out))) if x[0] == 1]
        assert 0 < len(got) <= 200 and got == spans(chrome.read(str(streamed)))
        assert (cut == len(data)) == (len(got) == 200)
    obj.write_bytes(obj_data[: len(obj_data) * 3 // 4])
    trace = merge_mod.load([str(tmp_path / "trace_rank0.json"), str(obj)])
    assert 0 < sum(1 for x in spans(trace) if x[0] == 1) < 200


# ---- input checks -----------------------------------------------------------------------------


def test_the_same_rank_twice_is_an_error_in_every_disguise(tmp_path: Path) -> None:
    paths = write_ranks(tmp_path / "r", world=2)
    copy = tmp_path / "again_rank0.json"
    copy.write_bytes(Path(paths[0]).read_bytes())
    with pytest.raises(MergeError, match="rank 0 appears twice"):
        merge_mod.load([*paths, str(copy)])
    link = tmp_path / "link.json"
    link.symlink_to(paths[1])
    with pytest.raises(MergeError, match="are the same file"):
        merge_mod.load([*paths, str(link)])
    merged = tmp_path / "merged.json"
    merge_mod.merge(paths, str(merged))
    with pytest.raises(MergeError, match="already a merged trace .*give it alone"):
        merge_mod.load([str(merged), paths[1]])


def test_files_of_different_runs_or_world_sizes_are_errors_unless_allowed(tmp_path: Path) -> None:
    a = write_ranks(tmp_path / "a", world=2, run_id="run-a")
    b = write_ranks(tmp_path / "b", world=2, run_id="run-b")
    with pytest.raises(MergeError, match=r"different runs: run run-a has rank 0 .*run run-b has rank 1.*--allow-mixed"):
        merge_mod.load([a[0], b[1]])
    mixed = merge_mod.load([a[0], b[1]], allow_mixed=True)
    assert mixed.ranks == [0, 1] and "run_id" not in mixed.metadata
    assert any("different runs" in n for n in mixed.metadata["notes"])
    # A missing run id is unknown, not a mismatch.
    c = write_ranks(tmp_path / "c", world=2, run_id=None)
    assert merge_mod.load([a[0], c[1]]).metadata["run_id"] == "run-a"
    # The stale rank 1 of an earlier 2-rank run beside a new 1-rank run (the ids unknown).
    stale = tmp_path / "stale"
    write_ranks(stale, world=2, run_id=None)
    chrome.write(rank_trace(0, 1, run_id=None), str(stale / "trace_rank0.json"))
    with pytest.raises(MergeError, match="different sizes: world size 1 .*world size 2"):
        merge_mod.load([str(stale)])
    r = CliRunner().invoke(main, ["merge", str(stale), "-o", str(tmp_path / "x.json")])
    assert r.exit_code == 2 and "--allow-mixed" in r.output and "Traceback" not in r.output
    # ... and with matching world sizes but a rank beyond them.
    lone = tmp_path / "lone"
    lone.mkdir()
    chrome.write(rank_trace(0, 1, run_id=None), str(lone / "trace_rank0.json"))
    chrome.write(rank_trace(1, 1, run_id=None), str(lone / "trace_rank1.json"))
    with pytest.raises(MergeError, match="beyond the world size 1"):
        merge_mod.load([str(lone)])


def test_a_trace_without_a_rank_names_the_flag_that_fixes_it(tmp_path: Path) -> None:
    anonymous = tmp_path / "trace_rank5.json"
    anonymous.write_bytes(b'[{"ph": "X", "name": "a", "pid": 9, "tid": 1, "ts": 1, "dur": 2}')
    r = CliRunner().invoke(main, ["merge", str(anonymous), "-o", str(tmp_path / "y.json")])
    assert r.exit_code == 2 and "--rank-from-filename" in r.output and "Traceback" not in r.output
    paths = write_ranks(tmp_path / "r", world=8, run_id=None)
    r = CliRunner().invoke(
        main, ["merge", str(anonymous), paths[0], "-o", str(tmp_path / "y.json"), "--rank-from-filename", "-q"]
    )
    assert r.exit_code == 0, r.output
    merged = chrome.read(str(tmp_path / "y.json"))
    assert merged.ranks == [0] and sorted({p.rank for p in merged.processes}) == [0, 5]
    assert [p.foreign for p in merged.processes if p.rank == 5] == [True]


def test_merging_never_half_writes_the_output(tmp_path: Path) -> None:
    paths = write_ranks(tmp_path / "r", world=2)
    dest = tmp_path / "keep.json"
    dest.write_text("precious")
    bad = tmp_path / "trace_rank1.json"
    bad.write_bytes(b'{"baseTimeNanoseconds": 1, "metadata": {"gputrace_version": "x", "rank": 1}, "traceEvents": [{"p')
    r = CliRunner().invoke(main, ["merge", paths[0], str(bad), "-o", str(dest)])
    assert r.exit_code == 2 and "cut off before its first complete event" in r.output
    assert dest.read_text() == "precious"
    with pytest.raises(MergeError, match="one of the inputs"):
        merge_mod.merge(paths, paths[0])
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".gputrace")] == []


# ---- selections ---------------------------------------------------------------------------------


def test_parse_selections() -> None:
    assert merge_mod.parse_ranks("0-3,7") == {0, 1, 2, 3, 7}
    assert merge_mod.parse_steps("10:20") == (10, 20) and merge_mod.parse_steps("5") == (5, 6)
    assert merge_mod.parse_steps(":3") == (None, 3) and merge_mod.parse_steps("4:") == (4, None)
    assert merge_mod.parse_window("2s:3.5s") == (2_000_000_000, 3_500_000_000)
    assert merge_mod.parse_window("250us:") == (250_000, None)
    assert merge_mod.parse_window(f"{BASE}:{BASE + 5}") == (BASE, BASE + 5)
    for bad, fn in (("3-1", merge_mod.parse_ranks), ("a", merge_mod.parse_ranks), ("x:y", merge_mod.parse_steps)):
        with pytest.raises(MergeError):
            fn(bad)
    with pytest.raises(MergeError, match="units"):
        merge_mod.parse_window("2 min:3")
    with pytest.raises(MergeError, match="select nothing"):
        merge_mod.load([], steps=(5, 5))


def test_ranks_steps_and_window_select_what_a_ui_can_hold(tmp_path: Path) -> None:
    d = tmp_path / "r"
    d.mkdir()
    for r in range(4):
        chrome.write(rank_trace(r, 4, syncs=[(BASE, r * 3_000, 10)]), str(d / f"trace_rank{r}.json"))
    trace = merge_mod.load([str(d)], ranks={1, 3}, steps=(5, 7))
    assert trace.ranks == [1, 3]
    assert trace.metadata["selection"] == {"ranks": [1, 3], "steps": [5, 7], "step_name": "step"}
    assert set(trace.metadata["alignment"]["per_rank"]) == {1, 3}
    for r in (1, 3):
        got = [x for x in spans(trace) if x[0] == r]
        # Steps 5 and 6 of that rank, on its (aligned) clock: every span of those two steps.
        lo, hi = BASE + 5 * STEP_NS + r * 3_000, BASE + 7 * STEP_NS + r * 3_000
        assert len(got) == 8 and all(lo <= s and e <= hi for _, _, s, e in got)
    out = tmp_path / "sel.json"
    CliRunner().invoke(main, ["merge", str(d), "-o", str(out), "--ranks", "1,3", "--steps", "5:7", "-q"])
    assert spans(chrome.read(str(out))) == spans(trace)
    # A window relative to the merged start: the first 25 us (steps 0-2 of rank 0 begin there).
    win = merge_mod.load([str(d)], window=(0, 25_000))
    assert win.metadata["selection"] == {"window_ns": [0, 25_000]}
    assert all(s < BASE + 25_000 for _, _, s, _ in spans(win))
    # Rank 0's third step starts at 20 us: its spans that begin before 25 us are kept whole.
    assert {(n, e) for r, n, s, e in spans(win) if r == 0 and s >= BASE + 20_000} == {
        ("step", BASE + 29_000),
        ("forward", BASE + 23_000),
        ("backward", BASE + 27_000),
    }
    absolute = merge_mod.load([str(d)], window=(BASE, BASE + 25_000))
    assert spans(absolute) == spans(win)
    with pytest.raises(MergeError, match=r"no span is named 'iteration'.*spans there: all_reduce, backward"):
        merge_mod.load([str(d)], steps=(0, 1), step_name="iteration")
    with pytest.raises(MergeError, match="no rank has that many 'step' spans"):
        merge_mod.load([str(d)], steps=(40, 41))
    with pytest.raises(MergeError, match="--ranks: no rank 9"):
        merge_mod.load([str(d)], ranks={9})


# ---- other tools' traces -------------------------------------------------------------------------

PROFILED = textwrap.dedent(
    """
    import sys, tempfile, time
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile
    import gputrace

    out = sys.argv[1]
    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    gputrace.enable(cuda=False)
    x = torch.randn(128, 128)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(3):
            with gputrace.span("step", i=i):
                with gputrace.span("matmul"):
                    y = x @ x
                time.sleep(0.002)
    prof.export_chrome_trace(out + "/kineto_rank0.json")
    gputrace.save(out)
    dist.destroy_process_group()
    """
)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real torch.profiler trace and gputrace's trace of the same process (rank 0 of a gloo
    world of one), both on the host's realtime clock."""
    out = tmp_path_factory.mktemp("profiled")
    r = run_py(PROFILED.replace("sys.argv[1]", repr(str(out))), timeout=240)
    assert r.returncode == 0, r.stderr
    return out


def test_a_torch_profiler_trace_joins_its_rank_on_one_timeline(profiled: Path, tmp_path: Path) -> None:
    kineto = profiled / "kineto_rank0.json"
    out = tmp_path / "both.json"
    r = CliRunner().invoke(main, ["merge", str(profiled / "trace_rank0.json"), str(kineto), "-o", str(out), "-q"])
    assert r.exit_code == 0, r.output
    assert_valid(out)
    merged = chrome.read(str(out))
    own = [p for p in merged.processes if not p.foreign]
    foreign = [p for p in merged.processes if p.foreign]
    assert [p.rank for p in own] == [0] and foreign and all(p.rank == 0 for p in foreign)
    # Kineto's processes are kept, after their rank's.
    assert all(p.sort_index > own[0].sort_index for p in foreign)
    assert any(p.label.startswith("python") for p in foreign)
    kineto_spans = chrome.read(str(kineto)).spans
    assert sum(1 for t in merged.spans.track if merged.processes[merged.tracks[t].process].foreign) == len(kineto_spans)
    # Each aten::mm ran inside one of gputrace's matmul spans: both clocks are the host's
    # realtime, so they line up to within how differently the two read it (a few us).
    rows = spans(merged)
    matmuls = [(s, e) for _, n, s, e in rows if n == "matmul"]
    mms = [(s, e) for _, n, s, e in rows if n == "aten::mm"]
    assert len(matmuls) == len(mms) == 3
    for s, e in mms:
        assert any(ms - 20_000 <= s and e <= me + 20_000 for ms, me in matmuls), (s, e, matmuls)
    # The same through load(), as summary and the viewer get it.
    loaded = merge_mod.load([str(profiled)] + [str(kineto)])
    assert spans(loaded) == rows


@pytest.mark.browser
@pytest.mark.skipif(perfetto_ui.available() is not None, reason=str(perfetto_ui.available()))
def test_the_merged_timeline_with_a_torch_profiler_trace_loads_cleanly_in_perfetto(
    profiled: Path, tmp_path: Path
) -> None:
    out = tmp_path / "both.json"
    merge_mod.merge([str(profiled / "trace_rank0.json"), str(profiled / "kineto_rank0.json")], str(out))
    with perfetto_ui.perfetto_ui(tmp_path / "ui") as ui:
        r = ui.report(out)
    assert r["errors"] == []
    merged = chrome.read(str(out))
    instants = sum(1 for e in merged.extra if e.get("ph") in ("i", "I"))  # Perfetto's 0-length slices
    assert r["slices"] == len(merged.spans) + instants
    assert any(p.startswith("rank 0") for p in r["processes"])
    # Kineto names its process after the interpreter (python, python3, ...).
    assert any(p.startswith("python") and p.endswith("[rank 0]") for p in r["processes"]), r["processes"]


def test_a_torch_profiler_trace_alone_needs_its_rank(profiled: Path, tmp_path: Path) -> None:
    lone = tmp_path / "profile.json"
    data = (profiled / "kineto_rank0.json").read_bytes()
    lone.write_bytes(re.sub(rb'"distributedInfo": \{[^}]*\[[^]]*\][^}]*\}\]\},', b"", data))
    with pytest.raises(MergeError, match="--rank-from-filename"):
        merge_mod.load([str(lone)])
    assert merge_mod.load([str(profiled / "kineto_rank0.json")]).metadata["ranks"] == []


def test_another_tools_trace_moves_with_its_ranks_offset(tmp_path: Path) -> None:
    paths = write_ranks(tmp_path / "r", world=2, syncs=[(BASE, 50_000, 10)])
    kineto = tmp_path / "gpu_trace.json"
    kineto.write_bytes(
        orjson.dumps(
            {
                "distributedInfo": {"rank": 1, "world_size": 2},
                "baseTimeNanoseconds": BASE - 1_000_000,
                "traceEvents": [
                    {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "GPU 0"}},
                    {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 1000.5, "dur": 2.25},
                    {"ph": "f", "id": 1, "pid": 0, "tid": 7, "ts": 1000.5, "cat": "ac2g", "name": "ac2g", "bp": "e"},
                ],
            }
        )
    )
    trace = merge_mod.load([*paths, str(kineto)])
    gemm = [x for x in spans(trace) if x[1] == "gemm"]
    assert gemm == [(1, "gemm", BASE + 500 + 50_000, BASE + 500 + 2_250 + 50_000)]
    gpu = [p for p in trace.processes if p.foreign]
    assert [(p.pid, p.rank, p.label, p.sort_index) for p in gpu] == [(3, 1, "GPU 0 [rank 1]", 101)]
    assert [p.sort_index for p in trace.processes if not p.foreign] == [0, 100]
    out = tmp_path / "m.json"
    merge_mod.merge([*paths, str(kineto)], str(out))
    assert spans(chrome.read(str(out))) == spans(trace)
    lines = out.read_bytes().split(b"\n")
    flow = orjson.loads(next(ln for ln in lines if b'"ac2g"' in ln).rstrip(b","))
    kernel = orjson.loads(next(ln for ln in lines if b'"gemm"' in ln).rstrip(b","))
    assert (flow["pid"], flow["tid"]) == (kernel["pid"], kernel["tid"]) == (3, kernel["tid"])


def test_merged_files_of_older_versions_keep_their_ranks(tmp_path: Path) -> None:
    """Before the pid -> rank table, a merged file said only its ranks; pid = rank + 1."""
    paths = write_ranks(tmp_path / "r", world=2)
    merged = tmp_path / "new.json"
    merge_mod.merge(paths, str(merged))
    data = orjson.loads(merged.read_bytes())
    for key in ("pid_rank", "foreign_pids"):
        del data["metadata"][key]
    old = tmp_path / "old.json"
    old.write_bytes(orjson.dumps(data))
    trace = merge_mod.load(str(old))
    assert trace.ranks == [0, 1] and spans(trace) == spans(merge_mod.load(paths))
    assert trace.metadata["rank_metadata"][1]["rank"] == 1


# ---- scale paths ---------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 1 << 30], ids=["a rank a task", "all ranks in one task"])
def test_worker_processes_give_the_same_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batch: int) -> None:
    monkeypatch.setattr(merge_run, "BATCH_BYTES", batch)
    paths = write_ranks(tmp_path / "r", world=4, syncs=[(BASE, 777, 1), (BASE + 2_000_000_000, 1_777, 1)])
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    merge_mod.merge(paths, str(a), workers=1)
    merge_mod.merge(paths, str(b), workers=2)
    assert a.read_bytes() == b.read_bytes()
    assert spans(merge_mod.load(paths, workers=2)) == spans(merge_mod.load(paths, workers=1))
    bad = tmp_path / "r" / "trace_rank3.json"
    bad.write_bytes(bad.read_bytes()[:200])
    with pytest.raises(TraceFormatError, match="trace_rank3.json"):
        merge_mod.merge(paths, str(tmp_path / "c.json"), workers=2)


def test_progress_on_stderr_unless_quiet(tmp_path: Path) -> None:
    d = tmp_path / "r"
    write_ranks(d, world=2)
    r = CliRunner().invoke(main, ["merge", str(d), "-o", str(tmp_path / "p.json")])
    assert r.exit_code == 0 and "2/2 done" in r.stderr and "[" in r.stderr
    assert "2/2" not in r.stdout and "rank 1: offset not measured, error unknown (no clock sync" in r.stdout
    r = CliRunner().invoke(main, ["merge", str(d), "-o", str(tmp_path / "q.json"), "--quiet"])
    assert r.exit_code == 0 and r.stderr == ""


def test_perfetto_output_holds_the_same_spans(tmp_path: Path) -> None:
    perfetto = pytest.importorskip("gputrace.trace.perfetto")
    paths = write_ranks(tmp_path / "r", world=2, syncs=[(BASE, 4_321, 5)])
    out = tmp_path / "merged.pftrace"
    r = CliRunner().invoke(main, ["merge", *paths, "-o", str(out), "-q"])
    assert r.exit_code == 0, r.output
    back = perfetto.read(str(out))
    assert spans(back) == spans(merge_mod.load(paths))
    assert sorted(p.rank for p in back.processes if not p.foreign) == [0, 1]
    assert_valid(out)
    as_json = tmp_path / "merged.json"
    merge_mod.merge(paths, str(as_json))
    assert os.path.getsize(out) < os.path.getsize(as_json)


def test_a_cut_file_is_read_and_said_to_be_cut(tmp_path: Path) -> None:
    from gputrace.trace import chrome as _chrome

    whole = tmp_path / "trace_rank0.json"
    _chrome.write(rank_trace(0, world=1), str(whole))
    data = whole.read_bytes()
    cut = tmp_path / "cut" / "trace_rank0.json"
    cut.parent.mkdir()
    cut.write_bytes(data[: len(data) * 2 // 3])
    assert not any("not finished" in n for n in merge_mod.load([str(whole)]).metadata.get("notes", []))
    notes = merge_mod.load([str(cut)]).metadata.get("notes", [])
    assert any("not finished" in n and str(cut) in n for n in notes)
