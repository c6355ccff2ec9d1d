"""The largest transformer each planner objective fits under a fixed per-rank memory budget.

The search benchmark's transformer (embedding 512x256, ``N`` ``TransformerEncoderLayer(256, 4,
1024)``, head to 512; ``N + 2`` layers) with Adam, global batch 8 x sequence 256, on ``--ranks``
CPU processes (one thread each). For each objective the depth ``N`` grows until no plan fits
the budget; the largest fitting size is reported with its plan and predicted step:

    straight        the time-balanced straight pipeline (one stage per rank, cut so stages
                    carry equal forward + backward time), its best micro-batch count that fits
    time            ``plan_dapple(objective="time")``: DAPPLE's fastest plan under the budget
    memory          ``plan_dapple(objective="memory")``: mCAP's least per-rank peak
    memory+recompute  the same, stages allowed to recompute (``plan_dapple(recompute=True)``)
    shard-full      the 2:1 plan on 3 ranks whose first stage shards its state over its 2 replicas
    shard-grads     (``shard: full`` or ``grads``), the second stage on one rank recomputing only
                    where it would not fit otherwise (a sharded stage cannot recompute): the cut and
                    micro-batch count predicted fastest under the budget (``planner.estimate``, which
                    prices the sharded stage with ``planner.shard_price``); needs ``--ranks 3``
    offload         what ``plan="auto"`` chooses under the budget (``planner.shortlist_with_levers``):
                    in memory while a plan fits, then recomputing, then the stages over it
                    offloaded to local disk (``offload: auto``)
    auto            planned as ``offload``, then run with ``plan="auto"`` and the budget as
                    ``memory_limit``: the job profiles, plans and offloads by itself

The profile comes from one run of ``profile_layers`` on a model of 2 blocks (the blocks are
alike, so a model of any depth is that profile's block repeated). Then each objective's plan at
its largest size is trained for a few steps by Lightning; each rank's live-bytes tracker
(``planner.live_bytes``, from the start of training to its end, plus the rank's parameters)
(a sharded stage's: its shards, and the gathers, whose storages FSDP2 resizes in place) gives its
measured peak, which must be under the budget: where a plan kept in memory measures over it, the
planner's budget is lowered by the excess and the largest size planned and run again (the sizes
measured over, and the margin, are reported). The runs go through Lightning's budget:
``DappleStrategy(plan, memory_limit=budget)``, whose rank 0 prices the plan again on the real
batch and would warn if it were over (recorded).

An offloaded stage's reads run on its worker thread, which the live-bytes tracker does not see,
so each rank also measures its resident set: the kernel's peak (``VmHWM``, reset through
``/proc/self/clear_refs`` after the first step, which writes an offloaded stage out) over the later
steps, less the process's resident memory at the start of training without the rank's
parameters then (the libraries, Lightning, the process group). glibc serves blocks of 128 KiB and
more from mmap (``MALLOC_MMAP_THRESHOLD_``), so that freed tensors leave the resident set.

    python benchmarks/largest.py                       # plan, then one run per objective
    python benchmarks/largest.py --plan-only           # the planning table alone (seconds)
    python benchmarks/largest.py --objectives memory+recompute,offload   # without and with offload
    python benchmarks/largest.py --ranks 3 --objectives memory+recompute,shard-full,shard-grads,offload
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

if "--worker" in sys.argv:  # before torch is imported: one intra-op thread per rank
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._harness import bare_trainer, launch, lightning_timer, median, step_times, write_record  # noqa: E402

MiB = 2**20
BATCH, SEQ = 8, 256
OBJECTIVES = ("straight", "time", "memory", "memory+recompute", "shard-full", "shard-grads", "offload", "auto")
SHARDED = {"shard-full": "full", "shard-grads": "grads"}
SHARDED_RANKS = 3  # the 2:1 plan


# ============================================================================ models


def build(blocks: int, steps: int) -> tuple[Any, Any]:
    """The transformer of ``blocks`` blocks with Adam, and a loader of ``steps`` global batches."""
    import torch

    from benchmarks import search_models

    module, loader = search_models.transformer(BATCH, seq=SEQ, batches=steps, blocks=blocks)

    def configure_optimizers(self: Any) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    # A subclass rather than an attribute on the instance: Lightning looks at the class.
    module.__class__ = type(type(module).__name__, (type(module),), {"configure_optimizers": configure_optimizers})
    return module, loader


def profile(rows: int) -> Any:
    """The profile of a 2-block model on ``rows`` rows, with Adam."""
    import torch

    from dapple_lightning.planner import profile_layers

    torch.set_num_threads(1)
    module, loader = build(2, 1)
    first = next(iter(loader))[0][:rows]
    return profile_layers(list(module.layers), first, repeats=3, warmup=1, optimizer=torch.optim.Adam)


def deepen(base: Any, blocks: int) -> Any:
    """``base`` (embedding, block, block, head) as a model of ``blocks`` alike blocks."""
    from dapple_lightning.planner import ModelProfile

    emb, block, _, head = base.layers
    layers = (emb, *(dataclasses.replace(block, name=f"block{i}") for i in range(blocks)), head)
    cuts = (0, base.cut_bytes[1], *([base.cut_bytes[2]] * blocks), 0)
    return ModelProfile(layers, base.profile_batch_size, cut_bytes=cuts)


# ============================================================================ planning


def plan_for(objective: str, prof: Any, cluster: Any) -> Any:
    """The objective's plan (a ``PlannedPlan``) for ``prof`` under the cluster's memory, or ``None``."""
    from dapple_lightning.planner import plan_dapple, straight_plan

    if objective == "straight":
        return straight_plan(prof, cluster, BATCH)
    if objective in ("offload", "auto"):
        return _with_levers(prof, cluster)
    if objective in SHARDED:
        return _sharded_2_1(SHARDED[objective], prof, cluster)
    kind = "time" if objective == "time" else "memory"
    try:
        return plan_dapple(prof, cluster, BATCH, objective=kind, recompute=objective == "memory+recompute")[0]
    except ValueError:
        return None  # no plan fits


def _with_levers(prof: Any, cluster: Any) -> Any:
    """``plan="auto"``'s first choice under the budget (in memory, recomputing, then offloaded), or ``None``."""
    from types import SimpleNamespace

    from dapple_lightning.planner import estimate, shortlist_with_levers

    try:
        shortlist = shortlist_with_levers(prof, cluster, BATCH)
    except ValueError:
        return None  # no plan fits, even offloaded
    close, lever = shortlist[0], shortlist[2]  # the plans, priced; what the levers changed
    plan = close[0][0]
    priced = estimate(plan, prof, cluster, BATCH)
    return SimpleNamespace(
        plan=plan, predicted_step_s=priced.step_s, stage_memory_bytes=priced.memory_bytes, lever=lever
    )


def _sharded_2_1(mode: str, prof: Any, cluster: Any) -> Any:
    """The fastest predicted 2:1 plan under the budget whose first stage shards by ``mode``, or ``None``."""
    from types import SimpleNamespace

    from dapple_lightning import Plan
    from dapple_lightning.planner import estimate

    budget, layers = cluster.memory_bytes, len(prof.layers)
    best = None
    for cut in range(1, layers):
        for micro_batches in (1, 2, 4, 8):
            for recompute in (False, True):  # the one-replica stage recomputes only where it must
                stages = [
                    {"layers": [0, cut], "replicas": 2, "shard": mode},
                    {"layers": [cut, layers], "replicas": 1, "recompute": recompute},
                ]
                try:
                    plan = Plan(stages=stages, micro_batches=micro_batches)
                    priced = estimate(plan, prof, cluster, BATCH)
                except ValueError:
                    break  # this micro-batch count does not divide the batch
                if priced.memory_bytes[1] <= budget:
                    if priced.memory_bytes[0] <= budget and (best is None or priced.step_s < best.predicted_step_s):
                        best = SimpleNamespace(
                            plan=plan, predicted_step_s=priced.step_s, stage_memory_bytes=priced.memory_bytes
                        )
                    break
    return best


def largest(objective: str, base: Any, cluster: Any, most: int) -> tuple[int, Any]:
    """The most blocks (up to ``most``) the objective fits, and its plan there (0, None if none)."""
    found: tuple[int, Any] = (0, None)
    for blocks in range(1, most + 1):
        planned = plan_for(objective, deepen(base, blocks), cluster)
        if planned is None:
            break  # a deeper model needs at least as much memory per rank
        found = (blocks, planned)
    return found


# ============================================================================ workers


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist

    from dapple_lightning import DappleStrategy
    from dapple_lightning.planner import live_bytes
    from dapple_lightning.runtime import local_part

    torch.set_num_threads(1)

    class Probe(pl.Callback):
        """The live-bytes tracker from the start of training to its end; the resident set's peak after
        the first step, less what the process held at the start besides its parameters."""

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            # A sharded stage's parameters are DTensors: their storage is the local shard's.
            held = [local_part(t).untyped_storage() for t in [*pl_module.parameters(), *pl_module.buffers()]]
            self.before = sum({s.data_ptr(): s.nbytes() for s in held}.values())
            self.baseline = resident_mib("VmRSS") * MiB - self.before
            self.tracker = live_bytes()
            self.tracker.__enter__()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 0:  # an offloaded stage is on disk now
                Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from now

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.tracker.__exit__(None, None, None)
            self.resident = resident_mib("VmHWM") * MiB - self.baseline
            offload = getattr(pl_module.layers, "offload", None)
            self.window = None if offload is None else offload.window

    module, loader = build(args.blocks, args.steps)
    probe, timer = Probe(), lightning_timer()
    plan = json.loads(args.plan)
    strategy = DappleStrategy(plan, start_method="popen", memory_limit=args.budget_mib * MiB)
    trainer = bare_trainer(strategy, args.ranks, args.steps, [probe, timer])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, train_dataloaders=loader)
    rank = trainer.global_rank
    warned = any("predicted to need more memory" in str(w.message) for w in caught)
    record = {"stage": strategy.plan.stage_of(rank), "peak": probe.before + probe.tracker.peak, **timer.rec.data}
    record.update(resident=probe.resident, window=probe.window, warned=warned, plan=strategy.plan.describe())
    if strategy.auto_plan is not None:
        record.update(lever=strategy.auto_plan.lever, profiling_s=strategy.auto_plan.profiling_s)
    write_record(rank, record)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def resident_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def run(objective: str, blocks: int, planned: Any, args: argparse.Namespace) -> dict[str, Any]:
    plan = "auto" if objective == "auto" else planned.plan.to_dict()
    spec = ["--worker", "--blocks", str(blocks), "--plan", json.dumps(plan), "--steps", str(args.steps)]
    spec += ["--ranks", str(args.ranks), "--budget-mib", str(args.budget_mib)]
    # Blocks of 128 KiB and more from mmap, back to the kernel when freed: the resident set is what is live.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    records = launch(__file__, spec, args.ranks, timeout=args.timeout, what=f"{objective} at {blocks} blocks")
    periods, _ = step_times(records[0], args.warmup)
    return {
        "step_s": median(periods),
        "peaks": [r["peak"] for r in records],
        "resident": [r["resident"] for r in records],
        "windows": [r["window"] for r in records],
        "warned": any(r["warned"] for r in records),
        "stages": [r["stage"] for r in records],
        "ran": records[0]["plan"],
        "ran_lever": records[0].get("lever"),
        "profiling_s": records[0].get("profiling_s"),
    }


# ======================================================================= orchestration


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--blocks", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=int, default=4, help="CPU rank processes (default 4)")
    parser.add_argument("--budget-mib", type=float, default=160.0, help="memory budget per rank in MiB (160)")
    parser.add_argument("--most", type=int, default=48, help="deepest model tried, in blocks (48)")
    parser.add_argument("--steps", type=int, default=5, help="training steps per run (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the step time (default 2)")
    parser.add_argument("--plan-only", action="store_true", help="plan, do not train")
    parser.add_argument(
        "--objectives", default=",".join(OBJECTIVES), help="comma-separated, of: " + " ".join(OBJECTIVES)
    )
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from dapple_lightning.planner import cores
    from dapple_lightning.search import local_cluster

    # The ranks share the machine's cores: the time objectives know it (Cluster.compute_units).
    units = min(cores(), args.ranks)
    cluster = local_cluster(args.ranks, units if units < args.ranks else None, args.budget_mib * MiB)
    base = profile(BATCH // 2)
    rows = []
    chosen = args.objectives.split(",")
    if unknown := sorted(set(chosen) - set(OBJECTIVES)):
        parser.error(f"unknown objectives {unknown}; choose from {list(OBJECTIVES)}")
    if args.ranks != SHARDED_RANKS and set(chosen) & set(SHARDED):
        parser.error(f"the sharded objectives plan 2:1: give --ranks {SHARDED_RANKS}")
    for objective in chosen:
        blocks, planned = largest(objective, base, cluster, args.most)
        over: list[tuple[int, float]] = []  # (blocks, MiB): sizes planned under the budget, measured over it
        margin = 0.0  # what the runs measured over the budget, taken off the planner's
        while True:
            row = describe(objective, blocks, planned, base)
            if planned is None or args.plan_only:
                break
            row.update(run(objective, blocks, planned, args))
            # The tracker measures a stage in memory; an offloaded one's reads escape it (see above).
            measured = not any(s.offload is not None for s in planned.plan.stages) and objective != "auto"
            excess = max(row["peaks"]) - args.budget_mib * MiB
            if not measured or excess <= 0:
                break
            over.append((blocks, max(row["peaks"]) / MiB))
            print(json.dumps({"objective": objective, "measured_over": over[-1], "plan": row["plan"]}), flush=True)
            margin += excess
            tighter = dataclasses.replace(cluster, memory_bytes=cluster.memory_bytes - margin)
            blocks, planned = largest(objective, base, tighter, blocks - 1)
        row.update(over=over, margin_mib=margin / MiB)
        rows.append(row)
        print(json.dumps(row), flush=True)
    report(rows, args.budget_mib)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


def describe(objective: str, blocks: int, planned: Any, base: Any) -> dict[str, Any]:
    """The row of ``objective``'s plan at ``blocks`` blocks, as planned (``planned`` ``None``: none fits)."""
    row: dict[str, Any] = {"objective": objective, "blocks": blocks if planned is not None else 0}
    if planned is not None:
        plan = planned.plan
        row.update(
            plan=plan.describe(),
            recompute=",".join(str(k) for k, s in enumerate(plan.stages) if s.recompute) or "-",
            lever=getattr(planned, "lever", None),
            params_m=sum(x.param_bytes for x in deepen(base, blocks).layers) / 4e6,
            predicted_step_s=planned.predicted_step_s,
            predicted_mib=[m / MiB for m in planned.stage_memory_bytes],
        )
    return row


def report(rows: list[dict[str, Any]], budget_mib: float) -> None:
    print(f"\n| objective | largest N (blocks) | parameters | plan | predicted step s | measured step s | "
          f"predicted peak MiB per stage | measured peak MiB per rank (budget {budget_mib:.0f}) | "
          "resident peak MiB per rank | warned |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if not r["blocks"]:
            print(f"| {r['objective']} | none fits | | | | | | | | |")
            continue
        measured = "; ".join(f"{p / MiB:.1f}" for p in r.get("peaks", [])) or "not run"
        under = "" if "peaks" not in r else (" (all under)" if max(r["peaks"]) <= budget_mib * MiB else " (OVER)")
        resident = "; ".join(f"{p / MiB:.1f}" for p in r.get("resident", [])) or "not run"
        step = f"{r['step_s']:.3f}" if "step_s" in r else "not run"
        predicted = "; ".join(f"{m:.1f}" for m in r["predicted_mib"])
        print(
            f"| {r['objective']} | {r['blocks']} | {r['params_m']:.1f} M | {r['plan']} | "
            f"{r['predicted_step_s']:.3f} | {step} | {predicted} | {measured}{under} | {resident} | "
            f"{r.get('warned', 'not run')} |"
        )
        if r.get("ran") and r["ran"] != r["plan"]:
            print(f"  ({r['objective']}: ran {r['ran']}; {r.get('ran_lever')}; planned in {r.get('profiling_s')} s)")
        for blocks, mib in r.get("over", []):
            print(f"  ({r['objective']}: {blocks} blocks planned under the budget, measured {mib:.1f} MiB on a rank)")
        if r.get("margin_mib"):
            print(
                f"  ({r['objective']}: planned {r['margin_mib']:.1f} MiB under the budget, what the runs over it measured)"
            )
        if r.get("lever"):
            print(f"  ({r['objective']}: {r['lever']}; windows chosen per rank: {r.get('windows')})")


if __name__ == "__main__":
    main()
