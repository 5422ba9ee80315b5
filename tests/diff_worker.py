"""One rank of the run-to-run diff tests, with the torchrun variables set.

`python -m tests.diff_worker OUT STEPS SLOW_MS`: a small training loop on gloo whose spans vary
from step to step as real ones do (`forward` sleeps a random 2-8 ms, `backward` 1-3 ms, `data` 0.5-2.5 ms),
with an all-reduce in each step; `backward` takes SLOW_MS more on every rank (0: the same program
as any other run). Saved into OUT with its step digest. Prints {"rank": R} as one JSON line.
"""

from __future__ import annotations

import random
import sys
import time

import orjson
import torch
import torch.distributed as dist

import gputrace


def main(out: str, steps: int, slow_ms: float) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rng = random.Random()  # seeded from the system: a second run differs as a real one does
    gputrace.enable(cuda=False)
    gputrace.sync_clocks()
    t = torch.ones(1000)
    for i in range(steps):
        with gputrace.span("step", step=i):
            with gputrace.span("data"):
                time.sleep(rng.uniform(0.0005, 0.0025))
            with gputrace.span("forward"):
                time.sleep(rng.uniform(0.002, 0.008))
            with gputrace.span("backward"):
                time.sleep(rng.uniform(0.001, 0.003) + slow_ms / 1000)
            with gputrace.span("all_reduce", collective=True):
                dist.all_reduce(t)
    gputrace.save(out)
    print(orjson.dumps({"rank": rank}).decode(), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
