"""The live straggler report (`report_every`): real gloo jobs with a planted slow rank, a job
whose ranks run different numbers of steps (it must end), the option off (nothing happens), and
the report's arithmetic on known numbers."""

from __future__ import annotations

import time

import pytest

import gputrace
from gputrace import session
from gputrace.config import Config
from gputrace.errors import ConfigError
from gputrace.straggler import FIELDS, build

from .conftest import run_rank_processes

SLOW = 2


def run(mode: str, world: int, steps: int = 10, every: int = 5) -> dict[int, dict]:
    return run_rank_processes(["tests.straggler_worker", mode, str(SLOW), str(steps), str(every)], world)


@pytest.fixture(scope="module")
def planted() -> dict[int, dict]:
    return run("planted", 4)


@pytest.mark.dist
def test_rank_0_names_the_planted_slow_rank_every_n_steps(planted: dict[int, dict]) -> None:
    logged = planted[0]["logged"]
    assert [r["report"]["window"] for r in logged] == [[0, 5], [5, 10]]
    for r in logged:
        assert f"rank {SLOW} is slowest: busy " in r["line"]
        assert "ranks 0, 1, 3 wait in collectives" in r["line"]
        rep = r["report"]
        assert rep["slowest"]["rank"] == SLOW and rep["slowest"]["called"]
        assert rep["metric"] == "busy" and rep["cause"].startswith(f"rank {SLOW} works ")
        # 30 ms against 5 ms of work a step: the slow rank's margin is ~25 ms, 5x the median.
        assert 15e6 < rep["slowest"]["by_ns"] < 40e6
    # Only rank 0 logs; every rank holds the same report.
    assert all(not planted[r]["logged"] for r in (1, 2, 3))
    assert all(planted[r]["report"] == planted[0]["report"] for r in (1, 2, 3))
    assert not any(planted[r]["warnings"] for r in planted)


@pytest.mark.dist
def test_scores_relative_to_the_fastest_rank_and_to_the_ranks_own_best(planted: dict[int, dict]) -> None:
    rep = planted[0]["report"]
    ranks = rep["ranks"]
    busy = {int(r): v["busy_ns"] for r, v in ranks.items()}
    fastest = min(busy.values())
    for r, v in ranks.items():
        assert v["relative"] == pytest.approx(fastest / busy[int(r)], abs=1e-4)
        assert v["steps"] == 5 and v["step"] == 10
        assert 0 < v["individual"] <= 1.0
        assert v["step_ns"] == pytest.approx(v["busy_ns"] + v["wait_ns"], rel=0.2)
    assert max(v["relative"] for v in ranks.values()) == 1.0
    assert 0.05 < ranks[str(SLOW)]["relative"] < 0.4  # ~5 ms / 30 ms
    # The slow rank waits little: it arrives last at every all_reduce.
    assert ranks[str(SLOW)]["wait_ns"] < min(v["wait_ns"] for r, v in ranks.items() if r != str(SLOW))


@pytest.mark.dist
def test_a_rank_with_fewer_steps_does_not_hang_the_job() -> None:
    """Rank 2 runs 9 steps, the others 10: they wait in the second report only report_timeout
    (3 s), give one warning each, and the job ends."""
    got = run("uneven", 4)
    assert len(got[0]["logged"]) == 1 and f"rank {SLOW} is slowest" in got[0]["logged"][0]["line"]
    for r in (0, 1, 3):
        assert got[r]["took_s"] < 30
        assert len(got[r]["warnings"]) == 1 and "straggler report 2 failed" in got[r]["warnings"][0]
        assert got[r]["report"]["report"] == 1  # the last report that came through
    assert got[SLOW]["report"]["report"] == 1 and not got[SLOW]["warnings"]


@pytest.mark.dist
def test_off_by_default_no_report_and_no_collective() -> None:
    """Without report_every, ranks with different step counts end as fast as without gputrace's
    reports: nothing is gathered, nothing logged."""
    got = run("off", 3, steps=6, every=2)
    for r, line in got.items():
        assert line["report"] is None and not line["logged"] and not line["warnings"]
        assert line["took_s"] < 3


def test_off_by_default_costs_nothing_in_flush() -> None:
    gputrace.enable(cuda=False)
    assert session.SESSION.reporter is None
    gputrace.enable(report_every=3)
    assert session.SESSION.reporter is not None and session.SESSION.reporter.every == 3
    gputrace.enable(report_every=None)
    assert session.SESSION.reporter is None


def test_the_option_is_spelled_once() -> None:
    assert Config.from_env({"GPUTRACE_REPORT_EVERY": "50"}).report_every == 50
    assert Config().report_every is None
    with pytest.raises(ConfigError, match="report_every"):
        Config().replace(report_every=0)
    with pytest.raises(ConfigError, match="report_every"):
        Config().replace(report_every="often")


def test_one_process_reports_its_own_slowdown() -> None:
    """Without torch.distributed a rank reports alone: its individual score falls when its steps
    take three times as long as in its best window."""
    gputrace.enable(cuda=False, report_every=3)
    for i in range(6):
        with gputrace.span("step"):
            time.sleep(0.004 if i < 3 else 0.012)
        gputrace.flush()
    rep = gputrace.last_report()
    assert rep is not None and rep["report"] == 2 and rep["window"] == [3, 6] and rep["metric"] == "step"
    assert rep["ranks"]["0"]["individual"] < 0.6
    assert rep["ranks"]["0"]["relative"] == 1.0
    assert "no straggler" in rep["line"]


def row(**v: int) -> list[int]:
    base = dict(report=1, step=10, steps=10, step_ns=100, busy_ns=50, wait_ns=50, collectives=1,
                best_step_ns=100, best_busy_ns=50, resolved=10)  # fmt: skip
    base.update(v)
    return [base[f] for f in FIELDS]


def test_build_on_known_numbers() -> None:
    table = [row(), row(busy_ns=80, wait_ns=20, best_busy_ns=40), row(busy_ns=40, wait_ns=60), row(busy_ns=50)]
    rep = build(table, [0, 1, 2, 3])
    assert rep["slowest"] == {
        "rank": 1, "value_ns": 80, "median_ns": 50, "by_ns": 30, "by_pct": 60.0, "fastest_ns": 40, "called": True
    }  # fmt: skip
    assert [rep["ranks"][str(r)]["relative"] for r in range(4)] == [0.8, 0.5, 1.0, 0.8]
    assert [rep["ranks"][str(r)]["individual"] for r in range(4)] == [1.0, 0.5, 1.25, 1.0]
    assert rep["line"].startswith("gputrace: steps 0-9 on 4 ranks: rank 1 is slowest: busy 80 ns a step, +30 ns (+60%)")
    assert rep["disagree"] is None


def test_build_says_when_ranks_disagree_and_when_no_rank_stands_out() -> None:
    rep = build([row(), row(step=9, busy_ns=51)], [0, 1])
    assert not rep["slowest"]["called"] and "no straggler" in rep["line"]
    assert rep["disagree"] == {"0": {"step": 10, "report": 1}, "1": {"step": 9, "report": 1}}
    assert "ranks at different steps: 0: 10, 1: 9" in rep["line"]
    rep = build([row(steps=0, step_ns=-1, busy_ns=-1, wait_ns=-1)], [0])
    assert rep["slowest"] is None and "no step resolved" in rep["line"]


@pytest.mark.cuda
def test_on_the_gpu_steps_still_running_count_towards_the_report() -> None:
    """CUDA spans: a step whose events the GPU has not reached is pending at the flush; it counts
    towards the report's step ordinal at once, and its times join the window they resolve in."""
    import torch

    gputrace.enable(report_every=2)
    for _ in range(4):
        with gputrace.span("step"):
            torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time: still running at the flush
        gputrace.flush()
    rep = gputrace.last_report()
    assert rep is not None and rep["report"] == 2 and rep["step"] == 4
    torch.cuda.synchronize()
    gputrace.flush()
    r = session.SESSION.reporter
    assert r is not None and r.resolved == 4
