"""The GPU check of issue 14: is dapple right on NCCL, and how fast, in one short run.

Prints one table. With one device: a 1-stage plan with M = 4 against single-device losses;
``plan="auto"`` (its profile's device, the plan it chose) and its predicted against its measured
peak memory per stage (``torch.cuda.max_memory_allocated`` on each rank; no such counter on CPU).
With two devices or more: the runtime tests' equivalence plans (``2x1``: two stages of one
replica; ``2:1`` with three devices) against single-device losses, dapple against
``torch.distributed.pipelining.Schedule1F1B`` on the same split (samples/s and their ratio), and
the bubble fraction per stage from dapple's trace (``DappleStrategy(trace=...)``).

    python benchmarks/gpu_check.py                   # every GPU there is, NCCL
    python benchmarks/gpu_check.py --device cpu      # the same table on CPU processes, gloo

The model is a Sequential of Linear+Tanh blocks (small on CPU, wide on GPU); every run trains
a few steps of SGD on fixed random data, so a full run stays within minutes.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from benchmarks.runtime import load_trace  # noqa: E402
from dapple_lightning import DappleStrategy, Plan  # noqa: E402
from dapple_lightning.planner import estimate  # noqa: E402
from dapple_lightning.runtime import bubble_fractions  # noqa: E402

SIZES = {"cpu": (64, 8, 32), "cuda": (2048, 8, 256)}
"""Width, Linear+Tanh blocks and batch rows, per device kind."""
TOLERANCE = {"cpu": 1e-5, "cuda": 1e-4}
"""Relative tolerance on losses: GPU kernels sum in an order that depends on the batch's split."""


class Blocks(LightningModule):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*(m for _ in range(blocks) for m in (nn.Linear(width, width), nn.Tanh())))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.layers(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def loader(width: int, rows: int, steps: int) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(rows * steps, width, generator=g), torch.randn(rows * steps, width, generator=g))
    return DataLoader(data, batch_size=rows, shuffle=False)


class Clock(Callback):
    """Rank 0 writes the seconds of each step after the first ``skip`` and its peak memory."""

    def __init__(self, out: Path, skip: int) -> None:
        self.out, self.skip, self.times, self.last = out, skip, [], 0.0

    def on_train_start(self, trainer, pl_module) -> None:
        # Training's peak, not setup's: plan="auto" profiles and runs trials before this.
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)
        self.last = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)
        if batch_idx >= self.skip:
            self.times.append(time.perf_counter() - self.last)

    def on_train_end(self, trainer, pl_module) -> None:
        device = trainer.strategy.root_device
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else -1
        rank = trainer.global_rank
        (self.out / f"peak{rank}.txt").write_text(str(peak))
        if rank == 0:
            (self.out / "times.txt").write_text(" ".join(map(str, self.times)))
            chosen = getattr(trainer.strategy, "auto_plan", None)  # the spawned ranks' strategy, not the parent's
            if chosen is not None:
                torch.save(chosen, self.out / "auto.pt")


def fit(args, out: Path, plan: Plan | str | None, devices: int, *, steps: int, trace: str | None = None) -> dict:
    """Train ``Blocks`` under dapple with ``plan`` (a Plan or ``"auto"``; ``None``: Lightning on one
    device, the reference); what rank 0 saw."""
    width, blocks, rows = SIZES[args.kind]
    out.mkdir(parents=True, exist_ok=True)
    strategy = "auto" if plan is None else DappleStrategy(plan, start_method="spawn", trace=trace)
    model = Blocks(width, blocks)
    trainer = Trainer(
        accelerator="gpu" if args.kind == "cuda" else "cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        logger=CSVLogger(out, name="run", version=0),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[Clock(out, skip=1)],
    )
    trainer.fit(model, loader(width, rows, steps))
    lines = (out / "run" / "version_0" / "metrics.csv").read_text().splitlines()
    column = lines[0].split(",").index("train_loss")
    losses = [float(row.split(",")[column]) for row in lines[1:] if row.split(",")[column]]
    times = [float(t) for t in (out / "times.txt").read_text().split()]
    peaks = [int((out / f"peak{r}.txt").read_text()) for r in range(devices)]
    auto = torch.load(out / "auto.pt", weights_only=False) if (out / "auto.pt").exists() else None
    return {"losses": losses, "step_s": sorted(times)[len(times) // 2] if times else None, "peaks": peaks, "auto": auto}


def _same(got: list[float], want: list[float], rtol: float) -> tuple[bool, str]:
    worst = max((abs(g - w) / max(abs(w), 1e-12) for g, w in zip(got, want)), default=float("inf"))
    ok = len(got) == len(want) and worst <= rtol
    return ok, f"{len(got)} losses, worst relative difference {worst:.1e}"


def one_device(args, tmp: Path, reference: list[float]) -> list[tuple[str, str, str]]:
    rows = []
    plan = Plan.data_parallel(2 * args.blocks_layers, 1, micro_batches=4)
    got = fit(args, tmp / "m4", plan, 1, steps=args.steps)
    ok, detail = _same(got["losses"], reference, TOLERANCE[args.kind])
    rows.append(("1 device, 1 stage, M=4 = single device", "yes" if ok else "NO", detail))
    auto = fit(args, tmp / "auto", "auto", 1, steps=args.steps)
    rows += _auto_rows(args, auto, reference)
    return rows


def _auto_rows(args, run: dict, reference: list[float]) -> list[tuple[str, str, str]]:
    chosen = run["auto"]
    ok, detail = _same(run["losses"], reference, TOLERANCE[args.kind])
    rows = [(f"plan='auto' on {chosen.cluster.world_size} = single device", "yes" if ok else "NO", detail)]
    rows.append(("  auto profiled on", chosen.profile.device, chosen.plan.describe()))
    batch = SIZES[args.kind][2]
    predicted = estimate(chosen.plan, chosen.profile, chosen.cluster, batch, optimizer_factor=1.0).memory_bytes
    for stage, bytes_ in enumerate(predicted):
        ranks = chosen.plan.stage_ranks(stage)
        measured = max(run["peaks"][r] for r in ranks)
        shown = "n/a (no allocator counter)" if measured < 0 else f"{measured / 2**20:.1f} MiB measured"
        rows.append((f"  stage {stage} peak memory", f"{bytes_ / 2**20:.1f} MiB predicted", shown))
    return rows


def _torch_1f1b(rank: int, world: int, args, port: int, out: str) -> None:
    """One stage of ``Schedule1F1B`` on the same 2-stage split as dapple's ``2x1``."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = args.kind == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    width, blocks, rows = SIZES[args.kind]
    layers = Blocks(width, blocks).layers
    half = len(layers) // 2
    local = (layers[:half] if rank == 0 else layers[half:]).to(device)
    stage = PipelineStage(local, rank, 2, device)
    schedule = Schedule1F1B(stage, n_microbatches=args.micro_batches, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.SGD(local.parameters(), lr=0.05, momentum=0.9)
    times = []
    for step, (x, y) in enumerate(loader(width, rows, args.steps)):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        schedule.step(x.to(device)) if rank == 0 else schedule.step(target=y.to(device))
        opt.step()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize(device)
        if step >= 1:
            times.append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(str(sorted(times)[len(times) // 2]))
    dist.destroy_process_group()


def two_devices(args, tmp: Path, reference: list[float]) -> list[tuple[str, str, str]]:
    import torch.multiprocessing as mp

    from benchmarks._harness import free_port

    layers = 2 * args.blocks_layers
    half = layers // 2
    rows = []
    straight = Plan.straight(layers, 2, micro_batches=args.micro_batches)
    trace = str(tmp / "trace.json")
    run = fit(args, tmp / "2x1", straight, 2, steps=args.steps, trace=trace)
    ok, detail = _same(run["losses"], reference, TOLERANCE[args.kind])
    rows.append(("2 stages 1:1 (2x1) = single device", "yes" if ok else "NO", detail))
    if args.devices >= 3:
        plan = Plan(
            stages=[{"layers": [0, half], "replicas": 2}, {"layers": [half, layers], "replicas": 1}],
            micro_batches=args.micro_batches,
        )
        ok, detail = _same(fit(args, tmp / "2-1", plan, 3, steps=args.steps)["losses"], reference, TOLERANCE[args.kind])
        rows.append(("2 stages 2:1 = single device", "yes" if ok else "NO", detail))
    out = tmp / "torch.txt"
    mp.spawn(_torch_1f1b, args=(2, args, free_port(), str(out)), nprocs=2, join=True)
    theirs = float(out.read_text())
    batch = SIZES[args.kind][2]
    ours = run["step_s"]
    rows.append(
        (
            "dapple vs torch Schedule1F1B, same split",
            f"{(batch / ours) / (batch / theirs):.2f}x",
            f"dapple {batch / ours:.0f} samples/s, torch {batch / theirs:.0f} samples/s (M={args.micro_batches})",
        )
    )
    events = [e for e in load_trace(trace) if e.step >= 1]
    bubbles = bubble_fractions(events)
    bound = 1 / (args.micro_batches + 1)
    detail = f"(S-1)/(M+S-1) = {bound:.1%} for equal stages"
    rows.append(
        ("bubble fraction from the trace", ", ".join(f"stage {s}: {b:.1%}" for s, b in bubbles.items()), detail)
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--devices", type=int, default=None, help="devices to use (default: every GPU; 3 on CPU)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--micro-batches", type=int, default=4)
    args = parser.parse_args()
    args.kind = args.device
    if args.kind == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here; run with --device cpu for the same table on CPU processes")
    args.devices = args.devices or (torch.cuda.device_count() if args.kind == "cuda" else 3)
    args.blocks_layers = SIZES[args.kind][1]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dapple-gpu-check-") as tmp:
        reference = fit(args, Path(tmp, "single"), None, 1, steps=args.steps)
        rows = one_device(args, Path(tmp), reference["losses"])
        if args.devices >= 2:
            rows += two_devices(args, Path(tmp), reference["losses"])
        else:
            rows.append(("2 or more devices", "skipped", f"{args.devices} device here"))
    name = torch.cuda.get_device_name(0) if args.kind == "cuda" else "CPU processes, gloo"
    print(f"\nGPU check on {name}, {args.devices} device(s), torch {torch.__version__}")
    width = max(len(r[0]) for r in rows)
    print(f"| {'check':{width}} | result | detail |\n|{'-' * (width + 2)}|---|---|")
    for check, result, detail in rows:
        print(f"| {check:{width}} | {result} | {detail} |")
    print(f"\n{time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    main()
