"""When no plan fits the memory budget: recomputation, sharding, then offload (``plan="auto"``'s last levers).

``plan="auto"`` asks the planner (:func:`~._select.shortlist`) for plans whose stages keep their
activations and their layers in memory. When none fits ``Cluster.memory_bytes`` that way,
:func:`shortlist_with_levers` tries, in turn:

1. **recomputation**: ``plan_dapple(recompute=True)``'s fastest plan, in which a stage recomputes
   its activations only where it would not fit otherwise;
2. **sharding** (``Stage.shard``), where the runtime accepts it: the same candidates as offload's
   below and data parallelism (:data:`DATA_PARALLEL_MICRO_BATCHES`), with the budget lifted, each
   with its stages over the budget sharded over their replicas (:func:`~._sharding.sharded_plan`:
   ``grads`` where that fits, else ``full``); a candidate is
   dropped when a stage over the budget has one replica, when it has chunks or a zero-bubble
   schedule (which the runtime does not shard under), or when the caller's ``shard_refused`` names
   a reason (recovery on, tied weights across stages, a stage across nodes). The fastest predicted,
   collectives included, wins: sharding only adds messages, which the cost model prices, so it
   comes before offload, whose disk transfers it does not;
3. **offload** (STRONGHOLD, ``Stage.offload``), where the runtime can offload (one
   ``nn.Sequential`` on CPU: the caller says when it cannot): the planner's
   :data:`OFFLOAD_CANDIDATES` fastest plans and as many of least peak memory (mCAP's objective:
   the fastest put most layers on the first stages, whose activations then fill the budget), with
   the budget lifted, each with the stages predicted over the budget offloaded (``offload:
   "auto"``, priced at its widest window, see ``_stage_memory``), kept when every stage then fits. The plan that offloads the fewest layers
   (counted on every replica) wins, the fastest predicted among equals: the transfers are what
   the cost model does not price (the disk's speed is measured only in the offloaded stage's first
   step, which then picks a window that hides them where it can), so its predicted step is the
   in-memory one, and fewer layers moved is the cheaper side of that unknown.

Each lever comes with a note for the setup report: which stages recompute, shard or are offloaded, and why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from dapple_lightning.plan import ZERO_BUBBLE, Plan
from dapple_lightning.planner._budget import format_bytes
from dapple_lightning.planner._cluster import Cluster
from dapple_lightning.planner._cost import estimate
from dapple_lightning.planner._dp import plan_dapple
from dapple_lightning.planner._profile import ModelProfile
from dapple_lightning.planner._select import shortlist
from dapple_lightning.planner._sharding import sharded_plan

__all__ = [
    "DATA_PARALLEL_MICRO_BATCHES",
    "OFFLOAD_CANDIDATES",
    "ShardRefusal",
    "offloaded_plan",
    "sharded_lever",
    "shortlist_with_levers",
]

OFFLOAD_CANDIDATES = 16
"""How many of the planner's fastest plans, and of its least-memory ones, :func:`sharded_lever` shards and
:func:`offloaded_plan` offloads in turn."""

DATA_PARALLEL_MICRO_BATCHES = (1, 2, 4)
"""The micro-batch counts of the data-parallel plans :func:`sharded_lever` shards besides the planner's."""

ShardRefusal = Callable[[Plan], str | None]
"""Why the runtime cannot run a plan's sharded stages here (``strategy._refusals.sharding_refusal``), or ``None``."""

_LIFTED = 1e30  # bytes: a budget no stage reaches (the cluster wants a finite one)

Shortlist = tuple[list[tuple[Plan, float]], float | None, str | None, dict[Plan, str]]
"""Close plans with their predicted steps, data parallelism's predicted step, the lever's note, and
why each chunked plan among them was offered."""


def _no_fit(error: ValueError) -> bool:
    return str(error).startswith("no plan fits in")  # the planner's message for memory, not for the batch


def shortlist_with_levers(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch: int,
    *,
    optimizer_factor: float = 2.0,
    offload_refused: str | None = None,
    shard_refused: ShardRefusal | None = None,
    **options: Any,
) -> Shortlist:
    """:func:`~._select.shortlist` (``options`` are its own), or, when no plan fits the budget, the
    fastest plan that recomputes, else the sharded plan of :func:`sharded_lever`, else the offloaded
    plan of :func:`offloaded_plan`, with a note saying what was changed and why (``None`` when
    nothing was). ``offload_refused``: why the runtime cannot offload here (then offload is not
    tried, and the error says why); ``shard_refused``: why it cannot run a given sharded plan here.

    Raises:
        ValueError: When no plan fits with either lever; the planner's message, then why the
            levers did not help.
    """
    try:
        close, dp_step, offers = shortlist(profile, cluster, global_batch, optimizer_factor=optimizer_factor, **options)
        return close, dp_step, None, offers
    except ValueError as error:
        if not _no_fit(error):
            raise
        first = error
    budget = format_bytes(cluster.memory_bytes)
    try:
        lean = plan_dapple(profile, cluster, global_batch, optimizer_factor=optimizer_factor, recompute=True)[0]
    except ValueError as error:
        if not _no_fit(error):
            raise
    else:
        stages = ", ".join(f"stage {k}" for k, s in enumerate(lean.plan.stages) if s.recompute)
        note = f"no plan fits memory_limit {budget} keeping every activation: {stages} recompute theirs"
        return [(lean.plan, lean.predicted_step_s)], None, note, {}
    found = sharded_lever(profile, cluster, global_batch, optimizer_factor=optimizer_factor, refused=shard_refused)
    if found is None:
        if offload_refused is not None:
            raise ValueError(
                f"{first}; recomputing does not fit either, and offload cannot run here: {offload_refused}"
            )
        found = offloaded_plan(profile, cluster, global_batch, optimizer_factor=optimizer_factor)
        if found is None:
            raise ValueError(f"{first}; neither recomputing nor offloading the stages over it (offload: auto) fits")
    plan, predicted, note = found
    return [(plan, predicted)], None, note, {}


def _candidates(profile: ModelProfile, cluster: Cluster, global_batch: int, optimizer_factor: float) -> list[Plan]:
    """The planner's :data:`OFFLOAD_CANDIDATES` fastest plans and as many of least peak memory, with
    ``cluster``'s budget lifted (the levers then bring them under it)."""
    lifted = dataclasses.replace(cluster, memory_bytes=_LIFTED)
    candidates = [
        planned.plan
        for objective in ("time", "memory")
        for planned in plan_dapple(
            profile,
            lifted,
            global_batch,
            top=OFFLOAD_CANDIDATES,
            optimizer_factor=optimizer_factor,
            objective=objective,
        )
    ]
    return list(dict.fromkeys(candidates))


def sharded_lever(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch: int,
    *,
    optimizer_factor: float = 2.0,
    refused: ShardRefusal | None = None,
) -> tuple[Plan, float, str] | None:
    """The fastest predicted plan that fits ``cluster``'s budget with its stages over it sharded
    (see the module docstring), its predicted step (sharding's collectives included) and a note
    naming each sharded stage with its peak per rank unsharded and sharded; ``None`` when sharding
    fits no candidate the runtime accepts."""
    budget = cluster.memory_bytes
    best: tuple[float, Plan, str] | None = None
    # Data parallelism too: the planner's fastest plans and its least-memory ones may all leave the
    # stage that holds most of the state on one replica (when the all-reduce is slow, or a pipeline is leaner).
    widest = [Plan.data_parallel(profile.num_layers, cluster.world_size, m) for m in DATA_PARALLEL_MICRO_BATCHES]
    for plan in dict.fromkeys([*_candidates(profile, cluster, global_batch, optimizer_factor), *widest]):
        if plan.chunks > 1 or plan.schedule in ZERO_BUBBLE:
            continue
        try:
            whole = estimate(plan, profile, cluster, global_batch, optimizer_factor=optimizer_factor)
        except ValueError:  # more micro-batches or replicas than the batch has rows for
            continue
        depths = [
            min(len(plan.stages) - k, plan.micro_batches) if plan.schedule == "dapple" else plan.micro_batches
            for k in range(len(plan.stages))
        ]
        found = sharded_plan(
            plan, profile, cluster, budget, samples=whole.samples, depths=depths, optimizer_factor=optimizer_factor
        )
        if found is None or found[0] == plan or (refused is not None and refused(found[0]) is not None):
            continue
        priced = estimate(found[0], profile, cluster, global_batch, optimizer_factor=optimizer_factor)
        if not priced.fits or (best is not None and priced.step_s >= best[0]):
            continue
        named = "; ".join(
            f"stage {k} (layers {stage.start}-{stage.end - 1}) shards its state over its {stage.replicas} replicas "
            f"(shard: {stage.shard}): {format_bytes(whole.memory_bytes[k])} per rank whole, "
            f"{format_bytes(priced.memory_bytes[k])} sharded"
            for k, stage in enumerate(found[0].stages)
            if stage.shard is not None
        )
        note = (
            f"no plan fits memory_limit {format_bytes(budget)} keeping its state whole, nor recomputing: {named}; "
            "the predicted step includes the gathers and reduce-scatters"
        )
        best = (priced.step_s, found[0], note)
    return None if best is None else (best[1], best[0], best[2])


def offloaded_plan(
    profile: ModelProfile, cluster: Cluster, global_batch: int, *, optimizer_factor: float = 2.0
) -> tuple[Plan, float, str] | None:
    """The plan that fits ``cluster``'s budget with the fewest offloaded layers (see the module
    docstring), its predicted step (the in-memory one) and a note naming the offloaded stages with
    their peaks in memory and offloaded; ``None`` when offloading fits no candidate."""
    budget = cluster.memory_bytes
    best: tuple[tuple[int, float], Plan, str] | None = None
    for plan in _candidates(profile, cluster, global_batch, optimizer_factor):
        whole = estimate(plan, profile, cluster, global_batch, optimizer_factor=optimizer_factor).memory_bytes
        over = [k for k, peak in enumerate(whole) if peak > budget]
        stages = [dataclasses.replace(s, offload="auto") if k in over else s for k, s in enumerate(plan.stages)]
        moved = dataclasses.replace(plan, stages=stages)
        priced = estimate(moved, profile, cluster, global_batch, optimizer_factor=optimizer_factor)
        if not priced.fits:
            continue
        rank = (sum((s.end - s.start) * s.replicas for s in stages if s.offload is not None), priced.step_s)
        if best is None or rank < best[0]:
            named = "; ".join(
                f"stage {k} (layers {stages[k].start}-{stages[k].end - 1}) {format_bytes(whole[k])} in memory, "
                f"{format_bytes(priced.memory_bytes[k])} offloaded"
                for k in over
            )
            note = (
                f"no plan fits memory_limit {format_bytes(budget)} in memory, nor recomputing: offload: auto on "
                f"{named}; the predicted step leaves out the transfers (the stage measures them in its first step)"
            )
            best = (rank, moved, note)
    return None if best is None else (best[1], best[0][1], best[2])
