"""Clock sync across ranks: one exchange per host, leaders in a binomial tree, followers derived
exactly. Real gloo processes; `GPUTRACE_HOST_ID` lets processes of this machine play several
hosts, and `HostClock(shift_ns=...)` gives a played host a clock that is off by a known amount."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gputrace import dist as gdist

from .conftest import run_rank_processes

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parent.parent
SHIFT = 40_000_000  # a "shifted" host's clock runs 40 ms ahead


def run_sync(hosts: list[str], mode: str = "sync") -> dict[int, dict]:
    """One process per entry of `hosts` (its host identity; "" for the real one)."""
    envs: list[dict[str, str | None]] = [{gdist.HOST_ID_ENV: host or None} for host in hosts]
    return run_rank_processes(["tests.dist_worker", mode, str(SHIFT)], len(hosts), envs)


@pytest.fixture(scope="module")
def one_host() -> dict[int, dict]:
    return run_sync([""] * 3)


@pytest.fixture(scope="module")
def four_hosts() -> dict[int, dict]:
    # Ranks 0-1 on host a, 2 on "shifted b", 3 on c, 4-5 on "shifted d": the leaders 0, 2, 3, 4
    # form the tree 0 -> 2 (round 1), 0 -> 3 and 2 -> 4 (round 2).
    return run_sync(["a", "a", "shifted b", "c", "shifted d", "shifted d"])


def test_on_one_host_every_rank_is_derived_exactly_and_the_offset_is_about_zero(one_host) -> None:  # type: ignore[no-untyped-def]
    e0 = one_host[0]["epoch_offset_ns"]
    for rank, line in one_host.items():
        for s in line["syncs"]:
            assert s["hosts"] == 1 and s["leader"] == 0
            if rank == 0:
                assert (s["method"], s["offset_ns"], s["error_ns"]) == ("reference", 0, 0)
                continue
            assert s["method"] == "same host" and s["exchanges"] == 0
            # Both processes read one CLOCK_MONOTONIC: their timelines differ by exactly the
            # difference of their realtime offsets, with no error bar of its own.
            assert s["offset_ns"] == e0 - line["epoch_offset_ns"]
            assert s["error_ns"] == 0
            assert abs(s["offset_ns"]) < 100_000


def test_a_shifted_host_is_recovered_within_its_error_bar(four_hosts) -> None:  # type: ignore[no-untyped-def]
    e0 = four_hosts[0]["epoch_offset_ns"]
    for rank, line in four_hosts.items():
        for s in line["syncs"]:
            truth = e0 - line["epoch_offset_ns"]  # exactly what aligns the two timelines
            shifted = rank in (2, 4, 5)
            assert abs(truth + (SHIFT if shifted else 0)) < 1_000_000  # the seam did shift them
            assert abs(s["offset_ns"] - truth) <= s["error_ns"], (rank, s)
            assert s["hosts"] == 4
            if rank > 1:  # ranks 0 and 1 share rank 0's host: no error bar
                assert s["error_ns"] > 0 and s["error_ns"] < 20_000_000


def test_leaders_sync_in_a_tree_and_followers_take_their_leaders_result(four_hosts) -> None:  # type: ignore[no-untyped-def]
    first = {r: line["syncs"][0] for r, line in four_hosts.items()}
    assert {r: (s["method"], s["leader"], s["hops"]) for r, s in first.items()} == {
        0: ("reference", 0, 0),
        1: ("same host", 0, 0),
        2: ("exchange", 2, 1),
        3: ("exchange", 3, 1),
        4: ("exchange", 4, 2),
        5: ("same host", 4, 2),
    }
    for leader, follower in ((0, 1), (4, 5)):
        for a, b in zip(four_hosts[leader]["syncs"], four_hosts[follower]["syncs"]):
            same_host = four_hosts[leader]["epoch_offset_ns"] - four_hosts[follower]["epoch_offset_ns"]
            assert b["offset_ns"] == a["offset_ns"] + same_host
            assert b["error_ns"] == a["error_ns"] and b["round_trip_ns"] == a["round_trip_ns"]
    # Two hops: rank 4's error bar holds its own half round trip and rank 2's.
    assert first[4]["error_ns"] >= first[2]["error_ns"] + (first[4]["round_trip_ns"] + 1) // 2


def test_the_device_refinement_brackets_the_true_offset_on_a_fake_gpu() -> None:
    # The refinement's whole path (probes, anchors, the exchange of ends, the bounds), with a
    # fake GPU whose events run when recorded and gloo's all-reduce for NCCL's. Rank 1 plays
    # another host whose clock is SHIFT ahead; both run on this machine, so the truth is known
    # exactly: the difference of their realtime offsets.
    results = run_sync(["a", "b"], mode="fakegpu")  # one host would need no probe
    truth = results[0]["epoch_offset_ns"] - results[1]["epoch_offset_ns"]
    assert abs(truth + SHIFT) < 1_000_000
    for s0, s1 in zip(results[0]["syncs"], results[1]["syncs"]):
        assert (s0["device"]["offset_ns"], s0["device"]["error_ns"]) == (0, 0)
        d = s1["device"]
        assert d["probes"] == 32 and len(d["batches"]) == 4
        assert abs(d["offset_ns"] - truth) <= d["error_ns"] < 50_000_000, d
        for b in d["batches"]:
            assert b["lo_ns"] <= b["offset_ns"] <= b["hi_ns"]
            assert b["lo_ns"] <= truth <= b["hi_ns"]  # causality: the bounds hold on any machine


def test_tree_rounds_pair_each_leader_once_with_one_that_already_knows() -> None:
    for n in range(1, 40):
        known = {0}
        answered = []
        for pairs in gdist.tree_rounds(n):
            servers = [s for s, _ in pairs]
            assert len(set(servers)) == len(servers)  # one partner per leader and round
            assert all(s in known for s in servers)
            known |= {c for _, c in pairs}
            answered += [c for _, c in pairs]
        assert sorted(answered) == list(range(1, n))
        assert len(gdist.tree_rounds(n)) == (n - 1).bit_length()


def test_hosts_are_led_by_their_lowest_rank_in_group_order() -> None:
    plan = gdist.plan_hosts([4, 5, 6, 7], [("y", 10), ("x", 11), ("y", 12), ("x", 13)])
    assert plan.leaders == [4, 5]
    assert plan.leader_of == {4: 4, 5: 5, 6: 4, 7: 5}
    assert plan.epoch_offset[7] == 13


def test_host_identity_reads_the_machine_unless_the_test_seam_says_otherwise(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv(gdist.HOST_ID_ENV, raising=False)
    real = gdist.host_identity()
    assert real.startswith(__import__("socket").gethostname())
    if os.path.exists("/proc/sys/kernel/random/boot_id"):
        assert open("/proc/sys/kernel/random/boot_id").read().strip() in real
    monkeypatch.setenv(gdist.HOST_ID_ENV, "node-7")
    assert gdist.host_identity() == "node-7"


def test_device_refinement_places_device_spans_only_where_it_is_tighter() -> None:
    from gputrace import align

    def meta(host_error: int, device_error: int) -> dict:
        dev = {"at_ns": 10, "offset_ns": -700, "error_ns": device_error}
        return {"clock": {"sync_to_rank0": [{"at_ns": 10, "offset_ns": -40, "error_ns": host_error, "device": dev}]}}

    across = align.from_metadata(1, meta(host_error=45_000, device_error=8_000))
    assert across.map(1_000) == 960 and across.device_map is not None and across.device_map(1_000) == 300
    assert across.device_error_ns == 8_000
    same_host = align.from_metadata(1, meta(host_error=0, device_error=8_000))
    assert same_host.device_map is None and same_host.map(1_000) == 960
    assert any("not tighter" in n for n in same_host.notes)
