"""A lower bound on the step of every plan a search may return, for a beam's gap to the optimum.

Every stage of a plan ends its step with its chains and then its all-reduce and optimizer step:
in the recurrence of ``_recurrence``, ``Z_t >= closing_t + D_t`` and ``D_t >= M (F_t + B_t)``,
and the latency ``Z_0`` is at least every ``Z_t``. So a plan's step is at least

    max over its stages of  closing(stage) + M (F + B)(stage)

with ``F + B`` at least the layers' compute on the stage's samples per micro-batch, and the
all-reduce at least the ring's over the fewest servers ``r`` devices can sit on. The least of
that maximum over the search space (contiguous stages at its cut points, replica counts from
``counts`` but the first stage's, at most the cluster's devices, each micro-batch count) is
found by bisection on the maximum: a dynamic program over cut points gives the fewest devices
that keep every stage at or under it.

Unlike the model's compute spread evenly over all devices (``_dp._record``'s other bound), this
one pays the all-reduce a stage's replicas need, which is what keeps a thousand-device plan from
being pure data parallelism; it does not count pipeline fill or the transfers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dapple_lightning.planner._cluster import Cluster
from dapple_lightning.planner._cost import CostModel

__all__ = ["stage_bound"]

# Bisection steps on the largest stage time: the bound is within 2**-30 of the range of the least.
_STEPS = 30
# Float sums here run in another order than the search's: stay a hair under.
_MARGIN = 1e-9


def stage_bound(
    model: CostModel, micro_batches: Sequence[int], counts: Sequence[int], cuts: Sequence[int] | None
) -> float:
    """A step time no plan of the search space beats (0 when there is no plan): see the module
    docstring. ``counts``: replica counts of stages after the first; ``cuts``: where stages may
    begin (``None``: every layer)."""
    layers = model.num_layers
    bounds = sorted({0, layers, *(range(1, layers) if cuts is None else (c for c in cuts if 0 < c < layers))})
    least = float("inf")
    for m in micro_batches:
        least = min(least, _least_max(model, m, counts, bounds, least))
    return 0.0 if not np.isfinite(least) else least * (1 - _MARGIN)


def _least_max(model: CostModel, m: int, counts: Sequence[int], bounds: list[int], ceiling: float) -> float:
    """The least, over plans at ``m`` micro-batches, of their largest stage time (a hair low), or
    ``inf`` when it is above ``ceiling`` (no plan at ``m`` keeps its stages under that)."""
    cluster = model.cluster
    world = cluster.world_size
    most = min(world, model.max_replicas(m))
    if most < 1:
        return float("inf")
    ff, bf, fv, bv, update = (np.asarray(x, dtype=float) for x in model.affine_prefix_sums())
    params = np.asarray(model.prefix_sums()[2], dtype=float)
    at = np.asarray(bounds)
    # Per pair of cut points (start a, end b): fixed and per-sample passes, parameters, update.
    fixed = (ff[at][None, :] - ff[at][:, None]) + (bf[at][None, :] - bf[at][:, None])
    per_sample = ((fv[at][None, :] - fv[at][:, None]) + (bv[at][None, :] - bv[at][:, None])) / (
        model.profile.profile_batch_size
    )
    nbytes = params[at][None, :] - params[at][:, None]
    steps = update[at][None, :] - update[at][:, None]

    def stage_times(starts: slice, replicas: np.ndarray) -> np.ndarray:
        """Least time of the stages from the cut points ``starts`` to every cut point (axes 0 and
        1) on each count of ``replicas`` (axis 2)."""
        samples = np.array([model.samples(m, int(r)) for r in replicas], dtype=float)
        ring = np.array([_ring(cluster, int(r)) for r in replicas])  # (seconds per byte, fixed)
        size = nbytes[starts]
        reduce = np.where(
            (replicas > 1)[None, None, :] & (size > 0)[:, :, None], size[:, :, None] * ring[:, 0] + ring[:, 1], 0.0
        )
        passes = fixed[starts][:, :, None] + per_sample[starts][:, :, None] * samples
        return m * passes + reduce + steps[starts][:, :, None]

    later = np.array(sorted({r for r in counts if 1 <= r <= most}), dtype=int)
    everywhere = slice(None)
    rest = stage_times(everywhere, later) if later.size else np.full((len(at), len(at), 0), np.inf)
    # The first stage [0, b) takes any count: the least time with at most c devices, per c.
    first = np.minimum.accumulate(stage_times(slice(0, 1), np.arange(1, most + 1))[0], axis=1)
    upper = min(float(first[-1, -1]), ceiling)  # the whole model on `most` devices is a plan
    lower = 0.0
    if not _fits(upper, rest, later, first, world):
        return float("inf")
    for _ in range(_STEPS):
        middle = (lower + upper) / 2
        if _fits(middle, rest, later, first, world):
            upper = middle
        else:
            lower = middle
    return lower


def _ring(cluster: Cluster, replicas: int) -> tuple[float, float]:
    """The cheapest ring all-reduce coefficients of ``replicas`` devices: on one server when they
    fit there (or over two, if that is cheaper on this cluster), else across servers."""
    spans = (1, 2) if replicas <= cluster.devices_per_node else (2,)
    per_byte, fixed = zip(*(cluster.allreduce_coefficients(replicas, n) for n in spans))
    return min(per_byte), min(fixed)


def _fits(limit: float, rest: np.ndarray, later: np.ndarray, first: np.ndarray, world: int) -> bool:
    """Whether some plan keeps every stage at or under ``limit`` on at most ``world`` devices."""
    points = rest.shape[0]
    ok = rest <= limit
    # Fewest devices of a stage between two cut points (inf: none within the limit).
    fewest = np.where(ok.any(axis=2), later[np.argmax(ok, axis=2)] if later.size else 0, np.inf)
    need = np.full(points, np.inf)
    need[-1] = 0.0
    for a in range(points - 2, 0, -1):
        need[a] = np.min(fewest[a, a + 1 :] + need[a + 1 :])
    # The first stage ends at cut point b and takes what the later stages leave.
    for b in range(1, points):
        left = world - need[b]
        if left >= 1 and first[b, int(min(left, first.shape[1])) - 1] <= limit:
            return True
    return False
