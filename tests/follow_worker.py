"""One rank of the `view --follow` browser test, with the torchrun variables set.

`python -m tests.follow_worker OUT HANG_AT`: a gloo job streaming into OUT, a flush a step; each
step a `data` span, a `compute` span (rank 1 three times as long: the straggler) and an
`all_reduce` marked collective. At step HANG_AT rank 1 stops for good inside `data`; rank 0 then
waits in its all_reduce. The test kills both.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

import gputrace


def main(out: str, hang_at: int) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gputrace.enable(cuda=False, out_dir=out)
    t = torch.ones(16)
    for i in range(100_000):
        with gputrace.span("step", step=i):
            with gputrace.span("data"):
                time.sleep(0.02)
                while rank == 1 and i == hang_at:
                    time.sleep(1)
            with gputrace.span("compute"):
                time.sleep(0.15 if rank == 1 else 0.05)
            with gputrace.span("all_reduce", collective=True):
                dist.all_reduce(t)
        gputrace.flush()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
