"""How long the DAPPLE planner takes on synthetic profiles (pure Python, one core).

    python benchmarks/planner_speed.py            # the two targets: 16 x 50 and 64 x 200
    python benchmarks/planner_speed.py --full     # also every cut point on 64 x 200 (slow)
    python benchmarks/planner_speed.py --sizes 1024x128,4096x256 --seeds 1 --tops 1   # the scale points

The profiles are transformer-like chains drawn from a seeded generator: an embedding layer
with large parameters, ``L - 2`` blocks of similar cost (+-25 %), a small head; global batch
1024. Times are for ``plan_dapple`` with its defaults (every divisor of the global batch as
micro-batch count, every placement policy that differs on the cluster, at most 64 cut points,
exact up to 16 devices and a beam beyond) for ``top`` 1 and 5 (the CLI's default). ``--full``
adds 64 x 200 with every cut point.

The scale points (1,024 devices = 128 servers x 8 with 128 layers, 4,096 x 256) run at a global
batch of 4 samples per device (4,096 and 16,384: 1,024 samples cannot feed thousands of devices
with pipelines). Every row says whether the search was exact, else how far its plan may be above
the optimum (its step over ``SearchRecord.lower_bound_s``), and the process's peak memory so far.
"""

from __future__ import annotations

import argparse
import random
import resource
import time

from dapple_lightning.planner import Cluster, LayerProfile, ModelProfile, plan_dapple

TARGETS = {(16, 50): 0.3, (64, 200): 5.0, (1024, 128): 10.0, (4096, 256): 60.0}
"""Wall seconds for ``top`` 1 (issue targets for this machine)."""


def global_batch(world: int) -> int:
    """1,024 samples, or 4 per device on clusters too large for that."""
    return max(1024, 4 * world)


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


def measure(world: int, layers: int, seed: int, top: int, max_cuts: int | None) -> tuple[float, float, str, str]:
    cluster = Cluster.parse(f"{max(1, world // 8)}x{min(8, world)}")
    profile = synthetic(layers, seed)
    wall, cpu = time.perf_counter(), time.process_time()
    best = plan_dapple(profile, cluster, global_batch(world), top=top, max_cuts=max_cuts)[0]
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    summary = f"{best.notation} M={best.plan.micro_batches} {best.placement} {best.predicted_step_s:.4f}s"
    record = best.search
    assert record is not None
    exactness = "exact" if record.exact else f"beam, <= {100 * record.gap(best.predicted_step_s):.1f}% above optimum"
    work = f"{record.states} / {record.partial_plans}"
    return wall, cpu, summary, f"{exactness} | {work}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="also search every cut point on 64 x 200")
    parser.add_argument("--sizes", default="16x50,64x200", help="DEVICESxLAYERS,... (default 16x50,64x200)")
    parser.add_argument("--seeds", type=int, default=2, help="profiles per size")
    parser.add_argument("--tops", default="1,5", help="top values (default 1,5)")
    args = parser.parse_args()
    sizes = [tuple(int(x) for x in size.split("x")) for size in args.sizes.split(",")]
    cases = [(w, n, 64) for w, n in sizes] + ([(64, 200, None)] if args.full else [])
    print(
        "| devices x layers | cut points | top | seed | wall s | CPU s | target s | best plan | exactness "
        "| states / partial plans | peak RSS MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for world, layers, max_cuts in cases:
        for top in (int(t) for t in args.tops.split(",")):
            for seed in range(args.seeds):
                wall, cpu, summary, search = measure(world, layers, seed, top, max_cuts)
                target = TARGETS.get((world, layers), float("nan")) if top == 1 else float("nan")
                cuts = "all" if max_cuts is None or layers - 1 <= max_cuts else str(max_cuts)
                peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
                print(
                    f"| {world} x {layers} | {cuts} | {top} | {seed} | {wall:.2f} | {cpu:.2f} | {target:g} "
                    f"| {summary} | {search} | {peak:.0f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
