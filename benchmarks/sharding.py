"""Memory and step time of a stage whose replicas shard their state (``shard:``), against the same stage unsharded.

A 2-stage plan ``r:1`` on ``r + 1`` CPU processes (gloo, one thread each), run by the runtime itself
(no Lightning): stage 0 holds ``--layers`` blocks of ``Linear(H, H)`` + ``Tanh`` on ``r`` replicas,
stage 1 one ``Linear(H, 8)`` and the loss; Adam; ``--micro-batches`` micro-batches of a global batch of
``--batch`` rows. Each configuration (``shard`` none, grads, full, for each ``r``) runs ``--steps``
steps; the configurations are interleaved over ``--rounds`` rounds.

Per stage-0 rank it reports:

* **state**: the bytes this rank keeps of the stage's parameters, gradients and Adam state after a
  step (a sharded value counts its local shard);
* **tracker**: the peak of the project's live-bytes tracker (``planner.live_bytes``, following
  FSDP2's storage resizes too) over the training steps after the first, plus the parameters held
  before them (as ``benchmarks/memory.py`` measures);
* **RSS**: the process's peak resident memory over the steps after the first (``VmHWM`` after
  resetting it with ``/proc/self/clear_refs``) less its resident memory when the steps began;
* **step**: the median wall time of a step after the first;
* **added**: the step time over the unsharded configuration's in the same round, beside what the
  planner's price of sharding predicts (``planner._sharding.shard_price`` on the links
  ``planner.measure_cluster`` measures on these processes).

    python benchmarks/sharding.py                       # r = 2 and 3: a few minutes
    python benchmarks/sharding.py --replicas 2 --rounds 1 --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

if "--worker" in sys.argv:  # before torch is imported: one intra-op thread per rank
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._harness import launch, write_record  # noqa: E402

MiB = 2**20
MODES = ("none", "grads", "full")
MEMORY_STEPS = 3
"""Steps under the live-bytes tracker before the timed ones; the peaks are those of the last two."""


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _predicted_cost(plan, rank: int, args: argparse.Namespace) -> tuple[float, list[float] | None]:
    """Seconds per step that the planner's price of sharding (``planner._sharding.shard_price``) adds to
    stage 0, on the links and the sharded layers' passes ``measure_cluster`` measures here (collective
    on every rank), and those passes' fitted costs (``ShardCosts.as_numbers``)."""
    import torch

    from dapple_lightning.planner import LayerProfile, ModelProfile, measure_cluster, shard_price, shard_sizes

    layer = (args.hidden * args.hidden + args.hidden) * 4
    # Only the parameter bytes enter the price of sharding's time; the times are placeholders.
    layers = [LayerProfile(f"l{i}", 1.0, 1.0, 0, layer if i % 2 == 0 else 0) for i in range(2 * args.layers)]
    profile = ModelProfile(tuple(layers), args.batch)
    stage = plan.stages[0]
    cluster = measure_cluster(torch.device("cpu"), shard_replicas=(stage.replicas,), shard_at=shard_sizes(profile))
    price = shard_price(
        profile,
        cluster,
        stage.start,
        stage.end,
        replicas=stage.replicas,
        mode=stage.shard,
        samples=args.batch // args.micro_batches // stage.replicas,
        depth=1,
        micro_batches=args.micro_batches,
    )
    costs = cluster.shard_costs_for(stage.replicas)
    return price.added_seconds, None if costs is None else costs.as_numbers()


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from dapple_lightning.plan import Plan
    from dapple_lightning.planner import live_bytes
    from dapple_lightning.runtime import Pipeline, local_part, p2p_groups, stage_group
    from dapple_lightning.surgery import partition

    sys.path.insert(0, str(ROOT / "tests"))
    from user_steps import LossStep

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    shard = None if args.mode == "none" else args.mode
    stages = [
        {"layers": [0, 2 * args.layers], "replicas": args.replicas, "shard": shard},
        {"layers": [2 * args.layers, 2 * args.layers + 1], "replicas": 1},
    ]
    plan = Plan(stages=stages, micro_batches=args.micro_batches)
    torch.manual_seed(0)
    blocks = [m for _ in range(args.layers) for m in (nn.Linear(args.hidden, args.hidden), nn.Tanh())]
    model = nn.Sequential(*blocks, nn.Linear(args.hidden, 8))
    stage = partition(model, plan, rank)
    del model, blocks
    pipe = Pipeline(
        plan, rank, stage, device=torch.device("cpu"), stage_group=stage_group(plan, rank), p2p_groups=p2p_groups()
    )
    optimizer = torch.optim.Adam(stage.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(args.batch, args.hidden, generator=g), torch.randn(args.batch, 8, generator=g)

    def forward(m, rows):
        out = stage(x[rows.start : rows.stop])
        return nn.functional.mse_loss(out, y[rows.start : rows.stop]) * (len(rows) / args.batch)

    def held(values) -> int:
        return sum(local_part(v).numel() * local_part(v).element_size() for v in values)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        pipe.run(args.batch, LossStep(forward))
        optimizer.step()

    param_bytes = held(stage.parameters())
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here on
    rss_start = _status("VmRSS")
    with live_bytes() as tracker:
        for index in range(MEMORY_STEPS):
            step()
            if index == 0:  # the peaks of the later steps: the first makes Adam's state and FSDP2's buffers
                tracker.reset_peak()
                Path("/proc/self/clear_refs").write_text("5")
    rss = _status("VmHWM") - rss_start
    # Timed outside the tracker: its dispatch hook runs on every op, and a sharded layer runs many more.
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    predicted, costs = _predicted_cost(plan, rank, args)  # collective: measures the links
    grads = [p.grad for p in stage.parameters() if p.grad is not None]
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    layer_bytes = (args.hidden * args.hidden + args.hidden) * 4
    write_record(
        rank,
        {
            "stage": plan.stage_of(rank),
            "state": param_bytes + held(grads) + held(state),
            "tracker": param_bytes + tracker.peak,
            "rss": rss,
            "step": statistics.median(times),
            "costs": costs,
            "layer": layer_bytes,
            "predicted": predicted,
        },
    )
    dist.barrier()
    pipe.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=48)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mode", choices=MODES, default="none")
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        (args.replicas,) = args.replicas
        worker(args)
        return
    # A fixed mmap threshold: glibc otherwise raises it after each large free and keeps such blocks in
    # the heap, so that the resident size would show what the allocator cached, not what is alive.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    common = ["--layers", str(args.layers), "--hidden", str(args.hidden), "--batch", str(args.batch)]
    common += ["--micro-batches", str(args.micro_batches), "--steps", str(args.steps)]
    results: dict[tuple[int, str], list[list[dict]]] = {}
    for round_ in range(args.rounds):
        for r in args.replicas:
            order = MODES[round_ % len(MODES) :] + MODES[: round_ % len(MODES)]  # no mode always first
            for mode in order:
                records = launch(
                    __file__,
                    [*common, "--worker", "--replicas", str(r), "--mode", mode],
                    r + 1,
                    timeout=600,
                    what=f"r={r} shard={mode}",
                )
                results.setdefault((r, mode), []).append([rec for rec in records if rec["stage"] == 0])
    _memory_table(results, args.replicas)
    print()
    _time_table(results, args.replicas)
    print(json.dumps({f"{r}:{m}": v for (r, m), v in results.items()}))


def _memory_table(results: dict[tuple[int, str], list[list[dict]]], replicas: list[int]) -> None:
    print(
        "| r | shard | state MiB (of unsharded) | bound: unsharded / r + one layer | tracker peak MiB | RSS growth MiB |"
    )
    print("|---|---|---|---|---|---|")
    for r in replicas:
        base = max(rec["state"] for rnd in results[(r, "none")] for rec in rnd)
        for mode in MODES:
            recs = [rec for rnd in results[(r, mode)] for rec in rnd]
            state = max(rec["state"] for rec in recs)
            print(
                f"| {r} | {mode} | {state / MiB:.1f} ({state / base:.2f}) | {base / r / MiB + recs[0]['layer'] / MiB:.1f} "
                f"| {max(rec['tracker'] for rec in recs) / MiB:.1f} | {max(rec['rss'] for rec in recs) / MiB:.1f} |"
            )


def _median_interval(values: list[float], draws: int = 2000) -> tuple[float, float]:
    """A bootstrap 95% interval of the median of ``values`` (a fixed seed: the same values, the same interval)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def _time_table(results: dict[tuple[int, str], list[list[dict]]], replicas: list[int]) -> None:
    """Per round, the sharded step less the unsharded one of the same round (a paired difference), and
    the price the planner gave in the sharded run; their medians over the rounds and the ratio."""
    print(
        "| r | shard | step ms, unsharded -> sharded (median) | added ms per round | added ms: median [95% CI] "
        "| predicted ms: median (range) | predicted / measured | within 15% |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in replicas:
        unsharded = [statistics.median(rec["step"] for rec in rnd) for rnd in results[(r, "none")]]
        for mode in MODES[1:]:
            rounds = results[(r, mode)]
            sharded = [statistics.median(rec["step"] for rec in rnd) for rnd in rounds]
            added = [(s - u) * 1e3 for s, u in zip(sharded, unsharded)]
            predicted = [statistics.median(rec["predicted"] for rec in rnd) * 1e3 for rnd in rounds]
            low, high = _median_interval(added)
            ratio = statistics.median(predicted) / statistics.median(added)
            print(
                f"| {r} | {mode} | {statistics.median(unsharded) * 1e3:.1f} -> {statistics.median(sharded) * 1e3:.1f} "
                f"| {', '.join(f'{a:.1f}' for a in added)} | {statistics.median(added):.1f} [{low:.1f}, {high:.1f}] "
                f"| {statistics.median(predicted):.1f} ({min(predicted):.1f}-{max(predicted):.1f}) | {ratio:.2f} "
                f"| {'met' if abs(ratio - 1) <= 0.15 else 'missed'} |"
            )


if __name__ == "__main__":
    main()
