"""The search's planner seeds and chunked plans: offered with why, not seeded (the space has no chunk parameters)."""

from __future__ import annotations

import optuna

from dapple_lightning.planner import CostModel, LayerProfile, ModelProfile, estimate_chunked
from dapple_lightning.search import PlanSpace, local_cluster, planner_seeds
from dapple_lightning.search._seed import chunked_offers, enqueue_planner_seeds

# Eight equal layers with a gigabyte of weights each on 2 independent devices: data parallelism's
# all-reduce is slow, the pipelines' bubble is what is left to win back.
PROFILE = ModelProfile(
    tuple(LayerProfile(f"l{i}", 1e-3, 2e-3, 10**3, 10**9, weight_s=1e-3) for i in range(8)), 4
).to_dict()
SPACE = PlanSpace(8, 2, 8, micro_batches=(4, 8), schedules=("dapple",), max_stages=2)


def test_a_chunked_variant_predicted_faster_than_a_seed_is_offered_and_reported_not_seeded():
    seeds = planner_seeds(PROFILE, SPACE, 3, memory_limit=1e12)
    offers = chunked_offers(PROFILE, SPACE, seeds, memory_limit=1e12)
    assert offers, [s.plan.describe() for s in seeds]
    model = CostModel(ModelProfile.from_dict(PROFILE), local_cluster(2, None, 1e12), 8)
    for plan, step, why in offers:
        assert plan.chunks == 2 and step == estimate_chunked(model, plan).step_s
        assert step < min(s.predicted_step_s for s in seeds if s.plan.num_stages == 2)
        assert "stages per group" in why and "under dapple" in why
    assert len({plan for plan, _, _ in offers}) == len(offers)
    said: list[str] = []
    study = optuna.create_study()
    enqueue_planner_seeds(study, SPACE, PROFILE, 3, None, said.append, memory_limit=1e12)
    assert [p["chunks"] for p in study.user_attrs["planner_chunked_offers"]] == [2] * len(offers)
    assert any(line.startswith("planner offers") and "not seeded" in line for line in said)
    # The seeds are queued as before, the offers beside them.
    assert study.user_attrs["planner_seeded"] and len(study.get_trials(deepcopy=False)) == len(seeds)


def test_no_chunked_variant_is_offered_for_one_stage_seeds():
    one = PlanSpace(8, 2, 8, micro_batches=(1,), schedules=("dapple",), max_stages=1)
    seeds = planner_seeds(PROFILE, one, 3, memory_limit=1e12)
    assert all(s.plan.num_stages == 1 for s in seeds) and chunked_offers(PROFILE, one, seeds, memory_limit=1e12) == []
