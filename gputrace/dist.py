"""Ranks and clocks across processes.

Takes: torch.distributed (when initialised), the torchrun environment, or an explicit option.
Gives: `RankInfo` (rank, world size, and where they came from) for every trace, and
`sync_clocks()`, this rank's host clock offset against rank 0 with its error bar and, where the
ranks record on GPUs joined by NCCL, the offset of this rank's device events refined on the
GPUs themselves.
Also `gather_digests()`, the ranks' step digests collected on one rank. What these need from
the recording (the recorder, the gloo side groups kept between calls, the digest last written)
they are handed by the session; this module keeps no state of its own.

How the host offsets are found, at any scale:
- Ranks on one host read one CLOCK_MONOTONIC, and each turns it into epoch ns through its own
  realtime-minus-monotonic offset (`HostClock.epoch_offset_ns`). Between two of them the offset
  is therefore the difference of those two numbers, exactly: no message needs to cross. One
  all_gather of three integers a rank (its host identity hashed, its epoch offset, whether it can
  take part in the device refinement) tells every rank all of this: the one step whose cost grows
  with the number of ranks (gloo's all_gather is a ring), and half of what all_gather_object
  would cost (a gather of sizes, then one of pickled bytes).
- One leader per host (its lowest rank) measures against rank 0's host by ping-pong (NTP's
  rule: keep the least round trip, the answer is off by at most half of it). The leaders do it in
  a binomial tree: in round k, each leader that already knows its offset answers the leader 2^k
  places after it, so H hosts need ceil(log2 H) rounds, all pairs of a round at once, instead of
  H - 1 exchanges one after the other through rank 0. A leader's error bar is its own half round
  trip plus that of the leader that answered it (errors add along the path).
- The other ranks of a host take their leader's offset plus the exact same-host difference,
  with the leader's error bar.

How the device offsets are refined (NCCL, ranks on more than one host): a host offset across
hosts is only as good as half a network round trip (tens of microseconds over TCP). A tiny
all-reduce ends on every GPU at nearly the same moment, so its end events, mapped to host time
through each rank's own anchors exactly as its spans are, give the offset of the rank's device
events directly, with bounds that causality guarantees. See `_device_probe`. On one host no probe
runs: the host offsets are exact there, and the anchors of two GPUs agreed with the GPUs' own
global timers to about 0.1 us (docs/accuracy.md, "Across ranks"), closer than the probes' own
~0.8 us end skew.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gputrace.errors import ConfigError, GputraceError

# A test seam: ranks whose environment gives different values here act as different hosts (and
# exchange messages), ranks with the same value as one host. Unset, the host is recognised by its
# hostname, its boot id and its time namespace.
HOST_ID_ENV = "GPUTRACE_HOST_ID"


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int | None  # None: not known (a rank given as an option, no WORLD_SIZE)
    local_rank: int | None
    source: str  # "torch.distributed", "env" (RANK/WORLD_SIZE), "option", "single process"


def _dist() -> Any:
    torch = sys.modules.get("torch")  # never import torch just to ask
    if torch is None:
        return None
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist
    return None


def rank_info(explicit_rank: int | None = None) -> RankInfo:
    """torch.distributed when initialised, else the torchrun variables, else the explicit
    option, else a single process (rank 0 of 1). A rank from RANK or the option without
    WORLD_SIZE has an unknown world size (None), not a guessed one: rank R's guess of R + 1
    would contradict every other rank's."""
    local = _env_int("LOCAL_RANK")
    dist = _dist()
    if dist is not None:
        return RankInfo(dist.get_rank(), dist.get_world_size(), local, "torch.distributed")
    rank = _env_int("RANK")
    if rank is not None:
        return RankInfo(rank, _env_int("WORLD_SIZE"), local, "env")
    if explicit_rank is not None:
        world = _env_int("WORLD_SIZE")
        return RankInfo(explicit_rank, max(explicit_rank + 1, world) if world else None, local, "option")
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
class DeviceSync:
    """This rank's device events against rank 0's: rank 0's time = ours + `offset_ns` for an
    event on this rank's GPU, within +- `error_ns`, measured at `at_ns` (our epoch ns) from
    `probes` tiny all-reduces. `spread_ns` is half the range of the per-batch estimates (how
    much the anchors moved between batches); `batches` keeps each batch's estimate and bounds."""

    at_ns: int
    offset_ns: int
    error_ns: int
    probes: int
    spread_ns: int
    method: str = "all-reduce ends"
    batches: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class ClockSync:
    """This rank's host clock against rank 0's: rank 0's time = ours + `offset_ns`, within
    +- `error_ns`, measured at `at_ns` (our epoch ns).

    `method`: "reference" (rank 0 itself), "exchange" (this rank led its host's ping-pong:
    `round_trip_ns` is its least round trip of `exchanges`, `hops` the exchanges between its host
    and rank 0's), or "same host" (derived exactly from `leader`, which shares this rank's host
    clock, and carrying the leader's error bar). `device`: the refinement for this rank's device
    events, when the ranks record on GPUs joined by NCCL."""

    at_ns: int
    offset_ns: int
    error_ns: int
    round_trip_ns: int
    exchanges: int
    method: str = "exchange"
    leader: int | None = None
    hops: int = 0
    hosts: int = 1
    device: DeviceSync | None = None


def gloo_group(dist: Any, group: Any, groups: dict[int, object]) -> Any:
    """A gloo group over the same ranks: NCCL cannot carry host timestamps without a device
    round trip, so the exchange always goes through gloo (a side group when the default is
    NCCL, kept in `groups`, the caller's, by the group it stands for). Creating it is
    collective, which sync_clocks() already is."""
    if dist.get_backend(group) == "gloo":
        return group
    key = id(group)
    if key not in groups:
        ranks = None if group is None else dist.get_process_group_ranks(group)
        groups[key] = dist.new_group(ranks=ranks, backend="gloo")
    return groups[key]


def host_identity() -> str:
    """What makes two processes share a host clock: the same kernel (hostname and boot id) and
    the same time namespace (which can move CLOCK_MONOTONIC). `GPUTRACE_HOST_ID` overrides it
    (a test seam: it lets processes of one machine play several hosts)."""
    override = os.environ.get(HOST_ID_ENV)
    if override:
        return override
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/timens_offsets"):
        try:
            with open(path) as f:
                parts.append(" ".join(f.read().split()))
        except OSError:
            pass
    return "|".join(parts)


@dataclass(frozen=True)
class HostPlan:
    """Who leads which host, from every rank's (host identity, epoch offset)."""

    leaders: list[int]  # global ranks, rank 0's host first, then in rank order
    leader_of: dict[int, int]  # global rank -> its host's leader
    epoch_offset: dict[int, int]  # global rank -> HostClock.epoch_offset_ns


def _host_key(identity: str) -> int:
    """A host identity as a signed 64-bit integer (a hash: two hosts of a 4,096-rank job collide
    with a probability of about 1e-12)."""
    return int.from_bytes(hashlib.blake2b(identity.encode(), digest_size=8).digest(), "little", signed=True)


def plan_hosts(ranks: list[int], table: list[tuple[Any, int]]) -> HostPlan:
    """`table[i]` is (host identity, epoch offset) of `ranks[i]`; the lowest rank of each host
    leads it, and the leaders are ordered as their ranks are in the group (so the group's first
    rank leads the first host)."""
    first: dict[Any, int] = {}
    leader_of: dict[int, int] = {}
    for rank, (ident, _) in zip(ranks, table):
        leader_of[rank] = first.setdefault(ident, rank)
    return HostPlan(list(first.values()), leader_of, {r: int(t[1]) for r, t in zip(ranks, table)})


def tree_rounds(n: int) -> list[list[tuple[int, int]]]:
    """The binomial tree over `n` leaders (indices; 0 is the reference): round k pairs each
    index j < 2^k that already knows its offset with j + 2^k. Every pair of a round runs at once."""
    rounds = []
    step = 1
    while step < n:
        rounds.append([(j, j + step) for j in range(step) if j + step < n])
        step *= 2
    return rounds


def sync_clocks(  # type: ignore[no-untyped-def]
    clock,
    group=None,
    exchanges: int = 16,
    device_probes: int = 8,
    *,
    recorder: Callable[[], Any] | None = None,
    gloo_groups: dict[int, object] | None = None,
) -> ClockSync | None:
    """Estimate this rank's host clock offset against rank 0 (the group's first rank) through
    torch.distributed; every rank of `group` must call it. Ranks that share a host share one
    exchange (see the module's docstring). Then, if the ranks span several hosts, every rank
    records on a GPU and `group` is NCCL, each rank's device offset is refined with
    `device_probes` tiny all-reduces per batch. Returns None when torch.distributed is not
    initialised.

    Handed by the session: `recorder`, a callable giving the recorder spans record into (or
    None; it may build one), asked only for the device refinement; `gloo_groups`, where the
    gloo side groups are kept between calls (None: made for this call only)."""
    dist = _dist()
    if dist is None:
        return None
    import torch

    g = gloo_group(dist, group, {} if gloo_groups is None else gloo_groups)
    me = dist.get_rank()
    ranks = dist.get_process_group_ranks(g) if g is not None else list(range(dist.get_world_size()))
    root = ranks[0]
    rec = recorder() if recorder is not None and device_probes > 0 else None
    probe_dev = _probe_device(dist, group, rec) if device_probes > 0 else None
    mine = torch.tensor([_host_key(host_identity()), clock.epoch_offset_ns, probe_dev is not None], dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in ranks]
    dist.all_gather(gathered, mine, group=g)
    table = [tuple(int(v) for v in t) for t in gathered]
    plan = plan_hosts(ranks, [(t[0], t[1]) for t in table])
    leader = plan.leader_of[me]
    hosts = len(plan.leaders)
    buf = torch.zeros(5, dtype=torch.int64)
    if me == leader:
        at, offset, error, rtt, hops = _lead(dist, g, clock, plan.leaders, me, exchanges, buf)
        result = ClockSync(at, offset, error, rtt, exchanges if me != root else 0, "exchange", me, hops, hosts)
        if me == root:
            result = dataclasses.replace(result, method="reference")
        if leader != plan.leader_of[root]:
            buf[:] = torch.tensor([at, offset, error, rtt, hops])
            for r in ranks:
                if r != me and plan.leader_of[r] == me:
                    dist.send(buf, dst=r, group=g)
    else:
        if leader == plan.leader_of[root]:
            # Rank 0's own host: its offset is 0 by definition, nothing to wait for.
            buf.zero_()
        else:
            dist.recv(buf, src=leader, group=g)
        at, offset, error, rtt, hops = (int(x) for x in buf)
        same_host = plan.epoch_offset[leader] - clock.epoch_offset_ns  # leader's time = ours + this
        at = at - same_host if at else clock.now()
        result = ClockSync(at, offset + same_host, error, rtt, 0, "same host", leader, hops, hosts)
    if hosts > 1 and all(t[2] for t in table):
        result = dataclasses.replace(result, device=_device_probe(dist, group, g, ranks, result, device_probes, rec))
    return result


def _lead(dist, g, clock, leaders: list[int], me: int, exchanges: int, buf) -> tuple[int, int, int, int, int]:  # type: ignore[no-untyped-def]
    """This leader's part of the binomial tree: be answered once (unless it is the reference),
    then answer its later partners. Returns (at, offset, error, round trip, hops)."""
    i = leaders.index(me)
    at, offset, error, rtt, hops = clock.now(), 0, 0, 0, 0
    for pairs in tree_rounds(len(leaders)):
        for server, client in pairs:
            if client == i:
                at, rtt, to_server = _ping(dist, g, clock, leaders[server], exchanges, buf)
                dist.recv(buf, src=leaders[server], group=g)  # the server's own offset and error
                offset, error, hops = to_server + int(buf[0]), (rtt + 1) // 2 + int(buf[1]), int(buf[2]) + 1
            elif server == i:
                _answer(dist, g, clock, leaders[client], exchanges, buf)
                buf[0], buf[1], buf[2] = offset, error, hops
                dist.send(buf, dst=leaders[client], group=g)
    return at, offset, error, rtt, hops


def _ping(dist, g, clock, server: int, exchanges: int, buf) -> tuple[int, int, int]:  # type: ignore[no-untyped-def]
    """NTP's exchange with `server`: (when, least round trip, server's time - ours)."""
    best: tuple[int, int, int] | None = None  # (round trip, offset, at)
    for _ in range(max(1, exchanges)):
        t0 = clock.now()
        dist.send(buf, dst=server, group=g)
        dist.recv(buf, src=server, group=g)
        t2 = clock.now()
        rtt = t2 - t0
        if best is None or rtt < best[0]:
            best = (rtt, int(buf[0]) - (t0 + t2) // 2, (t0 + t2) // 2)
    assert best is not None
    return best[2], best[0], best[1]


def _answer(dist, g, clock, client: int, exchanges: int, buf) -> None:  # type: ignore[no-untyped-def]
    for _ in range(max(1, exchanges)):
        dist.recv(buf, src=client, group=g)
        buf[0] = clock.now()
        dist.send(buf, dst=client, group=g)


# ---- device refinement ---------------------------------------------------------------------------


def _probe_device(dist, group, rec) -> int | None:  # type: ignore[no-untyped-def]
    """The GPU this rank records on, if the device refinement can run here: recording is on
    (`rec`, the recorder) with a CUDA device and `group` reduces CUDA tensors in place on the
    GPUs (NCCL)."""
    if rec is None or rec.device is None:
        return None
    try:
        if "nccl" not in str(dist.get_backend(group)):
            return None
    except (RuntimeError, ValueError):
        return None
    return int(rec.device.current_device())


# Batches of probes, each mapped through an anchor of its own; "busy" batches take that anchor
# while the GPU runs a kernel, the way flush() takes its anchors in a training loop.
_BATCHES = ("idle", "busy", "idle", "busy")
_LATE_CYCLES = 40_000  # ~20 us at H200 clocks: the late side of a probe arrives clearly last
_AHEAD_CYCLES = 2_000_000  # ~1 ms at H200 clocks: the host queues a whole batch before the GPU reaches it


class CudaProbe:
    """The CUDA calls the refinement makes, on the current stream of device `dev` (a test
    double stands in for them on a CPU)."""

    def __init__(self, dev: int) -> None:
        import torch

        self.torch = torch
        self.dev = dev
        self.stream = torch.cuda.current_stream(dev)

    def tensor(self) -> Any:
        return self.torch.zeros(1, device=self.torch.device("cuda", self.dev))

    def sleep(self, cycles: int) -> None:
        self.torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]

    def event(self) -> Any:
        ev = self.torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        ev.record(self.stream)
        return ev

    def wait(self, event: Any) -> None:
        event.synchronize()

    def drain(self) -> None:
        self.stream.synchronize()


PROBE: type = CudaProbe


def _device_probe(dist, group, g, ranks: list[int], host: ClockSync, per_batch: int, rec) -> DeviceSync | None:  # type: ignore[no-untyped-def]
    """Refine this rank's offset for its device events with tiny all-reduces on `group`.

    Each probe is a start event, a one-element all-reduce and an end event on the current
    stream, queued behind a sleep kernel so that they run back to back on the GPU. Both events
    are mapped to host epoch ns through this rank's anchors exactly as its spans are. Two facts
    bound rank 0's offset theta for our device events:
    - an all-reduce cannot end on any GPU before every GPU has started it, so
      theta >= start_0 - end_r and theta <= end_0 - start_r;
    - it ends on all GPUs at nearly the same moment, so theta ~ end_0 - end_r.
    Odd probes make rank 0 arrive last (a short sleep first), even probes every other rank, so
    both bounds are tight on some probe. Per batch: the median of end_0 - end_r, clamped into the
    bounds; the estimate is the median of the batches, and its error bar reaches from it to the
    farthest bound of any batch (batches with their own anchors show how much anchors move).
    `rec`: the recorder, whose anchors map the events."""
    assert rec is not None and rec.device is not None  # _probe_device said so on every rank
    dev = rec.device.current_device()
    gpu = PROBE(dev)
    me, root = dist.get_rank(), ranks[0]
    x = gpu.tensor()
    dist.all_reduce(x, group=group)  # the communicator may be built lazily: not in the probes
    gpu.drain()
    batches: list[list[tuple[int, int]]] = []
    for kind in _BATCHES:
        with rec._lock:
            tl = rec.timelines[dev]
            if not tl.anchors:
                rec._anchor(dev)
            first = len(tl.anchors) - 1
        gpu.sleep(_AHEAD_CYCLES)
        events = []
        for i in range(per_batch):
            if (i % 2 == 1) == (me == root):
                gpu.sleep(_LATE_CYCLES)
            s = gpu.event()
            dist.all_reduce(x, group=group)
            events.append((s, gpu.event()))
        if kind == "busy":
            gpu.sleep(_AHEAD_CYCLES // 8)  # still running when the anchor is taken
        gpu.wait(events[-1][1])
        with rec._lock:
            rec._anchor(dev)
            batches.append([(_to_host(tl, s, first), _to_host(tl, e, first)) for s, e in events])
        gpu.drain()
    # Rank 0's pairs, as int64 through the gloo group (object collectives would need numpy).
    import torch

    flat = torch.tensor(
        [v for batch in batches for pair in batch for v in pair] if me == root else [0] * (2 * sum(map(len, batches))),
        dtype=torch.int64,
    )
    dist.broadcast(flat, src=root, group=g)
    values = flat.tolist()
    ref: list[list[tuple[int, int]]] = []
    k = 0
    for batch in batches:
        ref.append([(values[k + 2 * i], values[k + 2 * i + 1]) for i in range(len(batch))])
        k += 2 * len(batch)
    n = per_batch * len(batches)
    if me == root:
        return DeviceSync(host.at_ns, 0, 0, n, 0)
    summaries: list[dict[str, Any]] = []
    offsets, los, his = [], [], []
    for kind, theirs, ours in zip(_BATCHES, ref, batches):
        lo = max(s0 - e1 for (s0, _), (_, e1) in zip(theirs, ours))
        hi = min(e0 - s1 for (_, e0), (s1, _) in zip(theirs, ours))
        gaps = [e0 - e1 for (_, e0), (_, e1) in zip(theirs, ours)]
        offset = min(max(int(statistics.median(gaps)), lo), hi)
        offsets.append(offset)
        los.append(lo)
        his.append(hi)
        summaries.append({"anchor": kind, "offset_ns": offset, "lo_ns": lo, "hi_ns": hi, "end_gaps_ns": gaps})
    estimate = int(statistics.median(offsets))
    error = max(estimate - min(los), max(his) - estimate)
    spread = (max(offsets) - min(offsets) + 1) // 2
    return DeviceSync(host.at_ns, estimate, error, n, spread, batches=tuple(summaries))


def _to_host(tl, event, first: int) -> int:  # type: ignore[no-untyped-def]
    located = tl.locate(event, first)
    assert located is not None, "a probe event after the anchor taken behind it"
    return int(tl.to_host_ns(*located))


# ---- gathering the step digests ------------------------------------------------------------------


def gather_digests(
    mine: str | None,
    out_dir: str | None,
    group: Any = None,
    dst: int = 0,
    *,
    gloo_groups: dict[int, object] | None = None,
) -> list[str]:
    """Collective (every rank of `group` calls it): each rank's digest file `mine` (None, or a
    file that is not there: this rank sends none) goes to rank `dst`, which writes them all into
    `out_dir` as `digest_rank{R}.digest`, so that `gputrace summary` there reads every rank
    without their traces. Returns the paths written (on `dst`; an empty list elsewhere).
    `gloo_groups`: as for `sync_clocks`."""
    import zlib

    import orjson
    import torch.distributed as dist

    from gputrace.trace.files import atomic_writer

    blob: bytes | None = None
    path = mine if mine is not None and os.path.isfile(mine) else None
    if path is not None:
        try:
            with open(path, "rb") as f:
                blob = zlib.compress(f.read(), 1)
        except OSError:
            blob = None
    g = gloo_group(dist, group, {} if gloo_groups is None else gloo_groups)
    ranks = dist.get_process_group_ranks(g) if g is not None else list(range(dist.get_world_size()))
    target = ranks[dst] if g is not None else dst
    me = dist.get_rank()
    box: list[Any] = [None] * len(ranks) if me == target else []
    dist.gather_object(blob, box if me == target else None, dst=target, group=g)
    if me != target:
        return []
    if not out_dir:
        raise GputraceError("gather_digests() needs out_dir on the receiving rank (or the out_dir option)")
    written = []
    for got in box:
        if got is None:
            continue
        data = zlib.decompress(got)
        doc = orjson.loads(data)
        dest = os.path.join(out_dir, f"digest_rank{int(doc['rank'])}.digest")
        if os.path.abspath(dest) != os.path.abspath(path or ""):
            with atomic_writer(dest) as f:
                f.write(data)
        written.append(dest)
    return written
