"""The planner's chosen plans on every planner benchmark case, as JSON lines, to compare two commits.

    python benchmarks/planner_plans.py > new.jsonl
    PYTHONPATH=<other checkout> python benchmarks/planner_plans.py > old.jsonl
    diff old.jsonl new.jsonl        # no output: the same plans, cuts, ranks and step times

Cases: the paper's five models on ``Cluster.paper_2x8()`` at ``benchmarks/planner_paper.py``'s
batches, and ``benchmarks/planner_speed.py``'s synthetic profiles (16 x 50 and 64 x 200, seeds
0 and 1), each for ``top`` 1 and 5. ``--quick`` leaves out 64 x 200 (the slow half).
A line holds each returned plan's notation, micro-batches, placement, cuts, ranks and the
predicted step (``repr``, so equal lines mean equal floats); seconds go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dapple_lightning.planner import REFERENCE_PROFILES, Cluster, plan_dapple, read_pipedream

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner_paper import MODELS
from planner_speed import synthetic


def cases(quick: bool) -> list[tuple[str, object, Cluster, int]]:
    out: list[tuple[str, object, Cluster, int]] = []
    for name, file, pbs, batch in MODELS:
        out.append((f"{name} 2x8", read_pipedream(REFERENCE_PROFILES / file, pbs), Cluster.paper_2x8(), batch))
    for world, layers in ((16, 50),) if quick else ((16, 50), (64, 200)):
        for seed in (0, 1):
            cluster = Cluster.parse(f"{max(1, world // 8)}x{min(8, world)}")
            out.append((f"{world}x{layers} seed {seed}", synthetic(layers, seed), cluster, 1024))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="leave out 64 x 200")
    parser.add_argument("--top", default="1,5", help="top values, comma-separated (default 1,5)")
    args = parser.parse_args()
    for name, profile, cluster, batch in cases(args.quick):
        for top in (int(t) for t in args.top.split(",")):
            started = time.process_time()
            plans = plan_dapple(profile, cluster, batch, top=top)  # type: ignore[arg-type]
            print(f"{name} top {top}: {time.process_time() - started:.2f} s CPU", file=sys.stderr, flush=True)
            rows = [
                [p.notation, p.plan.micro_batches, p.placement, list(p.cuts),
                 [list(s.ranks) if s.ranks else None for s in p.plan.stages], repr(p.predicted_step_s)]
                for p in plans
            ]  # fmt: skip
            print(json.dumps({"case": name, "top": top, "plans": rows}), flush=True)


if __name__ == "__main__":
    main()
