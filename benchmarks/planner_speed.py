"""How long the DAPPLE planner takes on synthetic profiles (pure Python, one core).

    python benchmarks/planner_speed.py            # the two targets: 16 x 50 and 64 x 200
    python benchmarks/planner_speed.py --full     # also every cut point on 64 x 200 (slow)

The profiles are transformer-like chains drawn from a seeded generator: an embedding layer
with large parameters, ``L - 2`` blocks of similar cost (+-25 %), a small head; global batch
1024. Times are for ``plan_dapple`` with its defaults (every divisor of the global batch as
micro-batch count, every placement policy that differs on the cluster, at most 64 cut points,
exact up to 16 devices and a beam beyond) for ``top`` 1 and 5 (the CLI's default). ``--full``
adds 64 x 200 with every cut point.
"""

from __future__ import annotations

import argparse
import random
import time

from dapple_lightning.planner import Cluster, LayerProfile, ModelProfile, plan_dapple

TARGETS = {(16, 50): 2.0, (64, 200): 60.0}


def synthetic(layers: int, seed: int) -> ModelProfile:
    """A transformer-like profile at batch 32: embedding, ``layers - 2`` blocks, head."""
    rng = random.Random(seed)
    out = [LayerProfile("embedding", 0.4e-3, 1.5e-3, 25_000_000, 120_000_000)]
    for i in range(layers - 2):
        f = 3e-3 * rng.uniform(0.75, 1.25)
        out.append(
            LayerProfile(
                f"block{i}",
                f,
                2 * f * rng.uniform(0.9, 1.1),
                int(25e6 * rng.uniform(0.75, 1.25)),
                int(8e6 * rng.uniform(0.75, 1.25)),
            )
        )
    out.append(LayerProfile("head", 0.5e-3, 1e-3, 100_000, 4_000_000))
    return ModelProfile(tuple(out), profile_batch_size=32, device="synthetic")


def measure(world: int, layers: int, seed: int, top: int, max_cuts: int | None) -> tuple[float, float, str]:
    cluster = Cluster.parse(f"{max(1, world // 8)}x{min(8, world)}")
    profile = synthetic(layers, seed)
    wall, cpu = time.perf_counter(), time.process_time()
    best = plan_dapple(profile, cluster, 1024, top=top, max_cuts=max_cuts)[0]
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    summary = f"{best.notation} M={best.plan.micro_batches} {best.placement} {best.predicted_step_s:.4f}s"
    return wall, cpu, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="also search every cut point on 64 x 200")
    parser.add_argument("--sizes", default="16x50,64x200", help="DEVICESxLAYERS,... (default 16x50,64x200)")
    parser.add_argument("--seeds", type=int, default=2, help="profiles per size")
    args = parser.parse_args()
    sizes = [tuple(int(x) for x in size.split("x")) for size in args.sizes.split(",")]
    cases = [(w, n, 64) for w, n in sizes] + ([(64, 200, None)] if args.full else [])
    print("| devices x layers | cut points | top | seed | wall s | CPU s | target s | best plan |")
    print("|---|---|---|---|---|---|---|---|")
    for world, layers, max_cuts in cases:
        for top in (1, 5):
            for seed in range(args.seeds):
                wall, cpu, summary = measure(world, layers, seed, top, max_cuts)
                target = TARGETS.get((world, layers), float("nan"))
                cuts = "all" if max_cuts is None or layers - 1 <= max_cuts else str(max_cuts)
                print(
                    f"| {world} x {layers} | {cuts} | {top} | {seed} | {wall:.2f} | {cpu:.2f} | {target:g} "
                    f"| {summary} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
