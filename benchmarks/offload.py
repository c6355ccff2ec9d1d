"""Step time of a stage offloaded to local disk (``offload: W``) against the same stage in memory.

One stage of ``--layers`` blocks (``Linear(width, width)`` then ``Tanh``) with Adam, run by the
runtime's ``StageModule`` in one process (no Lightning, no process group: the offload cost alone):
per step, ``--micro-batches`` forwards and backwards of ``--rows`` rows each, one after the other
as a single-stage pipeline runs them, then the optimizer step (layer by layer when offloaded).
Every variant starts from the same weights and batches; the variants take turns step by step
(in memory, W=1, W=2, W=4, in memory, ...) so that a drift in the machine's load falls on all of
them alike; the table gives each one's median step after ``--warmup`` steps, and the stage's
peak parameter + gradient + optimizer-state bytes as the offloader counted them (storage scan).

    python benchmarks/offload.py
    python benchmarks/offload.py --layers 8 --width 1024 --rows 64 --micro-batches 4 --steps 12
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

from dapple_lightning.runtime import StageModule


def stage(layers: int, width: int, window: int | None) -> tuple[StageModule, torch.optim.Optimizer]:
    torch.manual_seed(0)
    blocks = [(str(i), nn.Sequential(nn.Linear(width, width), nn.Tanh())) for i in range(layers)]
    module = StageModule(copy.deepcopy(blocks), offload=window)
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-4)
    if module.offload is not None:
        module.offload.attach([optimizer])
    return module, optimizer


def one_step(module: StageModule, optimizer: torch.optim.Optimizer, batches: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    offload = module.offload
    if offload is not None:
        offload.begin()
    for x in batches:
        module(x).pow(2).mean().backward()
    if offload is not None:
        offload.finish()
        offload.step(optimizer, optimizer.step)
    else:
        optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--windows", default="1,2,4")
    args = parser.parse_args()
    torch.set_num_threads(1)
    windows: list[int | None] = [None, *(int(w) for w in args.windows.split(","))]
    variants = {w: stage(args.layers, args.width, w) for w in windows}
    g = torch.Generator().manual_seed(1)
    times: dict[int | None, list[float]] = {w: [] for w in windows}
    for _ in range(args.steps):
        batches = [torch.randn(args.rows, args.width, generator=g) for _ in range(args.micro_batches)]
        for w in windows:
            times[w].append(one_step(*variants[w], batches))
    reference = dict(variants[None][0].state_dict())
    layer_bytes = 4 * sum(p.numel() * p.element_size() for p in variants[None][0][0].parameters())
    print(
        f"{args.layers} layers of Linear({args.width}, {args.width}) + Tanh, Adam, {args.micro_batches} x {args.rows} rows"
    )
    print(
        f"one layer's parameters + gradients + Adam state: {layer_bytes / 2**20:.1f} MiB; stage: {args.layers * layer_bytes / 2**20:.1f} MiB"
    )
    print("| variant | median step (s) | vs in memory | peak resident (MiB) | same weights |")
    print("|---|---|---|---|---|")
    base = statistics.median(times[None][args.warmup :])
    for w in windows:
        module, _ = variants[w]
        median = statistics.median(times[w][args.warmup :])
        if module.offload is None:
            peak, same = args.layers * layer_bytes, "-"
        else:
            peak = module.offload.residency.peak_storage
            module.offload.close()
            same = all(torch.equal(module.state_dict()[k], v) for k, v in reference.items())
        name = "in memory" if w is None else f"offload, window {w}"
        print(f"| {name} | {median:.3f} | {median / base:.2f}x | {peak / 2**20:.1f} | {same} |")


if __name__ == "__main__":
    main()
