"""A trial's processes and files, seen from the search's command line in a subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import optuna
import pytest
from optuna.trial import TrialState
from search_runs import MLP, poll, processes_with

from dapple_lightning.search import interrupted_trials

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")


def search(*args: str) -> list[str]:
    options = ("--devices", "2", "--batch-size", "8", "--micro-batches", "1,2,4", "--planner-seeds", "0")
    return [sys.executable, "-m", "dapple_lightning.search", "run", *options, *args]


def test_ctrl_c_during_a_trial_leaves_no_trial_directory_and_no_process(tmp_path):
    temp, started = tmp_path / "temp", tmp_path / "started"
    temp.mkdir()
    marker = f"dapple-ctrl-c-{uuid.uuid4().hex}"  # in the environment of every process the search starts
    storage = f"sqlite:///{tmp_path / 'ctrl_c.db'}"
    # Every plan hangs after its first step, which rank 0 announces by writing `started`.
    kwargs = {"hang_on": [1, 2, 4], "started_file": str(started)}
    command = search(
        "--model", MLP, "--model-kwargs", json.dumps(kwargs), "--trials", "1", "--timeout-per-trial", "120"
    )
    proc = subprocess.Popen(
        [*command, "--storage", storage, "--study", "ctrl_c"],
        cwd=tmp_path,
        env=dict(os.environ, TMPDIR=str(temp), DAPPLE_TEST_MARKER=marker),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C as in a terminal, even when the test runs where SIGINT is ignored (no job control).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        poll(started.exists, 180, "the trial's first step")
        assert list(temp.glob("dapple-trial-*")), "the running trial has a directory"
        assert len(processes_with(marker)) > 2, "the search, its trial template and the trial's processes run"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, f"stdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    assert "run the same command again to resume" in out
    assert list(temp.glob("dapple-*")) == []
    assert processes_with(marker) == []
    study = optuna.load_study(study_name="ctrl_c", storage=storage)
    assert study.trials[0].state == TrialState.FAIL and interrupted_trials(study) == {0}
    retry = [t for t in study.trials if t.user_attrs.get("retry_of") == 0]
    assert [t.state for t in retry] == [TrialState.WAITING]  # its plan is queued again
    assert retry[0].system_attrs["fixed_params"] == study.trials[0].params


def test_a_search_runs_in_a_directory_whose_path_holds_spaces(tmp_path):
    # The working directory, the factory's module beside it, the study and the trials' files all
    # lie under paths with spaces.
    cwd = tmp_path / "my plan search"
    temp = cwd / "temp files"
    temp.mkdir(parents=True)
    (cwd / "my_model.py").write_text("from dapple_lightning.search.testing import mlp  # noqa: F401\n")
    command = search(
        "--model",
        "my_model:mlp",
        "--trials",
        "2",
        "--steps",
        "1",
        "--storage",
        "sqlite:///my search.db",
        "--confirm-repeats",
        "0",
    )
    done = subprocess.run(
        [*command, "--study", "spaces"],
        cwd=cwd,
        env=dict(os.environ, TMPDIR=str(temp)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    study = optuna.load_study(study_name="spaces", storage=f"sqlite:///{cwd / 'my search.db'}")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    assert list(temp.glob("dapple-*")) == []
