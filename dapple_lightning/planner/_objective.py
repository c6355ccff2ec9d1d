"""What the planner minimises: step time (DAPPLE's), the largest per-device peak memory
(mCAP's, Dreuning et al., Euro-Par 2022), or step time among plans whose peak is within a margin
of the least.

Stage ``s``'s peak under the cost model (``_cost``) is its parameters, gradients and optimizer
state plus ``K_s`` micro-batches of its activations, ``K_s = min(S - s, M)`` for DAPPLE and
``M`` for GPipe; a plan's peak is the largest over its stages. Partitions balanced for time are
unbalanced in memory under 1F1B (the first stage keeps the most micro-batches alive), so the
plan that fits a model in the least memory per device is usually not the fastest one.

All three objectives are one search. :func:`least_memory` finds the least peak ``P`` of the
search space, a min-max dynamic program; the time search (``_search``) then runs with
``peak_limit(P, ...)`` in place of the device memory as its per-stage cap:

- ``"time"``: the device memory (DAPPLE);
- ``"memory"``: ``P`` itself, so it returns the plans at the least peak, fastest first (ties on
  memory broken by step time);
- ``"time-within-memory"``: ``(1 + memory_margin) P`` (never above the device memory), the
  fastest plans that need at most that much more than the least.

**Why a memory cap keeps the time search exact.** The search prunes a partial plan (a suffix)
only when others of the same state beat it in every number the latency depends on. A stage's
peak depends on its own layers, replicas and warm-up depth ``K``, and the state fixes ``K`` of
every stage still to come (through the suffix's stage count, up to ``M``); so whether the stages
in front fit under the cap is the same for every suffix of a state, and a suffix pruned by one
that beats it has, for each way of completing it under the cap, a completion of the other under
the same cap that is at least as fast. The cap only removes plans, each checked stage by stage
with the same float expressions as :meth:`CostModel.estimate`, so ``P`` itself passes. The plan
:func:`least_memory` returns is one of the space under any such cap, so its latency bounds the
search from the start (``_dp`` offers it first).

**Recomputation** (``recompute=True``): a stage may also recompute its activations
(``Stage.recompute``), which lowers its peak and lengthens its backward by its forward. The
least peak then takes, per stage, the lesser of its two peaks; the time search lets a stage
recompute exactly when it would exceed the cap otherwise. That keeps it exact: whether a stage
fits either way depends only on the stage and its ``K``, and where it fits as it is, recomputing
gives the same plan with a longer backward, never a faster one (latency only grows with ``B``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dapple_lightning.plan import Plan, Stage
from dapple_lightning.planner._cost import CostModel

__all__ = ["OBJECTIVES", "check_objective", "least_memory", "peak_limit"]

OBJECTIVES = ("time", "memory", "time-within-memory")
"""What :func:`~dapple_lightning.planner.plan_dapple` may minimise (see the module docstring)."""


def check_objective(objective: str, memory_margin: float) -> None:
    """Raise ``ValueError`` unless ``objective`` is one of :data:`OBJECTIVES` and
    ``memory_margin`` a finite number >= 0."""
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; choose one of {list(OBJECTIVES)}")
    margin = memory_margin
    if isinstance(margin, bool) or not isinstance(margin, int | float) or not (0 <= margin < math.inf):
        raise ValueError(
            f"memory_margin must be a finite number >= 0 (0.1: at most 1.1x the least peak), got {memory_margin!r}"
        )


def peak_limit(least: float, budget: float, objective: str, memory_margin: float) -> float:
    """The per-device peak a plan may reach under ``objective``, given the least peak of the
    search space (``least``) and the device memory (``budget``)."""
    check_objective(objective, memory_margin)
    if objective == "time":
        return budget
    if objective == "memory":
        return least
    return min(budget, least * (1 + memory_margin))


def least_memory(
    model: CostModel,
    candidates: Sequence[int],
    replicas: Sequence[int],
    schedule: str = "dapple",
    cuts: Sequence[int] | None = None,
    recompute: bool = False,
) -> tuple[float, Plan | None]:
    """The smallest per-device peak memory of any plan in the search space, and one such plan.

    With ``recompute``, each stage takes the lesser of its peaks keeping and recomputing its
    activations (the plan's stages say which).

    Placement does not change memory, so this is a min-max dynamic program over stages,
    replica counts, stage counts and micro-batch counts. ``cuts`` restricts where stages begin.
    A stage's memory only grows as it takes earlier layers, so once it reaches the best peak
    found, no longer stage can improve on it.
    """
    world = model.cluster.world_size
    layers = model.num_layers
    allowed = set(cuts or ())
    best: tuple[float, Plan | None] = (math.inf, None)
    for m in candidates:
        most = model.max_replicas(m)
        counts = [r for r in replicas if r <= most]
        # peak[j][(used, n)] = (smallest peak of a suffix [j, L) on `used` devices, n stages, its stages)
        peak: list[dict[tuple[int, int], tuple[float, tuple[tuple[int, int, int, bool], ...]]]] = [
            {} for _ in range(layers + 1)
        ]
        peak[layers][(0, 0)] = (0.0, ())
        for j in range(layers, 0, -1):
            for (used, n), (value, stages) in peak[j].items():
                left = world - used
                options = [r for r in counts if r < left]
                if left <= most:
                    options.append(left)
                for r in options:
                    closing = r == left
                    samples = model.samples(m, r)
                    depth = m if schedule == "gpipe" else min(n + 1, m)
                    for i in range(j - 1, -1, -1):
                        if closing != (i == 0) or (i and cuts is not None and i not in allowed):
                            continue
                        mem = model.memory.stage_bytes(i, j, samples, depth, r, m)
                        lean = model.memory.stage_bytes(i, j, samples, depth, r, m, True) if recompute else mem
                        # The lesser of two peaks that only grow with the stage grows too.
                        if min(mem, lean) >= best[0]:
                            break
                        value2 = max(value, min(mem, lean))
                        spec = ((i, j, r, lean < mem), *stages)
                        if closing:
                            if value2 < best[0]:
                                plan = Plan(tuple(Stage(a, b, c, None, d) for a, b, c, d in spec), m, schedule)
                                best = (value2, plan)
                        else:
                            key = (used + r, min(n + 1, m))
                            old = peak[i].get(key)
                            if old is None or value2 < old[0]:
                                peak[i][key] = (value2, spec)
    return best
