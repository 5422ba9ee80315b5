"""One rank of the multi-process tests, with the torchrun variables set.

`python -m tests.dist_worker OUT SHIFT_NS`: a short recorded job (rank 1 is a straggler and,
with SHIFT_NS, plays a host whose clock is that far ahead), saved into OUT.

`python -m tests.dist_worker sync SHIFT_NS`: clock syncs only. With `GPUTRACE_HOST_ID` set, the
rank plays that host, and a host named `shifted...` has its clock SHIFT_NS ahead (every rank of
it alike, as one host clock). Prints the syncs as one JSON line.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import orjson
import torch
import torch.distributed as dist

import gputrace
from gputrace import api
from gputrace.clock import HostClock


def main(out: str, shift_ns: int) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 1 and shift_ns:
        gputrace.set_host_clock(HostClock(shift_ns=shift_ns))  # this "host" is off by shift_ns
    gputrace.enable(cuda=False)
    first = gputrace.sync_clocks()
    t = torch.ones(1000)
    for i in range(6):
        with gputrace.span("step", step=i):
            with gputrace.span("compute"):
                time.sleep(0.004 * (rank + 1))  # rank 1 is the straggler
            with gputrace.span("all_reduce"):
                dist.all_reduce(t)
    second = gputrace.sync_clocks()
    gputrace.save(out)
    print(orjson.dumps({"rank": rank, "first": first.__dict__, "second": second.__dict__}).decode(), flush=True)
    dist.destroy_process_group()


def sync_only(shift_ns: int) -> None:
    dist.init_process_group("gloo")
    if os.environ.get("GPUTRACE_HOST_ID", "").startswith("shifted"):
        gputrace.set_host_clock(HostClock(shift_ns=shift_ns))
    gputrace.enable(cuda=False)
    syncs = [gputrace.sync_clocks(exchanges=8) for _ in range(2)]
    line = {
        "rank": dist.get_rank(),
        "epoch_offset_ns": api.host_clock().epoch_offset_ns,
        "syncs": [dataclasses.asdict(s) for s in syncs if s is not None],
    }
    print(orjson.dumps(line).decode(), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "sync":
        sync_only(int(sys.argv[2]))
    else:
        main(sys.argv[1], int(sys.argv[2]))
