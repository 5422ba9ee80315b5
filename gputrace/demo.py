"""The main job: train a small transformer-like model for a few seconds with nested spans, on
the GPU when there is one and the CPU otherwise, and write its traces.

Takes: an output directory, a step count and a number of ranks. Gives: `trace_rank{R}.json`
per rank (and, with several ranks, `merged.json`, with clocks synced through torch.distributed).
With several ranks the last one is made slower on purpose (a straggler: more data per step), so
that `gputrace summary` has something to find.

Progress goes to a callback (the CLI shows it on stderr): `train` reports each step; the rank
processes of `run_ranks` report theirs as marked lines on their stderr, which `run_ranks` reads
and hands to its callback.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

import gputrace
from gputrace.cpus import usable_cpus
from gputrace.errors import GputraceError


def build_model(torch: Any, width: int, depth: int, device: Any) -> Any:
    nn = torch.nn
    layer = nn.TransformerEncoderLayer(d_model=width, nhead=8, dim_feedforward=4 * width, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=depth, enable_nested_tensor=False).to(device)


def cores() -> int:
    """CPU cores this process may use (its affinity, its cgroup's quota)."""
    return usable_cpus()


def threads_per_rank(ranks: int, cuda: bool) -> int:
    """Intra-op threads for each rank. Ranks that fight for cores stall each other at every
    collective (2 ranks x 2 threads on 2 cores: step p50 291 ms, p99 5.7 s), so ranks x threads
    stays within the cores. On the CPU the model is small: one thread a rank measured 97 ms a
    step against 1,156 ms for two on a busy 2-core machine (59 against 45 ms on a quiet one), so
    a CPU rank gets one thread."""
    return 1 if not cuda else max(1, cores() // ranks)


def train(
    out_dir: str,
    steps: int,
    distributed: bool = False,
    progress: Callable[[int, int], None] | None = None,
    threads: int | None = None,
) -> str:
    """Record `steps` training steps in this process and save its trace; returns the file.
    `progress(done, steps)` is called once the model is built (0) and after each step;
    `threads` sets torch's intra-op threads (default: `threads_per_rank`)."""
    import torch as torch_module

    torch: Any = torch_module  # a demo, not an API: torch's partly untyped calls are fine here
    cuda = torch.cuda.is_available()
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if distributed else 1
    torch.set_num_threads(threads or threads_per_rank(world_size, cuda))
    rank, world = 0, 1
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local % max(1, torch.cuda.device_count())) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if distributed:
        import torch.distributed as dist

        nccl = cuda and torch.cuda.device_count() >= int(os.environ["WORLD_SIZE"])
        dist.init_process_group("nccl" if nccl else "gloo", device_id=device if nccl else None)
        rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    width, depth, batch, seq = (512, 4, 32, 256) if cuda else (128, 2, 8, 64)
    if distributed and rank == world - 1 and world > 1:
        batch += batch // 2  # the straggler
    model = build_model(torch, width, depth, device)
    params = list(model.parameters())
    side = torch.cuda.Stream() if cuda else None
    comm = torch.cuda.Stream() if cuda and distributed else None
    host_batch = torch.randn(batch, seq, width)
    if cuda:
        host_batch = host_batch.pin_memory()

    gputrace.enable()
    if distributed:
        gputrace.sync_clocks()
    if progress is not None:
        progress(0, steps)
    for step in range(steps):
        with gputrace.span("step", step=step):
            with gputrace.span("data"):
                if side is not None:
                    # The batch copies in on a second stream, as a prefetcher would.
                    with torch.cuda.stream(side), gputrace.span("h2d copy"):
                        x = host_batch.to(device, non_blocking=True)
                    torch.cuda.current_stream().wait_stream(side)
                else:
                    x = host_batch.clone()
            with gputrace.span("forward"):
                for i, block in enumerate(model.layers):
                    with gputrace.span("block", layer=i):
                        x = block(x)
                loss = x.float().pow(2).mean()
            with gputrace.span("backward"):
                loss.backward()
            if distributed:
                _all_reduce_grads(torch, model, comm)
            with gputrace.span("optimizer"), torch.no_grad():
                # Plain SGD in one call: torch.optim's optimizers import torch._dynamo when built,
                # seconds of start-up per rank on a small machine.
                torch._foreach_add_(params, [p.grad for p in params], alpha=-1e-4)
                for p in params:
                    p.grad = None
        gputrace.flush()
        if progress is not None:
            progress(step + 1, steps)
    if distributed:
        gputrace.sync_clocks()  # a second estimate: merge interpolates drift between the two
    path = gputrace.save(out_dir)
    if distributed:
        import torch.distributed as dist

        dist.destroy_process_group()
    return path


def _all_reduce_grads(torch: Any, model: Any, comm: Any) -> None:
    import torch.distributed as dist

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    nbytes = flat.numel() * flat.element_size()
    if comm is not None and dist.get_backend() == "nccl":
        # The collective runs on its own stream, as DDP's does.
        comm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(comm), gputrace.span("all_reduce", bytes=nbytes):
            dist.all_reduce(flat)
        torch.cuda.current_stream().wait_stream(comm)
    elif flat.is_cuda:
        # More ranks than GPUs: gloo, through host memory.
        with gputrace.span("all_reduce", bytes=nbytes):
            host = flat.cpu()
            dist.all_reduce(host)
            flat.copy_(host)
    else:
        with gputrace.span("all_reduce", bytes=nbytes):
            dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


_PROGRESS = "gputrace-demo-progress"


def rank_main(out_dir: str, steps: int) -> None:
    """A rank process of `run_ranks` (a program, not a library call): trains, and reports each
    step on its stderr as a marked line that `run_ranks` reads."""

    def report(done: int, total: int) -> None:
        print(f"{_PROGRESS} {done} {total}", file=sys.stderr, flush=True)

    train(out_dir, steps, distributed=True, progress=report)


def clear_previous(out_dir: str) -> list[str]:
    """Remove the files an earlier demo wrote in `out_dir` (traces, digests, the merged trace), so
    a run with fewer ranks never merges or summarises a stale rank. Returns what was removed."""
    import glob

    from gputrace.trace import digestfile, registry

    merged = [f"merged{fmt.extension}" for fmt in registry.formats()]
    removed = []
    for pattern in (*registry.rank_file_globs(), digestfile.RANK_GLOB, *merged):
        for path in glob.glob(os.path.join(out_dir, pattern)):
            os.remove(path)
            removed.append(path)
    return removed


def run_ranks(
    out_dir: str,
    steps: int,
    ranks: int,
    timeout_s: float = 600,
    progress: Callable[[int, int, int], None] | None = None,
) -> list[str]:
    """Start `ranks` real processes (gloo on CPU, NCCL with enough GPUs); returns their traces.
    `progress(rank, done, steps)` is called as each rank reports (from reader threads)."""
    port = free_port()
    procs = []
    for r in range(ranks):
        env = {**os.environ, **rank_environment(r, ranks, port)}
        # torch reads this at start; the CPU ranks' own setting follows threads_per_rank.
        env.setdefault("OMP_NUM_THREADS", str(max(1, cores() // ranks)))
        code = f"from gputrace.demo import rank_main; rank_main({out_dir!r}, {steps})"
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True))
    last_lines: list[list[str]] = [[] for _ in procs]
    readers = [
        threading.Thread(target=_read_rank, args=(r, p.stderr, last_lines[r], progress), daemon=True)
        for r, p in enumerate(procs)
    ]
    for t in readers:
        t.start()
    deadline = time.monotonic() + timeout_s
    failed = []
    for r, p in enumerate(procs):
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise GputraceError(f"demo rank {r} did not finish in {timeout_s:.0f} s") from None
        readers[r].join()
        if p.returncode != 0:
            last = last_lines[r][-1] if last_lines[r] else ""
            failed.append(f"rank {r} exited with {p.returncode}: {last}")
    if failed:
        raise GputraceError("; ".join(failed))
    return [os.path.join(out_dir, f"trace_rank{r}.json") for r in range(ranks)]


def _read_rank(
    rank: int, stream: IO[str] | None, last: list[str], progress: Callable[[int, int, int], None] | None
) -> None:
    """Hand a rank's progress lines to `progress`; keep its other stderr lines (the last few)
    for an error message."""
    if stream is None:
        return
    for line in stream:
        parts = line.split()
        if len(parts) == 3 and parts[0] == _PROGRESS:
            if progress is not None:
                progress(rank, int(parts[1]), int(parts[2]))
        elif line.strip():
            last.append(line.strip())
            del last[:-20]


def rank_environment(rank: int, world: int, port: int) -> dict[str, str]:
    """The variables torchrun gives each rank of a one-host run."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
