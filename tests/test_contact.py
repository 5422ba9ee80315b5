"""A user's first contact and the CLI's outputs: outputs only onto regular files, paths that are
not UTF-8, the viewer's server under many idle and busy connections, ranks recorded without
torch.distributed merged, unsynced clocks said to be unsynced, every file of `validate`
reported, and the messages that say what to do."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from gputrace.cli import main
from gputrace.errors import GputraceError
from gputrace.trace import files
from gputrace.trace.model import Trace
from gputrace.viewer import data, report, server

from .conftest import read_json
from .test_viewer import get, make_trace, write_ranks

# ---- outputs only onto regular files ------------------------------------------------------------


def _special_targets(tmp_path: Path) -> list[tuple[Path, str]]:
    """A FIFO and a link to /dev/null in a temp folder (the real /dev/null is never written)."""
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    null = tmp_path / "null.json"
    os.symlink("/dev/null", null)
    return [(fifo, "a FIFO"), (null, "a character device (through a symbolic link)")]


def _unchanged(target: Path) -> None:
    if target.is_symlink():
        assert os.readlink(target) == "/dev/null"
    else:
        assert stat.S_ISFIFO(os.lstat(target).st_mode)
    assert not [p for p in os.listdir(target.parent) if p.startswith(".gputrace-")]  # no temp file left


@pytest.mark.parametrize("out_name", ["merged.json", "merged.pftrace"])
def test_merge_refuses_to_write_onto_a_fifo_or_a_device(tmp_path: Path, out_name: str) -> None:
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    write_ranks(make_trace(2, 3), ranks)
    for target, kind in _special_targets(tmp_path):
        out = target.with_name(target.stem + Path(out_name).suffix)
        if out != target:
            target.rename(out)
        res = CliRunner().invoke(main, ["merge", str(ranks), "-o", str(out), "-q"])
        assert res.exit_code == 2, res.output
        lines = res.output.strip().splitlines()
        assert len(lines) == 1 and f"it is {kind}, not a regular file" in lines[0], res.output
        assert str(out) in lines[0]
        _unchanged(out)
    # A regular file and a new path are still written.
    (tmp_path / "old.json").write_bytes(b"old")
    for out in (tmp_path / "old.json", tmp_path / "new" / "m.json"):
        res = CliRunner().invoke(main, ["merge", str(ranks), "-o", str(out), "-q"])
        assert res.exit_code == 0, res.output
        assert out.is_file() and out.stat().st_size > 100


def test_view_export_refuses_to_write_onto_a_fifo_or_a_device(tmp_path: Path) -> None:
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    write_ranks(make_trace(2, 3), ranks)
    for target, kind in _special_targets(tmp_path):
        res = CliRunner().invoke(main, ["view", str(ranks), "--export", str(target)])
        assert res.exit_code == 2, res.output
        assert f"{target}: it is {kind}, not a regular file" in res.output.strip().splitlines()[-1]
        assert "reading" not in res.output  # refused before the traces were read
        _unchanged(target)


def test_the_atomic_writer_refuses_to_replace_a_non_regular_file(tmp_path: Path) -> None:
    (target, _), (link, _) = _special_targets(tmp_path)
    folder = tmp_path / "folder.json"
    folder.mkdir()
    for path, kind in ((target, "a FIFO"), (link, "a character device"), (folder, "a directory")):
        with pytest.raises(GputraceError, match=f"it is {kind}"):
            files.write_atomic(str(path), b"{}")
    _unchanged(target)
    _unchanged(link)
    assert folder.is_dir() and not list(folder.iterdir())
    # What was a regular file when the writing began and is a FIFO by the rename is not replaced.
    late = tmp_path / "late.json"
    with pytest.raises(GputraceError, match="it is a FIFO"):
        with files.atomic_writer(str(late)) as f:
            f.write(b"{}")
            os.mkfifo(late)
    _unchanged(late)


# ---- paths that are not UTF-8 -------------------------------------------------------------------


def test_view_of_a_folder_whose_name_is_not_utf8(tmp_path: Path) -> None:
    folder = Path(os.fsdecode(bytes(tmp_path) + b"/runs-\xff\xfe-x"))
    folder.mkdir()
    write_ranks(make_trace(2, 3), folder)
    out = tmp_path / "report.html"
    res = CliRunner().invoke(main, ["view", str(folder), "--export", str(out)])
    assert res.exit_code == 0, res.output
    page = out.read_text()
    assert "runs-\ufffd\ufffd-x" in page
    # The server's document (built when `view` serves) holds the name too, as JSON can.
    trace = data.load([str(folder)])
    doc = data.document(trace, inputs=[str(folder)])
    viewer = server.Viewer(trace, doc, server.resolve_ui(None), name=doc["title"])
    httpd = viewer.serve(0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        status, _, body = get(httpd.server_address, "/data.json")
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert status == 200
    shown = orjson.loads(body)
    assert shown["inputs"] == [str(folder).encode("utf-8", "surrogateescape").decode("utf-8", "replace")]
    assert shown["title"] == "runs-\ufffd\ufffd-x: 2 ranks"
    assert data.shown_text("lone \ud800 surrogate") == "lone ? surrogate"


# ---- the viewer's server: connections that say nothing ------------------------------------------


def _serving(trace: Trace | None = None, **settings: Any) -> Any:
    trace = trace or make_trace(2, 3)
    viewer = server.Viewer(trace, data.document(trace), server.resolve_ui("https://ui.perfetto.dev"), name="t")
    httpd = viewer.serve(0, **settings)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def _closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed `sock` (it reads EOF), or None if it is still open then."""
    t0 = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - t0


def _handler_threads() -> int:
    return sum("process_request_thread" in t.name for t in threading.enumerate())


def test_the_viewer_closes_idle_and_half_open_connections_after_its_timeout() -> None:
    assert server.IDLE_TIMEOUT_S > 0 and server.BACKLOG >= 128  # as `gputrace view` serves
    httpd = _serving(timeout=0.5)
    try:
        addr = httpd.server_address
        assert httpd.request_queue_size == server.BACKLOG
        idle = socket.create_connection(addr)
        half = socket.create_connection(addr)
        half.sendall(b"GET /data.json HTTP/1.1\r\nHost: 127.0.0.1")  # and nothing more
        keep = socket.create_connection(addr)  # keep-alive: one answered request, then silence
        keep.sendall(f"GET /data.json HTTP/1.1\r\nHost: 127.0.0.1:{addr[1]}\r\n\r\n".encode())
        for sock in (idle, half, keep):
            took = _closed_within(sock, 10)
            assert took is not None and took < 5, "the server still holds a silent connection"
            sock.close()
        deadline = time.monotonic() + 5
        while _handler_threads() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _handler_threads() == 0
        status, _, body = get(addr, "/data.json")  # and it still serves
        assert status == 200 and orjson.loads(body)["ranks"] == [0, 1]
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_client_that_stops_reading_frees_its_thread_quietly(capfd: pytest.CaptureFixture[str]) -> None:
    # A download larger than the sockets' buffers, never read: the write times out.
    httpd = _serving(make_trace(4, 3000), timeout=0.5)
    try:
        addr = httpd.server_address
        sock = socket.create_connection(addr)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(f"GET /trace.json?download=1 HTTP/1.1\r\nHost: 127.0.0.1:{addr[1]}\r\n\r\n".encode())
        deadline = time.monotonic() + 15
        time.sleep(0.2)
        while _handler_threads() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _handler_threads() == 0, "a thread still writes to a client that reads nothing"
        sock.close()
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert capfd.readouterr().err == ""  # no traceback from the server


def test_the_viewer_serves_at_most_max_threads_connections_at_once() -> None:
    httpd = _serving(timeout=1.0, max_threads=2)
    try:
        addr = httpd.server_address
        idle = [socket.create_connection(addr) for _ in range(2)]
        time.sleep(0.2)
        assert _handler_threads() == 2
        t0 = time.monotonic()
        status, _, _ = get(addr, "/data.json")  # waits in the backlog for a thread to be free
        assert status == 200 and 0.5 < time.monotonic() - t0 < 10
        assert _handler_threads() <= 2
        for sock in idle:
            sock.close()
    finally:
        httpd.shutdown()
        httpd.server_close()


# ---- ranks recorded with enable(rank=r) and no torch.distributed --------------------------------

_RANK_ONLY = """
import sys, time, gputrace
gputrace.enable(rank=int(sys.argv[1]), out_dir=sys.argv[2], cuda=False)
for i in range(3):
    with gputrace.span("step", step=i):
        with gputrace.span("work"):
            time.sleep(0.001)
    gputrace.flush()
gputrace.save()
"""


def test_ranks_recorded_with_a_rank_option_alone_merge(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env = {k: v for k, v in env.items() if not k.startswith(("GPUTRACE", "TORCHELASTIC", "SLURM"))}
    procs = [
        subprocess.Popen([sys.executable, "-c", _RANK_ONLY, str(r), str(tmp_path)], env=env, stderr=subprocess.PIPE)
        for r in range(3)
    ]
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read() if p.stderr else ""
    for r in range(3):
        head = read_json(tmp_path / f"trace_rank{r}.json")
        assert head["distributedInfo"] == {"rank": r}  # no world size made up
        assert head["metadata"]["world_size"] is None and head["metadata"]["run_id"] is None
    out = tmp_path / "merged.json"
    res = CliRunner().invoke(main, ["merge", str(tmp_path), "-o", str(out), "-q"])
    assert res.exit_code == 0, res.output
    merged = read_json(out)
    assert merged["metadata"]["ranks"] == [0, 1, 2]
    assert sorted({e["pid"] for e in merged["traceEvents"] if e["ph"] == "X"}) == [1, 2, 3]
    res = CliRunner().invoke(main, ["summary", str(tmp_path / "trace_rank*.json")])
    assert res.exit_code == 0, res.output


# ---- a run whose clocks were not synced does not look exact -------------------------------------


def _synced_meta(rank: int) -> dict[str, Any]:
    sync = {"at_ns": 1_700_000_000_000_000_000, "offset_ns": 1500 * rank, "error_ns": 2500}
    return {"hostname": "node1", "clock": {"sync_to_rank0": [sync]}}


def test_an_unsynced_merge_prints_no_error_bar_of_zero(tmp_path: Path) -> None:
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    write_ranks(make_trace(3, 2), ranks)  # recorded without sync_clocks()
    res = CliRunner().invoke(main, ["merge", str(ranks), "-o", str(tmp_path / "m.json"), "-q"])
    assert res.exit_code == 0, res.output
    assert "+- 0.0 us" not in res.output
    lines = [ln for ln in res.output.splitlines() if ln.startswith("rank ")]
    assert len(lines) == 3 and all("offset not measured, error unknown (no clock sync recorded" in ln for ln in lines)
    per_rank = read_json(tmp_path / "m.json")["metadata"]["alignment"]["per_rank"]
    assert all(a["measured"] is False for a in per_rank.values())
    # Beyond 16 ranks the rest are summed up: still no error of 0 for ranks nothing measured.
    many = tmp_path / "many"
    many.mkdir()
    write_ranks(make_trace(20, 1), many)
    res = CliRunner().invoke(main, ["merge", str(many), "-o", str(tmp_path / "m20.json"), "-q"])
    assert res.exit_code == 0, res.output
    assert "... 12 more ranks: 12 with no offset measured (error unknown)" in res.output
    assert "+- 0.0 us" not in res.output and "errors up to 0.0 us" not in res.output


def _add_metadata(paths: list[str], meta: Callable[[int], dict[str, Any]]) -> None:
    for path in paths:
        doc = read_json(path)
        doc["metadata"].update(meta(doc["metadata"]["rank"]))
        Path(path).write_bytes(orjson.dumps(doc))


def test_a_synced_merge_still_prints_its_offsets(tmp_path: Path) -> None:
    paths = write_ranks(make_trace(2, 2), tmp_path)
    _add_metadata(paths, _synced_meta)
    res = CliRunner().invoke(main, ["merge", *paths, "-o", str(tmp_path / "m.json"), "-q"])
    assert res.exit_code == 0, res.output
    assert "rank 1: offset +1.5 us +- 2.5 us" in res.output and "not measured" not in res.output


def test_summary_says_the_clocks_were_not_synced(tmp_path: Path) -> None:
    _add_metadata(write_ranks(make_trace(3, 3), tmp_path), lambda r: {"hostname": "node1"})  # one host
    res = CliRunner().invoke(main, ["summary", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "note: ranks 0-2: clocks not synced (no gputrace.sync_clocks())" in res.output
    # The viewer's document says which ranks nothing measured.
    doc = data.document(data.load([str(tmp_path)]))
    assert [a["measured"] for a in doc["alignment"]["per_rank"]] == [False, False, False]
    assert any("clocks not synced" in n for n in doc["notes"])


# ---- in Chromium: the page's facts and the timeline's failure note ------------------------------


def _chromium() -> Any:
    from . import perfetto_ui

    why_not = perfetto_ui.available()
    if why_not:
        pytest.skip(why_not)
    from playwright.sync_api import sync_playwright

    return perfetto_ui, sync_playwright


@pytest.mark.browser
def test_the_page_says_unsynced_clocks_have_no_error_bars(tmp_path: Path) -> None:
    perfetto_ui, sync_playwright = _chromium()
    write_ranks(make_trace(3, 3), tmp_path)
    out = tmp_path / "report.html"
    out.write_bytes(report.html(data.document(data.load([str(tmp_path)]))))
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=perfetto_ui.CHROMIUM, args=perfetto_ui.ARGS, headless=True)
        try:
            page = b.new_page()
            page.goto(out.as_uri())
            page.wait_for_selector("body[data-ready='1']", timeout=30_000)
            facts = page.text_content("#facts") or ""
        finally:
            b.close()
    assert "clocks not synced: host clocks as recorded, error unknown" in facts, facts
    assert "±0" not in facts and "error bars" not in facts


@pytest.mark.browser
def test_the_timeline_that_never_answers_names_the_offline_ways(tmp_path: Path) -> None:
    perfetto_ui, sync_playwright = _chromium()
    with socket.socket() as s:  # a port where nothing listens: the UI never answers
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/"
    trace = make_trace(2, 3)
    viewer = server.Viewer(trace, data.document(trace), server.resolve_ui(dead), name="t")
    httpd = viewer.serve(0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with sync_playwright() as p:
            b = p.chromium.launch(executable_path=perfetto_ui.CHROMIUM, args=perfetto_ui.ARGS, headless=True)
            try:
                page = b.new_page()
                page.clock.install()  # the page's 20 s of waiting, fast-forwarded
                page.goto(f"http://127.0.0.1:{httpd.server_address[1]}/")
                page.wait_for_selector("[data-testid=timeline-status]", timeout=30_000)
                page.clock.run_for(25_000)
                status = page.text_content("[data-testid=timeline-status]") or ""
            finally:
                b.close()
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert "did not answer" in status, status
    assert "pip install gputrace[offline]" in status and "--perfetto-ui DIR|URL" in status


# ---- validate reports every file ----------------------------------------------------------------


def test_validate_reports_every_file_and_exits_1_when_one_is_unreadable(tmp_path: Path) -> None:
    good = write_ranks(make_trace(1, 2), tmp_path)[0]
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"{not json")
    res = CliRunner().invoke(main, ["validate", str(bad), good])
    assert res.exit_code == 1, res.output
    lines = res.output.strip().splitlines()
    assert lines[0].startswith(f"{bad}: INVALID: ") and "not valid JSON" in lines[0]
    assert lines[1].startswith(f"{good}: ok: ")
    assert "Traceback" not in res.output and len(lines) == 2
    # A path that names no file is a wrong argument (exit 2), and every other file is still reported.
    res = CliRunner().invoke(main, ["validate", str(tmp_path / "missing.json"), str(bad), good])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert lines[0] == f"{tmp_path / 'missing.json'}: INVALID: no such file"
    assert lines[1].startswith(f"{bad}: INVALID: ") and lines[2].startswith(f"{good}: ok: ")
    res = CliRunner().invoke(main, ["validate", good])
    assert res.exit_code == 0, res.output


# ---- a folder with a stale rank -----------------------------------------------------------------


def _stale_folder(folder: Path, run_ids: bool) -> None:
    """Ranks 0-3 of an earlier run of world size 4, then ranks 0-1 of a later run of size 2
    written over them: trace_rank2.json and trace_rank3.json are left from before."""
    old = write_ranks(make_trace(4, 2), folder)
    new = write_ranks(make_trace(2, 2), folder)
    for paths, run, world, later in ((old[2:], "A", 4, 0), (new, "B", 2, 10**12)):
        for path in paths:
            doc = read_json(path)
            doc["metadata"].update(world_size=world, **({"run_id": run} if run_ids else {}))
            doc["distributedInfo"]["world_size"] = world
            doc["baseTimeNanoseconds"] += later
            Path(path).write_bytes(orjson.dumps(doc))


@pytest.mark.parametrize("run_ids", [True, False], ids=["runs", "world sizes"])
def test_a_stale_rank_is_named_and_view_offers_what_it_accepts(tmp_path: Path, run_ids: bool) -> None:
    _stale_folder(tmp_path, run_ids)
    stale = f"{tmp_path / 'trace_rank2.json'}, {tmp_path / 'trace_rank3.json'} are of the earlier run"
    res = CliRunner().invoke(main, ["view", str(tmp_path), "--export", str(tmp_path / "r.html")])
    assert res.exit_code == 2, res.output
    line = res.output.strip().splitlines()[-1]
    assert line.startswith("gputrace: error: these files come from ") and stale in line, line
    assert "or pass --allow-mixed" not in line and "view one run at a time" in line
    # merge and summary accept --allow-mixed, and say so.
    for args in (["merge", str(tmp_path), "-o", str(tmp_path / "m.json")], ["summary", str(tmp_path)]):
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 2, res.output
        line = res.output.strip().splitlines()[-1]
        assert stale in line and line.endswith("merge one run at a time, or pass --allow-mixed"), line
        res = CliRunner().invoke(main, [*args, "--allow-mixed"])
        assert res.exit_code == 0, res.output


# ---- labels that say what was measured ----------------------------------------------------------


def test_log_all_labels_a_cuda_timer_recorded_without_cuda_as_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    import gputrace
    from gputrace import timer

    gputrace.enable(cuda=False)
    with timer("fwd"):  # a CUDA timer by default, timed on the host here
        pass
    with timer("data", timer_type="cpu"):
        pass
    timer.log_all()
    out = capsys.readouterr().out
    assert "Timer 'fwd' (cpu: recorded without CUDA): " in out and "Timer 'data' (cpu): " in out
    assert "(cuda)" not in out


def test_summary_into_a_pipe_says_which_columns_it_left_out(tmp_path: Path) -> None:
    write_ranks(make_trace(3, 3, extra_names=["a rather long span name for the table"]), tmp_path)
    res = CliRunner().invoke(main, ["summary", str(tmp_path)], env={"COLUMNS": None})  # not a terminal
    assert res.exit_code == 0, res.output
    head = res.output.splitlines()[0]
    assert "least rank" not in head
    note = " ".join(res.output.split("note: left out to fit 100 columns: ")[1].split())
    assert note.startswith("least rank, most rank") and "COLUMNS=N" in note, res.output
    res = CliRunner().invoke(main, ["summary", str(tmp_path)], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    assert "least rank" in res.output.splitlines()[0] and "left out" not in res.output


# ---- the README a newcomer reads first ----------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


def test_the_readme_gives_a_cpu_machine_its_torch_command_and_keeps_the_quickstart() -> None:
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quickstart", 1)[1]
    assert (
        "```bash\n"
        "pip install -e . && gputrace demo --ranks 2      # the main job: record, write, merge real traces\n"
        'pip install -e ".[test]" && python -m pytest -q  # the tests\n'
        "```"
    ) in quick
    cpu = "`pip install torch --index-url <PyTorch's CPU index>`"
    assert cpu in quick and quick.index(cpu) < quick.index("`pip install -e .` installs torch")


def test_the_demo_on_the_cpu_records_what_the_readme_says(tmp_path: Path) -> None:
    import torch

    from gputrace import demo
    from gputrace.trace import registry

    if torch.cuda.is_available():
        pytest.skip("the README's CPU sentence is about a machine without a GPU")
    before = torch.get_num_threads()
    try:
        path = demo.train(str(tmp_path), 2)
    finally:
        torch.set_num_threads(before)
    names = set(registry.read(path).names)
    assert {"step", "data", "forward", "block", "backward", "optimizer"} <= names
    assert "h2d copy" not in names  # the README says only a GPU run has it
    readme = (ROOT / "README.md").read_text()
    assert "on a GPU the batch's H2D copy too, on a second\nstream (`h2d copy`, inside `data`)" in readme


def test_ctrl_c_stops_view_while_clients_keep_connecting() -> None:
    # Ctrl-C lands while the accept loop starts a connection's thread, as often as this can make
    # it: the view stops, quietly, every time.
    sample = ROOT / "samples" / "h200x2-nccl"
    for _ in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-m", "gputrace", "view", str(sample), "--no-browser"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        stop = threading.Event()

        def hammer(port: int, stop: threading.Event) -> None:
            while not stop.is_set():
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                except OSError:
                    pass

        try:
            assert proc.stdout is not None
            port = int(proc.stdout.readline().split("127.0.0.1:")[1].split("/")[0])
            clients = [threading.Thread(target=hammer, args=(port, stop), daemon=True) for _ in range(4)]
            for c in clients:
                c.start()
            time.sleep(0.5)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=15)
        finally:
            stop.set()
            proc.kill()
        assert proc.returncode == 0, err
        assert out == "gputrace view: stopped\n" and "Exception" not in err and "Traceback" not in err, err
