"""When no plan fits the memory budget: recomputation, then offload (``plan="auto"``'s last levers).

``plan="auto"`` asks the planner (:func:`~._select.shortlist`) for plans whose stages keep their
activations and their layers in memory. When none fits ``Cluster.memory_bytes`` that way,
:func:`shortlist_with_levers` tries, in turn:

1. **recomputation**: ``plan_dapple(recompute=True)``'s fastest plan, in which a stage recomputes
   its activations only where it would not fit otherwise;
2. **offload** (STRONGHOLD, ``Stage.offload``), where the runtime can offload (one
   ``nn.Sequential`` on CPU: the caller says when it cannot): the planner's
   :data:`OFFLOAD_CANDIDATES` fastest plans and as many of least peak memory (mCAP's objective:
   the fastest put most layers on the first stages, whose activations then fill the budget), with
   the budget lifted, each with the stages predicted over the budget offloaded (``offload:
   "auto"``, priced at its widest window, see ``_stage_memory``), kept when every stage then fits. The plan that offloads the fewest layers
   (counted on every replica) wins, the fastest predicted among equals: the transfers are what
   the cost model does not price (the disk's speed is measured only in the offloaded stage's first
   step, which then picks a window that hides them where it can), so its predicted step is the
   in-memory one, and fewer layers moved is the cheaper side of that unknown.

Each lever comes with a note for the setup report: which stages recompute or are offloaded, and why.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dapple_lightning.plan import Plan
from dapple_lightning.planner._budget import format_bytes
from dapple_lightning.planner._cluster import Cluster
from dapple_lightning.planner._cost import estimate
from dapple_lightning.planner._dp import plan_dapple
from dapple_lightning.planner._profile import ModelProfile
from dapple_lightning.planner._select import shortlist_offering

__all__ = ["OFFLOAD_CANDIDATES", "offloaded_plan", "shortlist_with_levers"]

OFFLOAD_CANDIDATES = 16
"""How many of the planner's fastest plans, and of its least-memory ones, :func:`offloaded_plan` offloads in turn."""

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
    **options: Any,
) -> Shortlist:
    """:func:`~._select.shortlist_offering` (``options`` are its own), or, when no plan fits the budget, the
    fastest plan that recomputes, else the offloaded plan of :func:`offloaded_plan`, with a note
    saying what was changed and why (``None`` when nothing was). ``offload_refused``: why the
    runtime cannot offload here (then offload is not tried, and the error says why).

    Raises:
        ValueError: When no plan fits with either lever; the planner's message, then why the
            levers did not help.
    """
    try:
        close, dp_step, offers = shortlist_offering(
            profile, cluster, global_batch, optimizer_factor=optimizer_factor, **options
        )
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
    if offload_refused is not None:
        raise ValueError(f"{first}; recomputing does not fit either, and offload cannot run here: {offload_refused}")
    found = offloaded_plan(profile, cluster, global_batch, optimizer_factor=optimizer_factor)
    if found is None:
        raise ValueError(f"{first}; neither recomputing nor offloading the stages over it (offload: auto) fits")
    plan, predicted, note = found
    return [(plan, predicted)], None, note, {}


def offloaded_plan(
    profile: ModelProfile, cluster: Cluster, global_batch: int, *, optimizer_factor: float = 2.0
) -> tuple[Plan, float, str] | None:
    """The plan that fits ``cluster``'s budget with the fewest offloaded layers (see the module
    docstring), its predicted step (the in-memory one) and a note naming the offloaded stages with
    their peaks in memory and offloaded; ``None`` when offloading fits no candidate."""
    budget = cluster.memory_bytes
    lifted = dataclasses.replace(cluster, memory_bytes=_LIFTED)
    best: tuple[tuple[int, float], Plan, str] | None = None
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
    for plan in dict.fromkeys(candidates):
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
