"""The Llama example's step time: dapple plans against Lightning DDP, on 2 CPU processes.

The model and data are the example's defaults (``examples/llama.py``: ``transformers``'
``LlamaForCausalLM`` with 4 decoder layers of width 128, character-level KJV text, global batch
32 x 64 tokens, AdamW). Systems:

    ddp           Lightning ``strategy="ddp"``, 2 processes, 16 rows each
    dp            ``DappleStrategy``: one stage of every layer on 2 replicas (dapple's data parallelism)
    pipe2-mM      a straight 2-stage pipeline of the decoder layers, [0, 2) | [2, 4), M micro-batches
    pipe2-c1, -c3 the same at M=4 with the cut after layer 1 or 3

Rounds alternate: each round starts every system once (fresh processes, order rotated per round)
for ``warmup + steps`` optimizer steps; rank 0 times each step as the wall time between the ends
of consecutive optimizer steps. A system's number is the median over rounds of its per-round
median over the steps after warm-up. One thread per process.

    python benchmarks/llama.py                      # 3 rounds x 5 steps (+2 warm-up), about 6 minutes
    python benchmarks/llama.py --quick              # 1 round x 2 steps
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

if "--worker" in sys.argv:  # before torch is imported: one intra-op thread per worker
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "examples"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from benchmarks import _harness  # noqa: E402
from benchmarks._harness import counter_per_step, median, other_load, step_times, timed_trainer, write_record  # noqa: E402

BATCH, LAYERS = 32, 4
PLANS = {  # name -> (micro_batches, stages as (start, end, replicas))
    "dp": (1, [(0, LAYERS, 2)]),
    "pipe2-m2": (2, [(0, 2, 1), (2, LAYERS, 1)]),
    "pipe2-m4": (4, [(0, 2, 1), (2, LAYERS, 1)]),
    "pipe2-m8": (8, [(0, 2, 1), (2, LAYERS, 1)]),
    "pipe2-c1": (4, [(0, 1, 1), (1, LAYERS, 1)]),
    "pipe2-c3": (4, [(0, 3, 1), (3, LAYERS, 1)]),
}
SYSTEMS = ("ddp", *PLANS)


def example(batch_size: int) -> tuple[Any, Any]:
    """The Llama example's model and data at its default sizes (``conf/model/llama.yaml``)."""
    from gpt_model import CharData
    from lightning.pytorch import seed_everything
    from llama_model import CharLlama

    seed_everything(1234)
    data = CharData(ROOT / "examples/data/kjv_genesis_to_numbers.txt", context=64, batch_size=batch_size, seed=1234)
    model = CharLlama(
        vocab_size=len(data.vocab),
        context=64,
        n_layers=LAYERS,
        hidden_size=128,
        intermediate_size=344,
        n_heads=4,
        n_kv_heads=2,
        lr=3e-3,
        weight_decay=0.1,
    )
    return model, data


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if args.worker == "ddp":
        strategy: Any = "ddp"
        model, data = example(BATCH // 2)  # the injected DistributedSampler gives each rank half the rows
    else:
        from dapple_lightning import DappleStrategy

        micro_batches, stages = PLANS[args.worker]
        plan = {
            "micro_batches": micro_batches,
            "stages": [{"layers": [a, b], "replicas": n} for a, b, n in stages],
        }
        strategy = DappleStrategy(plan, sequential="model.model.layers", start_method="popen")
        model, data = example(BATCH)  # every rank reads the global batch
    trainer, timer = timed_trainer(strategy, 2, args.total_steps)
    trainer.fit(model, datamodule=data)
    write_record(trainer.global_rank, dict(timer.rec.data))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per system per round (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first, at least 1 (default 2)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ",".join(SYSTEMS))
    parser.add_argument("--timeout", type=float, default=300, help="seconds before one launch is killed")
    parser.add_argument("--quick", action="store_true", help="1 round, 2 timed steps, 1 warm-up")
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--total-steps", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 2, 1
    args.warmup = max(args.warmup, 1)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if unknown := set(systems) - set(SYSTEMS):
        parser.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    total = args.warmup + args.steps
    print(f"# llama benchmark: {os.cpu_count()} CPUs, 2 processes x 1 thread, batch {BATCH}x64", flush=True)
    wall: dict[str, list[float]] = {s: [] for s in systems}
    cpu: dict[str, list[float]] = {s: [] for s in systems}
    for r in range(args.rounds):
        for system in systems[r % len(systems) :] + systems[: r % len(systems)]:
            command = ["--worker", system, "--total-steps", str(total)]
            try:
                records = _harness.launch(__file__, command, 2, timeout=args.timeout, what=system)
            except RuntimeError as e:
                print(f"round {r}: {e}", file=sys.stderr, flush=True)
                continue
            periods, _ = step_times(records[0], args.warmup)
            wall[system].append(median(periods))
            cpu[system].append(counter_per_step(records, "cpu", args.warmup))
            print(
                f"round {r}  {system:<9} median {wall[system][-1]:.3f} s/step  "
                f"steps {' '.join(f'{p:.3f}' for p in periods)}  other load {other_load(records, args.warmup):.2f} cores",
                flush=True,
            )
    print_table(systems, wall, cpu)


def print_table(systems: list[str], wall: dict[str, list[float]], cpu: dict[str, list[float]]) -> None:
    timed = {s: median(wall[s]) for s in systems if wall[s]}
    pipes = [s for s in timed if s.startswith("pipe2")]
    best = min((s for s in timed if s != "ddp"), key=timed.get, default=None)
    best_pipe = min(pipes, key=timed.get, default=None)
    print("\n| system | s/step (median) | min-max over rounds | samples/s | vs DDP | CPU s/step, both ranks |")
    print("|---|---|---|---|---|---|")
    for s in systems:
        if s not in timed:
            print(f"| {s} | failed | | | | |")
            continue
        marks = " (best plan)" * (s == best) + " (best straight pipeline)" * (s == best_pipe)
        ratio = f"{timed[s] / timed['ddp']:.2f}" if "ddp" in timed else ""
        print(
            f"| {s}{marks} | {timed[s]:.3f} | {min(wall[s]):.3f}-{max(wall[s]):.3f} | {BATCH / timed[s]:.1f} "
            f"| {ratio} | {median(cpu[s]):.3f} |"
        )


if __name__ == "__main__":
    main()
