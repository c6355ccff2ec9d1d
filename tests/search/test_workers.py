"""Several search workers on one study, in SQLite and in a real PostgreSQL server: one is killed
mid-trial, its trial is found by its stopped heartbeat, and the study still ends whole.

Two ``python -m dapple_lightning.search run`` processes share one study: the grid of a space of
exactly 16 plans (the grid sampler queues each plan once, shuffled; the workers pop them). Half way
through, worker A is SIGKILLed, process group and all, while one of its trials runs. Worker B's next
draws find that trial's heartbeat stopped: it is marked FAIL (and interrupted: it does not count)
and its plan is queued once more, behind the grid; B measures it and finishes the study. What
makes the 16 honest: they are the whole grid, each plan measured by one worker exactly once, the
killed trial's plan in its retry; no other plan ran twice, no trial was answered from another's.

(A worker started again in A's place would finish the study with B; it is left out because two
workers that end their last trials within milliseconds of each other may both start one more, a
race of the search loop's check and ask that this test would then see now and then.)
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import optuna
import pytest
import sqlalchemy
from optuna.trial import FrozenTrial, TrialState
from search_runs import MLP, env, poll, processes_with

from dapple_lightning.search import PlanSpace, interrupted_trials
from dapple_lightning.search._bookkeeping import draw_plan, heartbeat_storage
from dapple_lightning.trials import group_alive

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")

STUDY = "workers"
TRIALS = 16


@pytest.fixture(params=["sqlite", "postgresql"])
def storage(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'workers.db'}"
    return request.getfixturevalue("postgres_url")


def _pop(storage: str, name: str, count: int, start, numbers) -> None:
    study = optuna.load_study(study_name=name, storage=heartbeat_storage(storage, None))
    start.wait()
    numbers.put([study.ask().number for _ in range(count)])


def test_workers_popping_one_queue_at_once_never_take_the_same_trial(storage):
    """Without a lock between reading a WAITING trial and setting it RUNNING, SQLite gave 11 of 200
    trials to both of two processes popping in a loop."""
    name = f"queue-{uuid.uuid4().hex}"
    study = optuna.create_study(study_name=name, storage=heartbeat_storage(storage, None))
    for x in range(80):
        study.enqueue_trial({"x": x})
    context = multiprocessing.get_context("fork")
    start, numbers = context.Barrier(2), context.Queue()
    workers = [context.Process(target=_pop, args=(storage, name, 40, start, numbers)) for _ in range(2)]
    for w in workers:
        w.start()
    first, second = numbers.get(timeout=120), numbers.get(timeout=120)
    for w in workers:
        w.join(timeout=60)
    assert [w.exitcode for w in workers] == [0, 0]
    assert set(first).isdisjoint(second) and sorted(first + second) == list(range(80))


def _two_workers(storage: str, space: PlanSpace, plan) -> tuple[optuna.Study, optuna.Study]:
    """Two workers' views of a new study (heartbeats every second) that queues ``plan`` twice."""
    name = f"wait-{uuid.uuid4().hex}"
    first = optuna.create_study(study_name=name, storage=heartbeat_storage(storage, 1))
    for _ in range(2):
        first.enqueue_trial(space.params(plan))
    return first, optuna.load_study(study_name=name, storage=heartbeat_storage(storage, 1))


def _as_another_worker(trial: optuna.Trial) -> None:
    trial.set_user_attr("runner", {"host": "elsewhere", "pid": 1, "start": "0"})


def test_a_plan_another_worker_is_measuring_is_waited_for_not_measured_twice(storage):
    space = PlanSpace(4, 2, 8, (2,), ("dapple",), None)
    plan = next(iter(space.plans()))
    theirs_study, ours_study = _two_workers(storage, space, plan)
    theirs = theirs_study.ask()
    assert draw_plan(theirs_study, theirs, space) == (plan, None)
    _as_another_worker(theirs)
    ours = ours_study.ask()

    def finish_theirs() -> None:  # once our draw has drawn the same plan, and waits
        poll(lambda: "plan_str" in theirs_study.trials[ours.number].user_attrs, 60, "our trial's plan to be drawn")
        theirs_study.tell(theirs, 123.0)

    finisher = threading.Thread(target=finish_theirs)
    finisher.start()
    drawn, previous = draw_plan(ours_study, ours, space)
    finisher.join()
    # The loop answers our trial from theirs (repeat_trial) instead of measuring the plan again.
    assert drawn == plan and previous is not None and (previous.number, previous.values) == (theirs.number, [123.0])
    ours_study.tell(ours, state=TrialState.FAIL)  # ends its heartbeat


@pytest.mark.timeout(120)
def test_of_two_workers_drawing_one_plan_at_once_the_earlier_trial_does_not_wait(storage):
    space = PlanSpace(4, 2, 8, (2,), ("dapple",), None)
    plan = next(iter(space.plans()))
    ours_study, theirs_study = _two_workers(storage, space, plan)
    ours, theirs = ours_study.ask(), theirs_study.ask()  # both pop the plan: ours is the earlier trial
    assert draw_plan(theirs_study, theirs, space) == (plan, None)  # ours does not beat yet: no wait
    _as_another_worker(theirs)
    assert draw_plan(ours_study, ours, space) == (plan, None)  # had it waited, each would wait for the other
    for study, trial in ((ours_study, ours), (theirs_study, theirs)):
        study.tell(trial, state=TrialState.FAIL)


def worker(storage: str, folder: Path, seed: int, marker: str, started_file: Path | None = None) -> subprocess.Popen:
    """A search worker in a session of its own (to kill its process group), its output in files."""
    # 4 layers, 2 ranks, 2 or 4 micro-batches, 2 schedules: 16 plans. Each trial runs for a second
    # or so: time to kill one mid-run.
    kwargs: dict = {"layers": 2, "step_delay_s": 0.2}
    if started_file is not None:
        kwargs["started_file"] = str(started_file)
    options = {
        **{"--model": MLP, "--model-kwargs": json.dumps(kwargs), "--devices": 2, "--batch-size": 8},
        **{"--micro-batches": "2,4", "--warmup": 1, "--steps": 2, "--planner-seeds": 0, "--pruner": "none"},
        **{"--sampler": "grid", "--trials": TRIALS, "--timeout-per-trial": 120, "--heartbeat": 1},
        # The whole grid and nothing else: the confirmation round's workers are test_confirm.py's.
        **{"--confirm-repeats": 0},
        **{"--seed": seed, "--storage": storage, "--study": STUDY},
    }
    command = [sys.executable, "-m", "dapple_lightning.search", "run", *(str(x) for kv in options.items() for x in kv)]
    out = (folder / f"worker{seed}.out").open("w")
    return subprocess.Popen(
        command,
        cwd=folder,
        stdout=out,
        stderr=subprocess.STDOUT,
        env=env(DAPPLE_TEST_WORKERS=marker),
        start_new_session=True,
    )


def study_of(storage: str) -> optuna.Study | None:
    try:
        return optuna.load_study(study_name=STUDY, storage=storage)
    except (KeyError, sqlalchemy.exc.SQLAlchemyError):  # not created yet, or being created
        return None


def completed(storage: str) -> int:
    study = study_of(storage)
    return 0 if study is None else len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))


def marked(storage: str, number: int) -> bool:
    study = study_of(storage)
    return study is not None and number in interrupted_trials(study)


def output(folder: Path, seed: int) -> str:
    return (folder / f"worker{seed}.out").read_text()


def _plan(t: FrozenTrial) -> tuple:
    return tuple(sorted(t.params.items()))


def test_two_workers_one_killed_mid_trial_end_with_16_complete_trials_none_twice(storage, tmp_path):
    begun, marker = time.monotonic(), f"workers-{uuid.uuid4().hex}"
    a_started, b_started = tmp_path / "a_started", tmp_path / "b_started"
    workers = {0: worker(storage, tmp_path, 0, marker, a_started)}
    try:
        # A's first trial runs: A has created the study and queued the grid. B joins, and its first
        # trial runs: B has opened the study (before the kill, so no check at opening can see it).
        poll(a_started.exists, 120, "worker A's first trial to start")
        workers[1] = worker(storage, tmp_path, 1, marker, b_started)
        poll(b_started.exists, 120, "worker B's first trial to start")
        # Half way through the study, A's next trial runs: kill A, its process group and all, as a
        # node that goes down would.
        poll(lambda: completed(storage) >= TRIALS // 2 - 2, 240, "the study to be half done")
        a_started.unlink()
        poll(a_started.exists, 120, "worker A's next trial to start")
        os.killpg(workers[0].pid, signal.SIGKILL)
        assert workers[0].wait(timeout=30) == -signal.SIGKILL
        study = study_of(storage)
        running = [
            t
            for t in study.get_trials(states=(TrialState.RUNNING,))
            if t.user_attrs.get("runner", {}).get("pid") == workers[0].pid
        ]
        assert len(running) == 1, f"worker A should have died in one trial, it ran {running}"
        killed = running[0]
        # B finds that trial's heartbeat stopped (three beats of a second), marks it, queues its plan again.
        poll(lambda: marked(storage, killed.number), 120, f"worker B to mark trial {killed.number}")
        assert workers[1].wait(timeout=300) == 0, output(tmp_path, 1)[-3000:]
    finally:
        for w in workers.values():
            if w.poll() is None:
                os.killpg(w.pid, signal.SIGKILL)
                w.wait()

    study = study_of(storage)
    final = study.get_trials()
    complete = [t for t in final if t.state == TrialState.COMPLETE]
    states = Counter(t.state.name for t in final if t.state != TrialState.WAITING)
    by_worker = Counter(t.user_attrs["runner"]["pid"] for t in complete)
    counts = f"A {by_worker[workers[0].pid]} complete + trial {killed.number} killed, B {by_worker[workers[1].pid]}"
    print(f"\n{storage.split(':')[0]}: {dict(states)} ({counts}) in {time.monotonic() - begun:.1f} s")

    assert len(complete) == TRIALS, states
    assert [t.number for t in final if t.state == TrialState.FAIL] == [killed.number]
    assert not [t for t in final if t.state in (TrialState.RUNNING, TrialState.PRUNED)]
    # Marked by its heartbeat, by the survivor: not by a process check, which sees one host only.
    assert interrupted_trials(study) == {killed.number}
    mark = study.user_attrs[f"interrupted_trial_{killed.number}"]
    assert mark["reason"] == "its worker's heartbeat stopped" and mark["by"]["pid"] == workers[1].pid
    # Its plan ran once more, in the one retry; no other plan was measured twice.
    retries = [t for t in final if t.user_attrs.get("retry_of") == killed.number]
    assert [t.state for t in retries] == [TrialState.COMPLETE] and retries[0].params == killed.params
    assert len({_plan(t) for t in complete}) == TRIALS
    assert not [t for t in complete if "duplicate_of" in t.user_attrs]
    # Both workers measured trials; nothing of either is left running.
    assert by_worker[workers[0].pid] >= 1 and by_worker[workers[1].pid] >= 1, by_worker
    assert retries[0].user_attrs["runner"]["pid"] == workers[1].pid
    assert not group_alive(killed.user_attrs["pgid"])
    assert processes_with(marker) == []
