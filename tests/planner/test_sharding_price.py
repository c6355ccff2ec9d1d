"""The planner's price of sharding a stage (memory per rank, collectives' time) and its lever."""

from __future__ import annotations

import pytest

from dapple_lightning.plan import Plan
from dapple_lightning.planner import Cluster
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
