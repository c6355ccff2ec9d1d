"""Plan a model from its layer profile: ``python -m dapple_lightning.planner --help``.

The DAPPLE paper's profiles ship in ``dapple_lightning/planner/profiles``. Examples::

    python -m dapple_lightning.planner --profile dapple_lightning/planner/profiles/vgg-19-pbs-32.txt \\
        --cluster 2x8 --global-batch 1024
    python -m dapple_lightning.planner --profile profile.json --cluster 4x8 --global-batch 512 \\
        --top 3 --baselines --memory-gb 32
    python -m dapple_lightning.planner --profile bert-48-pbs-2.txt --global-batch 128 --json > plan.json
    python -m dapple_lightning.planner --profile bert-48-pbs-2.txt --global-batch 128 --memory-gb 8 \\
        --objective time-within-memory --memory-margin 0.1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from dapple_lightning.plan import SCHEDULES
from dapple_lightning.planner._baselines import baselines
from dapple_lightning.planner._budget import parse_memory, stage_memory_lines
from dapple_lightning.planner._cluster import GB, Cluster
from dapple_lightning.planner._dp import PlannedPlan, plan_dapple
from dapple_lightning.planner._objective import OBJECTIVES
from dapple_lightning.planner._pipedream import load_profile
from dapple_lightning.planner._placement import PLACEMENTS


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values:
        raise argparse.ArgumentTypeError("give at least one integer")
    return values


def _memory(text: str) -> float:
    try:
        return parse_memory(text, "--memory-limit")
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _bandwidths(text: str) -> tuple[float | None, float]:
    """``"INTER"`` or ``"INTRA,INTER"`` in GB/s."""
    try:
        values = [float(p) for p in text.split(",")]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} is not GB/s as INTER or INTRA,INTER, e.g. 3 or 25,3")
    return (None, values[0]) if len(values) == 1 else (values[0], values[1])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dapple_lightning.planner",
        description="DAPPLE planner: the fastest (or least memory) pipeline + data parallel plans for a layer profile.",
        epilog=__doc__.split("Examples::", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--profile", required=True, help="our JSON profile or a PipeDream-format .txt")
    parser.add_argument("--profile-batch", type=int, help="profile batch size (default: from 'pbs-N' in the name)")
    parser.add_argument("--cluster", default="2x8", help="SERVERSxDEVICES with V100 constants (default 2x8)")
    parser.add_argument("--global-batch", type=int, required=True, help="samples per optimizer step")
    parser.add_argument("--top", type=int, default=5, help="how many plans to list (default 5)")
    parser.add_argument("--json", action="store_true", help="print the best plan as JSON")
    parser.add_argument("--baselines", action="store_true", help="also PipeDream's plan, straight pipeline, DP")
    memory = parser.add_mutually_exclusive_group()
    memory.add_argument("--memory-gb", type=float, help="device memory in GB (default 16)")
    memory.add_argument(
        "--memory-limit",
        type=_memory,
        help="per-device memory budget as bytes or text, e.g. 6GiB or 512MB (instead of --memory-gb)",
    )
    parser.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="time",
        help="time: fastest that fits (DAPPLE); memory: least per-device peak (mCAP); "
        "time-within-memory: fastest within --memory-margin of the least peak",
    )
    parser.add_argument(
        "--memory-margin",
        type=float,
        default=0.1,
        help="share above the least peak that time-within-memory allows (default 0.1: 1.1x)",
    )
    parser.add_argument(
        "--recompute",
        action="store_true",
        help="let a stage that would not fit otherwise recompute its activations in the backward",
    )
    parser.add_argument(
        "--p2p-gbps",
        type=_bandwidths,
        help="point-to-point bandwidth in GB/s (1e9 bytes/s): INTER, or INTRA,INTER (default 25,1)",
    )
    parser.add_argument(
        "--allreduce-gbps",
        type=_bandwidths,
        help="all-reduce bandwidth per link in GB/s: INTER, or INTRA,INTER (default 25,3)",
    )
    parser.add_argument("--micro-batches", type=_ints, help="micro-batch counts to try (default: divisors)")
    parser.add_argument("--schedule", choices=SCHEDULES, default="dapple")
    parser.add_argument("--placements", help=f"comma-separated subset of {','.join(PLACEMENTS)}")
    parser.add_argument("--optimizer-factor", type=float, default=2.0, help="optimizer bytes per weight byte (2)")
    parser.add_argument("--max-cuts", type=int, default=64, help="cut points on long profiles (0: every layer)")
    parser.add_argument(
        "--exact",
        choices=["auto", "yes", "no"],
        default="auto",
        help="keep every partial plan (yes) or a beam (no); auto: exact up to 16 devices",
    )
    return parser


def _cluster(args: argparse.Namespace) -> Cluster:
    cluster = Cluster.parse(args.cluster)
    changes: dict[str, float] = {}
    if args.memory_gb is not None:
        changes["memory_bytes"] = args.memory_gb * GB
    if args.memory_limit is not None:
        changes["memory_bytes"] = args.memory_limit
    for link, given in (("p2p", args.p2p_gbps), ("allreduce", args.allreduce_gbps)):
        if given is not None:
            intra, inter = given
            changes[f"inter_{link}_bw"] = inter * GB
            if intra is not None:
                changes[f"intra_{link}_bw"] = intra * GB
    return dataclasses.replace(cluster, **changes)


def _exactness(best: PlannedPlan) -> str:
    """Whether the search was exhaustive, else how far its best plan may be from the optimum."""
    record = best.search
    if record is None:
        return ""
    work = f"{record.states} states, {record.partial_plans} partial plans priced"
    if record.exact:
        return f"\nsearch: exact over its space ({work})"
    return (
        f"\nsearch: a beam, not exhaustive ({work}); the best plan is at most "
        f"{100 * record.gap(best.predicted_step_s):.1f}% above the optimum (lower bound "
        f"{record.lower_bound_s:.4f} s: what the busiest stage of any plan takes at least, its all-reduce "
        "included)"
    )


def _table(plans: Sequence[PlannedPlan], global_batch: int) -> str:
    rows = [
        (
            "#",
            "method",
            "plan",
            "cuts",
            "M",
            "mb",
            "placement",
            "step s",
            "sim s",
            "samples/s",
            "mem GB",
            "vs DP",
            "pivot",
        )
    ]
    for index, p in enumerate(plans, 1):
        est = p.estimate
        rows.append(
            (
                str(index) if p.method == "dapple" else "-",
                p.method,
                p.notation,
                ",".join(map(str, p.cuts)) or "-",
                str(p.plan.micro_batches),
                str(est.micro_batch_size) if est else "?",
                p.placement,
                f"{p.predicted_step_s:.4f}",
                f"{p.simulated_step_s:.4f}" if p.simulated_step_s is not None else "?",
                f"{global_batch / p.predicted_step_s:.1f}" if p.predicted_step_s > 0 else "inf",
                f"{max(p.stage_memory_bytes) / GB:.2f}",
                f"{p.speedup_vs_dp:.2f}x" if p.speedup_vs_dp is not None else "n/a",
                est.pivot_name if est else "?",
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    right = {0, 4, 5, 7, 8, 9, 10, 11}
    lines = []
    for row in rows:
        cells = [cell.rjust(w) if c in right else cell.ljust(w) for c, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _memory_lines(best: PlannedPlan, cluster: Cluster, objective: str) -> str:
    """The best plan's predicted peak per device of each stage, beside the device memory (and
    the peak the objective allowed, when less): where a plan stands against its budget."""
    budget = cluster.memory_bytes
    head = f"predicted peak memory per device, best plan (budget {budget / GB:.2f} GB per device"
    if objective != "time" and best.peak_limit_bytes is not None:
        head += f"; objective {objective} allows {best.peak_limit_bytes / GB:.2f} GB"
    lines = stage_memory_lines(best.plan, best.stage_memory_bytes, budget, size=lambda n: f"{n / GB:.2f} GB")
    return "\n".join([head + "):", *lines])


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        profile = load_profile(args.profile, args.profile_batch)
        cluster = _cluster(args)
        placements = None if args.placements is None else [p.strip() for p in args.placements.split(",")]
        started = time.perf_counter()
        plans = plan_dapple(
            profile,
            cluster,
            args.global_batch,
            top=args.top,
            micro_batches=args.micro_batches,
            placements=placements,
            schedule=args.schedule,
            optimizer_factor=args.optimizer_factor,
            max_cuts=args.max_cuts or None,
            exact={"auto": None, "yes": True, "no": False}[args.exact],
            objective=args.objective,
            memory_margin=args.memory_margin,
            recompute=args.recompute,
        )
        seconds = time.perf_counter() - started
        others = (
            baselines(
                profile,
                cluster,
                args.global_batch,
                micro_batches=args.micro_batches,
                schedule=args.schedule,
                optimizer_factor=args.optimizer_factor,
            )
            if args.baselines
            else []
        )
    except (OSError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        best: dict[str, Any] = plans[0].to_dict()
        best.update(
            profile=str(args.profile),
            cluster=cluster.name,
            global_batch=args.global_batch,
            planning_s=seconds,
            objective=args.objective,
            memory_budget_bytes=cluster.memory_bytes,
        )
        if others:
            best["baselines"] = [p.to_dict() for p in others]
        print(json.dumps(best, indent=2))
        return 0
    print(
        f"profile {args.profile}: {profile.num_layers} layers at batch {profile.profile_batch_size}; "
        f"cluster {cluster.describe()}; global batch {args.global_batch}; planned in {seconds:.2f} s"
    )
    print(_table([*plans, *others], args.global_batch))
    print(_exactness(plans[0]))
    print(
        "\nstep s: the analytic model (what the planner minimises); sim s: the event simulator's replay "
        "of the same plan (queues on links, 1F1B waits)"
    )
    print("\n" + _memory_lines(plans[0], cluster, args.objective))
    print(f"\nbest plan ({plans[0].placement} placement):\n{plans[0].plan.to_yaml().rstrip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
