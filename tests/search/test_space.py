"""The plan search space: only valid plans, every valid plan, parameters that round-trip."""

from __future__ import annotations

import itertools
import math

import optuna
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dapple_lightning.plan import Plan, Stage
from dapple_lightning.search import (
    PlanSpace,
    describe_plan,
    params_from_plan,
    plan_from_params,
)

optuna.logging.set_verbosity(optuna.logging.WARNING)


def brute_force(num_layers: int, world_size: int, global_batch: int, micro_batches, schedules, max_stages=None):
    """Every plan, by filtering all cut sets x all replica vectors (no cleverness to share bugs with)."""
    limit = min(num_layers, world_size, max_stages or world_size)
    out = set()
    for schedule, m in itertools.product(schedules, micro_batches):
        for s in range(1, limit + 1):
            for inner in itertools.combinations(range(1, num_layers), s - 1):
                cuts = [0, *inner, num_layers]
                for replicas in itertools.product(range(1, world_size + 1), repeat=s):
                    if sum(replicas) != world_size or m * max(replicas) > global_batch:
                        continue
                    stages = tuple(Stage(a, b, r) for (a, b), r in zip(itertools.pairwise(cuts), replicas))
                    out.add(Plan(stages, m, schedule))
    return out


@pytest.mark.parametrize(
    ("layers", "world", "batch", "micro", "max_stages"),
    [
        (6, 2, 8, None, None),
        (5, 4, 8, None, None),
        (10, 4, 64, (1, 2, 4, 8), None),
        (4, 6, 6, None, None),  # more ranks than layers
        (7, 5, 10, (1, 2, 5, 10), 3),  # M=10 needs 5 stages of 1 replica: excluded by max_stages
        (3, 3, 2, None, None),  # batch smaller than the world: only pipelines fit
    ],
)
def test_enumeration_is_exactly_the_valid_plans(layers, world, batch, micro, max_stages):
    space = PlanSpace(layers, world, batch, micro, ("dapple", "gpipe"), max_stages)
    plans = list(space.plans())
    assert len(plans) == len(set(plans)) == space.size
    expected = brute_force(layers, world, batch, space.micro_batches, ("dapple", "gpipe"), max_stages)
    assert set(plans) == expected


def test_micro_batch_counts_no_plan_can_use_are_dropped():
    # 4 ranks, batch 8, at most 2 stages: a stage holds >= 2 replicas, so M <= 4.
    space = PlanSpace(num_layers=2, world_size=4, global_batch=8)
    assert space.micro_batches == (1, 2, 4)
    with pytest.raises(ValueError, match="no micro-batch count of \\[8\\] fits"):
        PlanSpace(num_layers=2, world_size=4, global_batch=8, micro_batches=(8,))


def sample(space: PlanSpace, sampler: str, n_trials: int) -> set[Plan]:
    """The plans ``sampler`` draws from ``space``, each checked valid and read back from its parameters."""
    make = {
        "random": lambda: optuna.samplers.RandomSampler(seed=0),
        "tpe": lambda: optuna.samplers.TPESampler(seed=0, n_startup_trials=5, multivariate=True, group=True),
    }[sampler]
    study = optuna.create_study(sampler=make())
    seen: set[Plan] = set()

    def objective(trial):
        plan = space.suggest(trial)
        assert space.contains(plan)
        assert plan_from_params(trial.params, num_layers=space.num_layers, world_size=space.world_size) == plan
        assert params_from_plan(plan) == trial.params
        seen.add(plan)
        return float(len(seen))

    study.optimize(objective, n_trials=n_trials)
    return seen


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
@pytest.mark.parametrize("sampler", ["random", "tpe"])
def test_sampled_plans_are_valid_and_cover_the_space(sampler):
    space = PlanSpace(num_layers=5, world_size=3, global_batch=6, micro_batches=(1, 2, 3, 6))
    seen = sample(space, sampler, 150)
    if sampler == "random":
        assert len(seen) > space.size // 2  # the constrained ranges reach all over the space


def test_every_plan_round_trips_through_enqueued_params():
    space = PlanSpace(num_layers=4, world_size=3, global_batch=6)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    plans = list(space.plans())
    for plan in plans:
        study.enqueue_trial(space.params(plan))
    got = []
    study.optimize(lambda t: got.append(space.suggest(t)) or 0.0, n_trials=len(plans))
    assert got == plans


def test_params_of_plans_outside_the_space_are_refused():
    space = PlanSpace(num_layers=6, world_size=2, global_batch=8, micro_batches=(1, 2), schedules=("dapple",))
    with pytest.raises(ValueError, match="schedule 'gpipe' is not searched"):
        space.params(Plan.straight(6, 2, micro_batches=2, schedule="gpipe"))
    with pytest.raises(ValueError, match="micro-batch count 4 is not searched"):
        space.params(Plan.straight(6, 2, micro_batches=4))
    with pytest.raises(ValueError, match="covers 5 layers on 2 ranks"):
        space.params(Plan.straight(5, 2, micro_batches=2))
    assert space.params(Plan.straight(6, 2, micro_batches=2)) == {
        "schedule": "dapple",
        "micro_batches": 2,
        "stages": 2,
        "s2_r0": 1,
        "s2_c1": 3,
    }


def test_params_missing_a_key_name_it():
    with pytest.raises(ValueError, match="lack 's2_c1'"):
        plan_from_params({"stages": 2, "micro_batches": 1, "s2_r0": 1}, num_layers=4, world_size=2)


def test_grid_refuses_spaces_over_the_cap():
    size = PlanSpace(10, 4, 64).size
    assert size > 100
    with pytest.raises(ValueError, match=f"the grid holds {size} plans, more than 100; restrict micro_batches"):
        PlanSpace(10, 4, 64).grid(100)
    small = PlanSpace(10, 4, 64, micro_batches=(4,), schedules=("dapple",), max_stages=2).grid(size)
    assert len(small) == 1 + 9 * 3  # one stage; or a cut at 1..9 with replicas 1:3, 2:2, 3:1


def test_describe_plan():
    plan = Plan((Stage(0, 5, 3), Stage(5, 10, 1)), micro_batches=4)
    assert describe_plan(plan) == "3:1 cuts=5 M=4 dapple"
    assert describe_plan(Plan.data_parallel(10, 4)) == "4 cuts=- M=1 dapple"


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 8),
    world=st.integers(1, 6),
    batch=st.integers(1, 24),
    data=st.data(),
)
def test_size_formula_matches_enumeration(layers, world, batch, data):
    try:
        space = PlanSpace(layers, world, batch, schedules=("dapple",))
    except ValueError:
        # No micro-batch count fits: then not even M=1 does, i.e. every stage would need more rows.
        assert math.ceil(world / min(layers, world)) > batch
        return
    plans = list(space.plans())
    assert len(plans) == space.size
    plan = data.draw(st.sampled_from(plans))
    assert plan_from_params(space.params(plan), num_layers=layers, world_size=world) == plan
