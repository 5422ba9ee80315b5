"""A trace read for the statistics alone (`read_spans` with the arguments they look at, within
`registry.only_args`): the same spans as a whole read, with only those arguments and no
categories, in both formats; the summary and the viewer's document of it are the whole read's;
and `summary` and the viewer's document of a large trace hold its columns, not an argument
dict a span (peak memory of a real subprocess)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gputrace import stats, stats_columns, summary
from gputrace.trace import chrome, perfetto, registry
from gputrace.trace.model import Process, Trace, Track
from gputrace.viewer import data

BASE = 1_700_000_000_000_000_000
FORMATS = {"json": chrome, "pftrace": perfetto}


def marked_trace(n: int) -> Trace:
    """One rank: a step every 50 spans on the host, kernels on two streams, collectives marked
    (and one unmarked), arguments of other names on many spans, an unfinished span, and
    categories."""
    meta = {"gputrace_version": "test", "rank": 0, "world_size": 1, "run_id": "stats-read"}
    t = Trace(dict(meta))
    p = t.add_process(Process(1, 0, "rank 0", 0, meta))
    host = t.add_track(Track(p, 1, "thread MainThread (host)", "cpu", None, 1))
    streams = [t.add_track(Track(p, 2 + i, f"cuda:0 stream {i}", "cuda", 0, i)) for i in range(2)]
    for k in range(n):
        s = BASE + k * 1_000 + (k * 7919) % 333
        if k % 50 == 0:
            t.add_span("step", host, s, s + 49_000, {"step": k // 50})
        elif k % 17 == 0:
            t.add_span("all_reduce", streams[k % 2], s, s + 700, {"collective": k % 34 != 0, "bytes": k, "group": "g"})
        elif k == n - 2:
            t.add_span("tail", host, s, s + 10, {"unfinished": True, "depth": 1})
        else:
            t.add_span(f"kernel_{k % 7}", streams[k % 2], s, s + 400 + k % 97, {"bytes": k} if k % 3 == 0 else None)
    return t


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("stats-read")
    t = marked_trace(2_000)
    out = {}
    for ext, fmt in FORMATS.items():
        out[ext] = d / f"trace_rank0.{ext}"
        fmt.write(t, str(out[ext]))
    return out


@pytest.mark.parametrize("ext", list(FORMATS))
def test_read_spans_keeps_the_named_arguments_alone(files: dict[str, Path], ext: str) -> None:
    path = str(files[ext])
    whole = FORMATS[ext].read(path)
    lean = FORMATS[ext].read_spans(path, keys=stats_columns.ARGS)
    assert lean.names == whole.names and lean.tracks == whole.tracks and lean.processes == whole.processes
    for col in ("name", "track", "start", "end"):
        assert list(getattr(lean.spans, col)) == list(getattr(whole.spans, col)), col
    assert lean.spans.entry == whole.spans.entry
    want = [{k: v for k, v in (a or {}).items() if k in stats_columns.ARGS} or None for a in whole.spans.args]
    assert type(lean.spans.args) is list and lean.spans.args == want
    assert sum(a is not None for a in want) > 50  # the collectives and the unfinished span
    assert list(lean.spans.cat) == [None] * len(whole.spans)
    # No keys: neither column takes memory, and every span reads as None.
    bare = FORMATS[ext].read_spans(path)
    assert len(bare.spans.args) == len(bare.spans.cat) == len(whole.spans)
    assert bare.spans.args[5] is None and bare.spans.cat[5] is None and list(bare.spans.end) == list(whole.spans.end)


def test_only_args_reads_so_within_it_alone(files: dict[str, Path]) -> None:
    path = str(files["json"])
    with registry.only_args(["collective"]):
        inside = registry.read(path)
    outside = registry.read(path)
    assert {k for a in inside.spans.args if a for k in a} == {"collective"}
    assert {"bytes", "step", "group", "collective", "unfinished"} <= {k for a in outside.spans.args if a for k in a}


@pytest.mark.parametrize("ext", list(FORMATS))
def test_statistics_of_the_lean_read_are_the_whole_reads(files: dict[str, Path], ext: str) -> None:
    from gputrace import merge

    path = str(files[ext])
    whole = merge.load([path])
    lean = summary.load_for_statistics([path])
    assert {k for a in lean.spans.args if a for k in a} == {"collective", "unfinished"}
    assert stats.summarize(lean, "step") == stats.summarize(whole, "step")
    s = summary.summary_of_files([path])
    assert s.notes[0] == "read from the full traces"
    assert dataclasses_equal(s, stats.summarize(whole, "step"))
    assert json.dumps(data.document(lean), sort_keys=True, default=str) == json.dumps(
        data.document(whole), sort_keys=True, default=str
    )


def dataclasses_equal(a: stats.Summary, b: stats.Summary) -> bool:
    """Equal but for the first note, which says what was read."""
    import dataclasses

    return dataclasses.replace(a, notes=a.notes[1:]) == b


def test_a_sparse_args_column_reads_as_the_list_it_came_from() -> None:
    from gputrace.trace.model import SparseArgs

    dense = [None, {"collective": True}, None, None, {"unfinished": True}, None]
    col = SparseArgs(dense)
    assert len(col) == 6 and list(col) == dense and col.dense() == dense
    assert col[1] == {"collective": True} and col[-2] == {"unfinished": True} and col[0] is None
    assert col[1:5] == dense[1:5] and col[::-1] == dense[::-1]
    assert col.rows == {1: {"collective": True}, 4: {"unfinished": True}}
    with pytest.raises(IndexError):
        col[6]
    with pytest.raises(TypeError):
        col.append(None)


def test_the_statistics_trace_holds_the_marked_spans_arguments_alone(files: dict[str, Path]) -> None:
    from gputrace.trace.model import SparseArgs

    t = summary.load_for_statistics([str(files["pftrace"])])
    assert isinstance(t.spans.args, SparseArgs) and len(t.spans.args) == len(t.spans)
    assert 0 < len(t.spans.args.rows) < len(t.spans) // 10
    assert len(t.spans.cat) == len(t.spans) and t.spans.cat[0] is None


def test_view_serves_the_page_from_the_lean_read_and_the_timeline_with_every_argument(
    files: dict[str, Path], tmp_path: Path
) -> None:
    """`gputrace view` of a trace (a real process): its page's numbers are the whole trace's, and
    the timeline, read when it is first asked for, carries every argument of every span."""
    import re
    import signal
    import subprocess
    import sys

    import orjson

    from gputrace import merge

    from .test_viewer import get

    path = files["pftrace"]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gputrace",
            "view",
            str(path),
            "--no-browser",
            "--perfetto-ui",
            "https://ui.example.org",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.match(r"gputrace view: http://127\.0\.0\.1:(\d+)/ ", line)
        assert m, line
        addr = ("127.0.0.1", int(m.group(1)))
        status, _, body = get(addr, "/data.json")
        whole = merge.load([str(path)])
        want = data.document(whole, inputs=[str(path)])
        got = orjson.loads(body)
        assert status == 200 and got["spans"] == len(whole.spans) and want["steps"]
        for key, value in want.items():
            if key not in ("timeline", "open"):  # what the server adds to the document
                assert got[key] == orjson.loads(orjson.dumps(value)), key
        status, _, body = get(addr, "/trace.json")
        assert status == 200 and body == data.timeline_trace(whole, want["base_ns"])
        events = orjson.loads(body)["traceEvents"]
        assert {"bytes", "group", "collective", "step", "unfinished"} <= {k for e in events for k in e.get("args", {})}
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err, err


def test_a_timeline_trace_that_cannot_be_read_then_is_one_line(files: dict[str, Path], tmp_path: Path) -> None:
    """The page's trace was read; the timeline's, read when first asked, is gone by then: the
    timeline gets one line (500), the page stays, and the server prints nothing."""
    import contextlib
    import io
    import threading

    from gputrace.viewer import server

    from .test_viewer import get

    path = tmp_path / "trace_rank0.json"
    path.write_bytes(files["json"].read_bytes())
    doc = data.document(summary.load_for_statistics([str(path)]))
    viewer = server.Viewer(lambda: data.load([str(path)]), doc, server.resolve_ui("https://ui.example.org"))
    path.unlink()
    err = io.StringIO()
    httpd = viewer.serve(0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with contextlib.redirect_stderr(err):
            status, _, body = get(httpd.server_address, "/trace.json")
            assert status == 500 and body.decode().count("\n") == 1 and str(path) in body.decode()
            assert get(httpd.server_address, "/trace.json?start=0&end=1000")[0] == 500
            assert get(httpd.server_address, "/data.json")[0] == 200
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert err.getvalue() == ""
