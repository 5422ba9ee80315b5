"""One rank of the straggler-report tests (`report_every`), with the torchrun variables set.

`python -m tests.straggler_worker MODE SLOW_RANK STEPS EVERY`: a gloo job of STEPS steps (each a
`compute` span, then an `all_reduce` marked collective), a flush after each step; SLOW_RANK
computes 30 ms a step where the others compute 5 ms. MODE:
- `planted`: reports every EVERY steps;
- `uneven`: as `planted`, but SLOW_RANK runs one step fewer (and does no all_reduce in its
  steps, so the others' all_reduces pair only among themselves: a job whose ranks run their own
  groups), report_timeout=3: the job must still end;
- `off`: no report_every, SLOW_RANK runs one step fewer.
Prints one JSON line: the rank, `gputrace.last_report()`, the report lines rank 0 logged (with
their `gputrace_report`), the warnings, and how long the job took.
"""

from __future__ import annotations

import logging
import sys
import time
import warnings

import orjson
import torch
import torch.distributed as dist

import gputrace


class Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def main(mode: str, slow: int, steps: int, every: int) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    keep = Keep()
    log = logging.getLogger("gputrace.straggler")
    log.addHandler(keep)
    log.setLevel(logging.INFO)
    options: dict[str, object] = {"cuda": False}
    if mode != "off":
        options["report_every"] = every
    if mode == "uneven":
        options["report_timeout"] = 3
    gputrace.enable(**options)
    mine = steps - 1 if mode in ("uneven", "off") and rank == slow else steps
    others = dist.new_group([r for r in range(world) if r != slow]) if mode in ("uneven", "off") else None
    t = torch.ones(64)
    began = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(mine):
            with gputrace.span("step", step=i):
                with gputrace.span("compute"):
                    time.sleep(0.030 if rank == slow else 0.005)
                with gputrace.span("sync", collective=True):
                    if others is None:
                        dist.all_reduce(t)
                    elif rank != slow:
                        dist.all_reduce(t, group=others)
            gputrace.flush()
    took = time.monotonic() - began
    dist.barrier()
    line = {
        "rank": rank,
        "report": gputrace.last_report(),
        "logged": [{"line": r.getMessage(), "report": getattr(r, "gputrace_report", None)} for r in keep.records],
        "warnings": [str(w.message) for w in caught],
        "took_s": took,
    }
    print(orjson.dumps(line).decode(), flush=True)
    gputrace.disable()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
