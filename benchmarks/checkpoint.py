"""Checkpoint benchmark: saving about 1 GB of state on 3 CPU ranks, dapple's saves against Lightning DDP's.

The model is one ``nn.Sequential`` of 6 ``Linear(3712, 3712)`` layers (82.7M fp32 parameters)
trained with AdamW, so weights and the two moments make 0.99 GB of checkpoint state. Every
configuration trains it 2 steps on tiny synthetic batches (12 rows), then, in a callback's
``on_train_end`` (still inside ``fit``, with the model partitioned), calls
``trainer.save_checkpoint`` on every rank ``warmup + saves`` times; each save goes to a fresh
path under ``--dir`` and is deleted after it is measured. The layers are wide so that every
weight and moment (55 MB) is above glibc's largest ``mmap`` threshold (32 MiB): freed tensors go
back to the system, and a save's peak never reuses memory the save before it left behind.

    dapple-before         the code at commit 230e227, run with ``--before PATH`` (a checkout of
                          it, put first on ``sys.path``): rank 0 gathers every owner's state
                          with ``gather_object``, then Lightning's ``torch.save``
    dapple-full           ``DappleStrategy(plan)``: rank 0 streams one file record by record
    dapple-sharded        ``DappleStrategy(plan, state_dict_type="sharded")``: a DCP directory
    dapple-full-async     ``DappleStrategy(plan, async_save=True)``
    dapple-sharded-async  ``DappleStrategy(plan, state_dict_type="sharded", async_save=True)``
    ddp                   ``Trainer(strategy="ddp")``: every rank holds the whole model, rank 0 writes

The dapple plan is 2:1, micro-batches 2: stage 0 (layers 0-2) on ranks 0 and 1, stage 1
(layers 3-5) on rank 2. Rank 0 is stage 0's first replica, so it owns (and writes) half of the
state itself and, in a full save, receives the other half from rank 2; rank 1 owns nothing.

Measured per save, on every rank (the table shows rank 0's, and the median peak of ranks 1 and 2):

* save: wall time from the call to the file or directory being complete (for an asynchronous
  save, until ``strategy.wait_for_checkpoint()`` returns);
* blocked: wall time until ``trainer.save_checkpoint`` returns (Lightning ends it with a barrier
  of all ranks), i.e. how long training waits;
* peak extra memory: ``VmHWM`` after the save (after ``wait_for_checkpoint()`` for asynchronous saves) minus
  ``VmRSS`` before it, with the high-water mark reset right before the save by writing ``5`` to
  ``/proc/self/clear_refs`` (Linux; the script checks that the reset works first);
* CPU seconds of the save, summed over the ranks (all threads).

dapple's saves ``fsync`` what they write (the file, or DCP's ``sync_files=True``); Lightning's
``TorchCheckpointIO`` does not, so DDP's save may return with the file still in the page cache.

Ranks start together (a barrier before each save). Each launch is a fresh set of processes,
started as ``torchrun`` would (see ``benchmarks/_harness.py``), one thread per rank; launches
rotate their order every round. The file sizes are what the save left on disk.

    git worktree add /tmp/ckpt-before 230e227
    python benchmarks/checkpoint.py --before /tmp/ckpt-before
    git worktree remove /tmp/ckpt-before
    python benchmarks/checkpoint.py --configs dapple-full,ddp --rounds 1 --saves 1   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if "--worker" in sys.argv:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _harness  # noqa: E402
from benchmarks._harness import median, write_record  # noqa: E402

WIDTH, LAYERS = 3712, 6
BATCH, STEPS, MICRO_BATCHES = 12, 2, 2
WORLD = 3
PLAN = {
    "micro_batches": MICRO_BATCHES,
    "stages": [{"layers": [0, 3], "replicas": 2}, {"layers": [3, LAYERS], "replicas": 1}],
}
CONFIGS = ("dapple-before", "dapple-full", "dapple-sharded", "dapple-full-async", "dapple-sharded-async", "ddp")
OPTIONS: dict[str, dict[str, Any]] = {
    "dapple-before": {},
    "dapple-full": {"state_dict_type": "full"},
    "dapple-sharded": {"state_dict_type": "sharded"},
    "dapple-full-async": {"state_dict_type": "full", "async_save": True},
    "dapple-sharded-async": {"state_dict_type": "sharded", "async_save": True},
}
NAMES = {
    "dapple-before": "dapple full, before streaming (230e227)",
    "dapple-full": "dapple full (streaming)",
    "dapple-sharded": "dapple sharded",
    "dapple-full-async": "dapple full, async",
    "dapple-sharded-async": "dapple sharded, async",
    "ddp": "Lightning DDP",
}
MIB = 2**20


# ============================================================================ workers


def memory_status() -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            key, value = line.split(":")
            out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak() -> None:
    """Reset ``VmHWM`` to the current ``VmRSS`` (Linux 4.0+)."""
    Path("/proc/self/clear_refs").write_text("5")


def build(batches: int):
    """The LightningModule and a loader of ``batches`` synthetic batches of ``batch_size`` rows."""
    import torch
    from lightning.pytorch import LightningModule
    from torch import nn

    class BigMLP(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layers = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.layers(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(batches * BATCH, WIDTH, generator=g)
    y = torch.randn(batches * BATCH, WIDTH, generator=g)
    return BigMLP(), (x, y)


def size_on_disk(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size if path.exists() else 0


def saver(args: argparse.Namespace, record: dict[str, Any]):
    """A callback that saves ``warmup + saves`` times at the end of training and records each save."""
    import lightning.pytorch as pl

    class Saver(pl.Callback):
        def on_train_end(self, trainer, pl_module) -> None:
            strategy = trainer.strategy
            wait = getattr(strategy, "wait_for_checkpoint", None)  # dapple after 230e227: async saves
            rank = trainer.global_rank
            for i in range(args.warmup + args.saves):
                path = Path(args.dir) / f"{args.worker}-{i}.ckpt"
                strategy.barrier()
                reset_peak()
                before = memory_status()["VmRSS"]
                cpu, t0 = time.process_time(), time.perf_counter()
                trainer.save_checkpoint(path)
                t1 = time.perf_counter()
                if wait is not None:
                    wait()
                t2 = time.perf_counter()
                peak = memory_status()["VmHWM"]
                cpu = time.process_time() - cpu
                strategy.barrier()
                if rank == 0:
                    record.setdefault("bytes", []).append(size_on_disk(path))
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
                if i < args.warmup:
                    continue
                for key, value in (
                    ("blocked", t1 - t0),
                    ("save", t2 - t0),
                    ("extra", peak - before),
                    ("rss_before", before),
                    ("cpu", cpu),
                ):
                    record.setdefault(key, []).append(value)

    return Saver()


def run_worker(args: argparse.Namespace) -> None:
    if args.before:
        sys.path.insert(0, str(Path(args.before).resolve()))  # the old dapple_lightning wins
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(1)
    module, (x, y) = build(STEPS)
    if args.worker == "ddp":
        strategy: Any = "ddp"
        batch_size = BATCH // WORLD  # the injected DistributedSampler splits the rows among ranks
    else:
        import dapple_lightning
        from dapple_lightning import DappleStrategy

        strategy = DappleStrategy(PLAN, start_method="popen", **OPTIONS[args.worker])
        batch_size = BATCH  # the plan acts as one device: every rank sees the global batch
    record: dict[str, Any] = {}
    trainer = _harness.bare_trainer(strategy, WORLD, STEPS, [saver(args, record)])
    trainer.fit(module, train_dataloaders=DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False))
    if args.worker != "ddp":
        record["dapple_lightning"] = str(Path(dapple_lightning.__file__).parent)
    write_record(trainer.global_rank, record)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# ======================================================================= orchestration


def check_peak_reset() -> None:
    """Refuse to run where writing ``5`` to ``clear_refs`` does not reset ``VmHWM``."""
    block = b"\x01" * (256 * MIB)  # touched, so resident
    del block
    reset_peak()
    status = memory_status()
    if status["VmHWM"] - status["VmRSS"] > 64 * MIB:
        sys.exit("this kernel does not reset VmHWM through /proc/self/clear_refs; peak memory cannot be measured")


def summary(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    if not values:
        return "failed"
    v = [x / scale for x in values]
    return f"{median(v):.{digits}f} ({min(v):.{digits}f}-{max(v):.{digits}f})"


def pick(runs: list[list[dict[str, Any]]], key: str) -> list[float]:
    """Rank 0's values of ``key`` over all launches."""
    return [v for run in runs for v in run[0].get(key, [])]


def table(results: dict[str, list[list[dict[str, Any]]]], configs: list[str]) -> str:
    """The markdown table: medians over every measured save, (min-max) beside them."""
    lines = [
        "| save | on disk, GB | save, s | blocked, s | rank 0 peak extra, MiB | rank 1 / rank 2 peak extra, MiB "
        "| CPU s, all ranks |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in configs:
        runs = results[c]
        if not runs:
            lines.append(f"| {NAMES[c]} | failed | | | | | |")
            continue
        saves = [(run, i) for run in runs for i in range(len(run[0]["save"]))]
        cpu = [sum(run[k]["cpu"][i] for k in range(WORLD)) for run, i in saves]
        size = median([b for run in runs for b in run[0]["bytes"]]) / 1e9
        others = " / ".join(f"{median([run[k]['extra'][i] for run, i in saves]) / MIB:.0f}" for k in range(1, WORLD))
        lines.append(
            f"| {NAMES[c]} | {size:.2f} | {summary(pick(runs, 'save'))} | {summary(pick(runs, 'blocked'))} "
            f"| {summary(pick(runs, 'extra'), MIB, 0)} | {others} | {summary(cpu, digits=1)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default=None, help="checkout of commit 230e227 (adds the dapple-before row)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ",".join(CONFIGS))
    parser.add_argument("--rounds", type=int, default=2, help="launches of each configuration, interleaved (2)")
    parser.add_argument("--saves", type=int, default=3, help="measured saves per launch (3)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured saves first in each launch (1)")
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a new directory in /tmp)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds before one launch is killed")
    parser.add_argument("--json", default=None, help="also write every rank's measurements to this JSON file")
    parser.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configurations {sorted(unknown)}; choose from {', '.join(CONFIGS)}")
    if "dapple-before" in configs and not args.before:
        configs.remove("dapple-before")
        print("# no --before checkout given: skipping dapple-before", flush=True)
    check_peak_reset()
    made = args.dir is None
    directory = Path(tempfile.mkdtemp(prefix="dapple-ckpt-bench-", dir="/tmp") if made else args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if free < 4e9:
        sys.exit(f"only {free / 1e9:.1f} GB free under {directory}; the benchmark needs 4 GB")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    print(
        f"# checkpoint benchmark: {os.cpu_count()} CPUs, {WORLD} ranks x 1 thread, {LAYERS} x Linear({WIDTH}, "
        f"{WIDTH}) + AdamW, plan 2:1, {args.rounds} round(s) x {args.saves} saves (+{args.warmup} warm-up), "
        f"HEAD {head.stdout.strip()}, writing to {directory} ({free / 1e9:.0f} GB free)",
        flush=True,
    )
    t_start = time.monotonic()
    results: dict[str, list[list[dict[str, Any]]]] = {c: [] for c in configs}
    worker_args = ["--dir", str(directory), "--saves", str(args.saves), "--warmup", str(args.warmup)]
    try:
        for r in range(args.rounds):
            for c in configs[r % len(configs) :] + configs[: r % len(configs)]:
                extra = ["--before", args.before] if c == "dapple-before" else []
                t, load = time.monotonic(), os.getloadavg()[0]
                try:
                    records = _harness.launch(
                        __file__, ["--worker", c, *worker_args, *extra], WORLD, timeout=args.timeout, what=c
                    )
                except RuntimeError as e:
                    print(f"round {r}: {e}", file=sys.stderr, flush=True)
                    continue
                results[c].append(records)
                r0 = records[0]
                print(
                    f"round {r}  {c:<21} save {' '.join(f'{v:.2f}' for v in r0['save'])} s  "
                    f"blocked {' '.join(f'{v:.2f}' for v in r0['blocked'])} s  "
                    f"rank 0 extra {' '.join(f'{v / MIB:.0f}' for v in r0['extra'])} MiB  "
                    f"rss before {' '.join(f'{v / MIB:.0f}' for v in r0['rss_before'])} MiB  "
                    f"({time.monotonic() - t:.0f} s, loadavg {load:.1f}; {r0.get('dapple_lightning', 'lightning')})",
                    flush=True,
                )
    finally:
        if made:
            shutil.rmtree(directory, ignore_errors=True)
    print()
    print(table(results, configs))
    print(f"\n# total {time.monotonic() - t_start:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
