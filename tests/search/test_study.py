"""End-to-end studies with real trial processes (tiny MLP, 2 ranks, 1 warm-up + 2 timed steps)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import optuna
import pytest
import torch
from lightning.pytorch import Trainer
from optuna.trial import TrialState

from dapple_lightning.plan import Plan
from dapple_lightning.search import (
    FingerprintMismatch,
    PlanSearch,
    SearchConfig,
    TrialConfig,
    best_choice,
    best_plan,
    strategy_from_study,
)
from dapple_lightning.search._cli import main as cli
from dapple_lightning.trials import group_alive, run_trial

MLP = "dapple_lightning.search.testing:mlp"
pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")


def trial_config(**overrides) -> TrialConfig:
    base = {"model": MLP, "world_size": 2, "global_batch": 8, "warmup": 1, "steps": 2, "timeout_s": 120.0}
    return TrialConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def mlp_study(tmp_path_factory):
    """Three measured trials: the planner's two picks, then one TPE proposal."""
    storage = f"sqlite:///{tmp_path_factory.mktemp('study') / 'search.db'}"
    config = SearchConfig(
        trial_config(),
        storage=storage,
        study_name="mlp",
        n_trials=3,
        planner_seeds=2,
        baselines=(),  # the planner's picks first (baselines: tests/search/test_choice.py)
        micro_batches=(1, 2, 4),
        confirm_repeats=0,  # three trials exactly (the round: test_the_command_line_confirms_its_leader_once)
        progress=False,
    )
    study = PlanSearch(config).run()
    return config, study


def test_search_measures_every_trial_in_fresh_processes(mlp_study):
    _config, study = mlp_study
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    assert [t.user_attrs["source"] for t in trials[:2]] == ["planner", "planner"]
    for t in trials:
        a = t.user_attrs
        plan = Plan.from_dict(a["plan"])
        assert plan.world_size == 2 and plan.num_layers == 6
        assert t.values[0] == pytest.approx(a["samples_per_s"]) and a["samples_per_s"] > 0
        assert len(a["step_times"]) == 3  # warm-up + 2 timed
        assert len(a["peak_bytes"]) == len(a["max_rss_bytes"]) == 2
        assert a["peak_memory_bytes"] == max(a["peak_bytes"]) > 0
        assert not group_alive(a["pgid"])  # the trial's process group is gone
    fp = study.user_attrs["fingerprint"]
    assert fp["num_layers"] == 6 and fp["world_size"] == 2 and fp["global_batch"] == 8 and fp["device"] == "cpu"
    assert len(fp["architecture"]) == 16


def test_rerunning_a_finished_study_runs_nothing(mlp_study, capsys):
    config, _study = mlp_study
    again = PlanSearch(replace(config, progress=True)).run()
    assert len(again.trials) == 3
    assert "already holds 3 finished trials" in capsys.readouterr().out


def test_best_and_export_round_trip(mlp_study, tmp_path, capsys):
    config, study = mlp_study
    out = tmp_path / "best.yaml"
    assert cli(["best", "--storage", config.storage, "--study", "mlp", "--export", str(out)]) == 0
    printed = capsys.readouterr().out
    best = best_plan(config.storage, "mlp")
    assert Plan.coerce(str(out)) == best
    fastest = max(study.trials, key=lambda t: t.values[0])
    chosen, note = best_choice(study)
    assert Plan.from_dict(chosen.user_attrs["plan"]) == best
    if note is None:  # the fastest plan, unless data parallelism was measured within the spread of it
        assert chosen.number == fastest.number
    else:
        assert best.num_stages == 1 and note in printed
    assert f"{fastest.values[0]:.1f}" in printed
    assert cli(["trials", "--storage", config.storage, "--study", "mlp"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:4] == ["trial", "state", "source", "plan"]
    assert len(table) == 1 + 3 and all("COMPLETE" in line for line in table[1:])


def test_strategy_from_study_trains_the_best_plan(mlp_study):
    config, _ = mlp_study
    best = best_plan(config.storage, "mlp")
    strategy = strategy_from_study(config.storage, "mlp", start_method="forkserver")
    from plan_model import factory

    model, loader = factory(8)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, train_dataloaders=loader)
    metrics = trainer.callback_metrics
    assert metrics["plan_micro_batches"].item() == best.micro_batches
    assert metrics["plan_stages"].item() == best.num_stages
    first_cut = best.stages[1].start if best.num_stages > 1 else 0
    assert metrics["plan_first_cut"].item() == first_cut
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))  # it trained


def test_resuming_with_another_setup_is_refused(mlp_study):
    config, _ = mlp_study
    other = replace(config, trial=trial_config(global_batch=16))
    with pytest.raises(FingerprintMismatch, match="global_batch: 8 != 16"):
        PlanSearch(other).open()


def test_crash_hang_oom_and_infeasible_trials_end_the_trial_not_the_study(tmp_path):
    storage = f"sqlite:///{tmp_path / 'failures.db'}"
    # Batch 16 but the loader gives 8 rows: 16 micro-batches cannot fill a batch (infeasible).
    trial = trial_config(
        global_batch=16,
        stall_timeout_s=6.0,
        model_kwargs={"crash_on": [2], "hang_on": [4], "oom_on": [8], "max_rows": 8},
    )
    plans = [Plan.straight(6, 2, micro_batches=m) for m in (2, 4, 16, 8, 1)]
    config = SearchConfig(
        trial,
        storage=storage,
        study_name="failures",
        n_trials=5,
        planner_seeds=0,
        baselines=(),  # exactly these plans, in this order
        confirm_repeats=0,
        pruner="none",
        schedules=("dapple",),
        enqueue=tuple(plans),
        progress=False,
    )
    study = PlanSearch(config).run()
    trials = study.get_trials()
    assert [Plan.from_dict(t.user_attrs["plan"]) for t in trials] == plans
    crash, hang, infeasible, oom, ok = trials
    assert crash.state == TrialState.FAIL and "injected crash (micro_batches=2)" in crash.user_attrs["fail_reason"]
    assert hang.state == TrialState.FAIL and hang.user_attrs["fail_reason"] == "timeout"
    assert "no step ended for 6 s" in hang.user_attrs["fail_detail"]
    assert infeasible.state == TrialState.PRUNED and infeasible.user_attrs["infeasible"]
    assert "16 micro-batches x 1 replicas need at least 16 rows" in infeasible.user_attrs["fail_reason"]
    assert oom.state == TrialState.FAIL and oom.user_attrs["fail_reason"] == "oom"
    assert ok.state == TrialState.COMPLETE and ok.values[0] > 0, ok.user_attrs
    for t in trials:
        assert not group_alive(t.user_attrs["pgid"]), f"trial {t.number} left processes behind"


def test_a_plan_over_the_memory_limit_ends_infeasible_without_running(tmp_path):
    plans = [Plan.data_parallel(6, 2, 1), Plan.straight(6, 2, micro_batches=2)]
    config = SearchConfig(
        trial_config(),
        storage=f"sqlite:///{tmp_path / 'budget.db'}",
        study_name="budget",
        n_trials=2,
        planner_seeds=0,  # the profile is still taken: the budget needs it
        baselines=(),
        confirm_repeats=0,
        enqueue=tuple(plans),
        memory_limit="1KiB",  # every plan is over it
        progress=False,
    )
    trials = PlanSearch(config).run().get_trials()
    assert [Plan.from_dict(t.user_attrs["plan"]) for t in trials] == plans
    for t in trials:
        assert t.state == TrialState.PRUNED and t.user_attrs["infeasible"], t.user_attrs
        assert (
            "predicted to need more memory per rank than memory_limit 1.0 KiB: stage 0" in t.user_attrs["fail_reason"]
        )
        assert "pgid" not in t.user_attrs  # no process was started for it


def test_multi_objective_study_keeps_a_pareto_front(tmp_path):
    storage = f"sqlite:///{tmp_path / 'multi.db'}"
    plans = (Plan.data_parallel(6, 2, 1), Plan.straight(6, 2, micro_batches=2))
    config = SearchConfig(
        trial_config(track_memory=True),
        storage=storage,
        study_name="multi",
        n_trials=2,
        planner_seeds=0,
        baselines=(),  # exactly these two plans
        multi_objective=True,
        enqueue=plans,
        progress=False,
    )
    study = PlanSearch(config).run()
    assert [d.name for d in study.directions] == ["MAXIMIZE", "MINIMIZE"]
    for t in study.trials:
        assert t.values[1] == t.user_attrs["peak_memory_bytes"]
    # Data parallelism holds the whole model on each rank; the pipeline half of it.
    dp, pipe = study.trials
    assert pipe.values[1] < dp.values[1]
    assert study.best_trials
    with pytest.raises(ValueError, match="optimizes \\['samples_per_s', 'peak_bytes'\\]"):
        PlanSearch(replace(config, multi_objective=False)).open()
    assert Path(storage.removeprefix("sqlite:///")).exists()
    assert optuna.get_all_study_names(storage) == ["multi"]


def test_a_trial_stopped_by_its_pruner_leaves_no_process(tmp_path):
    seen = []

    def prune_at_first_timed_step(step: int, samples_per_s: float) -> bool:
        seen.append((step, samples_per_s))
        return True

    result = run_trial(Plan.straight(6, 2, micro_batches=2), trial_config(steps=5), prune_at_first_timed_step)
    assert result.status == "pruned" and result.reason == "pruned at step 1"
    assert seen[0][0] == 1 and seen[0][1] > 0  # step 0 is the warm-up: not reported
    assert not group_alive(result.pgid)


def test_exec_launcher_runs_a_trial_in_fresh_interpreters():
    result = run_trial(Plan.straight(6, 2, micro_batches=2), trial_config(launcher="exec"))
    assert result.status == "complete" and result.samples_per_s > 0
    assert len(result.step_times) == 3 and len(result.peak_bytes) == 2
    assert not group_alive(result.pgid)


def test_cli_explains_what_is_missing(mlp_study, capsys):
    config, _ = mlp_study
    assert cli(["best", "--storage", config.storage, "--study", "nope"]) == 2
    assert "no study 'nope'" in capsys.readouterr().err
    if not optuna.visualization.is_available():
        assert cli(["plot", "--storage", config.storage, "--study", "mlp"]) == 1
        assert "pip install plotly" in capsys.readouterr().out


def test_the_command_line_confirms_its_leader_once(tmp_path, capsys):
    """A real search whose plans are measured again before one is chosen; run again, it repeats nothing."""
    storage = f"sqlite:///{tmp_path / 'confirm.db'}"
    plans = []
    for m in (2, 4):  # two pipelines, no data parallelism: the leader must prove itself
        path = tmp_path / f"pipe{m}.yaml"
        path.write_text(Plan.straight(6, 2, micro_batches=m).to_yaml())
        plans += ["--enqueue", str(path)]
    args = ["run", "--model", MLP, "--devices", "2", "--batch-size", "8", "--micro-batches", "1,2,4", "--trials", "2"]
    args += ["--warmup", "1", "--steps", "2", "--planner-seeds", "0", "--baselines", "", *plans]
    args += ["--storage", storage, "--study", "confirm"]
    assert cli(args) == 0
    out = capsys.readouterr().out
    study = optuna.load_study(study_name="confirm", storage=storage)
    again = [t for t in study.trials if "confirms" in t.user_attrs]
    leader = max(study.trials[:2], key=lambda t: t.values[0])
    assert again and again[0].user_attrs["confirms"] == leader.number and again[0].params == leader.params
    assert all(t.state == TrialState.COMPLETE and not group_alive(t.user_attrs["pgid"]) for t in again)
    assert "confirmation round: each contender to 2 runs" in out and "2 runs: " in out and "<- chosen" in out
    assert cli(args) == 0
    assert len(optuna.load_study(study_name="confirm", storage=storage).trials) == len(study.trials)
    assert "confirmation round of these trials (confirmation_after_2) was measured already" in capsys.readouterr().out


def test_a_search_over_chunked_schedules_measures_chunked_plans(tmp_path, capsys):
    """The planner's chunked picks are measured to the end in real processes, and one is the choice."""
    storage = f"sqlite:///{tmp_path / 'chunks.db'}"
    args = ["run", "--model", MLP, "--devices", "2", "--batch-size", "8", "--schedules", "zb-v,interleaved"]
    args += ["--trials", "2", "--warmup", "1", "--steps", "2", "--planner-seeds", "2", "--baselines", ""]
    args += ["--pruner", "none", "--confirm-repeats", "0", "--storage", storage, "--study", "chunks"]
    assert cli(args) == 0, capsys.readouterr()
    study = optuna.load_study(study_name="chunks", storage=storage)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    plans = [Plan.from_dict(t.user_attrs["plan"]) for t in study.trials]
    assert all(p.chunks == 2 and p.schedule in ("zb-v", "interleaved") for p in plans)
    assert all(t.values[0] == t.user_attrs["samples_per_s"] > 0 for t in study.trials)
    assert "rank group(s) x 2 chunks" in capsys.readouterr().out.split("best: trial")[1]
