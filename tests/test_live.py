"""Where every rank is, from the files alone: real gloo jobs streaming to a folder (one rank stuck
for good inside `data` of step 30 while the others wait in `all_reduce`; a desynced job; a clean
one), read while they hang and after SIGKILL, through the real CLI; the open file never half
written when its process is killed mid-rewrite; the GPU position on a CUDA device."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from gputrace import live
from gputrace.cli import main
from gputrace.demo import free_port, rank_environment

ROOT = Path(__file__).resolve().parent.parent
WORLD = 4


class Job:
    """`WORLD` ranks of tests.live_worker, killed (SIGKILL) when the test ends if still running."""

    def __init__(self, out: Path, mode: str, steps: int | None = None) -> None:
        port = free_port()
        self.procs: list[subprocess.Popen[str]] = []
        for r in range(WORLD):
            env = {**os.environ, **rank_environment(r, WORLD, port), "PYTHONPATH": str(ROOT)}
            args = [sys.executable, "-m", "tests.live_worker", str(out), mode] + ([str(steps)] if steps else [])
            self.procs.append(
                subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            )

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.procs:
            p.communicate(timeout=60)

    def check_alive(self) -> None:
        for r, p in enumerate(self.procs):
            if p.poll() is not None:
                raise AssertionError(f"rank {r} exited with {p.returncode}: {p.communicate()[1][-3000:]}")


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    jobs: list[Job] = []

    def start(mode: str, steps: int | None = None) -> Job:
        j = Job(tmp_path, mode, steps)
        jobs.append(j)
        return j

    yield start
    for j in jobs:
        j.kill()


def poll(j: Job, out: Path, done: Callable[[dict[int, live.OpenState]], bool], timeout: float = 180) -> None:
    """Until the ranks' open files say `done` (each read as any reader would, mid-rewrite or not)."""
    deadline = time.monotonic() + timeout
    states: dict[int, live.OpenState] = {}
    while time.monotonic() < deadline:
        j.check_alive()
        states = live.read_all([str(out)])
        if len(states) == WORLD and done(states):
            return
        time.sleep(0.2)
    raise AssertionError(f"the open files never said so: {live.as_json(states)}")


def still(states: dict[int, live.OpenState]) -> bool:
    """Every rank has sat in its innermost span long enough for the verdict to call it."""
    return all(time.time_ns() - s.stack[-1].since_ns >= live.SETTLED_S * 1e9 for s in states.values() if s.stack)


def hung(states: dict[int, live.OpenState]) -> bool:
    return (
        [sp.name for sp in states[2].stack] == ["step", "data"]
        and all(
            states[r].collective is not None and states[r].collective["name"] == "all_reduce"  # type: ignore[index]
            for r in (0, 1, 3)
        )
        and still(states)
    )


def summary_json(out: Path) -> dict[str, Any]:
    res = CliRunner().invoke(main, ["summary", str(out), "--json"])
    assert res.exit_code == 0, res.output
    return orjson.loads(res.output)  # type: ignore[no-any-return]


def check_hang_verdict(doc: dict[str, Any]) -> None:
    (line,) = doc["open_verdict"]
    assert line.startswith("ranks 0, 1, 3 wait in all_reduce of step 30 for rank 2, which is in data since "), line
    o = doc["open"]
    assert o["2"]["stack"] == ["step", "data"] and o["2"]["step"] == 30
    for r in ("0", "1", "3"):
        assert o[r]["stack"] == ["step", "all_reduce"] and o[r]["step"] == 30
        assert o[r]["collective"]["ordinal"] == 30  # 30 all_reduces before it: steps 0-29
    assert o["2"]["since_ns"] <= time.time_ns() and o["2"]["device"] is None  # gloo on the CPU: no GPU


@dataclasses.dataclass
class HungRun:
    out: Path
    while_hung_json: dict[str, Any]  # `gputrace summary --json` in a process of its own, while hung
    while_hung_text: str  # `gputrace summary`, through CliRunner, while hung
    report: Path  # `gputrace view --export`, after SIGKILL


@pytest.fixture(scope="module")
def hung_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HungRun]:
    """4 gloo ranks, rank 2 stuck for good in `data` of step 30, read while hung (the real CLI,
    in a subprocess and through CliRunner), then SIGKILLed as a watchdog would."""
    out = tmp_path_factory.mktemp("hung")
    j = Job(out, "hang")
    try:
        poll(j, out, hung)
        res = subprocess.run(
            [sys.executable, "-m", "gputrace", "summary", str(out), "--json"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            timeout=120,
        )
        assert res.returncode == 0, res.stderr
        text = CliRunner().invoke(main, ["summary", str(out)])
        assert text.exit_code == 0, text.output
        j.check_alive()  # still hung while it was read
    finally:
        j.kill()  # nothing runs at exit: the files stay as the last rewrite left them
    report = out / "report.html"
    res3 = CliRunner().invoke(main, ["view", str(out), "--export", str(report)])
    assert res3.exit_code == 0, res3.output
    yield HungRun(out, orjson.loads(res.stdout), text.output, report)


def test_a_hung_job_read_while_it_hangs(hung_run: HungRun) -> None:
    check_hang_verdict(hung_run.while_hung_json)
    lines = hung_run.while_hung_text.splitlines()
    assert lines[0].startswith("open: where each rank is")  # on top
    assert "ranks 0, 1, 3 wait in all_reduce of step 30 for rank 2, which is in data since" in lines[1]
    assert any(line.split()[:2] == ["name", "count"] for line in lines)  # the statistics follow


def test_a_hung_job_read_after_sigkill(hung_run: HungRun, tmp_path: Path) -> None:
    check_hang_verdict(summary_json(hung_run.out))
    # The open files sit beside traces that merge and view still read as before.
    res = CliRunner().invoke(main, ["merge", str(hung_run.out), "-o", str(tmp_path / "merged.json"), "-q"])
    assert res.exit_code == 0, res.output
    assert b"which is in data since" in hung_run.report.read_bytes()


@pytest.mark.browser
def test_the_page_shows_where_each_rank_is(hung_run: HungRun) -> None:
    from playwright.sync_api import sync_playwright

    from .perfetto_ui import ARGS, CHROMIUM

    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM}")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(hung_run.report.as_uri())
            page.wait_for_selector("body[data-ready='1']", timeout=30_000)
            assert page.is_visible("[data-testid=open-view]")
            verdict = page.inner_text("[data-testid=open-verdict]")
            assert "ranks 0, 1, 3 wait in all_reduce of step 30 for rank 2, which is in data since" in verdict
            assert page.inner_text("[data-testid=open-rank-2]").split("\t")[:3] == ["2", "30", "step › data"]
            assert errors == []
        finally:
            browser.close()


BEFORE_FIRST_FLUSH = """
import sys, time, gputrace
gputrace.enable(out_dir=sys.argv[1], cuda=False, open_every_s=0.05)
with gputrace.span("step"):
    with gputrace.span("load checkpoint"):
        print("in", flush=True)
        time.sleep(600)
"""


def test_a_rank_stuck_before_its_first_flush(tmp_path: Path) -> None:
    """No trace on disk yet: the open file is all there is, and the summary says so."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    p = subprocess.Popen(
        [sys.executable, "-c", BEFORE_FIRST_FLUSH, str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout is not None and p.stdout.readline() == "in\n"
        deadline = time.monotonic() + 60
        while not os.path.exists(live.open_path(str(tmp_path), 0)) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    res = CliRunner().invoke(main, ["summary", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "rank 0 is in load checkpoint of step 0 since" in res.output
    assert "no summary:" in res.output and "no trace_rank" in res.output
    doc = summary_json(tmp_path)
    assert doc["open"]["0"]["stack"] == ["step", "load checkpoint"]


def test_a_damaged_open_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "open_rank0.open").write_bytes(b'{"gputrace_open": 1, "rank": 0, "stack": [')
    res = CliRunner().invoke(main, ["summary", str(tmp_path)])
    assert res.exit_code == 2
    assert res.output.count("\n") == 1 and "open_rank0.open" in res.output and "not an open file" in res.output


def test_a_desynced_job_names_the_first_collective_where_ranks_disagree(
    job: Callable[..., Job], tmp_path: Path
) -> None:
    j = job("desync")
    poll(
        j,
        tmp_path,
        lambda s: all(x.collective is not None and x.collective["ordinal"] == 30 for x in s.values()) and still(s),
    )
    j.kill()
    doc = summary_json(tmp_path)
    (line,) = doc["open_verdict"]
    assert line == (
        "desync: ranks sit in different collectives; the first where they disagree is collective #30 (in step 30): "
        "ranks 0, 1, 3 in all_reduce; rank 2 in broadcast"
    )
    assert {r: o["collective"]["name"] for r, o in doc["open"].items()} == {
        "0": "all_reduce",
        "1": "all_reduce",
        "2": "broadcast",
        "3": "all_reduce",
    }


def test_a_clean_run_does_not_look_hung(job: Callable[..., Job], tmp_path: Path) -> None:
    j = job("clean", 400)
    looked = 0
    while any(p.poll() is None for p in j.procs):  # while it runs: ranks move, no one is called stuck
        states = live.read_all([str(tmp_path)])
        if len(states) == WORLD and not any(s.finished for s in states.values()):
            lines = live.verdict(states)
            assert lines and not [x for x in lines if "wait in" in x or "desync" in x], lines
            looked += 1
        time.sleep(0.05)
    assert looked > 5
    for p in j.procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
    states = live.read_all([str(tmp_path)])
    assert sorted(states) == [0, 1, 2, 3]
    assert all(s.finished and s.stack == () and s.step is None for s in states.values())
    doc = summary_json(tmp_path)
    assert doc["open_verdict"] == []
    assert all(o["finished"] for o in doc["open"].values())
    text = CliRunner().invoke(main, ["summary", str(tmp_path)])
    assert text.exit_code == 0 and "open:" not in text.output and "wait in" not in text.output


CHURN = """
import sys, time, gputrace
gputrace.enable(out_dir=sys.argv[1], cuda=False, open_every_s=0.0005)
print("go", flush=True)
i = 0
with gputrace.span("run"):  # never nothing open
    while True:
        with gputrace.span("step"):
            # a long stack and a new name each time: every look rewrites the file
            with gputrace.span("x" * 2000 + str(i)):
                time.sleep(0.001)
        i += 1
        if i % 50 == 0:
            gputrace.flush()
"""


def test_the_open_file_is_never_half_written_when_killed_mid_rewrite(tmp_path: Path) -> None:
    path = live.open_path(str(tmp_path), 0)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    reads = 0
    for kill_after in (0.05, 0.13, 0.21, 0.37, 0.5):
        p = subprocess.Popen([sys.executable, "-c", CHURN, str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True)
        try:
            assert p.stdout is not None and p.stdout.readline() == "go\n"
            deadline = time.monotonic() + 60
            while not os.path.exists(path) or live.read(path).pid != p.pid:
                assert time.monotonic() < deadline, "the open file was never written"
                time.sleep(0.01)
            deadline = time.monotonic() + kill_after
            while time.monotonic() < deadline:  # read as it is rewritten hundreds of times a second
                if os.path.exists(path):
                    live.read(path)  # raises on a half-written file
                    reads += 1
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait()
        s = live.read(path)  # whole after the kill, whatever the rewrite was doing
        assert s.pid == p.pid and s.stack[0].name == "run"
    assert reads > 20
    # The temporary files the killed rewrites left are not mistaken for open files.
    assert live.find([str(tmp_path)]) == [path]


@pytest.mark.cuda
def test_where_the_gpu_is(tmp_path: Path) -> None:
    """A long kernel inside `kernel` (itself inside `outer`): the host has left both spans and
    polls in a host span of its own; the open file says the GPU is in `kernel`."""
    import torch

    import gputrace
    from gputrace.session import SESSION

    gputrace.enable(out_dir=str(tmp_path), open_every_s=0.05)
    try:
        torch.cuda.synchronize()
        with gputrace.span("outer"):
            with gputrace.span("kernel"):
                torch.cuda._sleep(4_000_000_000)  # a few seconds of one spinning kernel
        with gputrace.span("poll", timer_type=gputrace.TimerType.CPU):
            deadline = time.monotonic() + 30
            state = None
            while time.monotonic() < deadline:
                time.sleep(0.1)
                state = live.read(live.open_path(str(tmp_path), 0))
                if state.device is not None:
                    break
            assert state is not None and state.device is not None, "the open file never showed the GPU"
            assert state.device["name"] == "kernel" and state.device["track"].startswith("cuda:")
            assert [sp.name for sp in state.stack] == ["poll"]
            torch.cuda.synchronize()
        gputrace.save()
        final = live.read(live.open_path(str(tmp_path), 0))
        assert final.finished and final.stack == () and final.device is None
    finally:
        SESSION.close()


def test_the_ordinals_count_every_span_once_wherever_it_is(tmp_path: Path) -> None:
    """Steps and collectives counted across the streamed (taken), resolved (store) and pending
    spans, looked at between every kind of flush: the ordinals are those of the open spans."""
    import gputrace
    from gputrace.session import SESSION

    from .conftest import install

    install(None, out_dir=str(tmp_path), cuda=False, open_every_s=1000.0)  # looks made here
    w = SESSION.watcher
    assert w is not None
    path = live.open_path(str(tmp_path), 0)
    span = gputrace.span
    for step in range(12):
        with span("step", step=step):
            with span("all_reduce"):  # a collective by its name, group ""
                pass
            with span("send", collective=True, group="pp"):  # marked, group "pp"
                pass
            with span("barrier_wait", collective=False):  # unmarked: not one, whatever its name
                pass
            with span("all_gather"):
                with span("look"):
                    assert w.write()
                    s = live.read(path)
                    assert s.step == step and [x.name for x in s.stack] == ["step", "all_gather", "look"]
                    assert s.collective == {"name": "all_gather", "group": "", "ordinal": 2 * step + 1,
                                            "since_ns": s.stack[1].since_ns}  # fmt: skip
                    assert s.stack[1].collective == 2 * step + 1
        if step % 3 == 0:
            gputrace.flush()  # streamed: taken from the store
        elif step % 3 == 1:
            SESSION.recorder.flush()  # type: ignore[union-attr]  # resolved into the store, not taken
        # else: left pending
    with span("step"):
        with span("send", collective=True, group="pp"):
            assert w.write()
            s = live.read(path)
            assert s.step == 12 and s.collective is not None
            assert (s.collective["group"], s.collective["ordinal"]) == ("pp", 12)
    gputrace.save()
    s = live.read(path)
    assert s.finished and s.stack == () and s.step is None


def test_where_the_gpu_is_on_a_fake_device(tmp_path: Path) -> None:
    """The device position on the CPU (tests/fakes.py's GPU): a kernel the host has left behind
    is where the GPU is until its end event runs, then the span around it that is still open."""
    import gputrace
    from gputrace.session import SESSION

    from .conftest import install
    from .fakes import FakeDevice

    fake = FakeDevice()
    install(fake, out_dir=str(tmp_path), open_every_s=1000.0)
    w = SESSION.watcher
    assert w is not None
    path = live.open_path(str(tmp_path), 0)
    with gputrace.span("step"):
        with gputrace.span("outer"):
            with gputrace.span("kernel"):
                fake.work(5_000_000)  # 5 ms of kernel queued
        fake.advance(1_000_000)  # 1 ms in: the GPU is inside the kernel, the host has moved on
        with gputrace.span("poll", timer_type=gputrace.TimerType.CPU):
            assert w.write()
            s = live.read(path)
            assert s.device is not None and s.device["name"] == "kernel"
            assert s.device["track"].startswith("cuda:0")
            assert [x.name for x in s.stack] == ["step", "poll"]  # CUDA step outside the host span
            fake.advance(10_000_000)  # the kernel and the end of outer have run
            assert w.write()
            s = live.read(path)
            assert s.device is not None and s.device["name"] == "step"
    gputrace.flush()
    assert w.write()
    assert live.read(path).device is None  # nothing open, nothing in flight
