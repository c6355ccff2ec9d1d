"""Plan validation, round trips and the fuzzed parser contract."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from dapple_lightning.plan import Plan, Stage, balanced_cuts

PLAN = {
    "micro_batches": 4,
    "schedule": "dapple",
    "stages": [{"layers": [0, 6], "replicas": 2}, {"layers": [6, 10], "replicas": 1}],
}


def test_ranks_and_table() -> None:
    plan = Plan.coerce(PLAN)
    assert plan.world_size == 3 and plan.num_layers == 10 and plan.notation == "2:1"
    assert plan.stage_ranks(0) == (0, 1) and plan.stage_ranks(1) == (2,)
    assert [plan.stage_of(r) for r in range(3)] == [0, 0, 1]
    assert plan.replica_of(1) == 1
    assert plan.table() == (
        "stage  layers   replicas  ranks\n"
        "0      [0, 6)   2         0,1\n"
        "1      [6, 10)  1         2\n"
        "2 stage(s) [2:1] on 3 rank(s), micro_batches=4, schedule=dapple"
    )


def test_recompute_is_a_stage_field() -> None:
    data = {"stages": [{"layers": [0, 6], "replicas": 2, "recompute": True}, {"layers": [6, 10]}]}
    plan = Plan.coerce(data)
    assert [s.recompute for s in plan.stages] == [True, False]
    assert plan.to_dict()["stages"] == [
        {"layers": [0, 6], "replicas": 2, "recompute": True},
        {"layers": [6, 10], "replicas": 1},
    ]
    assert Plan.from_yaml(plan.to_yaml()) == plan and plan != Plan.coerce(
        {"stages": [{"layers": [0, 6], "replicas": 2}, {"layers": [6, 10]}]}
    )
    assert plan.table().splitlines()[:2] == [
        "stage  layers   replicas  ranks  recompute",
        "0      [0, 6)   2         0,1    yes",
    ]
    assert plan.describe() == "2:1 cuts=6 M=1 dapple recompute=0"
    with pytest.raises(TypeError, match="recompute` must be true or false"):
        Plan.coerce({"stages": [{"layers": [0, 6], "recompute": "yes"}]})
    for zero_bubble in ("zb-h1", "zb-h2"):
        with pytest.raises(ValueError, match=f"twice more per micro-batch under schedule '{zero_bubble}'"):
            Plan.coerce({**data, "schedule": zero_bubble})


def test_explicit_ranks_place_replicas() -> None:
    plan = Plan.coerce(
        {
            "stages": [
                {"layers": [0, 2], "replicas": 2, "ranks": [0, 2]},
                {"layers": [2, 3], "ranks": [1], "replicas": 1},
            ]
        }
    )
    assert plan.stage_ranks(0) == (0, 2) and plan.stage_of(1) == 1


def test_round_trips(tmp_path: Path) -> None:
    plan = Plan.coerce(PLAN)
    assert Plan.coerce(plan.to_dict()) == plan
    assert Plan.from_yaml(plan.to_yaml()) == plan
    assert Plan.coerce(OmegaConf.create(PLAN)) == plan
    path = tmp_path / "plan.yaml"
    path.write_text(plan.to_yaml())
    assert Plan.coerce(str(path)) == plan
    assert Plan.coerce(path) == plan


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        ([{"layers": [0, 4]}, {"layers": [5, 8]}], r"layers \[4, 5\) belong to no stage"),
        ([{"layers": [0, 4]}, {"layers": [3, 8]}], "overlap"),
        ([{"layers": [1, 4]}], "must start at layer 0"),
        ([{"layers": [0, 4], "replicas": 0}], "replicas must be >= 1"),
        ([{"layers": [4, 4]}], "is empty"),
        ([], "at least one stage"),
        ([{"layers": [0, 4], "replicas": 2, "ranks": [0]}], "lists 1 ranks"),
        ([{"layers": [0, 4], "gpus": 2}], "unknown stage keys"),
    ],
)
def test_bad_stages(stages, message) -> None:
    with pytest.raises(ValueError, match=message):
        Plan.coerce({"stages": stages})


def test_bad_micro_batches_and_schedule() -> None:
    with pytest.raises(ValueError, match="micro_batches must be >= 1"):
        Plan.coerce({**PLAN, "micro_batches": 0})
    with pytest.raises(ValueError, match="unknown schedule"):
        Plan.coerce({**PLAN, "schedule": "1f1b"})
    with pytest.raises(TypeError, match="replicas must be an integer"):
        Plan.coerce({"stages": [{"layers": [0, 2], "replicas": True}]})


def test_check_against_model_and_world() -> None:
    plan = Plan.coerce(PLAN)
    plan.check(num_layers=10, world_size=3)
    with pytest.raises(ValueError, match="model's Sequential has 12 layers"):
        plan.check(num_layers=12)
    with pytest.raises(ValueError, match=r"needs 3 ranks.*runs 4"):
        plan.check(world_size=4)


def test_missing_plan_file_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        Plan.coerce(str(tmp_path / "nope.yaml"))


def test_balanced_cuts_minimises_the_heaviest_part() -> None:
    assert balanced_cuts([1, 1, 1, 1], 2) == [0, 2, 4]
    assert balanced_cuts([5, 1, 1, 1, 1, 1], 2) == [0, 1, 6]
    assert Plan.straight(10, 3).stages == (Stage(0, 3), Stage(3, 6), Stage(6, 10))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 12) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=20,
)
stage_like = st.fixed_dictionaries(
    {"layers": st.lists(st.integers(-1, 12) | st.text(max_size=2), min_size=0, max_size=3)},
    optional={"replicas": st.integers(-1, 4) | st.booleans() | st.none(), "ranks": json_values},
)
plan_like = st.fixed_dictionaries(
    {"stages": st.lists(stage_like, max_size=4) | json_values},
    optional={"micro_batches": json_values, "schedule": json_values, "extra": json_values},
)


@settings(max_examples=400, deadline=None)
@given(st.one_of(plan_like, json_values, st.text(max_size=40)))
def test_any_input_gives_a_plan_or_a_value_or_type_error(data) -> None:
    try:
        plan = Plan.coerce(data)
    except (ValueError, TypeError):
        return
    assert isinstance(plan, Plan)
    assert Plan.coerce(plan.to_dict()) == plan
