"""A process killed while a checkpoint is written leaves the previous one loadable; asynchronous saves overlap training.

Real processes: the script trains a 2:1 plan on 3 plainly launched ranks and saves at steps 2
and 4 to the same path; the fault comes during the second save.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dapple_lightning.strategy import consolidate_checkpoint

import models
from harness import assert_close_tree, quiet_trainer

SCRIPT = Path(__file__).parent / "scripts" / "checkpoint_faults.py"


def run(mode: str, out: Path) -> subprocess.CompletedProcess:
    """Run the script; afterwards no rank of it is left (the survivors of a kill exit on their own)."""
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), mode, str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # ranks a killed rank 0 left behind
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def at_step_2(tmp_path_factory):
    """Single-device Lightning's checkpoint at step 2."""
    root = tmp_path_factory.mktemp("single")
    trainer = quiet_trainer(devices=1, max_steps=2)
    trainer.fit(models.ScheduledHeadMLP(), models.loader())
    trainer.save_checkpoint(root / "single.ckpt")
    return torch.load(root / "single.ckpt", weights_only=False)


def assert_is_step_2(checkpoint: dict, want: dict) -> None:
    assert checkpoint["global_step"] == 2
    assert_close_tree(checkpoint["state_dict"], want["state_dict"])
    assert_close_tree(checkpoint["optimizer_states"], want["optimizer_states"])


@pytest.mark.parametrize("mode", ["full-kill", "async-kill"])
def test_a_kill_while_writing_a_file_leaves_the_previous_one(mode, at_step_2, tmp_path):
    proc = run(mode, tmp_path)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert_is_step_2(torch.load(tmp_path / "last.ckpt", weights_only=False), at_step_2)


def test_a_kill_while_writing_a_sharded_checkpoint_leaves_the_previous_one(at_step_2, tmp_path):
    proc = run("sharded-kill", tmp_path)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert (tmp_path / ".last.ckpt.tmp").is_dir(), "the killed save did not get as far as writing"
    one = consolidate_checkpoint(tmp_path / "last.ckpt", tmp_path / "one.ckpt")
    assert_is_step_2(torch.load(one, weights_only=False), at_step_2)


def test_training_goes_on_while_an_asynchronous_save_writes(at_step_2, tmp_path):
    proc = run("async-overlap", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_is_step_2(torch.load(tmp_path / "last.ckpt", weights_only=False), at_step_2)
