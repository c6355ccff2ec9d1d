"""The DAPPLE planner on the paper's five models and two clusters, against the baselines.

    python benchmarks/planner_paper.py [--profiles DIR]

Profiles are the DAPPLE authors' published ones, shipped in ``dapple_lightning/planner/profiles``
(``planner.REFERENCE_PROFILES``); batch sizes as in the paper's evaluation; clusters
``Cluster.paper_2x8()`` and ``Cluster.paper_16x1()``. Every plan is judged by the same cost
model (``_cost``); speedups are over pure data parallelism with its best micro-batch count
(gradient accumulation when memory needs it).
"(sim)" is the event simulator's replay of the same plan. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from dapple_lightning.plan import Plan, Stage
from dapple_lightning.planner import (
    REFERENCE_PROFILES,
    Cluster,
    CostModel,
    PlannedPlan,
    data_parallel_plan,
    pipedream_plan,
    plan_dapple,
    read_pipedream,
    simulate_plan,
    straight_plan,
)

# (name, file, profile batch, global batch)
MODELS = [
    ("VGG-19", "vgg-19-pbs-32.txt", 32, 1024),
    ("GNMT-16", "gnmt-16-pbs-64.txt", 64, 1024),
    ("BERT-48", "bert-48-pbs-2.txt", 2, 128),
    ("XLNet-36", "xlnet-36-pbs-1.txt", 1, 128),
    ("AmoebaNet-36", "amoeba-36-pbs-1.txt", 1, 128),
]
CLUSTERS = [("2x8", Cluster.paper_2x8()), ("16x1", Cluster.paper_16x1())]


def _plan(p: PlannedPlan | None) -> str:
    if p is None:
        return "does not fit"
    where = "" if p.placement == "append" else f", {p.placement}"
    return f"{p.notation} (M={p.plan.micro_batches}{where})"


def _speedup(p: PlannedPlan | None) -> str:
    if p is None:
        return "-"
    return f"{p.speedup_vs_dp:.2f}x" if p.speedup_vs_dp is not None else f"{p.predicted_step_s:.3f} s (no DP)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", type=Path, default=REFERENCE_PROFILES)
    args = parser.parse_args()
    print(
        "| model | cluster | DAPPLE plan | step s (sim) | DAPPLE vs DP | PipeDream plan | PipeDream vs DP "
        "| DAPPLE / PipeDream | straight vs DP | DP step s | planning s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, file, pbs, batch in MODELS:
        profile = read_pipedream(args.profiles / file, pbs)
        for cluster_name, cluster in CLUSTERS:
            started = time.perf_counter()
            best = plan_dapple(profile, cluster, batch)[0]
            seconds = time.perf_counter() - started
            pipedream = pipedream_plan(profile, cluster, batch)
            straight = straight_plan(profile, cluster, batch)
            dp = data_parallel_plan(profile, cluster, batch)
            ratio = f"{pipedream.predicted_step_s / best.predicted_step_s:.2f}x" if pipedream else "-"
            step = f"{best.predicted_step_s:.3f} ({best.simulated_step_s:.3f})"
            dp_step = f"{dp.predicted_step_s:.3f}" if dp else "does not fit"
            print(
                f"| {name} | {cluster_name} | {_plan(best)} | {step} | {_speedup(best)} "
                f"| {_plan(pipedream)} | {_speedup(pipedream)} | {ratio} | {_speedup(straight)} "
                f"| {dp_step} | {seconds:.2f} |",
                flush=True,
            )
    # The plan the paper ran for VGG-19 on 2x8 (15:1, 12 micro-batches), under this cost model.
    profile = read_pipedream(args.profiles / "vgg-19-pbs-32.txt", 32)
    print("\nThe paper's VGG-19 plan, 15:1 (convolutions | classifier), under this model:\n")
    print("| cluster | M | step s (sim) | pivot | vs DAPPLE's pick |")
    print("|---|---|---|---|---|")
    for cluster_name, cluster in CLUSTERS:
        model = CostModel(profile, cluster, 1024)
        best = plan_dapple(profile, cluster, 1024)[0]
        for m in (8, 12, 16):
            plan = Plan((Stage(0, 22, 15), Stage(22, 26, 1)), m)
            est = model.estimate(plan)
            sim = simulate_plan(model, plan).step_s
            print(
                f"| {cluster_name} | {m} | {est.step_s:.3f} ({sim:.3f}) | {est.pivot_name} "
                f"| {est.step_s / best.predicted_step_s:.2f}x |"
            )


if __name__ == "__main__":
    main()
