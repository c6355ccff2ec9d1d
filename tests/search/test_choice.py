"""The search's choice: data parallelism unless a plan beats it by more than the measurements' spread."""

from __future__ import annotations

import optuna
import pytest
from test_results import FP, _distributions

from dapple_lightning.plan import Plan
from dapple_lightning.search import PlanSpace, best_choice, best_plan, explain_choice, params_from_plan
from dapple_lightning.search._loop import enqueue_baselines
from dapple_lightning.search._seed import baseline_plans

DP = Plan.data_parallel(6, 2, 1)
PIPE = Plan.straight(6, 2, micro_batches=4)


def study_of(storage: str, measured: list[tuple[Plan, float, float | None]]) -> optuna.Study:
    study = optuna.create_study(storage=storage, study_name="s", direction="maximize")
    study.set_user_attr("fingerprint", FP.to_dict())
    for plan, speed, spread in measured:
        params = params_from_plan(plan)
        attrs = {"plan": plan.to_dict()} | ({} if spread is None else {"spread": spread})
        study.add_trial(
            optuna.trial.create_trial(
                params=params, distributions=_distributions(params), value=speed, user_attrs=attrs
            )
        )
    return study


@pytest.fixture
def storage(tmp_path):
    return f"sqlite:///{tmp_path / 'choice.db'}"


@pytest.mark.parametrize(
    ("pipe_speed", "spreads", "chosen"),
    [
        (104.0, (0.03, 0.03), DP),  # +4% within 6% of spread: cannot be told apart
        (110.0, (0.03, 0.03), PIPE),  # +10%: a real lead
        (110.0, (0.08, 0.04), DP),  # +10% within 12%: noisy measurements
        (104.0, (None, None), DP),  # no spread recorded: 3% each is assumed
        (90.0, (0.01, 0.01), DP),  # data parallelism is simply the fastest
    ],
)
def test_a_plan_must_beat_data_parallelism_by_more_than_the_spread(storage, pipe_speed, spreads, chosen):
    study = study_of(storage, [(DP, 100.0, spreads[1]), (PIPE, pipe_speed, spreads[0])])
    trial, note = best_choice(study)
    assert trial.user_attrs["plan"] == chosen.to_dict()
    assert (note is not None) == (chosen == DP and pipe_speed > 100.0)
    assert best_plan(storage, "s") == chosen


def test_the_explanation_compares_this_run_with_data_parallelism(storage):
    study_of(storage, [(DP, 100.0, 0.02), (PIPE, 150.0, 0.02)])
    text = explain_choice(f"optuna://{storage}?study=s", samples_per_s=140.0)
    assert "<- chosen" in text and "1.40x data parallelism's 100.0 samples/s" in text


def test_baselines_are_data_parallelism_and_a_straight_pipeline_when_the_space_has_them():
    space = PlanSpace(6, 2, 8)
    assert baseline_plans(space) == [("data_parallel", DP), ("straight", Plan.straight(6, 2))]
    only_four = PlanSpace(6, 2, 8, micro_batches=(4,))  # no M=1: data parallelism is not in it
    assert [name for name, _ in baseline_plans(only_four)] == ["straight"]
    with pytest.raises(ValueError, match="unknown baseline"):
        baseline_plans(space, ("fastest",))


def test_baselines_are_queued_first_and_once_per_study():
    space = PlanSpace(6, 2, 8)
    study = optuna.create_study(direction="maximize")
    enqueue_baselines(study, space)
    enqueue_baselines(study, space)  # a resumed study: nothing queued again
    waiting = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert [t.user_attrs["source"] for t in waiting] == ["data_parallel", "straight"]
    assert study.user_attrs["baselines_enqueued"] == ["data_parallel", "straight"]
