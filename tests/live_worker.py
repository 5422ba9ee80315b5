"""One rank of the live tests: a gloo job streaming to a folder, with a flush a step.

    python -m tests.live_worker OUT_DIR MODE [STEPS]

MODE `hang`: rank 2 stops for good inside `data` of step 30; the others block in `all_reduce`
of step 30 (the test kills them). `desync`: at step 30 rank 2 calls a broadcast where the others
call an all_reduce (each blocks). `clean`: STEPS steps, then a save and a normal exit. Each rank
prints "ready" once it has recorded its first step.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

import gputrace

HANG_STEP = 30


def main(out: str, mode: str, steps: int) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gputrace.enable(out_dir=out, cuda=False, open_every_s=0.2)
    t = torch.ones(64)
    for step in range(steps):
        with gputrace.span("step", step=step):
            with gputrace.span("data"):
                if mode == "hang" and rank == 2 and step == HANG_STEP:
                    while True:  # stuck for good: a dead data loader
                        time.sleep(1)
                time.sleep(0.001)
            with gputrace.span("forward"):
                time.sleep(0.002)
            if mode == "desync" and rank == 2 and step == HANG_STEP:
                with gputrace.span("broadcast"):
                    dist.broadcast(t, src=2)
            else:
                with gputrace.span("all_reduce"):
                    dist.all_reduce(t)
        gputrace.flush()
        if step == 0:
            print("ready", flush=True)
    gputrace.save()
    print("done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 1000)
