"""`gputrace view DIR --follow` in real Chromium against a running gloo job: the step count on
the page grows while the ranks run, the slow rank is marked, a rank stuck inside a span is
highlighted once the other waits for it, and after the job is SIGKILLed the page still shows
where it stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gputrace.demo import free_port, rank_environment
from gputrace.viewer.follow import Follower, FollowViewer

from . import perfetto_ui

pytestmark = pytest.mark.browser
ROOT = Path(__file__).resolve().parent.parent
HANG_AT = 25

why_not = perfetto_ui.available()
if why_not:
    pytestmark = [pytestmark, pytest.mark.skip(reason=why_not)]  # type: ignore[assignment]


def start_job(out: Path, world: int = 2) -> list[subprocess.Popen[str]]:
    port = free_port()
    pythonpath = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return [
        subprocess.Popen(
            [sys.executable, "-m", "tests.follow_worker", str(out), str(HANG_AT)],
            env={**os.environ, **rank_environment(r, world, port), "PYTHONPATH": pythonpath},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for r in range(world)
    ]


def wait_for(check: Any, timeout: float, what: str) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def steps_on_page(page: Any) -> int:
    return int(page.inner_text("[data-testid=follow-steps]"))


def test_follow_a_running_job_until_it_hangs_and_is_killed(browser: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    viewer = FollowViewer(Follower(str(out), stale_s=3.0), poll_ms=250)
    httpd = viewer.serve(0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    page = browser.new_page(viewport={"width": 1300, "height": 800})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    procs: list[subprocess.Popen[str]] = []
    try:
        page.goto(f"http://127.0.0.1:{httpd.server_address[1]}/")
        wait_for(lambda: "no trace_rank" in page.inner_text("[data-testid=follow-status]"), 20, "the empty folder")
        procs = start_job(out)
        # The count grows while the job runs, a poll at a time.
        first = wait_for(lambda: steps_on_page(page) >= 3 and steps_on_page(page), 180, "the first steps")
        later = wait_for(lambda: steps_on_page(page) > first and steps_on_page(page), 30, "more steps")
        assert first < later <= HANG_AT + 1
        assert page.inner_text("[data-testid=follow-status]") == "running"
        assert page.get_attribute("[data-testid=follow-heatmap]", "data-ranks") == "2"
        # The job hangs at step HANG_AT: rank 1 inside data, rank 0 in its all_reduce. The count
        # stops there, and rank 1 is highlighted as the one rank 0 waits for.
        wait_for(lambda: page.get_attribute("[data-testid=follow-heatmap]", "data-hung") == "1", 60, "rank 1 hung")
        assert steps_on_page(page) == HANG_AT
        row = page.locator("[data-testid=follow-rank-row][data-rank='1']")
        assert row.get_attribute("class") == "hung"
        assert "step > data" in row.inner_text()
        # The verdict is said once the ranks have sat still for live.SETTLED_S (a poll or two later).
        said = f"rank 0 wait in all_reduce of step {HANG_AT} for rank 1, which is in data"
        wait_for(lambda: said in page.inner_text("[data-testid=follow-verdict]"), 30, "the verdict")
        wait_for(lambda: "stopped" in page.inner_text("[data-testid=follow-status]"), 30, "the stopped state")
        # The slow rank (3x the compute) is marked slowest in its steps.
        doc = page.evaluate("async () => (await fetch('follow.json')).json()")
        marked = [s for s in doc["slowest"] if s is not None]
        assert marked and set(marked) == {1}
        # SIGKILL: the page keeps showing where the run stopped.
        for p in procs:
            p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait(timeout=30)
        polls = int(page.evaluate("() => document.body.dataset.polls"))
        wait_for(lambda: int(page.evaluate("() => document.body.dataset.polls")) > polls + 4, 30, "more polls")
        assert steps_on_page(page) == HANG_AT
        assert page.get_attribute("[data-testid=follow-heatmap]", "data-hung") == "1"
        assert page.get_attribute("[data-testid=follow-heatmap]", "data-steps") == str(HANG_AT)
        assert "stopped" in page.inner_text("[data-testid=follow-status]")
        assert not errors
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        page.close()
        httpd.shutdown()
        httpd.server_close()
