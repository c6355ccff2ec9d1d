"""Optimizers built from the model's own structure mean the same layers on every stage.

``configure_optimizers`` runs with the whole container in place (other stages' layers on the
meta device), so groups built from ``self.layers[i]`` or from parameter names hold on each rank
the parameters they hold on one device; frozen layers and fully frozen stages train too.
"""

from __future__ import annotations

import torch

from dapple_lightning import Plan

import models
from harness import assert_same, fit

PLAN_2_1 = Plan(stages=[{"layers": [0, 4], "replicas": 2}, {"layers": [4, 7], "replicas": 1}], micro_batches=3)


class LayerwiseLR(models.MLP):
    """Layer-wise learning-rate decay by index into the Sequential, a common fine-tuning recipe."""

    def configure_optimizers(self):
        groups = [
            {"params": list(layer.parameters()), "lr": 0.2 * 0.5**i}
            for i, layer in enumerate(self.layers)
            if list(layer.parameters())
        ]
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9)


class FrozenTail(models.MLP):
    """The last layers are frozen: under 2:1 the second stage has nothing to train."""

    def __init__(self) -> None:
        super().__init__()
        for layer in self.layers[4:]:
            layer.requires_grad_(False)

    def configure_optimizers(self):
        return torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=0.1, momentum=0.9)


def test_layerwise_learning_rates_by_index_match_one_device(tmp_path):
    assert_same(fit(LayerwiseLR, tmp_path / "dapple", plan=PLAN_2_1), fit(LayerwiseLR, tmp_path / "single"))


def test_a_fully_frozen_stage_trains_like_one_device(tmp_path):
    assert_same(fit(FrozenTail, tmp_path / "dapple", plan=PLAN_2_1), fit(FrozenTail, tmp_path / "single"))
