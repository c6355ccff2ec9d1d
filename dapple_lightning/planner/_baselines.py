"""Plans other planners would pick, judged by the same cost model as DAPPLE's.

- :func:`pipedream_plan`: PipeDream's optimizer. It minimises the slowest stage of an
  asynchronous pipeline, where a stage of ``r`` replicas takes ``(F + B) / r`` per
  micro-batch plus the all-reduce of its weights (PipeDream synchronises replicas after every
  minibatch, which is our micro-batch), and each cut costs twice its transfer (activations
  forward, gradients back). Its dynamic program over (layers, devices) with consecutive ranks
  is run for each micro-batch count; the synchronous cost model then picks the best.
- :func:`straight_plan`: a balanced straight pipeline (torchgpipe, DeepSpeed): one stage per
  device, cut by ``balanced_cuts`` on forward + backward time. With more devices than layers,
  the pipeline has the largest number of stages ``S <= L`` that divides the devices, each
  stage replicated ``W / S`` times (data parallelism over identical pipelines).
- :func:`data_parallel_plan`: one stage on every device (gradient accumulation over ``M``
  micro-batches when memory needs it).

Each is returned with the micro-batch count, among the same candidates the DAPPLE planner
uses, that the cost model finds fastest within device memory, or ``None`` when none fits.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from dapple_lightning.plan import Plan, Stage, balanced_cuts
from dapple_lightning.planner._cluster import Cluster
from dapple_lightning.planner._cost import CostModel, Estimate, Placement
from dapple_lightning.planner._dp import (
    PlannedPlan,
    _data_parallel_step,
    best_over_micro_batches,
    micro_batch_candidates,
    replica_candidates,
)
from dapple_lightning.planner._profile import LayerProfile, ModelProfile

__all__ = ["baselines", "data_parallel_plan", "pipedream_plan", "straight_plan"]


def _planned(model: CostModel, est: Estimate | None, method: str, dp_step: float | None) -> PlannedPlan | None:
    return None if est is None else PlannedPlan.predicted(model, est, dp_step, method=method)


def _setup(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch: int,
    optimizer_factor: float,
    micro_batches: Sequence[int] | None,
) -> tuple[CostModel, tuple[int, ...]]:
    """The cost model every baseline is judged by, and the micro-batch counts to try."""
    candidates = tuple(micro_batches) if micro_batches is not None else micro_batch_candidates(global_batch)
    return CostModel(profile, cluster, global_batch, optimizer_factor), candidates


def data_parallel_plan(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch: int,
    *,
    micro_batches: Sequence[int] | None = None,
    optimizer_factor: float = 2.0,
) -> PlannedPlan | None:
    """Pure data parallelism with the fastest micro-batch count that fits.

    Micro-batches here are gradient accumulation: one micro-batch of activations at a time.
    """
    model, candidates = _setup(profile, cluster, global_batch, optimizer_factor, micro_batches)
    world = cluster.world_size
    plans = (Plan.data_parallel(profile.num_layers, world, m) for m in candidates)
    est = best_over_micro_batches(model, plans)
    return _planned(model, est, "data-parallel", None if est is None else est.step_s)


def straight_plan(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch: int,
    *,
    micro_batches: Sequence[int] | None = None,
    schedule: str = "dapple",
    optimizer_factor: float = 2.0,
) -> PlannedPlan | None:
    """A balanced straight pipeline (see the module docstring) with its best micro-batch count."""
    model, candidates = _setup(profile, cluster, global_batch, optimizer_factor, micro_batches)
    world, layers = cluster.world_size, profile.num_layers
    count = max(s for s in range(1, min(world, layers) + 1) if world % s == 0)
    weights = [x.forward_s + x.backward_s for x in profile.layers]
    bounds = balanced_cuts(weights, count)
    stages = tuple(Stage(a, b, world // count) for a, b in itertools.pairwise(bounds))
    est = best_over_micro_batches(model, (Plan(stages, m, schedule) for m in candidates))
    return _planned(model, est, "straight", _data_parallel_step(model, candidates))


def _pipedream_stages(model: CostModel, micro_batches: int, replicas: Sequence[int]) -> tuple[Stage, ...] | None:
    """PipeDream's min-max dynamic program at ``micro_batches``, consecutive ranks."""
    cluster = model.cluster
    world, layers = cluster.world_size, model.num_layers
    g = cluster.devices_per_node
    m = micro_batches
    most = model.max_replicas(m)
    counts = sorted({r for r in replicas if r <= most} | ({world} if world <= most else set()))

    def place(first: int, r: int) -> Placement:
        ranks = range(first, first + r)
        return Placement.of(cluster, list(ranks))

    def stage_time(i: int, j: int, first: int, r: int) -> float:
        # Per micro-batch: the replicas share the work, and sync weights every micro-batch.
        fwd, bwd = model.compute(i, j, model.micro_batch_size(m))
        return (fwd + bwd) / r + model.allreduce(i, j, place(first, r))

    def cut_time(i: int, device: int) -> float:
        # Activations forward and gradients back over the link between devices device-1, device.
        nbytes = model.cut_bytes(i, m)
        if nbytes <= 0:
            return 0.0
        same = (device - 1) // g == device // g
        bw = cluster.intra_p2p_bw if same else cluster.inter_p2p_bw
        return 2 * (cluster.latency_s + nbytes / bw)

    # best[j][d]: (slowest stage time, stages) for layers [0, j) on devices [0, d).
    inf = (math.inf, ())
    best: list[list[tuple[float, tuple[Stage, ...]]]] = [[inf] * (world + 1) for _ in range(layers + 1)]
    for j in range(1, layers + 1):
        for r in counts:
            best[j][r] = min(best[j][r], (stage_time(0, j, 0, r), (Stage(0, j, r),)), key=lambda x: x[0])
        for d in range(2, world + 1):
            for r in counts:
                if r >= d:
                    break
                for i in range(1, j):
                    prev, stages = best[i][d - r]
                    if prev == math.inf:
                        continue
                    value = max(prev, cut_time(i, d - r), stage_time(i, j, d - r, r))
                    if value < best[j][d][0]:
                        best[j][d] = (value, (*stages, Stage(i, j, r)))
    value, stages = best[layers][world]
    return stages if value < math.inf else None


def pipedream_plan(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch: int,
    *,
    micro_batches: Sequence[int] | None = None,
    schedule: str = "dapple",
    optimizer_factor: float = 2.0,
    max_layers: int = 64,
) -> PlannedPlan | None:
    """PipeDream's optimizer's plan (see the module docstring) with its best micro-batch count.

    Profiles longer than ``max_layers`` are planned on groups of consecutive layers of about
    equal forward + backward time (PipeDream's dynamic program is cubic in layers).
    """
    model, candidates = _setup(profile, cluster, global_batch, optimizer_factor, micro_batches)
    counts = replica_candidates(cluster)
    coarse, bounds = _grouped(profile, max_layers)
    coarse_model = CostModel(coarse, cluster, global_batch, optimizer_factor)
    plans: list[Plan] = []
    for m in candidates:
        stages = _pipedream_stages(coarse_model, m, counts)
        if stages is not None:
            fine = tuple(Stage(bounds[s.start], bounds[s.end], s.replicas) for s in stages)
            plans.append(Plan(fine, m, schedule))
    est = best_over_micro_batches(model, plans)
    return _planned(model, est, "pipedream", _data_parallel_step(model, candidates))


def _grouped(profile: ModelProfile, most: int) -> tuple[ModelProfile, list[int]]:
    """``profile`` with consecutive layers merged into at most ``most`` groups, and the group bounds."""
    layers = profile.num_layers
    if layers <= most:
        return profile, list(range(layers + 1))
    weights = [x.forward_s + x.backward_s for x in profile.layers]
    bounds = balanced_cuts(weights, most)
    groups = []
    for a, b in itertools.pairwise(bounds):
        chunk = profile.layers[a:b]
        groups.append(
            LayerProfile(
                name=f"{chunk[0].name}..{chunk[-1].name}",
                forward_s=sum(x.forward_s for x in chunk),
                backward_s=sum(x.backward_s for x in chunk),
                activation_bytes=sum(x.activation_bytes for x in chunk),
                param_bytes=sum(x.param_bytes for x in chunk),
                forward_fixed_s=sum(x.forward_fixed_s for x in chunk),
                backward_fixed_s=sum(x.backward_fixed_s for x in chunk),
                update_s=sum(x.update_s for x in chunk),
                accumulate_s=sum(x.accumulate_s for x in chunk),
                optimizer_state_bytes=None
                if any(x.optimizer_state_bytes is None for x in chunk)
                else sum(x.optimizer_state_bytes for x in chunk),
            )
        )
    cuts = tuple(profile.cut_bytes[b] for b in bounds)
    return ModelProfile(tuple(groups), profile.profile_batch_size, profile.device, cuts), bounds


def baselines(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch: int,
    *,
    micro_batches: Sequence[int] | None = None,
    schedule: str = "dapple",
    optimizer_factor: float = 2.0,
) -> list[PlannedPlan]:
    """PipeDream's plan, the balanced straight pipeline and data parallelism (those that fit)."""
    options: dict[str, Any] = {"micro_batches": micro_batches, "optimizer_factor": optimizer_factor}
    found = [
        pipedream_plan(profile, cluster, global_batch, schedule=schedule, **options),
        straight_plan(profile, cluster, global_batch, schedule=schedule, **options),
        data_parallel_plan(profile, cluster, global_batch, **options),
    ]
    return [p for p in found if p is not None]
