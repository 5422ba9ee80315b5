"""How many CPUs this process may use: its affinity, and its cgroup's CPU quota (a container allowed
2 CPUs of a 64-core host has 2, though it sees 64). What sizes worker pools (merge, the view's
digests) and the demo's threads."""

from __future__ import annotations

import math
import os


def usable_cpus(root: str = "/") -> int:
    """CPUs this process may use: those it may run on (its affinity), fewer where its cgroup's CPU
    quota gives it fewer (a container allowed 2 CPUs of a 64-core host: 2). `root`: where the
    /proc and /sys files are read (a test's folder)."""
    affinity = getattr(os, "sched_getaffinity", None)
    cpus = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota(root)
    return max(1, min(cpus, quota)) if quota is not None else cpus


def cgroup_cpu_quota(root: str = "/") -> int | None:
    """The CPU quota of this process's cgroup in whole CPUs (rounded up), or None where none is
    set or it cannot be read: cgroup v2's `cpu.max` (the process's own group, else the
    namespace's root), else v1's `cpu.cfs_quota_us` over `cpu.cfs_period_us`."""

    def fields(path: str) -> list[str] | None:
        try:
            with open(os.path.join(root, path)) as f:
                return f.read(4096).split()  # a line or a few: what the kernel writes there
        except (OSError, UnicodeDecodeError):
            return None

    def ratio(quota: str, period: str) -> int | None:
        try:
            q, p = int(quota), int(period)
        except ValueError:
            return None
        return max(1, math.ceil(q / p)) if q > 0 and p > 0 else None

    own = ""
    for line in "\n".join(fields("proc/self/cgroup") or []).splitlines():
        if line.startswith("0::"):  # the unified (v2) hierarchy
            own = line[3:].strip("/")
    for group in dict.fromkeys([own, ""]):
        got = fields(os.path.join("sys/fs/cgroup", group, "cpu.max"))
        if got is not None and len(got) == 2:
            return None if got[0] == "max" else ratio(got[0], got[1])
    for v1 in ("sys/fs/cgroup/cpu", "sys/fs/cgroup/cpu,cpuacct"):
        quota, period = fields(f"{v1}/cpu.cfs_quota_us"), fields(f"{v1}/cpu.cfs_period_us")
        if quota and period:
            return ratio(quota[0], period[0])
    return None
