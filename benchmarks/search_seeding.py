"""What seeding a search costs: pricing plain and chunked plans, ranking a space, enumerating one.

    python benchmarks/search_seeding.py                          # this checkout
    git archive <commit> | tar -x -C /tmp/before
    python benchmarks/search_seeding.py --before /tmp/before     # both, interleaved

Each round runs every case in a fresh process per checkout (``PYTHONPATH`` set to it), the two
checkouts alternating so that a shared machine's load falls on both alike; a case reports the
median of ``--runs`` timed runs after one warm-up. Prints each case's medians per round and the
ratio after / before. The model: 12 equal layers (1 ms forward, 2 ms backward, 1 ms weight
gradient) on 4 ranks, global batch 16.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]

ONE = """
import json, statistics, time
from dapple_lightning.planner import CostModel, LayerProfile, ModelProfile
from dapple_lightning.search import PlanSpace, local_cluster, planner_seeds
layers = tuple(LayerProfile(f"l{{i}}", 1e-3, 2e-3, 10**3, 10**8, weight_s=1e-3) for i in range(12))
profile = ModelProfile(layers, 4)
model = CostModel(profile, local_cluster(4, None, 1e12), 16)
plain = list(PlanSpace(12, 4, 16).plans())
cases = {{
    "planner_seeds, plain 12-layer space": lambda: planner_seeds(profile.to_dict(), PlanSpace(12, 4, 16), 3, memory_limit=1e12),
    "size + plans of PlanSpace(10, 4, 64)": lambda: (PlanSpace(10, 4, 64).size, sum(1 for _ in PlanSpace(10, 4, 64).plans())),
    "price the 1,598 plain plans": lambda: [model.estimate(p) for p in plain],
}}
try:
    from dapple_lightning.planner import estimate_chunked
    chunked = list(PlanSpace(12, 4, 16, schedules=("zb-v", "interleaved", "v-half")).plans())[:2000]
    cases["price 2,000 chunked plans"] = lambda: [estimate_chunked(model, p) for p in chunked]
except (ImportError, ValueError):
    pass  # a checkout whose space has no chunked schedules
out = {{}}
for name, run in cases.items():
    run()
    times = []
    for _ in range({runs}):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    out[name] = statistics.median(times)
print(json.dumps(out))
"""


def measure(checkout: Path, runs: int) -> dict[str, float]:
    env = {"PYTHONPATH": str(checkout), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", ONE.format(runs=runs)], cwd=checkout, env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, help="another checkout to measure alternately with this one")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=7, help="timed runs per case and round (median)")
    args = parser.parse_args()
    sides = {"before": args.before, "after": HERE} if args.before else {"after": HERE}
    rows: dict[str, dict[str, list[float]]] = {}
    for round_ in range(args.rounds):
        for side, checkout in sides.items():
            for case, seconds in measure(checkout, args.runs).items():
                rows.setdefault(case, {}).setdefault(side, []).append(seconds)
        print(f"round {round_ + 1} of {args.rounds} done", file=sys.stderr)
    for case, got in rows.items():
        line = "; ".join(f"{side} " + " ".join(f"{s:.4g}" for s in got[side]) for side in sides if side in got)
        if "before" in got and "after" in got:
            ratios = [a / b for a, b in zip(got["after"], got["before"], strict=True)]
            line += f"; after/before {min(ratios):.2f}-{max(ratios):.2f} (median {statistics.median(ratios):.2f})"
        print(f"{case}: {line} s")


if __name__ == "__main__":
    main()
