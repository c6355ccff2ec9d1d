"""The price of sharding a stage's state over its replicas (``Stage.shard``): memory per rank and
the collectives' time, for ``plan="auto"`` to try before offload when a plan does not fit.

Memory. A stage of layers ``[i, j)`` on ``r`` replicas (``_stage_memory`` writes out the unsharded
terms: ``static`` = parameters + gradients + optimizer state, ``kept``, ``transient``, the second
set of gradients ``grads`` and ``closing``) holds per rank::

    shard: full    static / r + 2 x largest layer's parameters        + the unsharded activation terms
    shard: grads   parameters + gradients + optimizer state / r        + the unsharded activation terms

Under ``full`` one layer at a time is gathered, and its whole gradient lives until its backward's
reduce-scatter (the two largest-layer terms); the second set of gradients and the optimizer step's
temporaries shrink by ``r`` as well (they are shards). Under ``grads`` the parameters are gathered
for the whole step and the gradients accumulate whole until the step's last backward, so only the
optimizer state (and its step's temporaries) shrinks.

Time, added to the unsharded stage's step (its gradient all-reduce, which the cost model already
prices, is replaced by the sharded passes): where the cluster holds what FSDP2's passes cost on
``replicas`` ranks (``Cluster.shard_costs``, measured by ``_links.measure_shard_costs``), each
sharded layer's passes over the step's ``M`` micro-batches as the runtime makes them
(``_shard_costs.ShardCosts.added``), less the all-reduce. Without them (a preset cluster, a replica
count not measured, a stage across nodes), the collectives on the all-reduce links alone, with an
all-gather (``AG``) and a reduce-scatter (``RS``) of the stage's parameter bytes each half a ring
all-reduce (``AR = AG + RS``)::

    shard: full    2 M AG + M RS - AR = (2 M - 1) AG + (M - 1) RS
    shard: grads   AG + RS - AR = 0, plus AG not hidden (the gather before the step's first forward)

which on CPU comes out far under the measured cost (docs/benchmarks.md: FSDP2's copies and hooks
around each collective, on the compute thread, weigh more than the bytes). Every pass is counted as exposed (on
GPUs prefetching hides part of the gathers, which this errs against).

:func:`sharded_plan` is the lever: the stages of replicas over the budget, sharded ``grads`` where
that fits, else ``full``; ``planner._levers`` tries it after recomputation and before offload, and
``_cost.estimate`` prices a plan's sharded stages with :func:`shard_price`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dapple_lightning.plan import Plan
from dapple_lightning.planner._cluster import Cluster
from dapple_lightning.planner._profile import ModelProfile
from dapple_lightning.planner._stage_memory import StageMemory, peak_bytes

__all__ = ["ShardPrice", "shard_price", "sharded_plan"]


@dataclasses.dataclass(frozen=True)
class ShardPrice:
    """A stage's bytes per rank and the seconds per step that sharding adds."""

    bytes: float
    added_seconds: float


def shard_price(
    profile: ModelProfile,
    cluster: Cluster,
    start: int,
    end: int,
    *,
    replicas: int,
    mode: str | None,
    samples: int,
    depth: int,
    micro_batches: int,
    optimizer_factor: float = 2.0,
    nodes_spanned: int = 1,
) -> ShardPrice:
    """The price of stage ``[start, end)`` on ``replicas`` ranks sharded by ``mode`` (``None``: unsharded,
    no time added), each rank running ``samples`` per micro-batch and keeping ``depth`` micro-batches."""
    memory = StageMemory(profile, optimizer_factor)
    static, kept, transient, grads, closing = memory.parts(start, end, samples, replicas)
    if mode is None or replicas < 2:
        return ShardPrice(peak_bytes((static, kept, transient, grads, closing), depth, micro_batches), 0.0)
    layers = profile.layers[start:end]
    params = float(sum(x.param_bytes for x in layers))
    optimizer = float(sum(x.optimizer_bytes(optimizer_factor) for x in layers))
    if mode == "full":
        static = (2 * params + optimizer) / replicas + 2.0 * max(x.param_bytes for x in layers)
        grads, closing = grads / replicas, closing / replicas
    elif mode == "grads":
        static = 2 * params + optimizer / replicas
        closing = closing / replicas
    else:
        raise ValueError(f"shard must be 'grads', 'full' or None, got {mode!r}")
    costs = cluster.shard_costs_for(replicas) if nodes_spanned <= 1 else None
    if costs is not None:
        units = [float(x.param_bytes) for x in layers if x.param_bytes > 0]
        added = costs.added(mode, units, micro_batches) - cluster.allreduce_time(params, replicas, nodes_spanned)
    else:
        per_byte, fixed = cluster.allreduce_coefficients(replicas, nodes_spanned)
        half = params * per_byte / 2 + fixed / 2  # one all-gather, or one reduce-scatter
        added = (3 * micro_batches - 2) * half if mode == "full" else half
    return ShardPrice(peak_bytes((static, kept, transient, grads, closing), depth, micro_batches), added)


def sharded_plan(
    plan: Plan,
    profile: ModelProfile,
    cluster: Cluster,
    budget: float,
    *,
    samples: Sequence[int],
    depths: Sequence[int],
    optimizer_factor: float = 2.0,
) -> tuple[Plan, float] | None:
    """``plan`` with each stage that is over ``budget`` sharded (``grads`` where that fits, else ``full``)
    and the seconds per step that adds; ``None`` when a stage still does not fit (or has one replica).
    ``samples`` and ``depths``: per stage, the rows per micro-batch on one rank and the micro-batches kept."""
    stages = list(plan.stages)
    added = 0.0
    for index, stage in enumerate(stages):
        price = {
            mode: shard_price(
                profile,
                cluster,
                stage.start,
                stage.end,
                replicas=stage.replicas,
                mode=mode,
                samples=samples[index],
                depth=depths[index],
                micro_batches=plan.micro_batches,
                optimizer_factor=optimizer_factor,
                nodes_spanned=cluster.span(plan.stage_ranks(index)),
            )
            for mode in (None, "grads", "full")
        }
        if price[None].bytes <= budget:
            continue
        fitting = [mode for mode in ("grads", "full") if stage.replicas > 1 and price[mode].bytes <= budget]
        if not fitting:
            return None
        stages[index] = dataclasses.replace(stage, shard=fitting[0])
        added += price[fitting[0]].added_seconds
    return dataclasses.replace(plan, stages=tuple(stages)), added
