"""Memory and step time of a stage whose replicas shard their state (``shard:``), against the same stage unsharded.

A 2-stage plan ``r:1`` on ``r + 1`` CPU processes (gloo, one thread each), run by the runtime itself
(no Lightning): stage 0 holds ``--layers`` blocks of ``Linear(H, H)`` + ``Tanh`` on ``r`` replicas,
stage 1 one ``Linear(H, 8)`` and the loss; Adam; ``--micro-batches`` micro-batches of a global batch of
``--batch`` rows. Each configuration (``shard`` none, grads, full, for each ``r``) runs ``--steps``
steps; the configurations are interleaved over ``--rounds`` rounds.

Memory: each configuration (``shard`` none, grads, full, for each ``r``) runs in its own processes.
Per stage-0 rank it reports:

* **state**: the bytes this rank keeps of the stage's parameters, gradients and Adam state after a
  step (a sharded value counts its local shard);
* **tracker**: the peak of the project's live-bytes tracker (``planner.live_bytes``, following
  FSDP2's storage resizes too) over the training steps after the first, plus the parameters held
  before them (as ``benchmarks/memory.py`` measures);
* **RSS**: the process's peak resident memory over the steps after the first (``VmHWM`` after
  resetting it with ``/proc/self/clear_refs``) less its resident memory when the steps began.

Step time: for each ``r``, one set of processes builds the three configurations side by side and
runs ``--rounds`` rounds; in each, ``--steps`` steps of each configuration (in an order that turns
each round) and then the planner's price of sharding (``planner.shard_price`` on what
``planner.measure_cluster(shard_replicas=(r,))`` measures on these processes then). The cost of
sharding is each round's median step less the unsharded configuration's of the same round (a paired
difference, seconds apart on the same processes, so that the shared machine's load, which moves
between rounds, mostly cancels); it reports their median over the rounds with a bootstrap 95%
interval, beside the price's median.

    python benchmarks/sharding.py                       # r = 2 and 3: a few minutes
    python benchmarks/sharding.py --replicas 2 --rounds 2 --steps 4
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


def _profile(args: argparse.Namespace):
    """The stage's layers as the planner sees them: only the parameter bytes enter the price of
    sharding's time; the layers' own times are placeholders."""
    from dapple_lightning.planner import LayerProfile, ModelProfile

    layer = (args.hidden * args.hidden + args.hidden) * 4
    layers = [LayerProfile(f"l{i}", 1.0, 1.0, 0, layer if i % 2 == 0 else 0) for i in range(2 * args.layers)]
    return ModelProfile(tuple(layers), args.batch)


def _price(plan, cluster, args: argparse.Namespace) -> float:
    """Seconds per step that the planner's price of sharding (``planner.shard_price``) adds to stage 0."""
    from dapple_lightning.planner import shard_price

    stage = plan.stages[0]
    return shard_price(
        _profile(args),
        cluster,
        stage.start,
        stage.end,
        replicas=stage.replicas,
        mode=stage.shard,
        samples=args.batch // args.micro_batches // stage.replicas,
        depth=1,
        micro_batches=args.micro_batches,
    ).added_seconds


def _build(args: argparse.Namespace, rank: int, mode: str):
    """``(plan, stage module, step function)`` of configuration ``mode`` on this rank (collective: its groups)."""
    import torch
    from torch import nn

    from dapple_lightning.plan import Plan
    from dapple_lightning.runtime import Pipeline, p2p_groups, stage_group
    from dapple_lightning.surgery import partition

    sys.path.insert(0, str(ROOT / "tests"))
    from user_steps import LossStep

    shard = None if mode == "none" else mode
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

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        pipe.run(args.batch, LossStep(forward))
        optimizer.step()

    step.pipe, step.optimizer = pipe, optimizer  # type: ignore[attr-defined]
    return plan, stage, step


def worker(args: argparse.Namespace) -> None:
    """Memory of one configuration (``--mode``)."""
    import torch
    import torch.distributed as dist

    from dapple_lightning.planner import live_bytes
    from dapple_lightning.runtime import local_part

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    plan, stage, step = _build(args, rank, args.mode)

    def held(values) -> int:
        return sum(local_part(v).numel() * local_part(v).element_size() for v in values)

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
    optimizer = step.optimizer  # type: ignore[attr-defined]
    grads = [p.grad for p in stage.parameters() if p.grad is not None]
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    write_record(
        rank,
        {
            "stage": plan.stage_of(rank),
            "state": param_bytes + held(grads) + held(state),
            "tracker": param_bytes + tracker.peak,
            "rss": rss,
            "layer": (args.hidden * args.hidden + args.hidden) * 4,
        },
    )
    dist.barrier()
    step.pipe.close()  # type: ignore[attr-defined]
    dist.destroy_process_group()


def time_worker(args: argparse.Namespace) -> None:
    """Step times of the three configurations, interleaved over ``--rounds`` rounds on the same
    processes, and the planner's price of sharding measured after each round's steps."""
    import torch
    import torch.distributed as dist

    from dapple_lightning.planner import measure_cluster, shard_sizes

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    built = {mode: _build(args, rank, mode) for mode in MODES}
    for _, _, step in built.values():
        for _ in range(MEMORY_STEPS):  # warm: Adam's state, FSDP2's buffers, the connections
            step()
    rounds = []
    for index in range(args.rounds):
        steps = {}
        for mode in MODES[index % len(MODES) :] + MODES[: index % len(MODES)]:  # no mode always first
            dist.barrier()
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                built[mode][2]()
                times.append(time.perf_counter() - start)
            steps[mode] = statistics.median(times)
        at = shard_sizes(_profile(args))
        cluster = measure_cluster(torch.device("cpu"), shard_replicas=(args.replicas,), shard_at=at)
        predicted = {mode: _price(built[mode][0], cluster, args) for mode in MODES[1:]}
        rounds.append({"steps": steps, "predicted": predicted, "costs": cluster.shard_costs[0].as_numbers()})
    write_record(rank, {"stage": built["none"][0].stage_of(rank), "rounds": rounds})
    dist.barrier()
    for _, _, step in built.values():
        step.pipe.close()  # type: ignore[attr-defined]
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=48)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--mode", choices=MODES, default="none", help="the memory worker's configuration")
    parser.add_argument("--worker", choices=("memory", "time"))
    args = parser.parse_args()
    if args.worker:
        (args.replicas,) = args.replicas
        worker(args) if args.worker == "memory" else time_worker(args)
        return
    # A fixed mmap threshold: glibc otherwise raises it after each large free and keeps such blocks in
    # the heap, so that the resident size would show what the allocator cached, not what is alive.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    common = ["--layers", str(args.layers), "--hidden", str(args.hidden), "--batch", str(args.batch)]
    common += ["--micro-batches", str(args.micro_batches), "--steps", str(args.steps), "--rounds", str(args.rounds)]
    memory: dict[tuple[int, str], list[dict]] = {}
    timed: dict[int, list[dict]] = {}
    for r in args.replicas:
        for mode in MODES:
            records = launch(
                __file__,
                [*common, "--worker", "memory", "--replicas", str(r), "--mode", mode],
                r + 1,
                timeout=600,
                what=f"memory r={r} shard={mode}",
            )
            memory[(r, mode)] = [rec for rec in records if rec["stage"] == 0]
        records = launch(
            __file__, [*common, "--worker", "time", "--replicas", str(r)], r + 1, timeout=1800, what=f"time r={r}"
        )
        timed[r] = [rec for rec in records if rec["stage"] == 0]
    _memory_table(memory, args.replicas)
    print()
    _time_table(timed, args.replicas)
    print(json.dumps({"memory": {f"{r}:{m}": v for (r, m), v in memory.items()}, "time": timed}))


def _memory_table(memory: dict[tuple[int, str], list[dict]], replicas: list[int]) -> None:
    print(
        "| r | shard | state MiB (of unsharded) | bound: unsharded / r + one layer | tracker peak MiB | RSS growth MiB |"
    )
    print("|---|---|---|---|---|---|")
    for r in replicas:
        base = max(rec["state"] for rec in memory[(r, "none")])
        for mode in MODES:
            recs = memory[(r, mode)]
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


def _per_round(records: list[dict], mode: str, key: str = "steps") -> list[float]:
    """Milliseconds of ``key`` for ``mode`` in each round, the median over the stage's replicas."""
    rounds = len(records[0]["rounds"])
    return [statistics.median(rec["rounds"][i][key][mode] for rec in records) * 1e3 for i in range(rounds)]


def _time_table(timed: dict[int, list[dict]], replicas: list[int]) -> None:
    """Per round, each sharded configuration's step less the unsharded one's (stage 0's median over its
    replicas), and the price the planner gave after that round's steps; their medians and the ratio."""
    print(
        "| r | shard | step ms, unsharded -> sharded (median) | added ms per round | added ms: median [95% CI] "
        "| predicted ms: median (range) | predicted / measured | within 15% |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in replicas:
        records = timed[r]
        unsharded = _per_round(records, "none")
        for mode in MODES[1:]:
            sharded = _per_round(records, mode)
            added = [s - u for s, u in zip(sharded, unsharded)]
            predicted = _per_round(records, mode, "predicted")
            low, high = _median_interval(added)
            ratio = statistics.median(predicted) / statistics.median(added)
            print(
                f"| {r} | {mode} | {statistics.median(unsharded):.1f} -> {statistics.median(sharded):.1f} "
                f"| {', '.join(f'{a:.0f}' for a in added)} | {statistics.median(added):.1f} [{low:.1f}, {high:.1f}] "
                f"| {statistics.median(predicted):.1f} ({min(predicted):.1f}-{max(predicted):.1f}) | {ratio:.2f} "
                f"| {'met' if abs(ratio - 1) <= 0.15 else 'missed'} |"
            )


if __name__ == "__main__":
    main()
