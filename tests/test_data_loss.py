"""Nothing a signal, a thread or a bad argument does loses a trace: real signals at real moments
in real recording processes, real threads against flush/save/reset, arguments that cannot be
written, a file that cannot grow, and temp files left by a killed writer."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import orjson
import pytest

import gputrace
from gputrace import native, session
from gputrace.trace import files, layout, registry
from gputrace.validate import format_report, validate_file

ROOT = Path(__file__).resolve().parent.parent
EXT = {"json": ".json", "perfetto": ".pftrace"}


def run_child(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def temps(folder: Path) -> list[str]:
    return glob.glob(str(folder / ".gputrace-*.tmp"))


def assert_valid(path: Path, spans: int | None = None) -> None:
    report = validate_file(str(path))
    assert report.ok, format_report(report)
    if spans is not None:
        assert len(registry.read(str(path)).spans) == spans


# ---- 1. a signal during the final save ---------------------------------------------------------

# Streams STEPS steps of 100 host spans, opens one span left open, then saves. `--hook` sends the
# signal to itself from inside the save, at the moment a file is about to be renamed into place
# (JSON: the finished trace; protobuf: its digest), so the moment is the same on every run.
SAVE_CHILD = """
    import os, signal, sys
    import gputrace
    from gputrace.trace import files

    out, fmt, steps, sig, hook = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5] == "hook"
    if hook:
        real = files.publish
        def publish(tmp, path):
            if not path.endswith(".digest") or fmt != "json":
                os.kill(os.getpid(), getattr(signal, sig))
            real(tmp, path)
        files.publish = publish
    gputrace.enable(out_dir=out, cuda=False, format=fmt)
    for k in range(steps):
        with gputrace.span("step", step=k):
            for i in range(99):
                with gputrace.span("op"):
                    pass
        gputrace.flush()
    gputrace.span("open at save").start()
    print("saving", flush=True)
    gputrace.save()
    print("saved", flush=True)
"""


@pytest.mark.parametrize("fmt", ["json", "perfetto"])
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_inside_save_lets_the_save_finish(tmp_path: Path, fmt: str, sig: str) -> None:
    r = run_child(SAVE_CHILD, str(tmp_path), fmt, "50", sig, "hook")
    assert r.returncode == -getattr(signal, sig), r.stderr  # the signal's own end, after the save
    if sig == "SIGINT":
        assert "KeyboardInterrupt" in r.stderr
    assert "saving" in r.stdout
    assert not temps(tmp_path)
    # Every span once, the open one once (marked unfinished), the file whole.
    assert_valid(tmp_path / f"trace_rank0{EXT[fmt]}", spans=50 * 100 + 1)
    assert (tmp_path / "digest_rank0.digest").exists()


def _saving_child(tmp_path: Path, steps: int) -> subprocess.Popen[str]:
    """A child that records `steps` steps and saves them (JSON), returned once its save's temp
    file is on disk (or it has ended)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(SAVE_CHILD), str(tmp_path), "json", str(steps), "SIGTERM", "no"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "saving"
    deadline = time.monotonic() + 60
    while not temps(tmp_path) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.0005)
    return proc


def test_sigterm_sent_while_a_large_save_is_under_way(tmp_path: Path) -> None:
    """No hook: the signal comes from outside, the moment the save's temp file appears."""
    proc = _saving_child(tmp_path, 6000)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode in (-signal.SIGTERM, 0), err
    assert not temps(tmp_path)
    assert_valid(tmp_path / "trace_rank0.json", spans=6000 * 100 + 1)


# ---- 3. a span argument that cannot be written -------------------------------------------------


class NoRepr:
    def __repr__(self) -> str:
        raise RuntimeError("this object has no repr")


@pytest.mark.parametrize("c", [True, False], ids=["c", "python"])
@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "whole"])
@pytest.mark.parametrize("fmt", ["json", "perfetto"])
def test_an_argument_that_cannot_be_written_becomes_a_placeholder(
    tmp_path: Path, fmt: str, streaming: bool, c: bool
) -> None:
    if c and native.hot is None and native.UNUSED_BECAUSE:
        pytest.skip(f"no C build: {native.UNUSED_BECAUSE}")
    with native.using(c):
        me: dict[str, object] = {}
        me["me"] = me
        loop: list[object] = [1]
        loop.append(loop)
        gputrace.enable(cuda=False, format=fmt, **({"out_dir": str(tmp_path)} if streaming else {}))
        with gputrace.span("before", n=1):
            pass
        with gputrace.span("itself", d=me, l=loop, ok=1):
            pass
        gputrace.flush()  # raised into the training loop, every flush after too
        with gputrace.span("no repr", x=NoRepr(), ok="yes"):
            pass
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing to warn about either
            gputrace.flush()
        for step in range(3):
            with gputrace.span("after", step=step):
                pass
            gputrace.flush()
        path = gputrace.save() if streaming else gputrace.save(str(tmp_path / f"t{EXT[fmt]}"))
        gputrace.disable()
    assert_valid(Path(path))
    t = registry.read(path)
    rows = {t.names[t.spans.name[i]] + str((t.spans.args[i] or {}).get("step", "")): t.spans.args[i]
            for i in range(len(t.spans))}  # fmt: skip
    assert rows["before"] == {"n": 1}
    assert rows["itself"] == {"d": {"me": "<unserializable: dict>"}, "l": [1, "<unserializable: list>"], "ok": 1}
    assert rows["no repr"] == {"x": "<unserializable: NoRepr>", "ok": "yes"}
    assert [rows[f"after{s}"] for s in range(3)] == [{"step": s} for s in range(3)]
    assert len(t.spans) == 6


def test_dumps_never_raises() -> None:
    deep: list[object] = []
    inner = deep
    for _ in range(1000):
        inner.append([])
        inner = inner[0]  # type: ignore[assignment]
    assert layout.dumps({"deep": deep}).count(b"<unserializable: list>") == 1
    assert orjson.loads(layout.dumps({"x": NoRepr(), 1.5: float("nan")})) == {
        "x": "<unserializable: NoRepr>",
        "1.5": "nan",
    }


# ---- 5. a save killed part way -----------------------------------------------------------------


def test_the_next_save_removes_the_temp_file_of_a_killed_save(tmp_path: Path) -> None:
    proc = _saving_child(tmp_path, 4000)
    proc.kill()
    proc.communicate(timeout=60)
    left = temps(tmp_path)
    assert left and proc.returncode == -signal.SIGKILL, "the kill must land while the save is under way"
    # A live process's temp file beside it (this test's own) must stay.
    live = tmp_path / f".gputrace-{os.getpid()}@{files._host()}@abc123.tmp"
    live.write_bytes(b"being written")
    other_host = tmp_path / ".gputrace-1@another-host@abc123.tmp"
    other_host.write_bytes(b"another machine's")
    # The next run into the folder (here, this process streaming to it) removes the dead one.
    gputrace.enable(out_dir=str(tmp_path), cuda=False)
    with gputrace.span("next run"):
        pass
    gputrace.flush()
    assert sorted(temps(tmp_path)) == sorted([str(live), str(other_host)])
    gputrace.save()
    gputrace.disable()
    assert sorted(temps(tmp_path)) == sorted([str(live), str(other_host)])


@pytest.mark.parametrize("fmt", ["json", "perfetto"])
def test_a_save_removes_temp_files_of_dead_writers_only(tmp_path: Path, fmt: str) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # reaped: no process has this pid now (unless reused, then kept)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        host = files._host()
        gone = tmp_path / f".gputrace-{dead_pid}@{host}@x1.tmp"
        kept = tmp_path / f".gputrace-{sleeper.pid}@{host}@x2.tmp"
        old_style = tmp_path / ".gputrace-k3j2h1.tmp"  # no writer named: left alone
        for p in (gone, kept, old_style):
            p.write_bytes(b"x" * 1000)
        gputrace.enable(cuda=False)
        with gputrace.span("s"):
            pass
        gputrace.save(str(tmp_path / f"t{EXT[fmt]}"))
        gputrace.disable()
        assert not gone.exists() or files._alive(dead_pid)
        assert kept.exists() and old_style.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


# ---- 4. a full disk while streaming ------------------------------------------------------------

# 60 steps of 51 host spans, a flush each. From step 20 the stream's file cannot grow past 3,000
# more bytes (RLIMIT_FSIZE: the kernel refuses the write with EFBIG, as a full disk does with
# ENOSPC, possibly part way through); from step 40 it can again. Prints what it saw as JSON.
FULL_CHILD = """
    import json, os, resource, sys, warnings
    import gputrace
    from gputrace.trace import registry

    out, fmt = sys.argv[1], sys.argv[2]
    warnings.simplefilter("always")
    told = []
    warnings.showwarning = lambda m, c, *a, **k: told.append(c.__name__ + ": " + str(m))
    gputrace.enable(out_dir=out, cuda=False, format=fmt)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    path = None
    midway = None
    for step in range(60):
        with gputrace.span("step", step=step):
            for i in range(50):
                with gputrace.span("op", i=i):
                    pass
        if step == 20:
            resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path) + 3000, hard))
        if step == 40:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        gputrace.flush()  # never raises
        path = gputrace.session.SESSION.stream.path
        if step == 45:  # what a crash now would leave
            midway = registry.read(path).metadata.get("spans_unwritten")
    saved = gputrace.save()
    print(json.dumps({"told": told, "path": saved, "midway": midway}))
"""


@pytest.mark.parametrize("fmt", ["json", "perfetto"])
def test_a_full_disk_while_streaming_is_one_warning_and_counted_spans(tmp_path: Path, fmt: str) -> None:
    r = run_child(FULL_CHILD, str(tmp_path), fmt)
    assert r.returncode == 0, r.stderr
    got = orjson.loads(r.stdout.splitlines()[-1])
    assert len(got["told"]) == 1, got["told"]
    assert got["told"][0].startswith("GputraceWarning: gputrace cannot write") and "File too large" in got["told"][0]
    path = Path(got["path"])
    assert_valid(path)
    t = registry.read(str(path))
    unwritten = t.metadata["spans_unwritten"]
    assert unwritten > 0 and unwritten % 51 == 0  # whole flushes dropped, nothing half written
    assert len(t.spans) + unwritten == 60 * 51
    assert t.metadata["spans"] == len(t.spans)
    assert got["midway"] == unwritten  # the streamed file said so once it could be written again
    steps = sorted(
        int((t.spans.args[i] or {})["step"]) for i in range(len(t.spans)) if t.names[t.spans.name[i]] == "step"
    )
    assert steps[:20] == list(range(20)) and steps[-20:] == list(range(40, 60))
    assert not temps(tmp_path)
    # The summary says what the trace lacks, per rank and in words.
    from gputrace import stats

    summary = stats.summarize(t)
    assert stats.to_json(summary)["counts"]["0"]["unwritten"] == unwritten
    assert any(
        f"{unwritten:,} spans of ranks 0 were recorded but their file could not take them" in n for n in summary.notes
    )


# ---- 2. threads recording while another flushes, saves and resets ------------------------------


PUBLISH = files.publish  # as imported, before the suite's fixture checks every file it renames


def rss_mb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the memory in use from /proc")
@pytest.mark.parametrize("c", [True, False], ids=["c", "python"])
def test_threads_record_while_another_flushes_saves_and_resets(
    tmp_path: Path, c: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if c and native.hot is None and native.UNUSED_BECAUSE:
        pytest.skip(f"no C build: {native.UNUSED_BECAUSE}")
    # The file is validated at the end, and at every save through the stream's own checks; the
    # suite's check at every rename would read the growing file hundreds of times.
    monkeypatch.setattr(files, "publish", PUBLISH)
    seconds = 4.0
    with native.using(c):
        # A short pending list: the recording threads resolve into the store all the time (the
        # race with a flush's encoding); a span limit: what bounds memory when 16 threads record
        # faster than one can write (past it spans are counted, not kept).
        gputrace.enable(out_dir=str(tmp_path), cuda=False, max_pending=256, max_spans=500_000)
        stop = threading.Event()
        failed: list[str] = []

        def record(k: int) -> None:
            try:
                while not stop.is_set():
                    with gputrace.span("outer", k=k):
                        for _ in range(20):
                            with gputrace.span("inner"):
                                pass
                    time.sleep(0.0002)  # the GIL for the others now and then, as a training loop's waits give it
            except BaseException as e:  # noqa: BLE001 - reported below
                failed.append(f"thread {k}: {e!r}")

        threads = [threading.Thread(target=record, args=(k,), name=f"rec{k}") for k in range(16)]
        # Threads take turns every 20 us rather than 5 ms: a recording thread's resolve lands
        # inside a flush's encoding far more often.
        switch = sys.getswitchinterval()
        sys.setswitchinterval(2e-5)
        before = peak = rss_mb()
        calls = 0
        with warnings.catch_warnings(record=True) as told:
            warnings.simplefilter("always")
            for t in threads:
                t.start()
            try:
                # Long enough to have failed on the old code (it did within a few seconds, or a
                # few dozen calls), however busy the machine.
                end, cap = time.monotonic() + seconds, time.monotonic() + 150
                while (time.monotonic() < end or calls < 40) and time.monotonic() < cap:
                    what = ("flush", "save", "flush", "reset", "trace")[calls % 5]
                    try:
                        if what == "flush":
                            gputrace.flush()
                        elif what == "save":
                            gputrace.save()
                        elif what == "reset":
                            gputrace.reset()
                        else:
                            session.trace()
                    except Exception as e:  # noqa: BLE001 - every call must succeed: reported below
                        failed.append(f"{what} #{calls}: {e!r}")
                    calls += 1
                    peak = max(peak, rss_mb())
            finally:
                stop.set()
                for t in threads:
                    t.join()
                sys.setswitchinterval(switch)
            with gputrace.span("inner"):  # the last call may have been a reset: one span at least
                pass
            path = gputrace.save()
        gputrace.disable()
    assert not failed, failed[:5]
    assert not [str(w.message) for w in told if issubclass(w.category, gputrace.GputraceWarning)]
    assert calls >= 40
    assert_valid(Path(path))
    t = registry.read(path)
    assert {t.names[i] for i in set(t.spans.name)} == {"outer", "inner"}, (calls, t.metadata)
    # What is resolved leaves memory at every flush: the store never holds more than the spans
    # recorded between two of them (the old failure kept every span once a flush had failed).
    assert peak - before < 1500, f"memory grew by {peak - before} MB"


# A signal while a span's exit resolves a full pending list (no flush or save of the session's
# under way): it sends itself the signal as the recorder begins resolving a slice of spans.
RESOLVE_CHILD = """
    import os, signal, sys
    import gputrace
    from gputrace import record

    out, sig = sys.argv[1], getattr(signal, sys.argv[2])
    gputrace.enable(out_dir=out, cuda=False, max_pending=1000)
    for k in range(20):
        with gputrace.span("step", step=k):
            for i in range(99):
                with gputrace.span("op"):
                    pass
        gputrace.flush()
    real = record.resolve
    def resolve(*args):
        record.resolve = real
        os.kill(os.getpid(), sig)  # handled at the next line of Python: inside the resolve
        return real(*args)
    record.resolve = resolve
    for i in range(5000):
        with gputrace.span("late"):
            pass
    print("not stopped", flush=True)
"""


@pytest.mark.parametrize("c", [True, False], ids=["c", "python"])
def test_a_signal_while_a_span_exit_resolves_loses_nothing(tmp_path: Path, c: bool) -> None:
    if c and native.hot is None and native.UNUSED_BECAUSE:
        pytest.skip(f"no C build: {native.UNUSED_BECAUSE}")
    env = {**os.environ, "GPUTRACE_PURE_PYTHON": "0" if c else "1"}
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(RESOLVE_CHILD), str(tmp_path), "SIGTERM"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == -signal.SIGTERM, r.stderr
    assert "not stopped" not in r.stdout and "could not" not in r.stderr, r.stderr
    # Every span closed before the signal: the flushed steps, and the 1,000 pending at the exit
    # that found the list full (half of them were being resolved when the signal came).
    assert_valid(tmp_path / "trace_rank0.json", spans=20 * 100 + 1000)
    assert (tmp_path / "trace_rank0.json").read_bytes().startswith(b"{")
