"""Consolidated checkpoints: one file, single-device layout, resumable under any plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dapple_lightning import Plan

import models
from harness import SaveAtEnd, assert_close_tree, assert_same, fit, single_device_resumed


def plan(*stages, micro_batches=3) -> Plan:
    return Plan(stages=[{"layers": list(layers), "replicas": r} for layers, r in stages], micro_batches=micro_batches)


PLAN_2_1 = plan(((0, 4), 2), ((4, 7), 1))
PLAN_1_1 = plan(((0, 3), 1), ((3, 7), 1), micro_batches=2)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-device Lightning: 4 steps, checkpoint, then resumed to 8 steps."""
    return single_device_resumed(tmp_path_factory.mktemp("single"))


@pytest.fixture(scope="module")
def dapple_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("dapple")
    ckpt = root / "dapple.ckpt"
    result = fit(models.ScheduledMLP, root / "a", plan=PLAN_2_1, callbacks=(SaveAtEnd(ckpt),))
    return ckpt, result


def test_checkpoint_is_the_single_device_checkpoint(reference, dapple_checkpoint):
    ref_ckpt, ref_first, _ = reference
    ckpt, result = dapple_checkpoint
    assert_same(result, ref_first)
    got, want = torch.load(ckpt, weights_only=False), torch.load(ref_ckpt, weights_only=False)
    assert list(got["state_dict"]) == list(want["state_dict"])
    assert_close_tree(got["state_dict"], want["state_dict"])
    assert_close_tree(got["optimizer_states"], want["optimizer_states"])
    assert_close_tree(got["lr_schedulers"], want["lr_schedulers"])
    assert got["global_step"] == want["global_step"] == 4


def test_plain_model_loads_it_on_one_device(reference, dapple_checkpoint):
    _, (_, ref_state), _ = reference
    model = models.ScheduledMLP.load_from_checkpoint(dapple_checkpoint[0], map_location="cpu")
    assert_close_tree(dict(model.state_dict()), dict(ref_state))


def test_resume_under_another_plan_and_world_size(reference, dapple_checkpoint, tmp_path):
    _, _, ref_resumed = reference
    got = fit(models.ScheduledMLP, tmp_path, plan=PLAN_1_1, max_steps=8, ckpt_path=str(dapple_checkpoint[0]))
    assert_same(got, ref_resumed)


def test_resume_under_the_same_plan(reference, dapple_checkpoint, tmp_path):
    _, _, ref_resumed = reference
    got = fit(models.ScheduledMLP, tmp_path, plan=PLAN_2_1, max_steps=8, ckpt_path=str(dapple_checkpoint[0]))
    assert_same(got, ref_resumed)


def test_single_device_lightning_resumes_a_dapple_checkpoint(reference, dapple_checkpoint, tmp_path):
    _, _, ref_resumed = reference
    got = fit(models.ScheduledMLP, tmp_path, max_steps=8, ckpt_path=str(dapple_checkpoint[0]))
    assert_same(got, ref_resumed)


def test_a_kill_while_saving_leaves_the_previous_checkpoint_intact(tmp_path):
    import signal
    import subprocess
    import sys

    path = tmp_path / "last.ckpt"
    script = Path(__file__).parent / "scripts" / "killed_while_saving.py"
    proc = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    torch.testing.assert_close(torch.load(path)["weights"], torch.ones(3))
