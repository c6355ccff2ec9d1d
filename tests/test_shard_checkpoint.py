"""Checkpoints of sharded stages: the single-device layout, resumable sharded or not, under another
replica count; an unsharded checkpoint resumes sharded."""

from __future__ import annotations

import pytest
import torch

from dapple_lightning import Plan
from dapple_lightning.strategy.consolidate import consolidate_checkpoint

import models
from harness import SaveAtEnd, assert_close_tree, assert_same, fit, single_device_resumed


def plan(first: tuple[int, str | None], micro_batches: int = 3) -> Plan:
    replicas, shard = first
    stages = [{"layers": [0, 4], "replicas": replicas, "shard": shard}, {"layers": [4, 7], "replicas": 1}]
    return Plan(stages=stages, micro_batches=micro_batches)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-device Lightning: 4 steps, checkpoint, then resumed to 8 steps."""
    return single_device_resumed(tmp_path_factory.mktemp("single"))


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_a_sharded_stage_saves_the_single_device_checkpoint_and_resumes_unsharded(reference, tmp_path, state_dict_type):
    ref_ckpt, ref_first, ref_resumed = reference
    ckpt = tmp_path / "sharded.ckpt"
    kwargs = {"state_dict_type": state_dict_type}
    first = fit(
        models.ScheduledMLP,
        tmp_path / "a",
        plan=plan((2, "full")),
        callbacks=(SaveAtEnd(ckpt),),
        strategy_kwargs=kwargs,
    )
    assert_same(first, ref_first)  # AdamW, two param groups, an LR schedule
    single = ckpt
    if state_dict_type == "sharded":  # consolidated into one file, as any sharded checkpoint
        single = consolidate_checkpoint(ckpt, tmp_path / "consolidated.ckpt")
    got, want = torch.load(single, weights_only=False), torch.load(ref_ckpt, weights_only=False)
    assert list(got["state_dict"]) == list(want["state_dict"])
    assert_close_tree(got["state_dict"], want["state_dict"])
    assert_close_tree(got["optimizer_states"], want["optimizer_states"])
    if (
        state_dict_type == "sharded"
    ):  # each replica of the sharded stage wrote its own rows of each of its values, no more
        import torch.distributed.checkpoint as dcp

        entries = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
        for name in ("model/layers.2.weight", "optim/0/layers.2.weight/exp_avg"):
            assert [tuple(c.offsets) for c in entries[name].chunks] == [(0, 0), (8, 0)], name
        assert len(entries["model/layers.6.weight"].chunks) == 1  # the unsharded stage's, whole
    resumed = fit(models.ScheduledMLP, tmp_path / "b", plan=plan((1, None)), max_steps=8, ckpt_path=str(ckpt))
    assert_same(resumed, ref_resumed)


def test_an_unsharded_checkpoint_resumes_sharded_on_another_replica_count(reference, tmp_path):
    ref_ckpt, _, ref_resumed = reference
    got = fit(models.ScheduledMLP, tmp_path, plan=plan((3, "grads")), max_steps=8, ckpt_path=str(ref_ckpt))
    assert_same(got, ref_resumed)
