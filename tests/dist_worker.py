"""One rank of the multi-process tests: run as `python -m tests.dist_worker OUT SHIFT_NS`
with the torchrun variables set."""

from __future__ import annotations

import sys
import time

import orjson
import torch
import torch.distributed as dist

import gputrace
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


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
