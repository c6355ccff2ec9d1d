"""The confirmation round that ends a search: the contenders measured again, interleaved, before the
choice; with a runner that returns given numbers instead of measuring (no trial processes)."""

from __future__ import annotations

import multiprocessing
import uuid
from collections.abc import Sequence

import optuna
import pytest
from optuna.trial import TrialState

from dapple_lightning.plan import Plan
from dapple_lightning.search import Drawn, Outcome, PlanSpace, choose_plan, finished_count, interrupted_trials, optimize
from dapple_lightning.search._bookkeeping import heartbeat_storage
from dapple_lightning.search._confirm import MAX_CONTENDERS, claim, plan_round
from dapple_lightning.search._loop import enqueue_plans

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")

SPACE = PlanSpace(6, 2, 8, schedules=("dapple",))
DP = Plan.data_parallel(6, 2, 1)
PIPE = Plan.straight(6, 2, micro_batches=4)
PIPE2 = Plan.straight(6, 2, micro_batches=2)
PIPE8 = Plan.straight(6, 2, micro_batches=8)
PIPE1 = Plan.straight(6, 2, micro_batches=1)


class Bench:
    """A runner that 'measures' each plan at the numbers given for it, one per run (the last again
    when they run out), and records what it ran; ``interrupt_at``: the run that gets Ctrl-C."""

    def __init__(self, values: dict[Plan, Sequence[float]], interrupt_at: int | None = None) -> None:
        self.values = {plan: list(runs) for plan, runs in values.items()}
        self.interrupt_at = interrupt_at
        self.ran: list[tuple[Plan, int | None]] = []

    def __call__(self, batch: Sequence[Drawn]) -> list[Outcome]:
        outcomes = []
        for drawn in batch:
            if len(self.ran) == self.interrupt_at:
                raise KeyboardInterrupt
            self.ran.append((drawn.plan, drawn.confirms))
            runs = self.values[drawn.plan]
            value = runs.pop(0) if len(runs) > 1 else runs[0]
            attrs = {"samples_per_s": value, "spread": 0.02}
            outcomes.append(Outcome(TrialState.COMPLETE, (value,), attrs, f"{value:.1f} samples/s"))
        return outcomes


def new_study(storage: str, plans: Sequence[Plan], name: str = "s") -> optuna.Study:
    """A study that measures ``plans`` first, in order."""
    study = optuna.create_study(
        storage=heartbeat_storage(storage, None),
        study_name=name,
        direction="maximize",
        sampler=optuna.samplers.RandomSampler(seed=0),
    )
    enqueue_plans(study, SPACE, plans)
    return study


def search(study: optuna.Study, bench: Bench, n_trials: int, repeats: int = 1, lines: list | None = None) -> None:
    say = (lambda line: None) if lines is None else lines.append
    optimize(study, SPACE, bench, n_trials=n_trials, confirm_repeats=repeats, say=say)


def confirmations(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.get_trials() if "confirms" in t.user_attrs]


@pytest.fixture
def storage(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'confirm.db'}"


def test_the_contenders_are_measured_again_interleaved_and_at_most_three(storage):
    # The leader, data parallelism, and of the three plans within the spreads of the leader only the
    # closest: three contenders in all.
    values = {PIPE: [150.0], DP: [100.0], PIPE2: [149.0], PIPE8: [147.0], PIPE1: [146.0]}
    study = new_study(storage, list(values))
    bench = Bench(values)
    search(study, bench, n_trials=5, repeats=2)
    explored, again = bench.ran[:5], bench.ran[5:]
    assert [confirms for _, confirms in explored] == [None] * 5
    by_plan = {t.user_attrs["plan_str"]: t.number for t in study.trials if "confirms" not in t.user_attrs}
    contenders = [PIPE, DP, PIPE2]
    assert len(contenders) == MAX_CONTENDERS
    assert again == [(plan, by_plan[plan.describe()]) for plan in contenders * 2]  # A B C A B C
    # New trials of the same plans, marked: not answered from the first run, not counted as search trials.
    repeated = confirmations(study)
    assert [t.state for t in repeated] == [TrialState.COMPLETE] * 6
    assert all("duplicate_of" not in t.user_attrs and t.user_attrs["source"] == "confirm" for t in repeated)
    assert finished_count(study) == 5
    runs = {r.plan: len(r.trials) for r in choose_plan(study).ranked}
    assert runs == {PIPE: 3, DP: 3, PIPE2: 3, PIPE8: 1, PIPE1: 1}


def test_a_leader_whose_lead_vanishes_on_repeat_is_not_chosen(storage):
    # Its first run led data parallelism by 30%; measured again, it is no faster.
    study = new_study(storage, [DP, PIPE])
    search(study, Bench({DP: [100.0, 101.0], PIPE: [130.0, 100.0]}), n_trials=2)
    choice = choose_plan(study)
    pipe, dp = choice.ranked
    assert (pipe.plan, pipe.samples_per_s, dp.samples_per_s) == (PIPE, 115.0, 100.5)
    assert pipe.spread == pytest.approx(15 / 115)  # the runs disagree by more than their step times vary
    assert choice.chosen is dp and choice.note is not None
    assert "cannot be told apart" in choice.note and "115.0 ± 13%" in choice.note and "100.5 ± 3%" in choice.note


def test_a_lead_that_holds_on_repeat_is_chosen(storage):
    study = new_study(storage, [DP, PIPE])
    search(study, Bench({DP: [100.0, 101.0], PIPE: [130.0, 128.0]}), n_trials=2)
    choice = choose_plan(study)
    assert choice.chosen.plan == PIPE and choice.note is None
    assert choice.chosen.samples_per_s == 129.0


def test_a_resumed_study_does_not_measure_a_finished_round_again(storage):
    values = {DP: [100.0], PIPE: [120.0]}
    study = new_study(storage, list(values))
    search(study, Bench(values), n_trials=2)
    trials = len(study.trials)
    again, lines = Bench(values), []
    search(study, again, n_trials=2, lines=lines)
    assert again.ran == [] and len(study.trials) == trials
    assert any("confirmation round of these trials (confirmation_after_2) was measured already" in x for x in lines)
    # A larger budget: a new search trial, and a round of its own, since the leader may change. It
    # brings the new contender to two runs; the two the first round measured have theirs.
    more = Bench({**values, PIPE2: [125.0]})
    study.enqueue_trial(SPACE.params(PIPE2))
    search(study, more, n_trials=3)
    by_plan = {t.user_attrs["plan_str"]: t.number for t in study.trials if "confirms" not in t.user_attrs}
    assert more.ran == [(PIPE2, None), (PIPE2, by_plan[PIPE2.describe()])]
    assert {"confirmation_after_2", "confirmation_after_3"} <= set(study.user_attrs)
    assert [len(r.trials) for r in choose_plan(study).ranked] == [2, 2, 2]


def test_when_data_parallelism_leads_alone_there_is_nothing_to_confirm(storage):
    values = {DP: [100.0], PIPE: [80.0]}
    study = new_study(storage, list(values))
    bench, lines = Bench(values), []
    search(study, bench, n_trials=2, lines=lines)
    assert len(bench.ran) == 2 and confirmations(study) == []
    assert any("no confirmation round: data parallelism leads" in line for line in lines)


def test_an_interrupted_round_leaves_the_study_consistent_and_resumes_where_it_stopped(storage):
    values = {DP: [100.0], PIPE: [120.0]}
    study = new_study(storage, list(values))
    stopped = Bench(values, interrupt_at=3)  # two search trials, one repeat, then Ctrl-C
    with pytest.raises(KeyboardInterrupt):
        search(study, stopped, n_trials=2, repeats=2)
    (lost,) = [t for t in confirmations(study) if t.state == TrialState.FAIL]
    assert lost.number in interrupted_trials(study)
    queued = [t for t in confirmations(study) if t.state == TrialState.WAITING]
    retry = [t for t in queued if t.user_attrs.get("retry_of") == lost.number]
    assert len(retry) == 1 and retry[0].user_attrs["confirms"] == lost.user_attrs["confirms"]  # still a repeat
    assert len(queued) == 3  # the two turns not started, and the retry
    resumed = Bench(values)
    search(study, resumed, n_trials=2, repeats=2)
    assert len(resumed.ran) == 3 and all(confirms is not None for _, confirms in resumed.ran)
    assert [len(r.trials) for r in choose_plan(study).ranked] == [3, 3]  # each: first run + 2 repeats
    assert [k for k in study.user_attrs if k.startswith("confirmation_after_")] == ["confirmation_after_2"]


def test_the_round_measures_its_own_trials_not_plans_left_queued_by_the_budget(storage):
    values = {DP: [100.0], PIPE: [120.0], PIPE2: [90.0]}
    study = new_study(storage, list(values))  # three queued, a budget of two
    bench = Bench(values)
    search(study, bench, n_trials=2)
    assert PIPE2 not in [plan for plan, _ in bench.ran]
    assert [t.state for t in study.trials if t.user_attrs.get("plan_str") is None] == [TrialState.WAITING]


def test_without_repeats_there_is_no_round(storage):
    values = {DP: [100.0], PIPE: [120.0]}
    study = new_study(storage, list(values))
    bench = Bench(values)
    search(study, bench, n_trials=2, repeats=0)
    assert len(bench.ran) == 2 and confirmations(study) == []


# ------------------------------------------------------------------------- several workers


@pytest.fixture(params=["sqlite", "postgresql"])
def shared(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'shared.db'}"
    return request.getfixturevalue("postgres_url")


def _claim_all(storage: str, name: str, keys: list[str], start, results) -> None:
    study = optuna.load_study(study_name=name, storage=heartbeat_storage(storage, None))
    start.wait()
    results.put([key for key in keys if claim(study, key, {"by": "me"})])


def test_of_workers_claiming_one_round_at_once_exactly_one_gets_it(shared):
    name = f"claim-{uuid.uuid4().hex}"
    optuna.create_study(study_name=name, storage=heartbeat_storage(shared, None))
    keys = [f"confirmation_after_{k}" for k in range(40)]
    context = multiprocessing.get_context("fork")
    start, results = context.Barrier(2), context.Queue()
    workers = [context.Process(target=_claim_all, args=(shared, name, keys, start, results)) for _ in range(2)]
    for w in workers:
        w.start()
    won = results.get(timeout=120) + results.get(timeout=120)
    for w in workers:
        w.join(timeout=60)
    assert [w.exitcode for w in workers] == [0, 0]
    assert sorted(won) == sorted(keys)  # each key once: no round claimed by both, none by neither


def _worker(storage: str, name: str, start, ran) -> None:
    study = optuna.load_study(study_name=name, storage=heartbeat_storage(storage, 1))
    bench = Bench({DP: [100.0], PIPE: [120.0], PIPE2: [118.0]})
    start.wait()
    search(study, bench, n_trials=3, repeats=2)
    ran.put([confirms for _, confirms in bench.ran])


def test_workers_ending_a_search_together_run_its_round_once_between_them(shared):
    name = f"round-{uuid.uuid4().hex}"
    study = new_study(shared, [DP, PIPE, PIPE2], name=name)
    search(study, Bench({DP: [100.0], PIPE: [120.0], PIPE2: [118.0]}), n_trials=3, repeats=0)
    context = multiprocessing.get_context("fork")
    start, ran = context.Barrier(2), context.Queue()
    workers = [context.Process(target=_worker, args=(shared, name, start, ran)) for _ in range(2)]
    for w in workers:
        w.start()
    measured = ran.get(timeout=120) + ran.get(timeout=120)
    for w in workers:
        w.join(timeout=60)
    assert [w.exitcode for w in workers] == [0, 0]
    # One round queued (3 contenders x 2 turns), each of its trials measured by one worker or the other.
    assert sorted(measured) == sorted([0, 1, 2] * 2)
    assert [t.state for t in confirmations(study)] == [TrialState.COMPLETE] * 6
    assert [k for k in study.user_attrs if k.startswith("confirmation_after_")] == ["confirmation_after_3"]


def test_planning_a_round_twice_queues_it_once(storage):
    study = new_study(storage, [DP, PIPE])
    search(study, Bench({DP: [100.0], PIPE: [120.0]}), n_trials=2, repeats=0)
    assert [r.number for r in plan_round(study, 2, lambda line: None)] == [1, 0]
    assert plan_round(study, 2, lambda line: None) is None
    assert len(confirmations(study)) == 4
