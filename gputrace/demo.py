"""The main job: train a small transformer-like model for a few seconds with nested spans, on
the GPU when there is one and the CPU otherwise, and write its traces.

Takes: an output directory, a step count and a number of ranks. Gives: `trace_rank{R}.json`
per rank (and, with several ranks, `merged.json`, with clocks synced through torch.distributed).
With several ranks the last one is made slower on purpose (a straggler: more data per step), so
that `gputrace summary` has something to find.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Any

import gputrace
from gputrace.errors import GputraceError


def build_model(torch: Any, width: int, depth: int, device: Any) -> Any:
    nn = torch.nn
    layer = nn.TransformerEncoderLayer(d_model=width, nhead=8, dim_feedforward=4 * width, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=depth, enable_nested_tensor=False).to(device)


def train(out_dir: str, steps: int, distributed: bool = False) -> str:
    """Record `steps` training steps in this process and save its trace; returns the file."""
    import torch

    rank, world = 0, 1
    cuda = torch.cuda.is_available()
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
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    side = torch.cuda.Stream() if cuda else None
    comm = torch.cuda.Stream() if cuda and distributed else None
    host_batch = torch.randn(batch, seq, width)
    if cuda:
        host_batch = host_batch.pin_memory()

    gputrace.enable()
    if distributed:
        gputrace.sync_clocks()
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
            with gputrace.span("optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)
        gputrace.flush()
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


def run_ranks(out_dir: str, steps: int, ranks: int, timeout_s: float = 600) -> list[str]:
    """Start `ranks` real processes (gloo on CPU, NCCL with enough GPUs); returns their traces."""
    port = free_port()
    procs = []
    for r in range(ranks):
        env = {**os.environ, **rank_environment(r, ranks, port)}
        code = f"from gputrace.demo import train; train({out_dir!r}, {steps}, distributed=True)"
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True))
    failed = []
    for r, p in enumerate(procs):
        try:
            _, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise GputraceError(f"demo rank {r} did not finish in {timeout_s:.0f} s") from None
        if p.returncode != 0:
            failed.append(f"rank {r} exited with {p.returncode}: {err.strip().splitlines()[-1] if err.strip() else ''}")
    if failed:
        raise GputraceError("; ".join(failed))
    return [os.path.join(out_dir, f"trace_rank{r}.json") for r in range(ranks)]


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
