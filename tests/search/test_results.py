"""Reading a study's results: best plan, plan specs, fingerprints (studies built without trials' processes)."""

from __future__ import annotations

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, IntDistribution

from dapple_lightning.plan import Plan
from dapple_lightning.search import (
    Fingerprint,
    FingerprintMismatch,
    best_plan,
    params_from_plan,
    resolve_plan_spec,
)
from dapple_lightning.trials import check_fingerprint, classify_failure

FP = Fingerprint(num_layers=6, architecture="abc", world_size=2, device="cpu", global_batch=8)
PLANS = [Plan.data_parallel(6, 2, 2), Plan.straight(6, 2, micro_batches=4), Plan.straight(6, 2, micro_batches=2)]
SPEEDS = [100.0, 300.0, 200.0]


def _distributions(params):
    out = {}
    for k, _v in params.items():
        if k == "schedule":
            out[k] = CategoricalDistribution(["dapple", "gpipe"])
        elif k == "micro_batches":
            out[k] = CategoricalDistribution([1, 2, 4, 8])
        else:
            out[k] = IntDistribution(0, 10)
    return out


def make_study(storage: str, name: str, fingerprint: Fingerprint = FP, directions=("maximize",)) -> optuna.Study:
    study = optuna.create_study(storage=storage, study_name=name, directions=list(directions))
    study.set_user_attr("fingerprint", fingerprint.to_dict())
    for plan, speed in zip(PLANS, SPEEDS):
        params = params_from_plan(plan)
        values = [speed] if len(directions) == 1 else [speed, 1000.0 - speed / 10]
        study.add_trial(
            optuna.trial.create_trial(
                params=params,
                distributions=_distributions(params),
                values=values,
                user_attrs={"plan": plan.to_dict(), "samples_per_s": speed},
            )
        )
    return study


@pytest.fixture
def storage(tmp_path):
    return f"sqlite:///{tmp_path / 'results.db'}"


def test_best_plan_is_the_fastest_trials_plan(storage):
    make_study(storage, "s")
    assert best_plan(storage, "s") == PLANS[1]
    assert best_plan(storage, "s", FP) == PLANS[1]


def test_best_plan_of_a_multi_objective_study_is_the_fastest_of_the_front(storage):
    make_study(storage, "m", directions=("maximize", "minimize"))
    assert best_plan(storage, "m") == PLANS[1]


def test_plan_spec_resolves_to_the_best_plan_or_a_given_trial(storage):
    make_study(storage, "gpt")
    assert resolve_plan_spec(f"optuna://{storage}?study=gpt") == PLANS[1]
    assert resolve_plan_spec(f"optuna://{storage}?study=gpt&trial=2") == PLANS[2]
    # Anything that is not a study spec passes through untouched.
    assert resolve_plan_spec("auto") == "auto"
    assert resolve_plan_spec({"stages": []}) == {"stages": []}
    assert resolve_plan_spec("plan.yaml") == "plan.yaml"


def test_plan_spec_errors_name_the_fix(storage):
    make_study(storage, "gpt")
    with pytest.raises(ValueError, match="names no study"):
        resolve_plan_spec(f"optuna://{storage}")
    with pytest.raises(ValueError, match=r"no study 'nope' in .*studies there: gpt"):
        resolve_plan_spec(f"optuna://{storage}?study=nope")
    with pytest.raises(ValueError, match="has no trial '9'"):
        resolve_plan_spec(f"optuna://{storage}?study=gpt&trial=9")
    with pytest.raises(ValueError, match="unknown parameter 'foo'"):
        resolve_plan_spec(f"optuna://{storage}?study=gpt&foo=1")


def test_storage_urls_with_their_own_query_keep_it():
    from dapple_lightning.search._results import _split_study_query

    assert _split_study_query("postgresql://u@h/db?sslmode=require&study=gpt&trial=3") == (
        "postgresql://u@h/db?sslmode=require",
        {"study": "gpt", "trial": "3"},
    )
    assert _split_study_query("sqlite:///a%20b.db?study=my%20study") == ("sqlite:///a%20b.db", {"study": "my study"})


def test_fingerprint_mismatch_is_refused_with_the_fields_that_differ(storage):
    make_study(storage, "s")
    other = Fingerprint(num_layers=6, architecture="abc", world_size=4, device="cpu", global_batch=16)
    with pytest.raises(FingerprintMismatch) as info:
        best_plan(storage, "s", other)
    message = str(info.value)
    assert "world_size: 2 != 4" in message and "global_batch: 8 != 16" in message
    assert "num_layers" not in message and "allow_mismatch=True" in message
    assert best_plan(storage, "s", other, allow_mismatch=True) == PLANS[1]


def test_unknown_architecture_hash_is_not_a_difference():
    partial = Fingerprint(num_layers=6, architecture="", world_size=2, device="cpu", global_batch=8)
    assert check_fingerprint(FP.to_dict(), partial, study_name="s") == []
    changed = Fingerprint(num_layers=6, architecture="def", world_size=2, device="cpu", global_batch=8)
    with pytest.raises(FingerprintMismatch, match="architecture: 'abc' != 'def'"):
        check_fingerprint(FP.to_dict(), changed, study_name="s")


def test_fingerprint_validates_its_fields():
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        Fingerprint(6, "", 0, "cpu", 8)
    with pytest.raises(ValueError, match="lacks \\['global_batch'\\]"):
        Fingerprint.from_dict({"num_layers": 6, "architecture": "", "world_size": 2, "device": "cpu"})


@pytest.mark.parametrize(
    ("codes", "killed", "stderr", "kind"),
    [
        ([1, 1], [], "Traceback...\nRuntimeError: injected crash", "crash"),
        ([1, -9], [], "", "oom"),  # SIGKILL nobody in the trial sent: the OOM killer
        ([1, -9], [1], "Traceback...\nRuntimeError: boom", "crash"),  # SIGKILL by the launcher after rank 0 failed
        ([1, 0], [], "Traceback...\nMemoryError", "oom"),
        (
            [1, 1],
            [],
            "RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 1e12 bytes",
            "oom",
        ),
    ],
)
def test_failures_are_classified(codes, killed, stderr, kind):
    got, detail = classify_failure(codes, killed, stderr)
    assert got == kind
    if kind == "crash" and stderr:
        assert detail.splitlines()[-1] == stderr.splitlines()[-1]


def test_repeated_proposals_lead_to_an_unmeasured_plan():
    from dapple_lightning.search import PlanSpace, RepeatGuard, finished_count, unmeasured_plan

    space = PlanSpace(num_layers=3, world_size=2, global_batch=2, schedules=("dapple",))
    plans = list(space.plans())
    missing = plans[-1]
    study = optuna.create_study(direction="maximize")
    for plan in plans[:-1]:
        study.enqueue_trial(space.params(plan))
        trial = study.ask()
        space.suggest(trial)
        study.tell(trial, 1.0)
    assert unmeasured_plan(study, space, seed=0) == missing
    guard = RepeatGuard(limit=3)
    assert guard.repeated(study, space) is None and guard.repeated(study, space) is None
    assert guard.repeated(study, space) == missing  # the third repeat in a row: explore
    trial = study.ask()
    assert space.suggest(trial) == missing and trial.user_attrs["source"] == "explore"
    study.tell(trial, 2.0)
    assert unmeasured_plan(study, space, seed=0) is None
    assert finished_count(study) == len(plans)


@pytest.mark.parametrize(
    ("sup", "errors", "reason"),
    [
        # The agent saw the peer that lost rank 1 first; rank 1 vanished (SIGKILL): an out-of-memory.
        ({"returncodes": [1, None], "first_failure": 0, "killed_after_failure": [1], "vanished": [1]},
         {0: "RuntimeError: dapple: rank 0 lost a peer."}, "oom"),
        # A rank with an error of its own is the cause, whatever vanished after it.
        ({"returncodes": [None, 1], "first_failure": 1, "killed_after_failure": [0], "vanished": [0]},
         {1: "ValueError: injected crash"}, "ValueError: injected crash"),
    ],
)  # fmt: skip
def test_a_rank_that_vanished_behind_a_lost_peer_is_the_cause(tmp_path, sup, errors, reason):
    import json

    from dapple_lightning.search import TrialConfig
    from dapple_lightning.trials._trial import _collect

    (tmp_path / "supervisor.json").write_text(json.dumps({**sup, "exit_code": 1}))
    for rank, text in errors.items():
        (tmp_path / f"rank{rank}.err").write_text(f"Traceback (most recent call last):\n{text}\n")
    result = _collect(
        1, TrialConfig(model="dapple_lightning.search.testing:mlp", world_size=2, global_batch=8), tmp_path
    )
    assert result.status == "failed"
    assert result.reason == reason if reason == "oom" else reason in result.reason
