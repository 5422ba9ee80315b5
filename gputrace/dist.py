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
