"""Pool the paired rounds of several ``benchmarks/runtime.py --json`` runs into one interval.

One run of the runtime benchmark gives one paired speed-up per round (the two systems' medians
in the same round, launched next to each other); a handful of rounds on a noisy 2-core machine
leaves a ratio of a few percent unresolved. This script pools the per-round speed-ups
``theirs / ours`` of every run given and prints, per pair of systems, the median with a
distribution-free confidence interval of the median (order statistics: the interval between the
``k``-th smallest and largest speed-ups whose binomial coverage is at least ``--confidence``),
and how many rounds ``ours`` was ahead in. No assumption about the noise beyond rounds being
independent.

    python benchmarks/pool_rounds.py run1.json run2.json --pair dapple-zb2:torch-1f1b
    python benchmarks/pool_rounds.py /tmp/zbt-bench*/zb.json --pair dapple-zb2:torch-1f1b --pair dapple-zbt:torch-1f1b
"""

from __future__ import annotations

import argparse
import json
import statistics
from math import comb
from pathlib import Path


def median_interval(values: list[float], confidence: float) -> tuple[float, float, float]:
    """``(low, high, coverage)``: the narrowest order-statistic interval of the median whose
    coverage ``1 - 2 P(Binomial(n, 1/2) <= k)`` is at least ``confidence``."""
    ordered, n = sorted(values), len(values)
    for k in range(n // 2, -1, -1):
        coverage = 1 - 2 * sum(comb(n, i) for i in range(k + 1)) / 2**n
        if coverage >= confidence:
            return ordered[k], ordered[n - k - 1], coverage
    raise ValueError(f"{n} rounds cannot give {confidence:.0%} confidence; pool more runs")


def speedups(path: str, ours: str, theirs: str) -> list[float]:
    """Per round of one run, ``theirs``'s median step over ``ours``'s (rounds where both ran)."""
    wall = json.loads(Path(path).read_text())["per_round"]["wall"]
    if ours not in wall or theirs not in wall:
        return []
    return [t / o for o, t in zip(wall[ours], wall[theirs]) if o and t]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="JSON files written by benchmarks/runtime.py --json")
    parser.add_argument("--pair", action="append", required=True, help="OURS:THEIRS, e.g. dapple-zb2:torch-1f1b")
    parser.add_argument("--confidence", type=float, default=0.95)
    args = parser.parse_args()
    for pair in args.pair:
        ours, _, theirs = pair.partition(":")
        pooled = [x for path in args.runs for x in speedups(path, ours, theirs)]
        if not pooled:
            print(f"{ours} over {theirs}: no round ran both")
            continue
        low, high, coverage = median_interval(pooled, args.confidence)
        ahead = sum(x > 1 for x in pooled)
        print(
            f"{ours} over {theirs}: speed-up median {statistics.median(pooled):.3f}, "
            f"{coverage:.1%} interval [{low:.3f}, {high:.3f}], {len(pooled)} rounds from {len(args.runs)} runs, "
            f"ahead in {ahead}"
        )


if __name__ == "__main__":
    main()
