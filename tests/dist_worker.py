"""One rank of the multi-process tests, with the torchrun variables set.

`python -m tests.dist_worker OUT SHIFT_NS`: a short recorded job (rank 1 is a straggler and,
with SHIFT_NS, plays a host whose clock is that far ahead), saved into OUT.

`python -m tests.dist_worker sync SHIFT_NS`: clock syncs only. With `GPUTRACE_HOST_ID` set, the
rank plays that host, and a host named `shifted...` has its clock SHIFT_NS ahead (every rank of
it alike, as one host clock). Prints the syncs as one JSON line.

`python -m tests.dist_worker cuda OUT STEPS` (NCCL, one GPU a rank): `gputrace demo`'s training,
untouched, with the ground truth beside it: after each gradient all-reduce a one-thread kernel on
the collective's stream stores the GPU's %globaltimer, and each GPU's global timer is mapped to
the host clock by spinning on mapped memory (`GlobalTimer`). Writes `truth_rank{R}.json` to OUT.

`python -m tests.dist_worker fakegpu SHIFT_NS`: the device refinement's whole path on a CPU. A
fake GPU (tests/fakes.py) whose events run at the real host instant they are recorded stands in
for CUDA, and gloo's all-reduce for NCCL's; rank 1's host clock is SHIFT_NS ahead. Prints the
syncs as one JSON line.
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
from gputrace import session as api
from gputrace.clock import HostClock
from gputrace.config import Config
from gputrace.record import Recorder

from .fakes import FakeDevice


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


class RealTimeFake(FakeDevice):
    """A fake GPU on the real host clock: an event runs the moment it is recorded."""

    now = property(lambda self: time.monotonic_ns(), lambda self, value: None)  # type: ignore[assignment]


def fake_gpu(shift_ns: int) -> None:
    from gputrace import dist as gdist
    from gputrace import session

    dist.init_process_group("gloo")
    fake = RealTimeFake(launch_ns=0, wake_ns=0)
    clock = HostClock(monotonic_ns=time.monotonic_ns, shift_ns=shift_ns if dist.get_rank() == 1 else 0)
    session.SESSION.install(Recorder(Config().replace(anchor_every_ms=0), fake, clock))

    class Probe:
        def __init__(self, dev: int) -> None:
            pass

        def tensor(self) -> torch.Tensor:
            return torch.zeros(1)

        def sleep(self, cycles: int) -> None:
            pass

        def event(self) -> object:
            ev = fake.new_event()
            fake.record(ev, fake.current[0])
            return ev

        def wait(self, event: object) -> None:
            pass

        def drain(self) -> None:
            pass

    gdist.PROBE = Probe
    gdist._probe_device = lambda dist, group, rec: 0  # gloo's all-reduce plays NCCL's
    syncs = [gputrace.sync_clocks(exchanges=8) for _ in range(2)]
    line = {
        "rank": dist.get_rank(),
        "epoch_offset_ns": clock.epoch_offset_ns,
        "syncs": [dataclasses.asdict(s) for s in syncs if s is not None],
    }
    print(orjson.dumps(line).decode(), flush=True)
    dist.destroy_process_group()


STAMP_SRC = r"""
extern "C" __global__ void stamp(unsigned long long* out, int i) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    out[i] = t;
    __threadfence_system();
}
"""


class GlobalTimer:
    """The GPU's own clock, read by a one-thread kernel (through CuPy, which compiles it at run
    time), and its map to the host clock: host = globaltimer + c, where c is the least of
    (host time at which the host sees a stamp) - (the stamp) over many tries, i.e. the map is
    late by the one-way latency of a write to mapped host memory, alike on every GPU of a host."""

    def __init__(self, clock: HostClock) -> None:
        import cupy
        import numpy

        self.cupy, self.numpy, self.clock = cupy, numpy, clock
        cupy.cuda.Device(torch.cuda.current_device()).use()
        self.kernel = cupy.RawKernel(STAMP_SRC, "stamp")
        self.pinned = cupy.cuda.alloc_pinned_memory(64)
        self.host = numpy.frombuffer(self.pinned, dtype=numpy.int64, count=1)
        self.side = torch.cuda.Stream()
        self.stamps = torch.zeros(4096, dtype=torch.int64, device="cuda")
        self.n = 0

    def _launch(self, stream: torch.cuda.Stream, ptr: int, i: int) -> None:
        with self.cupy.cuda.ExternalStream(stream.cuda_stream):
            self.kernel((1,), (1,), (self.numpy.uint64(ptr), self.numpy.int32(i)))

    def stamp(self, stream: torch.cuda.Stream) -> None:
        self._launch(stream, self.stamps.data_ptr(), self.n)
        self.n += 1

    def calibrate(self, tries: int = 300) -> tuple[int, int]:
        """(c, a stamp it was measured at)."""
        best: tuple[int, int] | None = None
        for _ in range(tries):
            self.host[0] = 0
            self._launch(self.side, self.pinned.ptr, 0)
            while self.host[0] == 0:
                pass
            seen = self.clock.now()
            gt = int(self.host[0])
            if best is None or seen - gt < best[0]:
                best = (seen - gt, gt)
        assert best is not None
        return best


def cuda_truth(out: str, steps: int) -> None:
    from gputrace import demo

    timer: list[GlobalTimer] = []
    calibrations = []
    train_all_reduce = demo._all_reduce_grads

    def all_reduce_and_stamp(torch_: object, model: object, comm: torch.cuda.Stream) -> None:
        if not timer:
            timer.append(GlobalTimer(api.host_clock()))
            calibrations.append(timer[0].calibrate())
        train_all_reduce(torch_, model, comm)
        timer[0].stamp(comm)  # queued right behind the span's end event, on the same stream

    demo._all_reduce_grads = all_reduce_and_stamp
    demo.train(out, steps, distributed=True)
    torch.cuda.synchronize()
    calibrations.append(timer[0].calibrate())
    line = {"calibrations": calibrations, "stamps": timer[0].stamps[: timer[0].n].tolist()}
    with open(os.path.join(out, f"truth_rank{os.environ['RANK']}.json"), "wb") as f:
        f.write(orjson.dumps(line))


if __name__ == "__main__":
    if sys.argv[1] == "sync":
        sync_only(int(sys.argv[2]))
    elif sys.argv[1] == "cuda":
        cuda_truth(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1] == "fakegpu":
        fake_gpu(int(sys.argv[2]))
    else:
        main(sys.argv[1], int(sys.argv[2]))
