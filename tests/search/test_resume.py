"""Killing the search process (SIGKILL, no cleanup possible) loses no finished trial; rerunning resumes."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import optuna
import pytest
import sqlalchemy
from optuna.trial import TrialState

from dapple_lightning.search import interrupted_trials
from dapple_lightning.trials import group_alive

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")


def poll(condition, timeout: float, what: str):
    """Call ``condition`` until it returns something truthy, or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)  # polling with a deadline
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def trials(storage: str, name: str) -> list[optuna.trial.FrozenTrial]:
    if name not in optuna.get_all_study_names(storage):
        return []
    return optuna.load_study(study_name=name, storage=storage).get_trials()


def running_after(storage: str, completed: int):
    """A condition: ``completed`` trials done and another one running with its processes up."""

    def check():
        try:
            ts = trials(storage, "resume")
        except sqlalchemy.exc.IntegrityError:  # we opened the new database as the search was creating it
            return None
        done = [t for t in ts if t.state == TrialState.COMPLETE]
        running = [t for t in ts if t.state == TrialState.RUNNING and "pgid" in t.user_attrs]
        return (done, running[0]) if len(done) >= completed and running else None

    return check


def search_command(storage: str) -> list[str]:
    """A 4-trial search of the tiny MLP whose trials take a few seconds: time to catch one running."""
    options = (
        "--devices 2 --batch-size 8 --micro-batches 1,2,4 --trials 4 --warmup 1 --steps 2 --planner-seeds 0 "
        "--study resume --timeout-per-trial 120"
    )
    return [
        *(sys.executable, "-m", "dapple_lightning.search", "run"),
        *("--model", "dapple_lightning.search.testing:mlp", "--model-kwargs", '{"step_delay_s": 0.3}'),
        *options.split(),
        *("--storage", storage),
    ]


def test_interrupted_or_killed_search_resumes_without_losing_trials(tmp_path):
    storage = f"sqlite:///{tmp_path / 'resume.db'}"
    command = search_command(storage)

    # 1. Ctrl-C during the second trial: the trial's processes are killed, the trial marked FAIL.
    first = subprocess.Popen(
        command,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C as in a terminal, even when this test runs in the background of a shell without
        # job control, which starts it (and so the search) with SIGINT ignored.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        done, running = poll(running_after(storage, 1), 180, "a completed trial and a second one running")
        first.send_signal(signal.SIGINT)
        out, err = first.communicate(timeout=60)
    finally:
        first.kill()
    assert first.returncode == 130, f"stdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    assert "run the same command again to resume" in out
    ctrl_c = trials(storage, "resume")[running.number]
    assert ctrl_c.state == TrialState.FAIL and ctrl_c.user_attrs["fail_reason"].startswith("interrupted")
    assert not group_alive(running.user_attrs["pgid"])

    # 2. SIGKILL during a later trial: no handler runs, the trial's processes are orphaned.
    second = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        done, killed = poll(running_after(storage, len(done) + 1), 180, "one more completed trial and another running")
    finally:
        second.send_signal(signal.SIGKILL)
        second.wait()
    assert second.returncode == -signal.SIGKILL
    # The orphaned trial notices its parent is gone and kills its own process group.
    poll(lambda: not group_alive(killed.user_attrs["pgid"]), 30, "the orphaned trial's processes to exit")
    assert trials(storage, "resume")[killed.number].state == TrialState.RUNNING  # nobody could mark it

    # 3. The same command again: marks the orphan, retries both interrupted plans, completes the study.
    rerun = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"trial {killed.number:>3} was running when its search process died" in rerun.stdout

    final = trials(storage, "resume")
    by_number = {t.number: t for t in final}
    for t in done:  # nothing measured before the interruptions is lost
        assert by_number[t.number].state == TrialState.COMPLETE
        assert by_number[t.number].values == t.values
    study = optuna.load_study(study_name="resume", storage=storage)
    assert interrupted_trials(study) == {running.number, killed.number}
    for lost in (running, killed):
        assert by_number[lost.number].state == TrialState.FAIL
        retry = [t for t in final if t.user_attrs.get("retry_of") == lost.number]
        assert len(retry) == 1 and retry[0].params == lost.params  # the interrupted plan ran again
    # A sampler's repeat of a measured plan is answered from that measurement: not measured, not counted.
    repeats = [t for t in final if "duplicate_of" in t.user_attrs]
    assert all("pgid" not in t.user_attrs for t in repeats)
    # The confirmation round that ends the search re-measures plans: it is not a search trial.
    searched = [t for t in final if "confirms" not in t.user_attrs]
    counted = [t for t in searched if t.number not in (running.number, killed.number) and t not in repeats]
    assert len(counted) == 4 and all(t.state != TrialState.RUNNING for t in counted)
    assert all(not group_alive(t.user_attrs["pgid"]) for t in final if "pgid" in t.user_attrs)
