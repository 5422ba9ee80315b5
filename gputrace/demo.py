"""The main job: train a small transformer-like model for a few seconds with nested spans,
on the GPU when there is one and the CPU otherwise, and write its trace.

Takes: an output directory and a step count. Gives: `trace_rank{R}.json` in that directory.
"""

from __future__ import annotations

import os
from typing import Any

import gputrace


def build_model(torch: Any, width: int, depth: int, device: Any) -> Any:
    nn = torch.nn
    layer = nn.TransformerEncoderLayer(d_model=width, nhead=8, dim_feedforward=4 * width, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=depth, enable_nested_tensor=False).to(device)


def run(out_dir: str, steps: int = 20, seed: int = 0) -> str:
    """Record `steps` training steps and save the trace; returns the file written."""
    import torch

    torch.manual_seed(seed)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    width, depth, batch, seq = (512, 4, 32, 256) if cuda else (128, 2, 8, 64)
    model = build_model(torch, width, depth, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    side = torch.cuda.Stream() if cuda else None
    host_batch = torch.randn(batch, seq, width).pin_memory() if cuda else torch.randn(batch, seq, width)

    gputrace.enable()
    for step in range(steps):
        with gputrace.span("step", step=step):
            with gputrace.span("data"):
                if side is not None:
                    # The next batch copies in on a second stream while this one computes.
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
            with gputrace.span("optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)
        gputrace.flush()
    return gputrace.save(out_dir)
