"""Ranks and clocks across processes.

Takes: torch.distributed (when initialised), the torchrun environment, or an explicit option.
Gives: `RankInfo` (rank, world size, and where they came from) for every trace, and
`sync_clocks()`, this rank's host clock offset against rank 0 with its error bar.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from gputrace.errors import ConfigError


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int | None
    source: str  # "torch.distributed", "env" (RANK/WORLD_SIZE), "option", "single process"


def _dist():  # type: ignore[no-untyped-def]
    torch = sys.modules.get("torch")  # never import torch just to ask
    if torch is None:
        return None
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist
    return None


def rank_info(explicit_rank: int | None = None) -> RankInfo:
    """torch.distributed when initialised, else the torchrun variables, else the explicit
    option, else a single process (rank 0 of 1)."""
    local = _env_int("LOCAL_RANK")
    dist = _dist()
    if dist is not None:
        return RankInfo(dist.get_rank(), dist.get_world_size(), local, "torch.distributed")
    rank = _env_int("RANK")
    if rank is not None:
        world = _env_int("WORLD_SIZE") or rank + 1
        return RankInfo(rank, world, local, "env")
    if explicit_rank is not None:
        return RankInfo(explicit_rank, max(explicit_rank + 1, _env_int("WORLD_SIZE") or 1), local, "option")
    return RankInfo(0, 1, local, "single process")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer") from None
    if number < 0:
        raise ConfigError(f"{name}={value!r} is negative")
    return number


@dataclass(frozen=True)
class ClockSync:
    """This rank's host clock against rank 0's: rank 0's time = ours + `offset_ns`, within
    +- `error_ns` (half the least round trip of `exchanges` ping-pongs), measured at `at_ns`
    (our epoch ns)."""

    at_ns: int
    offset_ns: int
    error_ns: int
    round_trip_ns: int
    exchanges: int


_gloo_groups: dict[int, object] = {}


def _gloo_group(dist, group):  # type: ignore[no-untyped-def]
    """A gloo group over the same ranks: NCCL cannot carry host timestamps without a device
    round trip, so the exchange always goes through gloo (a side group when the default is
    NCCL). Creating it is collective, which sync_clocks() already is."""
    if dist.get_backend(group) == "gloo":
        return group
    key = id(group)
    if key not in _gloo_groups:
        ranks = None if group is None else dist.get_process_group_ranks(group)
        _gloo_groups[key] = dist.new_group(ranks=ranks, backend="gloo")
    return _gloo_groups[key]


def sync_clocks(clock, group=None, exchanges: int = 16) -> ClockSync | None:  # type: ignore[no-untyped-def]
    """Estimate this rank's host clock offset against rank 0 by ping-pong through
    torch.distributed; every rank of `group` must call it. Rank 0 answers the others in turn
    and gets offset 0. The exchange with the least round trip wins (NTP's rule): the reply was
    stamped by rank 0 somewhere inside that round trip, so the midpoint is off by at most half
    of it. Returns None when torch.distributed is not initialised."""
    dist = _dist()
    if dist is None:
        return None
    import torch

    g = _gloo_group(dist, group)
    me = dist.get_rank()
    ranks = dist.get_process_group_ranks(g) if g is not None else list(range(dist.get_world_size()))
    root = ranks[0]
    buf = torch.zeros(1, dtype=torch.int64)
    if me == root:
        for r in ranks[1:]:
            for _ in range(exchanges):
                dist.recv(buf, src=r, group=g)
                buf[0] = clock.now()
                dist.send(buf, dst=r, group=g)
        now = clock.now()
        return ClockSync(now, 0, 0, 0, 0)
    best: tuple[int, int, int] | None = None  # (round trip, offset, at)
    for _ in range(exchanges):
        t0 = clock.now()
        dist.send(buf, dst=root, group=g)
        dist.recv(buf, src=root, group=g)
        t2 = clock.now()
        remote = int(buf[0])
        rtt = t2 - t0
        if best is None or rtt < best[0]:
            best = (rtt, remote - (t0 + t2) // 2, (t0 + t2) // 2)
    assert best is not None
    rtt, offset, at = best
    return ClockSync(at, offset, (rtt + 1) // 2, rtt, exchanges)
