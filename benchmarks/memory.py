"""The planner's memory model on this machine: predicted against measured peak memory per rank.

Two models, each trained for a few steps by Lightning on 2-4 CPU processes (one thread each)
under fixed plans, with Adam (its state is real memory the prediction must hold):

    transformer   the search benchmark's (embedding 512x256, 8 TransformerEncoderLayer(256, 4, 1024),
                  head to 512; 10 layers), global batch 16 x sequence 32
    vgg           the search benchmark's VGG-style CNN (4 blocks of two 3x3 convolutions + pooling,
                  32-64-128-256 channels, 32x32 images, Flatten, two 1024-wide dense layers,
                  classifier; 8 layers), global batch 32

**Measured**: each rank enters the live-bytes tracker (``planner.live_bytes``, what the
profile's CPU peaks come from) when training starts, after the strategy has cut the model and
built the optimizer, and leaves it when training ends; its peak is everything allocated during
the steps and alive at once (gradients, the optimizer's state from its first step, activations,
messages), to which the rank's parameters (allocated before) are added.

**Predicted**: ``planner.estimate(plan, profile, ...)``'s per-stage memory, from one profile of
the layers (``profile_layers`` on one process, with the same optimizer) at the plans' largest
micro-batch; every rank of a stage is compared with its stage's prediction.

    python benchmarks/memory.py                    # both models, every plan: a few minutes
    python benchmarks/memory.py --models vgg --plans "2|6 M=2"
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path
from typing import Any

if "--worker" in sys.argv:  # before torch is imported: one intra-op thread per rank
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._harness import bare_trainer, launch, write_record  # noqa: E402

MiB = 2**20


def _plan(cuts: list[int], layers: int, m: int, schedule: str = "dapple", replicas: list[int] | None = None) -> dict:
    bounds = [0, *cuts, layers]
    reps = replicas or [1] * (len(bounds) - 1)
    stages = [{"layers": [a, b], "replicas": r} for (a, b), r in zip(itertools.pairwise(bounds), reps)]
    return {"micro_batches": m, "schedule": schedule, "stages": stages}


MODELS: dict[str, dict[str, Any]] = {
    "transformer": {
        "batch": 16,
        "plans": {
            "5|5 M=2": _plan([5], 10, 2),
            "5|5 M=4": _plan([5], 10, 4),
            "5|5 M=4 gpipe": _plan([5], 10, 4, "gpipe"),
            "3|4|3 M=4": _plan([3, 7], 10, 4),
            "3|2|2|3 M=4": _plan([3, 5, 7], 10, 4),
            "dp x2 M=2": _plan([], 10, 2, replicas=[2]),
            "5|5 x2:2 M=2": _plan([5], 10, 2, replicas=[2, 2]),
        },
    },
    "vgg": {
        "batch": 32,
        "plans": {
            "2|6 M=2": _plan([2], 8, 2),
            "2|6 M=4": _plan([2], 8, 4),
            "2|6 M=4 gpipe": _plan([2], 8, 4, "gpipe"),
            "1|2|5 M=4": _plan([1, 3], 8, 4),
            "dp x2 M=2": _plan([], 8, 2, replicas=[2]),
        },
    },
}


# ============================================================================ models


def build(model: str, steps: int) -> tuple[Any, Any]:
    """The LightningModule (with Adam) and a loader of ``steps`` global batches."""
    import torch

    from benchmarks import search_models

    batch = MODELS[model]["batch"]
    if model == "transformer":
        module, loader = search_models.transformer(batch, seq=32, batches=steps)
    else:
        module, loader = search_models.vgg(batch, batches=steps)

    def configure_optimizers(self: Any) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    # A subclass rather than an attribute on the instance: Lightning looks at the class.
    module.__class__ = type(type(module).__name__, (type(module),), {"configure_optimizers": configure_optimizers})
    return module, loader


def _unique_bytes(tensors: Any) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen.setdefault(storage.data_ptr(), storage.nbytes())
    return sum(seen.values())


# ============================================================================ workers


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist

    from dapple_lightning import DappleStrategy
    from dapple_lightning.planner import live_bytes

    torch.set_num_threads(1)

    class Probe(pl.Callback):
        """The live-bytes tracker from the start of training to its end."""

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.before = _unique_bytes([*pl_module.parameters(), *pl_module.buffers()])
            self.tracker = live_bytes()
            self.tracker.__enter__()

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.tracker.__exit__(None, None, None)

    module, loader = build(args.model, args.steps)
    probe = Probe()
    plan = json.loads(args.plan)
    strategy = DappleStrategy(plan, start_method="popen")
    world = sum(s["replicas"] for s in plan["stages"])
    trainer = bare_trainer(strategy, world, args.steps, [probe])
    trainer.fit(module, train_dataloaders=loader)
    rank = trainer.global_rank
    record = {"stage": strategy.plan.stage_of(rank), "before": probe.before, "peak": probe.tracker.peak}
    write_record(rank, record)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# ======================================================================= orchestration


def profile(model: str, rows: int) -> Any:
    """The layers' profile on one process, on ``rows`` rows of the first batch, with Adam."""
    import torch

    from dapple_lightning.planner import profile_layers

    torch.set_num_threads(1)
    module, loader = build(model, 1)
    first = next(iter(loader))[0][:rows]
    return profile_layers(list(module.layers), first, repeats=1, warmup=0, optimizer=torch.optim.Adam)


def predicted(model: str, plan: dict, prof: Any) -> tuple[float, ...]:
    from dapple_lightning.plan import Plan
    from dapple_lightning.planner import Cluster, estimate

    p = Plan.coerce(plan)
    cluster = Cluster(1, p.world_size, 1e9, 1e9, 1e9, 1e9, latency_s=0.0, memory_bytes=1e15)
    return estimate(p, prof, cluster, MODELS[model]["batch"]).memory_bytes


def run_model(model: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    plans = {k: v for k, v in MODELS[model]["plans"].items() if args.plans is None or k in args.plans}
    batch = MODELS[model]["batch"]
    rows = max(-(-batch // p["micro_batches"]) for p in plans.values())
    prof = profile(model, rows)
    results = []
    for name, plan in plans.items():
        world = sum(s["replicas"] for s in plan["stages"])
        spec = ["--worker", "--model", model, "--plan", json.dumps(plan), "--steps", str(args.steps)]
        records = launch(__file__, spec, world, timeout=args.timeout, what=f"{model} {name}")
        expected = predicted(model, plan, prof)
        for r in records:
            measured = r["before"] + r["peak"]
            guess = expected[r["stage"]]
            row = {"model": model, "plan": name, "rank": r["rank"], "stage": r["stage"], "predicted": guess}
            row.update(measured=measured, error=(guess - measured) / measured)
            results.append(row)
            print(
                f"{model:11s} {name:14s} rank {r['rank']} stage {r['stage']}: predicted {guess / MiB:7.1f} MiB "
                f"measured {measured / MiB:7.1f} MiB ({row['error']:+.1%})",
                flush=True,
            )
    return results


def report(results: list[dict[str, Any]]) -> None:
    print("\n| model | plan | ranks | per stage: predicted / measured MiB (error) | worst error |")
    print("|---|---|---|---|---|")
    for (model, plan), rows in itertools.groupby(results, key=lambda r: (r["model"], r["plan"])):
        rows = list(rows)
        per_stage: dict[int, list[dict[str, Any]]] = {}
        for r in rows:
            per_stage.setdefault(r["stage"], []).append(r)
        cells = []
        for stage, group in sorted(per_stage.items()):
            measured = max(r["measured"] for r in group)  # a stage's replicas hold alike
            guess = group[0]["predicted"]
            cells.append(f"s{stage} {guess / MiB:.1f} / {measured / MiB:.1f} ({(guess - measured) / measured:+.1%})")
        worst = max(rows, key=lambda r: abs(r["error"]))["error"]
        print(f"| {model} | {plan} | {len(rows)} | {'; '.join(cells)} | {worst:+.1%} |")
    errors = [abs(r["error"]) for r in results]
    within = sum(1 for e in errors if e <= 0.10)
    print(f"\n{within} of {len(errors)} ranks within 10%; worst {max(errors):.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--plans", nargs="+", help="plan names to run (default: all of each model)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per run (default 3)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    results = []
    for model in args.models:
        results += run_model(model, args)
    report(results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
