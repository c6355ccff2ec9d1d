"""The planner's price of sharding a stage (memory per rank, collectives' time) and its lever."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dapple_lightning.plan import Plan
from dapple_lightning.planner import Affine, Cluster, ShardCosts, estimate, fit_affine
from dapple_lightning.planner._profile import LayerProfile, ModelProfile
from dapple_lightning.planner._sharding import shard_price, sharded_plan

MiB = 2**20


def profile() -> ModelProfile:
    # Four layers of 8 MiB of parameters (Adam's state: twice that), 1 MiB of output each at batch 8.
    return ModelProfile(tuple(LayerProfile(f"l{i}", 0.01, 0.02, MiB, 8 * MiB) for i in range(4)), 8)


def test_sharding_divides_the_state_by_the_replicas_and_adds_the_collectives() -> None:
    cluster = Cluster.v100(1, 4)
    common = {"samples": 4, "depth": 1, "micro_batches": 4}
    none = shard_price(profile(), cluster, 0, 4, replicas=2, mode=None, **common)
    grads = shard_price(profile(), cluster, 0, 4, replicas=2, mode="grads", **common)
    full = shard_price(profile(), cluster, 0, 4, replicas=2, mode="full", **common)
    three = shard_price(profile(), cluster, 0, 4, replicas=3, mode="full", **common)
    state = 4 * (8 + 8 + 16) * MiB  # parameters, gradients, Adam
    activations = none.bytes - state
    assert none.added_seconds == 0
    assert grads.bytes == pytest.approx(state - 4 * 16 * MiB / 2 + activations)
    assert full.bytes == pytest.approx(state / 2 + 2 * 8 * MiB + activations)
    assert three.bytes == pytest.approx(state / 3 + 2 * 8 * MiB + activations)
    gather = 4 * 8 * MiB * (2 - 1) / 2 / cluster.intra_allreduce_bw + (2 - 1) * cluster.latency_s
    assert grads.added_seconds == pytest.approx(gather)
    assert full.added_seconds == pytest.approx((3 * 4 - 2) * gather)


def test_the_lever_shards_only_the_stages_over_the_budget_and_grads_first() -> None:
    cluster = Cluster.v100(1, 3)
    plan = Plan(stages=[{"layers": [0, 3], "replicas": 2}, {"layers": [3, 4], "replicas": 1}], micro_batches=2)
    sizes = {"samples": [4, 8], "depths": [2, 1]}
    unsharded = shard_price(profile(), cluster, 0, 3, replicas=2, mode=None, samples=4, depth=2, micro_batches=2)
    assert sharded_plan(plan, profile(), cluster, unsharded.bytes, **sizes) == (plan, 0.0)
    grads = shard_price(profile(), cluster, 0, 3, replicas=2, mode="grads", samples=4, depth=2, micro_batches=2)
    chosen, added = sharded_plan(plan, profile(), cluster, grads.bytes, **sizes)
    assert [s.shard for s in chosen.stages] == ["grads", None] and added == grads.added_seconds
    full = shard_price(profile(), cluster, 0, 3, replicas=2, mode="full", samples=4, depth=2, micro_batches=2)
    chosen, _ = sharded_plan(plan, profile(), cluster, full.bytes, **sizes)
    assert [s.shard for s in chosen.stages] == ["full", None]
    assert sharded_plan(plan, profile(), cluster, full.bytes - 1, **sizes) is None


def measured(replicas: int = 2) -> ShardCosts:
    # Each kind of pass its own fixed and per-byte seconds, so that a miscount shows.
    fits = {
        "gather": Affine(1e-3, 1e-9),
        "gather_scatter": Affine(3e-3, 2e-9),
        "kept_forward": Affine(1e-5, 0.0),
        "kept_backward": Affine(2e-5, 1e-11),
        "scatter": Affine(2e-3, 1e-9),
    }
    return ShardCosts(replicas, **fits)


def uneven() -> ModelProfile:
    # Parameters in layers 0, 2 and 3 (8, 2 and 4 MiB); layer 1 (an activation) has none and is no FSDP2 unit.
    sizes = (8 * MiB, 0, 2 * MiB, 4 * MiB)
    return ModelProfile(tuple(LayerProfile(f"l{i}", 0.01, 0.02, MiB, size) for i, size in enumerate(sizes)), 8)


def test_a_measured_cluster_prices_each_units_passes_as_the_runtime_calls_them() -> None:
    cluster = Cluster.v100(1, 4, shard_costs=(measured(2), measured(3)))
    m = 4
    units = [8 * MiB, 2 * MiB, 4 * MiB]
    whole = 14 * MiB
    allreduce = 2 * (2 - 1) / 2 * whole / cluster.intra_allreduce_bw + 2 * (2 - 1) * cluster.latency_s
    # full: every micro-batch gathers for its forward and again for its backward, which reduce-scatters.
    full = sum(m * ((1e-3 + p * 1e-9) + (3e-3 + p * 2e-9)) for p in units) - allreduce
    # grads: one gather, M - 1 forwards and backwards on kept parameters, one reduce-scatter, per unit.
    grads = sum((1e-3 + p * 1e-9) + (m - 1) * (1e-5 + 2e-5 + p * 1e-11) + (2e-3 + p * 1e-9) for p in units) - allreduce
    common = {"replicas": 2, "samples": 4, "depth": 1, "micro_batches": m}
    assert shard_price(uneven(), cluster, 0, 4, mode="full", **common).added_seconds == pytest.approx(full)
    assert shard_price(uneven(), cluster, 0, 4, mode="grads", **common).added_seconds == pytest.approx(grads)
    # A replica count that was not measured, or a stage across nodes, falls back to the all-reduce links.
    unmeasured = shard_price(uneven(), Cluster.v100(1, 4), 0, 4, mode="full", **common).added_seconds
    halves = (3 * m - 2) * allreduce / 2
    assert unmeasured == pytest.approx(halves)
    assert shard_price(
        uneven(), Cluster.v100(1, 4, shard_costs=(measured(3),)), 0, 4, mode="full", **common
    ).added_seconds == pytest.approx(halves)


def test_the_estimate_and_the_lever_take_the_measured_price() -> None:
    cluster = Cluster.v100(1, 3, shard_costs=(measured(2),))
    plan = Plan(stages=[{"layers": [0, 3], "replicas": 2}, {"layers": [3, 4], "replicas": 1}], micro_batches=2)
    sizes = {"samples": [4, 8], "depths": [2, 1]}
    price = shard_price(uneven(), cluster, 0, 3, replicas=2, mode="grads", samples=4, depth=2, micro_batches=2)
    unmeasured = shard_price(
        uneven(), Cluster.v100(1, 3), 0, 3, replicas=2, mode="grads", samples=4, depth=2, micro_batches=2
    )
    assert price.added_seconds != pytest.approx(unmeasured.added_seconds)
    chosen, added = sharded_plan(plan, uneven(), cluster, price.bytes, **sizes)
    assert [s.shard for s in chosen.stages] == ["grads", None] and added == price.added_seconds
    before, after = estimate(plan, uneven(), cluster, 8), estimate(chosen, uneven(), cluster, 8)
    assert after.allreduce_s[0] == pytest.approx(before.allreduce_s[0] + price.added_seconds)


def test_affine_fits_keep_at_or_above_zero() -> None:
    fit = fit_affine([1e3, 1e6, 4e6], [1e-3 + n * 2e-9 for n in (1e3, 1e6, 4e6)])
    assert fit.fixed_s == pytest.approx(1e-3) and fit.per_byte_s == pytest.approx(2e-9)
    assert fit_affine([1e3, 1e6], [3e-3, 1e-3]) == Affine(2e-3, 0.0)  # shrinking with size: noise, the mean
    through_zero = fit_affine([1e3, 1e6], [1e-6, 2e-3])  # the line would cross below zero
    assert through_zero.fixed_s == 0.0
    assert through_zero.per_byte_s == pytest.approx((1e3 * 1e-6 + 1e6 * 2e-3) / (1e3**2 + 1e6**2))
    assert fit_affine([1e3, 1e6], [-1e-3, -2e-3]) == Affine(0.0, 0.0)
    with pytest.raises(ValueError, match="as many timings as sizes"):
        fit_affine([1e3, 1e6], [1e-3])


def test_shard_costs_refuse_bad_input_and_survive_a_round_trip_through_json() -> None:
    with pytest.raises(ValueError, match=">= 2 replicas"):
        measured(1)
    with pytest.raises(ValueError, match="fixed_s must be a finite number >= 0"):
        Affine(-1.0, 0.0)
    with pytest.raises(ValueError, match="replica count twice"):
        Cluster.v100(1, 4, shard_costs=(measured(2), measured(2)))
    cluster = Cluster.v100(1, 4, shard_costs=(measured(2), measured(3)))
    assert Cluster(**json.loads(json.dumps(dataclasses.asdict(cluster)))) == cluster
    assert cluster.shard_costs_for(3) == measured(3) and cluster.shard_costs_for(4) is None
    assert ShardCosts.from_numbers(2, measured(2).as_numbers()) == measured(2)
