"""Checkpoints of sharded stages: the single-device layout, resumable sharded or not, under another
replica count; an unsharded checkpoint resumes sharded."""

from __future__ import annotations

import pytest
import torch

from dapple_lightning import Plan

import models
from harness import assert_close_tree, assert_same, fit
from test_checkpoint import SaveAtEnd


def plan(first: tuple[int, str | None], micro_batches: int = 3) -> Plan:
    replicas, shard = first
    stages = [{"layers": [0, 4], "replicas": replicas, "shard": shard}, {"layers": [4, 7], "replicas": 1}]
    return Plan(stages=stages, micro_batches=micro_batches)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-device Lightning: 4 steps, checkpoint, then resumed to 8 steps."""
    root = tmp_path_factory.mktemp("single")
    ckpt = root / "single.ckpt"
    first = fit(models.ScheduledMLP, root / "a", callbacks=(SaveAtEnd(ckpt),))
    resumed = fit(models.ScheduledMLP, root / "b", max_steps=8, ckpt_path=str(ckpt))
    return ckpt, first, resumed


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_a_sharded_stage_saves_the_single_device_checkpoint_and_resumes_unsharded(
    reference, tmp_path, state_dict_type
):
    ref_ckpt, ref_first, ref_resumed = reference
    ckpt = tmp_path / "sharded.ckpt"
    kwargs = {"state_dict_type": state_dict_type}
    first = fit(
        models.ScheduledMLP, tmp_path / "a", plan=plan((2, "full")), callbacks=(SaveAtEnd(ckpt),), strategy_kwargs=kwargs
    )
    assert_same(first, ref_first)  # AdamW, two param groups, an LR schedule
    if state_dict_type == "full":
        got, want = torch.load(ckpt, weights_only=False), torch.load(ref_ckpt, weights_only=False)
        assert list(got["state_dict"]) == list(want["state_dict"])
        assert_close_tree(got["state_dict"], want["state_dict"])
        assert_close_tree(got["optimizer_states"], want["optimizer_states"])
    resumed = fit(models.ScheduledMLP, tmp_path / "b", plan=plan((1, None)), max_steps=8, ckpt_path=str(ckpt))
    assert_same(resumed, ref_resumed)


def test_an_unsharded_checkpoint_resumes_sharded_on_another_replica_count(reference, tmp_path):
    ref_ckpt, _, ref_resumed = reference
    got = fit(models.ScheduledMLP, tmp_path, plan=plan((3, "grads")), max_steps=8, ckpt_path=str(ref_ckpt))
    assert_same(got, ref_resumed)
