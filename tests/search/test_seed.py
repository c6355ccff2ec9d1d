"""The planner's seeds: ranked by the cost model on the machine the trials share."""

from __future__ import annotations

import os

import pytest

from dapple_lightning.plan import Plan
from dapple_lightning.planner import CostModel, LayerProfile, ModelProfile
from dapple_lightning.search import PlanSpace, TrialConfig, compute_units, local_cluster, planner_seeds
from dapple_lightning.search._seed import memory_refusal

# Four layers of equal cost with 0.1 GB of weights each: data parallelism's all-reduces are its
# only extra work, so it is the fastest plan on independent devices and the slowest on shared cores.
PROFILE = ModelProfile(tuple(LayerProfile(f"l{i}", 1.0, 2.0, 100, 10**8) for i in range(4)), 4).to_dict()
SPACE = PlanSpace(4, 4, 8, micro_batches=(1, 2, 4, 8), schedules=("dapple",), max_stages=4)


def test_seeds_are_the_cost_models_best_plans_of_the_space():
    for units in (None, 2):
        model = CostModel(ModelProfile.from_dict(PROFILE), local_cluster(4, units), 8)
        best = sorted(model.estimate(p).step_s for p in SPACE.plans())[:4]
        seeds = planner_seeds(PROFILE, SPACE, 4, units)
        assert [s.rank for s in seeds] == [0, 1, 2, 3]
        assert [s.predicted_step_s for s in seeds] == pytest.approx(best)
        assert all(SPACE.contains(s.plan) for s in seeds)


def test_shared_cores_put_data_parallelism_behind_the_pipelines():
    dp = Plan.data_parallel(4, 4)
    assert planner_seeds(PROFILE, SPACE, 1)[0].plan == dp
    shared = [s.plan for s in planner_seeds(PROFILE, SPACE, 10, units=2)]
    assert dp not in shared
    assert all(p.num_stages > 1 for p in shared)


def test_compute_units_are_the_cores_over_a_ranks_threads():
    cores = len(os.sched_getaffinity(0))
    cpu = TrialConfig("m:f", world_size=4, global_batch=8, threads_per_rank=1)
    assert compute_units(cpu) == cores
    wide = TrialConfig("m:f", world_size=4, global_batch=8, threads_per_rank=cores + 1)
    assert compute_units(wide) == 1
    assert compute_units(TrialConfig("m:f", world_size=2, global_batch=8, accelerator="cuda")) is None


def test_plans_that_run_alike_under_every_schedule_are_seeded_once():
    space = PlanSpace(num_layers=4, world_size=2, global_batch=8, micro_batches=(1, 2), schedules=("dapple", "gpipe"))
    seeds = [s.plan for s in planner_seeds(PROFILE, space, 20)]
    alike = [(p.stages, p.micro_batches) for p in seeds if p.num_stages == 1 or p.micro_batches == 1]
    assert len(alike) == len(set(alike)) > 0
    assert all(p.schedule == "dapple" for p in seeds if p.num_stages == 1 or p.micro_batches == 1)
    # With two stages and two micro-batches the schedules differ: both may be seeded.
    assert {p.schedule for p in seeds if p.num_stages == 2 and p.micro_batches == 2} == {"dapple", "gpipe"}


def test_the_search_may_seed_zero_bubble_plans(monkeypatch):
    # Weights' gradients half of each backward: the best pipelines are zero-bubble ones.
    split = ModelProfile(tuple(LayerProfile(f"l{i}", 1.0, 2.0, 100, 10**8, weight_s=1.0) for i in range(4)), 4)
    space = PlanSpace(4, 4, 8, micro_batches=(2, 4, 8), schedules=("dapple", "zb-h1"), max_stages=4)
    seeds = [s.plan for s in planner_seeds(split.to_dict(), space, 3)]
    assert [p.schedule for p in seeds if p.num_stages > 1] == ["zb-h1", "zb-h1"]
    # A space too large to rank whole goes through the dynamic program (DAPPLE's chains), its
    # pipelines seeded as zero-bubble plans when the space has no other schedule.
    import dapple_lightning.search._seed as seed

    monkeypatch.setattr(seed, "EXHAUSTIVE", 0)
    only = PlanSpace(4, 4, 8, micro_batches=(2, 4, 8), schedules=("zb-h1",), max_stages=4)
    planned = planner_seeds(split.to_dict(), only, 3, units=2)
    assert planned and all(s.plan.schedule == "zb-h1" and only.contains(s.plan) for s in planned)
    only = PlanSpace(4, 4, 8, micro_batches=(2, 4, 8), schedules=("zb-h2",), max_stages=4)
    planned = planner_seeds(split.to_dict(), only, 3, units=2)
    assert planned and all(s.plan.schedule == "zb-h2" and only.contains(s.plan) for s in planned)


def test_no_seed_is_predicted_over_the_memory_limit():
    # Data parallelism holds all four layers per rank: 0.4 GB of weights x (1 + 1 + Adam's 2).
    model = CostModel(ModelProfile.from_dict(PROFILE), local_cluster(4, None, 1e9), 8)
    seeds = planner_seeds(PROFILE, SPACE, 10, None, memory_limit=1e9)
    assert seeds and all(max(model.estimate(s.plan).memory_bytes) <= 1e9 for s in seeds)
    assert Plan.data_parallel(4, 4) not in [s.plan for s in seeds]
    with pytest.raises(ValueError, match=r"no plan of the space fits in 0\.1 GB per rank"):
        planner_seeds(PROFILE, SPACE, 10, None, memory_limit=1e8)


def test_a_proposed_plan_over_the_memory_limit_is_refused_before_it_runs():
    refusal = memory_refusal(PROFILE, SPACE, 1e9)
    # Data parallelism holds all four layers on every rank (1.6 GB); a straight pipeline one each.
    reason = refusal(Plan.data_parallel(4, 4))
    assert (
        reason is not None and "predicted to need more memory per rank than memory_limit 953.7 MiB: stage 0" in reason
    )
    assert refusal(Plan.straight(4, 4)) is None
    assert refusal(Plan.straight(4, 4, schedule="zb-h1")) is None  # min(S, M) micro-batches on every stage


def test_the_search_reads_its_memory_limit_as_text():
    from dapple_lightning.search import SearchConfig

    trial = TrialConfig("m:f", world_size=4, global_batch=8)
    assert SearchConfig(trial, memory_limit="1.5GiB").memory_limit == 1.5 * 2**30
    with pytest.raises(ValueError, match="memory_limit='lots' is not a size"):
        SearchConfig(trial, memory_limit="lots")
