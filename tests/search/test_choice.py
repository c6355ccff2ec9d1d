"""The search's choice: plans by the median of their runs, told apart only beyond their spreads; the
simplest of those that cannot be told apart from the fastest, data parallelism first."""

from __future__ import annotations

import optuna
import pytest
from test_results import FP, _distributions

from dapple_lightning.plan import Plan
from dapple_lightning.planner import Measured, measure_and_choose
from dapple_lightning.search import (
    PlanSpace,
    best_choice,
    best_plan,
    choice_lines,
    choose_plan,
    explain_choice,
    params_from_plan,
)
from dapple_lightning.search._cli import main as cli
from dapple_lightning.search._loop import enqueue_baselines
from dapple_lightning.search._seed import baseline_plans

DP = Plan.data_parallel(6, 2, 1)
PIPE = Plan.straight(6, 2, micro_batches=4)


def stages(*spans: tuple[int, int, int], micro_batches: int = 4) -> Plan:
    """A plan of (first layer, end layer, replicas) stages."""
    return Plan.from_dict(
        {"micro_batches": micro_batches, "stages": [{"layers": [a, b], "replicas": r} for a, b, r in spans]}
    )


DP4 = Plan.data_parallel(6, 4, 1)
TWO = stages((0, 3, 2), (3, 6, 2))
THREE = stages((0, 2, 2), (2, 4, 1), (4, 6, 1))


def study_of(storage: str, measured: list[tuple[Plan, float, float | None]], extra: dict | None = None) -> optuna.Study:
    """A study of completed trials (plan, samples/s, spread), in order; ``extra`` attributes on each."""
    study = optuna.create_study(storage=storage, study_name="s", direction="maximize")
    study.set_user_attr("fingerprint", FP.to_dict())
    for plan, speed, spread in measured:
        params = params_from_plan(plan)
        attrs = {"plan": plan.to_dict(), **(extra or {})} | ({} if spread is None else {"spread": spread})
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
    assert "<- chosen" in text and "1.40x data parallelism's 100.0 ± 3% (trial 0, 1 run)" in text


def test_plans_are_ranked_by_the_median_of_their_runs_and_runs_that_disagree_widen_the_spread(storage):
    study = study_of(storage, [(DP, 100.0, 0.02), (PIPE, 140.0, 0.02), (PIPE, 100.0, 0.02), (PIPE, 104.0, 0.02)])
    choice = choose_plan(study)
    pipe, dp = choice.ranked
    assert (pipe.plan, pipe.samples_per_s, len(pipe.trials), pipe.number) == (PIPE, 104.0, 3, 1)
    assert pipe.spread == pytest.approx(20 / 104)  # half the range of its runs, over their median
    assert (dp.samples_per_s, dp.spread) == (100.0, 0.03)  # one run: its step times' spread, at least 3%
    assert choice.chosen is dp and "trial 1 (1:1 cuts=3 M=4 dapple, 104.0 ± 19%, 3 runs)" in choice.note
    lines = "\n".join(choice_lines(choice))
    assert "3 runs: 140.0 100.0 104.0" in lines and "<- chosen" in lines


def test_a_repeated_proposal_answered_from_an_earlier_run_is_not_a_measurement(storage):
    study = study_of(storage, [(DP, 100.0, 0.02), (PIPE, 120.0, 0.02)])
    copy = params_from_plan(PIPE)
    study.add_trial(
        optuna.trial.create_trial(
            params=copy,
            distributions=_distributions(copy),
            value=120.0,
            user_attrs={"plan": PIPE.to_dict(), "duplicate_of": 1},
        )
    )
    assert [len(r.trials) for r in choose_plan(study).ranked] == [1, 1]


@pytest.mark.parametrize(
    ("measured", "chosen", "why"),
    [
        # The 3-stage leader and the 2-stage plan cannot be told apart; both beat data parallelism.
        ([(DP4, 100.0), (THREE, 120.0), (TWO, 116.0)], TWO, "the simpler: fewer stages"),
        # The 2-stage plan cannot be told apart from the leader, nor from data parallelism: it is not
        # a plan that beats data parallelism, and the leader, which does, is chosen.
        ([(DP4, 110.0), (THREE, 120.0), (TWO, 114.0)], THREE, "the simpler ones do not beat data parallelism"),
        # Two 2-stage plans that cannot be told apart: the one measured first.
        ([(DP4, 100.0), (TWO, 118.0), (stages((0, 2, 2), (2, 6, 2)), 121.0)], TWO, "the simpler: measured first"),
        # Data parallelism within the spreads of the leader: data parallelism.
        ([(THREE, 104.0), (TWO, 103.0), (DP4, 100.0)], DP4, "data parallelism, the simplest"),
    ],
)
def test_of_plans_that_cannot_be_told_apart_the_simplest_that_beats_data_parallelism_is_chosen(
    storage, measured, chosen, why
):
    study = study_of(storage, [(plan, speed, 0.02) for plan, speed in measured])
    choice = choose_plan(study)
    assert choice.chosen.plan == chosen
    assert "cannot be told apart" in choice.note and why in choice.note
    assert best_plan(storage, "s") == chosen


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


PIPE2 = Plan.straight(6, 2, micro_batches=2)


@pytest.mark.parametrize(
    ("step_s", "chosen"),
    [
        # Step seconds per turn of each plan, in the shortlist's order.
        ({DP: [1.00, 1.02, 1.01], PIPE: [0.97, 0.96, 0.98]}, DP),  # 4% ahead: within the spreads
        ({DP: [1.00], PIPE: [0.80]}, PIPE),  # 25% ahead: data parallelism gets no second turn
        ({DP: [1.20], PIPE: [1.00, 1.01, 1.00], PIPE2: [0.98, 1.00, 0.99]}, PIPE),  # same stages: the first
    ],
)
def test_plan_auto_and_the_search_choose_the_same_plan_from_the_same_measurements(storage, tmp_path, step_s, chosen):
    # plan="auto"'s path: the shortlist measured in turns of scripted step times, and chosen, by the
    # call autoplan.choose_plan makes.
    close = [(plan, 1.0) for plan in step_s]
    taken: list[tuple[Plan, float]] = []

    def trial(plan: Plan) -> Measured:
        step = step_s[plan][sum(p == plan for p, _ in taken)]
        taken.append((plan, step))
        return Measured(step, (step / 2,) * plan.num_stages, (step / 2,) * plan.num_stages)

    auto, _, _ = measure_and_choose(close, trial, global_batch=FP.global_batch)
    # The search's path: every turn a trial of the study, samples/s as its value, in the order taken.
    study = study_of(storage, [(plan, FP.global_batch / step, None) for plan, step in taken])
    out = tmp_path / "best.yaml"
    assert cli(["best", "--storage", storage, "--study", "s", "--export", str(out)]) == 0
    assert auto.chosen.plan == choose_plan(study).chosen.plan == best_plan(storage, "s") == chosen
    assert Plan.coerce(str(out)) == chosen
    assert [m.plan for m in auto.ranked] == [r.plan for r in choose_plan(study).ranked]
