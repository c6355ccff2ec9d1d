"""Batch norm under a plan: replicas keep equal buffers; with sync_batchnorm they normalise together."""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from torch import nn

from dapple_lightning import Plan

import models
from harness import assert_same, fit


class BatchNormMLP(models.MLP):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            nn.Linear(models.IN, 16),
            nn.BatchNorm1d(16),
            nn.Tanh(),
            nn.Linear(16, 16),
            nn.BatchNorm1d(16),
            nn.Tanh(),
            nn.Linear(16, models.OUT),
        )


def plan(micro_batches: int) -> Plan:
    # Stage 0 (with the first batch norm) on two replicas, stage 1 (with the second) on one.
    return Plan(
        stages=[{"layers": [0, 4], "replicas": 2}, {"layers": [4, 7], "replicas": 1}], micro_batches=micro_batches
    )


class ReplicasAgree(Callback):
    """Fails the run if two replicas of a stage hold different buffers after any step."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        buffers = {name: b.detach().clone() for name, b in pl_module.named_buffers()}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, buffers)
        strategy = trainer.strategy
        mine = strategy.plan.stage_of(trainer.global_rank)
        for rank in strategy.plan.stage_ranks(mine):
            assert everyone[rank].keys() == buffers.keys()
            for name, value in buffers.items():
                assert torch.equal(everyone[rank][name], value), (
                    f"step {trainer.global_step}: {name} differs on rank {rank}"
                )


def test_replicas_hold_equal_buffers_after_every_step(tmp_path):
    fit(BatchNormMLP, tmp_path, plan=plan(3), callbacks=(ReplicasAgree(),))


def test_sync_batchnorm_with_one_micro_batch_matches_one_device(tmp_path):
    got = fit(BatchNormMLP, tmp_path / "dapple", plan=plan(1), val=True, sync_batchnorm=True)
    assert_same(got, fit(BatchNormMLP, tmp_path / "single", val=True))
