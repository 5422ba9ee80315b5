"""The viewer without a browser: its document is the statistics' numbers, its timeline windows,
its server (local only, nothing outside what it was given, traversal refused), its report, the
`view` command, and the wheel carrying the page."""

from __future__ import annotations

import dataclasses
import http.client
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from gputrace import stats
from gputrace.cli import main
from gputrace.errors import GputraceError
from gputrace.trace import chrome
from gputrace.trace.model import Process, Trace, Track
from gputrace.viewer import data, report, server

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "samples" / "h200x2-nccl"
BASE = 1_700_000_000_000_000_000
STEP = 40_000_000
HOSTILE = [
    "<script>window.pwned = 1</script>",
    '</script><img src=x onerror="window.pwned = 2">',
    "\"quotes' & <b>markup</b>",
    "x" * 5000,
    "\u202eevil rtl \u0301\U0001f525 名前 \x00nul",
]


def make_trace(
    ranks: int = 3, steps: int = 6, slow: dict[int, set[int]] | None = None, extra_names: list[str] | None = None
) -> Trace:
    """A merged trace built by hand: each rank computes then all-reduces in every step; a rank in
    `slow` computes 50% longer in its steps, and the others wait for it in the all-reduce."""
    slow = slow or {}
    t = Trace(
        {
            "merged": True,
            "alignment": {
                "method": "clock",
                "per_rank": {str(r): {"offset_ns": 0, "error_ns": 1000} for r in range(ranks)},
            },
        }
    )
    work = {
        r: [10_000_000 + (5_000_000 if k in slow.get(r, ()) else 0) + 1000 * r for k in range(steps)]
        for r in range(ranks)
    }
    for r in range(ranks):
        p = t.add_process(Process(r + 1, r, f"rank {r}", r, {}))
        comp = t.add_track(Track(p, 2, "cuda:0 default stream", "cuda", 0, 2))
        comm = t.add_track(Track(p, 3, "cuda:0 stream 7", "cuda", 0, 3))
        for k in range(steps):
            s = BASE + k * STEP
            done = s + max(work[q][k] for q in range(ranks)) + 1_000_000
            t.add_span("step", comp, s, done, {"step": k})
            t.add_span("compute", comp, s, s + work[r][k])
            t.add_span("all_reduce", comm, s + work[r][k], done)
            for i, name in enumerate(extra_names or ()):
                t.add_span(name, comp, s + 1000 * i, s + 1000 * i + 500)
    return t


def write_ranks(trace: Trace, out: Path, ext: str = "json") -> list[str]:
    """Each rank of `trace` as gputrace's own per-rank file (Chrome JSON, or Perfetto protobuf
    with ext="pftrace")."""
    paths = []
    for proc in trace.processes:
        r = proc.rank
        assert r is not None
        one = Trace({"gputrace_version": "test", "rank": r, "world_size": len(trace.processes)})
        p = one.add_process(Process(r + 1, r, proc.label, r, {}))
        mine = [i for i, tr in enumerate(trace.tracks) if trace.processes[tr.process] is proc]
        tracks = {i: one.add_track(dataclasses.replace(trace.tracks[i], process=p)) for i in mine}
        for name, track, s, e, args in trace.iter_spans():
            if track in tracks:
                one.add_span(name, tracks[track], s, e, args)
        path = out / f"trace_rank{r}.{ext}"
        if ext == "json":
            chrome.write(one, str(path))
        else:
            from gputrace.trace import perfetto

            perfetto.write(one, str(path))
        paths.append(str(path))
    return paths


# ---- the document -------------------------------------------------------------------------------


def test_the_document_carries_the_statistics_numbers() -> None:
    trace = make_trace(3, 6, {2: {1, 4}})
    summary = stats.summarize(trace)
    doc = data.document(trace, summary)
    assert doc["ranks"] == [0, 1, 2] and doc["base_ns"] == BASE
    st = doc["steps"]
    assert st["count"] == 6
    assert [len(v) for v in st["busy"]] == [6, 6, 6]
    for slot, r in enumerate(doc["ranks"]):
        assert st["busy"][slot] == summary.steps.busy_ns[r]
        assert st["start"][slot] == [v - BASE for v in summary.steps.start_ns[r]]
    called = {(st["verdict"]["slot"][k], k) for k in range(6) if st["verdict"]["called"][k]}
    assert called == {(2, 1), (2, 4)}
    assert st["times_slowest"] == [0, 0, 2]
    co = doc["collectives"]
    assert co["count"] == 6 and co["names"] == ["all_reduce"]
    last = {co["step"][j] for j in range(6) if co["last_called"][j]}
    assert last == {1, 4} and all(co["last_slot"][j] == 2 for j in range(6) if co["step"][j] in last)
    assert co["per_rank"]["times_last"] == [0, 0, 2]
    assert co["per_rank"]["wait_caused_ns"][2] == summary.collectives.per_rank[2].wait_caused_ns > 0
    rows = {row[0]: row for row in doc["stats"]["names"]}
    cols = doc["stats"]["columns"]
    for n in summary.names:
        row = dict(zip(cols, rows[n.name]))
        assert (row["count"], row["total_ns"], row["p99_ns"], row["slowest_rank"]) == (
            n.count,
            n.total_ns,
            n.p99_ns,
            n.slowest.rank,
        )
        assert row["slowest_start_ns"] == n.slowest.start_ns - BASE
    assert len(doc["stats"]["by_rank"]) == 3
    orjson.dumps(doc)  # JSON as it is (no infinities, no bytes)


def test_a_trace_without_steps_or_collectives_still_has_statistics() -> None:
    t = Trace()
    p = t.add_process(Process(1, 0, "rank 0", 0))
    tr = t.add_track(Track(p, 2, "thread main (host)", "cpu"))
    t.add_span("load", tr, BASE, BASE + 100)
    doc = data.document(t)
    assert doc["steps"] is None and doc["collectives"] is None
    assert [row[0] for row in doc["stats"]["names"]] == ["load"]


def test_timeline_windows_keep_the_time_base() -> None:
    trace = make_trace(2, 10)
    whole = chrome.read("whole.json", data.timeline_trace(trace, BASE))
    assert whole.metadata["base_ns"] == BASE and len(whole.spans) == len(trace.spans)
    lo, hi = BASE + 3 * STEP, BASE + 5 * STEP
    part = chrome.read("part.json", data.timeline_trace(trace, BASE, lo, hi))
    assert part.metadata["base_ns"] == BASE  # Perfetto's trace time stays ns - BASE
    want = sorted((n, s, e) for n, _, s, e, _ in trace.iter_spans() if s < hi and e > lo)
    assert sorted((n, s, e) for n, _, s, e, _ in part.iter_spans()) == want
    assert {s // STEP for _, _, s, _, _ in part.iter_spans()} == {(BASE // STEP) + 3, (BASE // STEP) + 4}
    # Too many spans for the UI: the window is cut, keeping its start.
    a, b = data.fit_window(trace, BASE, BASE + 10 * STEP, limit=12)
    assert a == BASE and data.spans_in(trace, a, b) <= 12 < data.spans_in(trace, a, BASE + 10 * STEP)


def test_a_large_trace_gives_the_timeline_a_first_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data, "TIMELINE_SPANS", 20)
    trace = make_trace(2, 10)
    tl = data.document(trace)["timeline"]
    assert tl["whole"] is False
    lo, hi = tl["initial"]
    assert lo == 0 and 0 < hi <= 3 * STEP
    assert data.spans_in(trace, BASE + lo, BASE + hi) <= 20


# ---- the server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ui_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ui")
    (root / "ui").mkdir()
    (root / "ui" / "index.html").write_text("<!doctype html><title>a Perfetto UI</title>")
    (root / "ui" / "engine.wasm").write_bytes(b"\0asm")
    (root / "secret.txt").write_text("outside the UI")
    os.symlink(root / "secret.txt", root / "ui" / "link.txt")
    return root / "ui"


@pytest.fixture(scope="module")
def served(ui_dir: Path) -> Iterator[tuple[str, int]]:
    trace = make_trace(2, 4, extra_names=HOSTILE)
    viewer = server.Viewer(trace, data.document(trace), server.resolve_ui(str(ui_dir)), name="t")
    httpd = viewer.serve(0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield httpd.server_address
    finally:
        httpd.shutdown()
        httpd.server_close()


def get(addr: tuple[str, int], path: str, method: str = "GET", host: str | None = None) -> tuple[int, dict, bytes]:
    """A request with the path sent exactly as given (no client-side normalisation of '..')."""
    conn = http.client.HTTPConnection(*addr, timeout=30)
    conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
    conn.putheader("Host", host or f"127.0.0.1:{addr[1]}")
    conn.endheaders()
    res = conn.getresponse()
    body = res.read()
    conn.close()
    return res.status, {k.lower(): v for k, v in res.getheaders()}, body


def test_the_server_binds_127_0_0_1_and_serves_the_page_with_a_policy(served: tuple[str, int]) -> None:
    assert served[0] == "127.0.0.1"
    status, headers, body = get(served, "/")
    assert status == 200 and b'src="static/app.js"' in body
    csp = headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "frame-src 'self'" in csp
    assert headers["x-content-type-options"] == "nosniff"
    for name in ("app.js", "heatmap.js", "collectives.js", "stats.js", "timeline.js", "util.js", "style.css"):
        status, headers, _ = get(served, f"/static/{name}")
        assert status == 200 and "content-security-policy" in headers, name
    status, headers, body = get(served, "/data.json")
    doc = orjson.loads(body)
    assert doc["timeline"]["ui"]["src"].startswith("/ui/index.html#!/viewer?mode=embedded")
    assert {row[0] for row in doc["stats"]["names"]} >= set(HOSTILE)


def test_the_server_serves_the_trace_and_its_windows(served: tuple[str, int]) -> None:
    status, headers, body = get(served, "/trace.json")
    assert status == 200 and len(chrome.read("t.json", body).spans) == 4 * 2 * (3 + len(HOSTILE))
    status, headers, body = get(served, f"/trace.json?start={STEP}&end={2 * STEP}")
    assert status == 200 and headers["x-gputrace-window"] == f"{STEP},{2 * STEP}"
    assert {s // STEP for _, _, s, _, _ in chrome.read("w.json", body).iter_spans()} == {BASE // STEP + 1}
    status, headers, body = get(served, "/trace.json?download=1")
    assert status == 200 and "attachment" in headers["content-disposition"]
    assert len(chrome.read("d.json", body).spans) == 4 * 2 * (3 + len(HOSTILE))
    assert get(served, "/trace.json?start=x&end=2")[0] == 400
    assert get(served, "/trace.json?start=5&end=2")[0] == 400


@pytest.mark.parametrize(
    "path",
    [
        "/../../../../etc/passwd",
        "/static/../server.py",
        "/static/..%2fserver.py",
        "/static/%2e%2e/server.py",
        "/static/%2e%2e%2fdata.py",
        "/static//etc/passwd",
        "/static/%2fetc%2fpasswd",
        "/static/",
        "/ui/../secret.txt",
        "/ui/%2e%2e/secret.txt",
        "/ui/%2e%2e%2fsecret.txt",
        "/ui/..%5csecret.txt",
        "/ui//etc/passwd",
        "/ui/%2fetc%2fpasswd",
        "/ui/link.txt",
        "/ui/index.html%00.txt",
        "/etc/passwd",
        "//etc/passwd",
        "/data.json/../../etc/passwd",
        "http://127.0.0.1/../../etc/passwd",
        "/viewer/server.py",
        "/gputrace/cli.py",
    ],
)
def test_path_traversal_is_refused(served: tuple[str, int], path: str) -> None:
    status, _, body = get(served, path)
    assert status == 404, (path, status)
    assert b"root:" not in body and b"outside the UI" not in body and b"import" not in body


def test_the_ui_directory_is_served_and_only_it(served: tuple[str, int]) -> None:
    status, headers, body = get(served, "/ui/index.html")
    assert status == 200 and b"a Perfetto UI" in body
    assert headers["content-security-policy"] == "frame-ancestors 'self'"
    status, headers, _ = get(served, "/ui/engine.wasm")
    assert status == 200 and headers["content-type"] == "application/wasm"


def test_other_hosts_and_methods_are_refused(served: tuple[str, int]) -> None:
    assert get(served, "/data.json", host="attacker.example:80")[0] == 421
    assert get(served, "/data.json", host=f"attacker.example:{served[1]}")[0] == 421
    assert get(served, "/data.json", host=f"localhost:{served[1]}")[0] == 200
    assert get(served, "/data.json", method="POST")[0] == 405
    assert get(served, "/data.json", method="HEAD")[:1] == (200,)


def test_a_taken_port_is_a_one_line_error() -> None:
    trace = make_trace(1, 1)
    v = server.Viewer(trace, data.document(trace), server.resolve_ui("https://ui.example.org"))
    first = v.serve(0)
    try:
        with pytest.raises(GputraceError, match="choose another --port"):
            v.serve(first.server_address[1])
    finally:
        first.server_close()


def test_where_the_timeline_comes_from(tmp_path: Path) -> None:
    u = server.resolve_ui("https://ui.example.org/x/")
    assert (u.kind, u.frame_origin) == ("url", "https://ui.example.org")
    assert u.src.startswith("https://ui.example.org/x/#!/viewer?mode=embedded")
    assert "frame-src https://ui.example.org;" in server.page_csp(u)
    with pytest.raises(GputraceError, match="no index.html"):
        server.resolve_ui(str(tmp_path))
    local = server.resolve_ui(None)
    if server.local_ui():
        assert local.kind == "dir" and os.path.isfile(os.path.join(local.location, "index.html"))
    else:
        assert local.location == server.REMOTE_UI


# ---- the report ---------------------------------------------------------------------------------


def test_the_report_is_one_file_under_a_strict_policy() -> None:
    trace = make_trace(2, 3, extra_names=HOSTILE)
    page = report.html(data.document(trace)).decode()
    csp = re.search(r'<meta http-equiv="Content-Security-Policy" content="([^"]+)">', page).group(1)
    assert "default-src 'none'" in csp and "'unsafe-inline'" not in csp and "connect-src" not in csp
    scripts = re.findall(r"<script>(.*?)</script>", page, re.S)
    assert len(scripts) == 1 and report._sha256(scripts[0]) in csp
    styles = re.findall(r"<style>(.*?)</style>", page, re.S)
    assert len(styles) == 1 and report._sha256(styles[0]) in csp
    # No name can close the data block: the only '</script>' are the two real ones.
    assert page.count("</script>") == 2 and "<script>window.pwned" not in page
    payload = re.search(r'<script type="application/json" id="gputrace-data">(.*?)</script>', page, re.S).group(1)
    assert {row[0] for row in orjson.loads(payload)["stats"]["names"]} >= set(HOSTILE)
    assert not re.search(r'(src|href)="(?!data:)', page)  # nothing to fetch


def test_the_bundler_refuses_what_it_does_not_understand() -> None:
    assets = server.static_assets()
    bad = dict(assets)
    bad["stats.js"] = (b'import { el } from "./util.js"\nexport default 1;\n', "text/javascript")
    with pytest.raises(ValueError, match="stats.js"):
        report.bundle(bad)
    late = dict(assets)
    late["util.js"] = (b'import { render } from "./app.js";\nexport function el() {}\n', "text/javascript")
    with pytest.raises(ValueError, match="not bundled before"):
        report.bundle(late)


# ---- the command --------------------------------------------------------------------------------


def test_view_export_writes_the_report(tmp_path: Path) -> None:
    paths = write_ranks(make_trace(3, 6, {1: {2}}), tmp_path)
    out = tmp_path / "report.html"
    res = CliRunner().invoke(main, ["view", *paths, "--export", str(out), "--skip-steps", "1"])
    assert res.exit_code == 0, res.output
    assert res.stdout == f"wrote {out}\n" and res.stderr == "gputrace view: reading 3 trace files\n"
    payload = re.search(r'id="gputrace-data">(.*?)</script>', out.read_text(), re.S).group(1)
    doc = orjson.loads(payload)
    assert doc["steps"]["skipped"] == 1 and doc["steps"]["count"] == 5 and doc["timeline"]["ui"] is None


def test_view_reads_perfetto_protobuf(tmp_path: Path) -> None:
    write_ranks(make_trace(3, 6, {0: {4}}), tmp_path, "pftrace")
    out = tmp_path / "report.html"
    res = CliRunner().invoke(main, ["view", str(tmp_path), "--export", str(out)])
    assert res.exit_code == 0, res.output
    doc = orjson.loads(re.search(r'id="gputrace-data">(.*?)</script>', out.read_text(), re.S).group(1))
    st = doc["steps"]
    assert doc["ranks"] == [0, 1, 2] and st["count"] == 6
    assert {(st["verdict"]["slot"][k], k) for k in range(6) if st["verdict"]["called"][k]} == {(0, 4)}


def test_view_errors_are_one_line(tmp_path: Path) -> None:
    res = CliRunner().invoke(main, ["view", str(tmp_path / "missing.json"), "--no-browser"])
    assert res.exit_code == 2 and res.output.count("\n") == 1 and "no such file" in res.output
    res = CliRunner().invoke(main, ["view", str(SAMPLE), "--perfetto-ui", str(tmp_path), "--no-browser"])
    assert res.exit_code == 2 and "no index.html" in res.output
    res = CliRunner().invoke(main, ["view", str(SAMPLE), "--step", "iteration", "--export", str(tmp_path / "r.html")])
    assert res.exit_code == 2 and "no span is named 'iteration'" in res.output and "'step'" in res.output


def test_view_serves_until_ctrl_c(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gputrace", "view", str(SAMPLE), "--no-browser"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        line = proc.stdout.readline()
        m = re.match(r"gputrace view: http://127\.0\.0\.1:(\d+)/ ", line)
        assert m, line
        status, _, body = get(("127.0.0.1", int(m.group(1))), "/data.json")
        assert status == 200 and orjson.loads(body)["ranks"] == [0, 1]
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert out == "gputrace view: stopped\n" and err == "gputrace view: reading 2 trace files\n"


# ---- packaging ----------------------------------------------------------------------------------


def test_the_wheel_carries_the_page(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
    shutil.copytree(ROOT / "gputrace", src / "gputrace", ignore=ignore)
    shutil.copytree(ROOT / "viewer", src / "viewer", ignore=ignore)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CC": "/bin/false"},  # the C hot path is optional: skip compiling it
    )
    assert res.returncode == 0, res.stderr
    wheel = next(tmp_path.glob("gputrace-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    static = sorted(p.name for p in (ROOT / "viewer" / "static").iterdir())
    assert {f"gputrace/viewer/static/{n}" for n in static} <= names
    assert {"gputrace/viewer/__init__.py", "gputrace/viewer/data.py", "gputrace/viewer/server.py"} <= names
    assert not any(n.startswith("viewer/") for n in names)
