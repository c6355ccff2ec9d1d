"""The planner on this machine: predicted against measured step time, and what plan="auto" picks.

Two models, each trained for a few steps on 2 CPU processes (one thread each) by Lightning:

    transformer   the runtime benchmark's reference (embedding 512x256, 8 TransformerEncoderLayer
                  (256, 4, 1024), head to 512; 10 layers), global batch 64 x sequence 64, SGD
    vgg           examples/cnn.py's VGGNet at its default config (3 VGG blocks of 32-64-128
                  channels, Flatten, two 1024-wide dense layers, classifier; 7 layers, 3.4 M
                  parameters, 92% of them in the dense head), 64 generated 32x32 images, AdamW

Systems, each a fresh set of processes per round (rounds alternate, order rotated per round):

    auto          ``DappleStrategy()`` (plan="auto"): profiles the layers and the process group in
                  ``setup``, plans, trains. Its profile and measured cluster are what every
                  prediction below is computed from (``planner.estimate``), one per round.
    ddp           Lightning ``strategy="ddp"``, 32 rows per rank
    <plans>       ``DappleStrategy(plan)`` for fixed plans: data parallel (1 stage x 2) at M = 1
                  and 2-4, and straight 2-stage pipelines at several cuts, M and both schedules

A system's step time is the median over rounds of its per-round median over the steps after
warm-up (rank 0, time between the ends of consecutive optimizer steps, as in
``benchmarks/runtime.py``). Printed: per plan the predicted and measured step time and the
error; the plan ``auto`` chose each round; ``auto`` against the best of ``ddp`` and the best
straight pipeline measured in the same run.

    python benchmarks/planner_accuracy.py                       # both models, 3 rounds: ~25 min
    python benchmarks/planner_accuracy.py --models vgg --rounds 1 --steps 2 --warmup 1   # smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

if "--worker" in sys.argv:  # before torch is imported: one intra-op thread per rank
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "examples"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from benchmarks._harness import counter_per_step, launch, median, other_load, step_times, timed_trainer, write_record  # noqa: E402

BATCH = 64
WORLD = 2


def _plan(cuts: list[int], layers: int, m: int, schedule: str = "dapple", replicas: int | None = None) -> dict:
    bounds = [0, *cuts, layers]
    stages = [{"layers": [a, b], "replicas": replicas or 1} for a, b in itertools.pairwise(bounds)]
    return {"micro_batches": m, "schedule": schedule, "stages": stages}


MODELS: dict[str, dict[str, Any]] = {
    "transformer": {
        "plans": {
            "dp M=1": _plan([], 10, 1, replicas=2),
            "dp M=4": _plan([], 10, 4, replicas=2),
            "5|5 M=4": _plan([5], 10, 4),
            "5|5 M=8": _plan([5], 10, 8),
            "5|5 M=16": _plan([5], 10, 16),
            "5|5 M=8 gpipe": _plan([5], 10, 8, "gpipe"),
            "4|6 M=8": _plan([4], 10, 8),
            "6|4 M=8": _plan([6], 10, 8),
        },
    },
    "vgg": {
        "plans": {
            "dp M=1": _plan([], 7, 1, replicas=2),
            "dp M=2": _plan([], 7, 2, replicas=2),
            "2|5 M=2": _plan([2], 7, 2),
            "2|5 M=4": _plan([2], 7, 4),
            "2|5 M=8": _plan([2], 7, 8),
            "2|5 M=16": _plan([2], 7, 16),
            "2|5 M=8 gpipe": _plan([2], 7, 8, "gpipe"),
            "1|6 M=8": _plan([1], 7, 8),
            "3|4 M=8": _plan([3], 7, 8),
        },
    },
}


def label(plan: dict) -> str:
    """``'2 stages [0,5)|[5,10) x1:1 M=8 dapple'``-like name of a plan dict, for the auto column."""
    stages = plan["stages"]
    cuts = "|".join(f"[{s['layers'][0]},{s['layers'][1]})" for s in stages)
    reps = ":".join(str(s.get("replicas", 1)) for s in stages)
    return f"{cuts} x{reps} M={plan['micro_batches']} {plan.get('schedule', 'dapple')}"


# ============================================================================ workers


def build(model: str, total_steps: int):
    """The LightningModule and a dataset of ``total_steps`` global batches (generated, seeded)."""
    import torch
    from torch.utils.data import TensorDataset

    if model == "transformer":
        from benchmarks.search_models import transformer

        module, loader = transformer(BATCH, batches=total_steps)
        return module, loader.dataset
    from cnn_model import Gratings, VGGNet

    torch.manual_seed(1234)
    images = Gratings(total_steps * BATCH, seed=1, class_seed=0)
    # Generated once up front: the benchmark times the model, not the images' synthesis.
    x = torch.stack([images[i][0] for i in range(len(images))])
    y = torch.stack([images[i][1] for i in range(len(images))])
    return VGGNet(), TensorDataset(x, y)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    module, data = build(args.model, args.total_steps)
    if args.system == "ddp":
        strategy: Any = "ddp"
        batch_size = BATCH // WORLD  # the injected DistributedSampler gives each rank its share
    else:
        from dapple_lightning import DappleStrategy

        strategy = DappleStrategy("auto" if args.system == "auto" else json.loads(args.system), start_method="popen")
        batch_size = BATCH  # every rank sees the global batch
    trainer, timer = timed_trainer(strategy, WORLD, args.total_steps)
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=batch_size, shuffle=False))
    record: dict[str, Any] = dict(timer.rec.data)
    auto = getattr(trainer.strategy, "auto_plan", None)
    if auto is not None:
        record["auto"] = {
            "plan": auto.plan.to_dict(),
            "predicted_step_s": auto.predicted_step_s,
            "data_parallel_step_s": auto.data_parallel_step_s,
            "profile": auto.profile.to_dict(),
            "cluster": dataclasses.asdict(auto.cluster),
            "profiling_s": auto.profiling_s,
            "trials": [
                {"plan": t.plan.to_dict(), "predicted_step_s": t.predicted_step_s, "measured_step_s": t.measured_step_s}
                for t in auto.trials
            ],
        }
    write_record(trainer.global_rank, record)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# ======================================================================= orchestration


def predict(plan: dict, auto: dict) -> float:
    from dapple_lightning.plan import Plan
    from dapple_lightning.planner import Cluster, ModelProfile, estimate

    profile = ModelProfile.from_dict(auto["profile"])
    return estimate(Plan.coerce(plan), profile, Cluster(**auto["cluster"]), BATCH).step_s


def run_model(model: str, args: argparse.Namespace) -> dict[str, Any]:
    plans: dict[str, dict] = MODELS[model]["plans"]
    systems = [s for s in ("auto", "ddp", *plans) if args.systems is None or s in args.systems]
    total = args.warmup + args.steps
    times: dict[str, list[float]] = {s: [] for s in systems}
    loads: dict[str, list[float]] = {s: [] for s in systems}
    cpu: dict[str, list[float]] = {s: [] for s in systems}
    autos: list[dict] = []
    for r in range(args.rounds):
        order = systems[r % len(systems) :] + systems[: r % len(systems)]
        for system in order:
            spec = system if system in ("auto", "ddp") else json.dumps(plans[system])
            records = launch(
                __file__,
                ["--worker", "--model", model, "--system", spec, "--total-steps", str(total)],
                WORLD,
                timeout=args.timeout,
                what=f"{model} {system}",
            )
            periods, _ = step_times(records[0], args.warmup)
            times[system].append(median(periods))
            loads[system].append(other_load(records, args.warmup))
            cpu[system].append(counter_per_step(records, "cpu", args.warmup))
            note = ""
            if system == "auto":
                autos.append(records[0]["auto"])
                a = records[0]["auto"]
                note = f"  chose {label(a['plan'])}, predicted {a['predicted_step_s']:.3f} s, profiled in {a['profiling_s']:.1f} s"
            print(
                f"{model} round {r}  {system:14s} median {median(periods):.3f} s/step  "
                f"steps {' '.join(f'{p:.3f}' for p in periods)}  cpu {cpu[system][-1]:.3f} s/step  other load {loads[system][-1]:.2f} cores{note}",
                flush=True,
            )
    measured = {s: median(v) for s, v in times.items()}
    predicted = {name: median([predict(plan, a) for a in autos]) for name, plan in plans.items() if autos}
    if autos:
        predicted["auto"] = median([a["predicted_step_s"] for a in autos])
    return {
        "measured": measured,
        "predicted": predicted,
        "rounds": times,
        "other_load": loads,
        "cpu": cpu,
        "auto": [
            {k: a[k] for k in ("plan", "predicted_step_s", "data_parallel_step_s", "profiling_s", "trials")}
            for a in autos
        ],
        "cluster": autos[0]["cluster"] if autos else None,
    }


def report(model: str, result: dict[str, Any]) -> None:
    plans = MODELS[model]["plans"]
    measured, predicted = result["measured"], result["predicted"]
    print(f"\n## {model}: predicted vs measured (2 processes, global batch {BATCH})")
    print("| plan | predicted s/step | measured s/step | error |")
    print("|---|---|---|---|")
    errors = []
    for name in (n for n in plans if n in measured and n in predicted):
        err = predicted[name] / measured[name] - 1
        errors.append(abs(err))
        print(f"| {name} | {predicted[name]:.3f} | {measured[name]:.3f} | {err:+.1%} |")
    if errors:
        print(f"mean |error| {sum(errors) / len(errors):.1%}, max |error| {max(errors):.1%}")
    if not {"auto", "ddp"} <= measured.keys():
        return

    straight = {n: measured[n] for n, p in plans.items() if len(p["stages"]) > 1 and n in measured}
    best_straight = min(straight, key=straight.get) if straight else None
    chosen = sorted({label(a["plan"]) for a in result["auto"]})
    best_peer = min([measured["ddp"], *straight.values()])
    print(f"\n## {model}: choice")
    print("| system | measured s/step | vs auto |")
    print("|---|---|---|")
    print(f"| auto (chose: {'; '.join(chosen)}) | {measured['auto']:.3f} | 1.00 |")
    print(f"| Lightning DDP | {measured['ddp']:.3f} | {measured['ddp'] / measured['auto']:.2f} |")
    if best_straight is not None:
        print(
            f"| best straight pipeline ({best_straight}) | {straight[best_straight]:.3f} | "
            f"{straight[best_straight] / measured['auto']:.2f} |"
        )
    print(
        f"auto / best of DDP and straight pipelines: step time {measured['auto'] / best_peer:.3f} "
        f"({'auto as fast or faster' if measured['auto'] <= best_peer else 'auto slower'})"
    )
    # The same comparison round by round (each round runs every system once, back to back), so
    # that drift between rounds cancels; the best peer is the one with the lowest median.
    peer = min(["ddp", *straight], key=measured.get)
    ratios = [a / b for a, b in zip(result["rounds"]["auto"], result["rounds"][peer], strict=True)]
    if len(ratios) > 1:
        mean, half = _mean_and_half_interval(ratios)
        verdict = (
            "auto faster" if mean + half < 1 else "auto slower" if mean - half > 1 else "no difference beyond the noise"
        )
        print(
            f"auto / {peer}, per round: mean {mean:.3f}, 95% interval [{mean - half:.3f}, {mean + half:.3f}] "
            f"over {len(ratios)} rounds ({verdict})"
        )
    cluster = result["cluster"]
    print(
        f"measured cluster: p2p {cluster['intra_p2p_bw'] / 1e9:.2f} GB/s, all-reduce "
        f"{cluster['intra_allreduce_bw'] / 1e9:.2f} GB/s per link, latency {cluster['latency_s'] * 1e6:.0f} us"
    )


# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom (beyond: the normal's).
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip


def _mean_and_half_interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% confidence interval (Student's t)."""
    n = len(values)
    t = _T95[n - 2] if n - 1 <= len(_T95) else 1.960
    return statistics.fmean(values), t * statistics.stdev(values) / n**0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="transformer,vgg", help="comma-separated subset of " + ",".join(MODELS))
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per system per round (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first, at least 1 (default 2)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds before one launch is killed")
    parser.add_argument("--systems", default=None, help="only these systems (comma-separated names as printed)")
    parser.add_argument("--json", default=None, help="also write all measurements to this JSON file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--total-steps", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.systems is not None:
        args.systems = {s.strip() for s in args.systems.split(",")}
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {sorted(MODELS)}")
    if args.rounds < 1 or args.steps < 1 or args.warmup < 1:
        parser.error("--rounds, --steps and --warmup must be at least 1")
    print(
        f"# planner accuracy: {WORLD} processes x 1 thread, {args.rounds} rounds x {args.steps} steps "
        f"(+{args.warmup} warm-up)",
        flush=True,
    )
    results = {}
    for model in models:
        results[model] = run_model(model, args)
        report(model, results[model])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
