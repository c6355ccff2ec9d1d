"""Step time of a stage offloaded to local disk (``offload: W``) against the same stage in memory.

One stage of ``--layers`` blocks (``Linear(width, width)`` then ``Tanh``) with Adam, run by the
runtime's ``StageModule`` in one process (no Lightning, no process group: the offload cost alone):
per step, ``--micro-batches`` forwards and backwards of ``--rows`` rows each, one after the other
as a single-stage pipeline runs them, then the optimizer step (layer by layer when offloaded).
Every variant starts from the same weights and batches; the variants take turns step by step
(in memory, W=1, W=2, W=4, in memory, ...) so that a drift in the machine's load falls on all of
them alike; the table gives each one's median step after ``--warmup`` steps, and the stage's
peak parameter + gradient + optimizer-state bytes as the offloader counted them (storage scan).

The variants are the stage in memory, windows 1, 2, 4, and ``auto`` (window 1 for the first step,
then the window chosen from what it measured; its median is over the steps after that).

``--largest MIB``: the deepest such stage (4, 8, 12, ... layers, up to ``--most``) whose peak
resident memory stays within MIB, in memory and offloaded with a window of 2 (``auto`` chooses for
speed, not memory, and may take a larger window). Each depth runs in
a fresh process: a one-layer stage of width 64 takes a step first (the libraries start lazily),
then the process's resident memory is the baseline; the stage is built (whole, in memory), one step
writes it out, the kernel's peak resident-set counter is reset (``/proc/self/clear_refs``), then
three steps run; the peak over them (``VmHWM``) less the baseline is the stage's. glibc is told to
serve blocks of 128 KiB and more from mmap (``MALLOC_MMAP_THRESHOLD_``), so that freed tensors leave
the resident set at once, in both variants.

    python benchmarks/offload.py
    python benchmarks/offload.py --layers 8 --width 1024 --rows 64 --micro-batches 4 --steps 12
    python benchmarks/offload.py --largest 256 --most 64
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from dapple_lightning.runtime import StageModule


def stage(layers: int, width: int, window: int | str | None) -> tuple[StageModule, torch.optim.Optimizer]:
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


def resident_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak(args: argparse.Namespace) -> None:
    """One depth, in this fresh process: print the stage's peak resident MiB over three steps."""
    window = None if args.peak_window == "none" else ("auto" if args.peak_window == "auto" else int(args.peak_window))
    warm, warm_optimizer = stage(1, 64, window)  # the libraries' lazy start, before the baseline
    one_step(warm, warm_optimizer, [torch.randn(2, 64)])
    if warm.offload is not None:
        warm.offload.close()
    del warm, warm_optimizer
    before = resident_mib("VmRSS")
    module, optimizer = stage(args.peak, args.width, window)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(args.rows, args.width, generator=g) for _ in range(args.micro_batches)]
    one_step(module, optimizer, batches)
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from now
    for _ in range(3):
        one_step(module, optimizer, batches)
    chosen = module.offload.choice.window if module.offload is not None and module.offload.choice else None
    print(json.dumps({"peak_mib": resident_mib("VmHWM") - before, "window": chosen}))


def largest(args: argparse.Namespace, window: int | str | None) -> tuple[int, dict[int, float]]:
    """The deepest stage within ``--largest`` MiB (4 layers at a time, up to ``--most``); each depth's peak."""
    seen: dict[int, float] = {}
    best = 0
    for layers in range(4, args.most + 1, 4):
        command = [sys.executable, __file__, "--peak", str(layers), "--peak-window", str(window).lower()]
        command += ["--width", str(args.width), "--rows", str(args.rows), "--micro-batches", str(args.micro_batches)]
        # Blocks of 128 KiB and more come from mmap and go back to the kernel when freed (glibc's threshold
        # otherwise grows, and the worker thread's arena keeps what it freed): resident is what is live.
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
        out = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True, env=env).stdout
        seen[layers] = json.loads(out.strip().splitlines()[-1])["peak_mib"]
        if seen[layers] > args.largest:
            break
        best = layers
    return best, seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--windows", default="1,2,4")
    parser.add_argument("--largest", type=float, default=None, help="per-stage budget in MiB")
    parser.add_argument("--most", type=int, default=64)
    parser.add_argument("--peak", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--peak-window", default="none", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.peak is not None:
        return peak(args)
    if args.largest is not None:
        print(
            f"Linear({args.width}, {args.width}) + Tanh layers, Adam, {args.micro_batches} x {args.rows} rows, "
            f"budget {args.largest:.0f} MiB"
        )
        print("| variant | largest depth within the budget | peak resident MiB by depth |")
        print("|---|---|---|")
        for window in (None, 2):  # a fixed window: "auto" chooses for speed and may take a larger one
            best, seen = largest(args, window)
            capped = " (the search's cap)" if best == args.most else ""
            name = "in memory" if window is None else f"offload, window {window}"
            print(f"| {name} | {best} layers{capped} | {', '.join(f'{n}: {v:.0f}' for n, v in seen.items())} |")
        return None
    timing(args)
    return None


def timing(args: argparse.Namespace) -> None:
    windows: list[int | str | None] = [None, *(int(w) for w in args.windows.split(",")), "auto"]
    variants = {w: stage(args.layers, args.width, w) for w in windows}
    g = torch.Generator().manual_seed(1)
    times: dict[int | str | None, list[float]] = {w: [] for w in windows}
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
        median = statistics.median(times[w][max(args.warmup, 1 if w == "auto" else 0) :])
        if module.offload is None:
            resident, same = args.layers * layer_bytes, "-"
        else:
            resident = module.offload.residency.peak_storage
            chosen = module.offload.choice
            module.offload.close()
            same = all(torch.equal(module.state_dict()[k], v) for k, v in reference.items())
        name = "in memory" if w is None else f"offload, window {w}"
        if w == "auto" and chosen is not None:
            name += f" (chose {chosen.window}{'' if chosen.hidden else ', stalls: ' + str(list(chosen.stalls))})"
        print(f"| {name} | {median:.3f} | {median / base:.2f}x | {resident / 2**20:.1f} | {same} |")


if __name__ == "__main__":
    main()
