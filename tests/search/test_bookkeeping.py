"""Interrupted trials: workers sharing a study mark them without losing each other's marks."""

from __future__ import annotations

import multiprocessing
import threading

import optuna
from optuna.trial import TrialState

from dapple_lightning.search import interrupted_trials
from dapple_lightning.search._bookkeeping import heartbeat_storage, mark_interrupted, start_heartbeat

TRIALS = 40


def _mark(storage: str, numbers: list[int], start: multiprocessing.synchronize.Barrier) -> None:
    study = optuna.load_study(study_name="s", storage=storage)
    start.wait()
    for number in numbers:
        assert mark_interrupted(study, number, {})


def test_workers_marking_trials_interrupted_at_once_lose_no_mark(tmp_path):
    storage = f"sqlite:///{tmp_path / 's.db'}"
    study = optuna.create_study(storage=storage, study_name="s")
    for _ in range(TRIALS):
        study.ask()
    context = multiprocessing.get_context("fork")
    start = context.Barrier(2)
    workers = [context.Process(target=_mark, args=(storage, list(range(i, TRIALS, 2)), start)) for i in (0, 1)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert [w.exitcode for w in workers] == [0, 0]
    assert interrupted_trials(study) == set(range(TRIALS))
    assert {t.state for t in study.trials} == {TrialState.FAIL}


def test_the_second_worker_to_find_an_orphan_queues_no_second_retry(tmp_path):
    storage = f"sqlite:///{tmp_path / 's.db'}"
    first = optuna.create_study(storage=storage, study_name="s")
    trial = first.ask()
    trial.suggest_int("x", 0, 3)
    second = optuna.load_study(study_name="s", storage=storage)
    params = second.trials[0].params  # as the second worker saw the trial: RUNNING
    assert mark_interrupted(first, trial.number, params) is True
    assert mark_interrupted(second, trial.number, params) is False
    retries = [t for t in first.trials if t.user_attrs.get("retry_of") == trial.number]
    assert len(retries) == 1 and retries[0].system_attrs["fixed_params"] == params
    assert interrupted_trials(first) == {trial.number}


def test_a_drawn_trial_beats_through_its_storage_until_it_is_told(tmp_path, monkeypatch):
    storage = heartbeat_storage(f"sqlite:///{tmp_path / 's.db'}", 1)
    study = optuna.create_study(storage=storage, study_name="s")
    trial = study.ask()
    beats: list[int] = []
    second = threading.Event()
    record = storage.record_heartbeat

    def counted(trial_id: int) -> None:
        record(trial_id)
        beats.append(trial_id)
        if len(beats) >= 2:
            second.set()

    monkeypatch.setattr(storage, "record_heartbeat", counted)
    assert start_heartbeat(study, trial) == 1
    assert len(beats) == 1  # the first beat before returning
    (beating,) = [t for t in threading.enumerate() if t.name == f"dapple-heartbeat-{trial.number}"]
    assert second.wait(timeout=30), "no second beat from the heartbeat's thread"
    study.tell(trial, 1.0)
    beating.join(timeout=30)  # it ends once the storage says the trial finished
    assert not beating.is_alive()
    assert set(beats) == {storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name("s"), 0)}
    in_memory = optuna.create_study()
    assert start_heartbeat(in_memory, in_memory.ask()) is None  # no heartbeat to record
