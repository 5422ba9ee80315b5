"""How many CPUs gputrace sizes its worker pools for: the process's affinity, capped by its cgroup's
CPU quota, read from a folder laid out as /proc and /sys are (a container's v2 and v1 groups)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gputrace.cpus import cgroup_cpu_quota, usable_cpus

AFFINITY = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def lay_out(root: Path, files: dict[str, str]) -> str:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(root)


@pytest.mark.parametrize(
    "files, quota",
    [
        ({"proc/self/cgroup": "0::/\n", "sys/fs/cgroup/cpu.max": "max 100000\n"}, None),
        ({"proc/self/cgroup": "0::/\n", "sys/fs/cgroup/cpu.max": "150000 100000\n"}, 2),
        ({"proc/self/cgroup": "0::/\n", "sys/fs/cgroup/cpu.max": "50000 100000\n"}, 1),
        (  # the process's own group, below the root the namespace shows
            {
                "proc/self/cgroup": "0::/job/step\n",
                "sys/fs/cgroup/job/step/cpu.max": "400000 100000\n",
                "sys/fs/cgroup/cpu.max": "max 100000\n",
            },
            4,
        ),
        (  # cgroup v1: a quota of -1 is none
            {"sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n", "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n"},
            None,
        ),
        (
            {
                "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "300000",
                "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000",
            },
            3,
        ),
        ({"sys/fs/cgroup/cpu.max": "lots of\nnonsense here\n"}, None),  # unreadable: no quota
        ({}, None),
    ],
    ids=["v2-max", "v2-1.5", "v2-half", "v2-own-group", "v1-none", "v1-3", "hostile", "none"],
)
def test_the_cgroup_quota_is_read_as_the_kernel_writes_it(
    tmp_path: Path, files: dict[str, str], quota: int | None
) -> None:
    root = lay_out(tmp_path, files)
    assert cgroup_cpu_quota(root) == quota
    assert usable_cpus(root) == (min(AFFINITY, quota) if quota is not None else AFFINITY)


def test_a_container_allowed_one_cpu_gets_no_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A big merge on a machine of many CPUs, in a container allowed one: read in this process."""
    from gputrace.merge import run

    root = lay_out(tmp_path / "sysroot", {"proc/self/cgroup": "0::/\n", "sys/fs/cgroup/cpu.max": "100000 100000\n"})
    monkeypatch.setattr(run, "usable_cpus", lambda: usable_cpus(root))
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    big = []
    for r in range(4):
        path = tmp_path / f"trace_rank{r}.json"
        with open(path, "wb") as f:
            f.truncate(run.PARALLEL_MIN_BYTES // 3)  # its size is what counts (a sparse file)
        big.append(str(path))
    assert run.workers_for(big, None) == 1
    monkeypatch.setattr(run, "usable_cpus", lambda: 16)
    assert run.workers_for(big, None) > 1  # the same inputs where 16 CPUs are the process's


def test_a_huge_or_binary_cgroup_file_is_no_quota(tmp_path: Path) -> None:
    root = lay_out(tmp_path, {"proc/self/cgroup": "0::/" + "x/" * 200_000 + "\n"})
    (tmp_path / "sys/fs/cgroup").mkdir(parents=True)
    (tmp_path / "sys/fs/cgroup/cpu.max").write_bytes(b"\xff\xfe" * 1_000_000)
    assert cgroup_cpu_quota(root) is None
    assert usable_cpus(root) == AFFINITY
