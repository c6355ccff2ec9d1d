"""Activation checkpointing: inside the layers it trains as on one device; around the container it is refused clearly."""

from __future__ import annotations

import pytest
from torch import nn
from torch.utils.checkpoint import checkpoint

from dapple_lightning import Plan

import models
from harness import assert_same, fit

PLAN_1_1 = Plan(stages=[{"layers": [0, 3], "replicas": 1}, {"layers": [3, 7], "replicas": 1}], micro_batches=2)


class _Checkpointed(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return checkpoint(self.layer, x, use_reentrant=False)


class CheckpointedLayers(models.MLP):
    """Each Linear recomputes its forward in backward (what gradient_checkpointing_enable does per block)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(_Checkpointed(m) if isinstance(m, nn.Linear) else m for m in self.layers))


class CheckpointedContainer(models.MLP):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(checkpoint(self.layers, x, use_reentrant=False), y)
        self.log("train_loss", loss)
        return loss


def test_checkpointing_inside_the_layers_matches_one_device(tmp_path):
    assert_same(
        fit(CheckpointedLayers, tmp_path / "dapple", plan=PLAN_1_1), fit(CheckpointedLayers, tmp_path / "single")
    )


def test_checkpointing_around_the_container_is_refused_with_the_fix(tmp_path):
    with pytest.raises(Exception, match="Checkpoint inside the layers instead"):
        fit(CheckpointedContainer, tmp_path, plan=PLAN_1_1)
