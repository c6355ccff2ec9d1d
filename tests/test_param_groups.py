"""Optimizers built from the model's own structure mean the same layers on every stage.

``configure_optimizers`` runs with the whole container in place (other stages' layers on the
meta device), so groups built from ``self.layers[i]`` or from parameter names hold on each rank
the parameters they hold on one device; frozen layers and fully frozen stages train too.
"""

from __future__ import annotations

import torch
from lightning.pytorch.callbacks import BaseFinetuning

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


class TrainsWhatIsTrainable(models.MLP):
    def configure_optimizers(self):
        return torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=0.1, momentum=0.9)


class FrozenTail(TrainsWhatIsTrainable):
    """The last layers are frozen: under 2:1 the second stage has nothing to train."""

    def __init__(self) -> None:
        super().__init__()
        for layer in self.layers[4:]:
            layer.requires_grad_(False)


class UnfreezeAtEpoch1(BaseFinetuning):
    """Freezes the first four layers (stage 0 of the 2:1 plan), then unfreezes them with a param group of their own."""

    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.layers[:4])

    def finetune_function(self, pl_module, current_epoch, optimizer):
        if current_epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.layers[:4], optimizer, lr=0.05)


def test_base_finetuning_unfreezing_at_epoch_1_matches_one_device(tmp_path):
    def run(out, **kwargs):
        return fit(TrainsWhatIsTrainable, out, max_steps=8, callbacks=(UnfreezeAtEpoch1(),), **kwargs)

    assert_same(run(tmp_path / "dapple", plan=PLAN_2_1), run(tmp_path / "single"))


def test_layerwise_learning_rates_by_index_match_one_device(tmp_path):
    assert_same(fit(LayerwiseLR, tmp_path / "dapple", plan=PLAN_2_1), fit(LayerwiseLR, tmp_path / "single"))


def test_a_fully_frozen_stage_trains_like_one_device(tmp_path):
    assert_same(fit(FrozenTail, tmp_path / "dapple", plan=PLAN_2_1), fit(FrozenTail, tmp_path / "single"))
