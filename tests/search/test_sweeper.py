"""The Hydra sweeper plugin (``hydra/sweeper=dapple``) on a fake app that scores plans with a formula."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from fake_objective import FAIL_MICRO_BATCHES, fake_samples_per_s
from hydra.core.override_parser.overrides_parser import OverridesParser
from optuna.trial import TrialState

from dapple_lightning.plan import Plan
from dapple_lightning.search import SweepSettings, finished_count, plan_override

ROOT = Path(__file__).resolve().parents[2]
APP = Path(__file__).with_name("sweep_app.py")


def sweep(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    # The repository root on PYTHONPATH is what makes Hydra find hydra_plugins/dapple_sweeper
    # (an installed package would do the same).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, str(APP), "-m", "hydra/sweeper=dapple", *overrides],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_plan_override_parses_back_to_the_plan():
    plan = Plan.straight(6, 3, micro_batches=4, schedule="gpipe")
    override = plan_override(plan, "plan")
    parsed = OverridesParser.create().parse_override(override)
    assert parsed.key_or_group == "plan"
    assert parsed.value() == plan.to_dict()


def test_settings_are_checked():
    with pytest.raises(ValueError, match=r"several directions need hydra\.sweeper\.metrics"):
        SweepSettings(6, 4, 16, directions=("maximize", "minimize"))
    with pytest.raises(ValueError, match="sampler must be tpe or random"):
        SweepSettings(6, 4, 16, sampler="grid")


def test_sweeper_runs_plans_as_jobs_and_resumes(tmp_path):
    storage = f"sqlite:///{tmp_path / 'sweep.db'}"
    common = (f"hydra.sweeper.storage={storage}", "hydra.sweeper.study_name=fake", "hydra.sweeper.seed=3")
    done = sweep(tmp_path, *common, "hydra.sweeper.n_trials=12")
    assert done.returncode == 0, done.stderr[-3000:]
    study = optuna.load_study(study_name="fake", storage=storage)
    trials = study.get_trials()
    searched = [t for t in trials if "confirms" not in t.user_attrs]
    assert len(searched) == 12
    assert study.user_attrs["fingerprint"] == {
        "num_layers": 6,
        "architecture": "",
        "world_size": 4,
        "device": "cpu",
        "global_batch": 16,
    }
    for t in trials:
        plan = Plan.from_dict(t.user_attrs["plan"])
        if plan.micro_batches == FAIL_MICRO_BATCHES:
            assert t.state == TrialState.FAIL
            if "duplicate_of" not in t.user_attrs:
                assert "injected job failure" in t.user_attrs["fail_reason"]
        else:
            # The value Optuna holds is what the job computed from the plan the sweeper sampled.
            assert t.state == TrialState.COMPLETE
            assert t.value == pytest.approx(fake_samples_per_s(plan, 16))
    # The confirmation round: each contender (the leader, then the plans within its spread) once more, as jobs.
    (round_,) = [v for k, v in study.user_attrs.items() if k.startswith("confirmation_after_")]
    again = [t for t in trials if "confirms" in t.user_attrs]
    assert [t.user_attrs["confirms"] for t in again] == round_["contenders"] and 1 < len(again) <= 3
    assert all(t.params == study.trials[t.user_attrs["confirms"]].params for t in again)
    printed = done.stdout + done.stderr
    assert "confirmation round: each contender to 2 runs" in printed and "<- chosen" in printed
    assert "chosen: trial" in printed and "2 runs:" in printed
    completed = [t for t in trials if t.state == TrialState.COMPLETE]
    assert study.best_value == max(t.value for t in completed)
    results = list(tmp_path.glob("multirun/*/*/optimization_results.yaml"))
    assert len(results) == 1 and "best_plan" in results[0].read_text() and "best_runs" in results[0].read_text()

    # The same command with a larger budget continues the study; the contenders have their runs already.
    more = sweep(tmp_path, *common, "hydra.sweeper.n_trials=15")
    assert more.returncode == 0, more.stderr[-3000:]
    assert finished_count(optuna.load_study(study_name="fake", storage=storage)) == 15
    assert "no confirmation round: the contenders have 2 runs each already" in more.stdout + more.stderr

    # Another world size is another setup: refused.
    other = sweep(tmp_path, *common, "hydra.sweeper.n_trials=16", "trainer.devices=2")
    assert other.returncode != 0
    assert "world_size: 4 != 2" in other.stderr


def test_the_sweeper_searches_chunked_schedules_and_hands_the_plans_to_the_jobs(tmp_path):
    storage = f"sqlite:///{tmp_path / 'sweep.db'}"
    spaced = ("hydra.sweeper.space.schedules=[dapple,interleaved,v-half]", "hydra.sweeper.space.chunks=3")
    settings = ("hydra.sweeper.n_trials=12", "hydra.sweeper.confirm_repeats=0", "hydra.sweeper.baselines=[]")
    done = sweep(tmp_path, f"hydra.sweeper.storage={storage}", "hydra.sweeper.study_name=chunks", *spaced, *settings)
    assert done.returncode == 0, done.stderr[-3000:]
    study = optuna.load_study(study_name="chunks", storage=storage)
    assert study.user_attrs["space"]["chunks"] == 3
    plans = {t.number: Plan.from_dict(t.user_attrs["plan"]) for t in study.get_trials()}
    assert {(p.schedule, p.chunks) for p in plans.values()} >= {("interleaved", 3), ("v-half", 2)}
    for t in study.get_trials(states=(TrialState.COMPLETE,)):
        # The job's value is computed from the plan it received: a chunked plan arrived whole.
        assert t.value == pytest.approx(fake_samples_per_s(plans[t.number], 16))


def test_the_planner_seeds_the_sweep_after_the_baselines(tmp_path):
    storage = f"sqlite:///{tmp_path / 'sweep.db'}"
    common = (f"hydra.sweeper.storage={storage}", "hydra.sweeper.confirm_repeats=0")
    seeded = ("hydra.sweeper.study_name=seeded", "hydra.sweeper.model=sweep_app:search_model")
    done = sweep(tmp_path, *common, *seeded, "hydra.sweeper.n_trials=5", "hydra.sweeper.space.micro_batches=[1,2,4]")
    assert done.returncode == 0, done.stderr[-3000:]
    study = optuna.load_study(study_name="seeded", storage=storage)
    sources = [t.user_attrs.get("source") for t in study.get_trials()]
    assert study.user_attrs["baselines_enqueued"] == ["data_parallel"]  # no straight pipeline with M <= 4
    assert len(study.user_attrs["planner_seeded"]) == 3
    picks = sources.count("planner")  # the picks that are not data parallelism, measured next
    assert 2 <= picks <= 3 and sources[: 1 + picks] == ["data_parallel"] + ["planner"] * picks
    assert all(t.user_attrs["predicted_step_s"] > 0 for t in study.get_trials() if "predicted_step_s" in t.user_attrs)
    assert "planner pick #0" in done.stdout + done.stderr
    # Resumed, the study is not profiled again.
    again = sweep(tmp_path, *common, *seeded, "hydra.sweeper.n_trials=6", "hydra.sweeper.space.micro_batches=[1,2,4]")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "profiling" not in again.stdout + again.stderr

    # A model that does not match the space is not used; the sweep says why and goes on.
    wrong = ("hydra.sweeper.study_name=wrong", "hydra.sweeper.model=sweep_app:search_model", "model.num_layers=4")
    other = sweep(tmp_path, *common, *wrong, "hydra.sweeper.n_trials=2", "hydra.sweeper.space.num_layers=6")
    assert other.returncode == 0, other.stderr[-3000:]
    reason = optuna.load_study(study_name="wrong", storage=storage).user_attrs["planner_seeded"]
    assert reason == "the model has 4 layers, the space 6"
    assert "not seeding with the planner: the model has 4 layers" in other.stdout + other.stderr


def test_job_results_become_objective_values():
    from dapple_lightning.search._hydra import _objective

    one = SweepSettings(6, 4, 16)
    assert _objective(12.5, one) == [12.5]
    with pytest.raises(TypeError, match=r"choose the objective\(s\) with hydra\.sweeper\.metrics"):
        _objective({"samples_per_s": 3.0}, one)
    with pytest.raises(ValueError, match="must be a finite number"):
        _objective(None, one)
    two = SweepSettings(6, 4, 16, directions=("maximize", "minimize"), metrics=("samples_per_s", "peak_bytes"))
    assert _objective({"samples_per_s": 3.0, "peak_bytes": 10, "other": 1}, two) == [3.0, 10.0]
    with pytest.raises(KeyError, match="lacks \\['peak_bytes'\\]"):
        _objective({"samples_per_s": 3.0}, two)
