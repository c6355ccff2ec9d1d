"""plan="auto"'s levers shard a replicated stage over the budget before they offload it."""

from __future__ import annotations

import dataclasses

import pytest

from dapple_lightning.plan import Plan
from dapple_lightning.planner import Cluster, estimate, shortlist_with_levers
from dapple_lightning.planner._profile import LayerProfile, ModelProfile
from dapple_lightning.planner._sharding import shard_price

MiB = 2**20


def embedding_heavy() -> ModelProfile:
    # One 32 MiB layer and three of 1 MiB, each with a tiny output: recomputing saves next to nothing,
    # and no pipeline cut splits the big layer, whose parameters, gradients and Adam state take 128 MiB.
    sizes = (32 * MiB, MiB, MiB, MiB)
    return ModelProfile(tuple(LayerProfile(f"l{i}", 0.01, 0.02, 1024, size) for i, size in enumerate(sizes)), 8)


def budget(megabytes: int) -> Cluster:
    return dataclasses.replace(Cluster.v100(1, 3), memory_bytes=megabytes * MiB)


def test_a_budget_only_sharding_meets_gets_the_sharded_plan_and_the_note_names_it() -> None:
    cluster = budget(110)
    close, dp_step, note, _ = shortlist_with_levers(embedding_heavy(), cluster, 8, offload_refused="not here")
    [(plan, predicted)] = close
    assert dp_step is None
    sharded = [(k, s) for k, s in enumerate(plan.stages) if s.shard is not None]
    assert sharded and all(s.replicas > 1 and s.start == 0 for _, s in sharded)
    assert all(s.offload is None for s in plan.stages)
    priced = estimate(plan, embedding_heavy(), cluster, 8)
    assert priced.fits and predicted == pytest.approx(priced.step_s)
    unsharded = Plan(stages=[dataclasses.replace(s, shard=None) for s in plan.stages], micro_batches=plan.micro_batches)
    assert not estimate(unsharded, embedding_heavy(), cluster, 8).fits
    k, stage = sharded[0]
    assert f"stage {k} (layers 0-{stage.end - 1}) shards its state over its {stage.replicas} replicas" in note


def test_the_estimate_prices_a_sharded_stage_at_its_share_and_adds_its_collectives() -> None:
    cluster = budget(1000)
    whole = Plan(stages=[{"layers": [0, 1], "replicas": 2}, {"layers": [1, 4], "replicas": 1}], micro_batches=4)
    stages = [dataclasses.replace(whole.stages[0], shard="grads"), whole.stages[1]]
    sharded = dataclasses.replace(whole, stages=stages)
    before, after = estimate(whole, embedding_heavy(), cluster, 8), estimate(sharded, embedding_heavy(), cluster, 8)
    price = shard_price(
        embedding_heavy(), cluster, 0, 1, replicas=2, mode="grads", samples=before.samples[0], depth=2, micro_batches=4
    )
    assert after.memory_bytes[0] == pytest.approx(price.bytes) and price.bytes < before.memory_bytes[0]
    assert after.memory_bytes[1] == before.memory_bytes[1]
    assert after.allreduce_s[0] == pytest.approx(before.allreduce_s[0] + price.added_seconds)
    assert after.step_s > before.step_s


def test_a_sharded_plan_the_runtime_refuses_is_not_offered() -> None:
    asked: list[Plan] = []

    def refused(plan: Plan) -> str:
        asked.append(plan)
        return "recovery is on"

    with pytest.raises(ValueError, match="offload cannot run here: not here"):
        shortlist_with_levers(embedding_heavy(), budget(110), 8, shard_refused=refused, offload_refused="not here")
    assert asked and all(any(s.shard is not None for s in plan.stages) for plan in asked)


def test_sharding_is_offered_only_where_the_sharded_stage_meets_the_budget() -> None:
    # 2 ranks: a cut leaves the big layer's stage on one replica (128 MiB, nothing to split with); one
    # stage on both ranks sharded by grads holds 2 x 35 + 70 / 2 = 105 MiB (full: 70 + 64 = 134 MiB).
    ranks = Cluster.v100(1, 2)
    close, _, note, _ = shortlist_with_levers(
        embedding_heavy(), dataclasses.replace(ranks, memory_bytes=106 * MiB), 8, offload_refused="not here"
    )
    [(plan, _)] = close
    assert [(s.start, s.end, s.replicas, s.shard) for s in plan.stages] == [(0, 4, 2, "grads")]
    assert "105.0 MiB sharded" in note
    with pytest.raises(ValueError, match="offload cannot run here: not here"):
        shortlist_with_levers(
            embedding_heavy(), dataclasses.replace(ranks, memory_bytes=100 * MiB), 8, offload_refused="not here"
        )
