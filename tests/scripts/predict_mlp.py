"""Predicts with tests/models.PredictMLP under dapple, launched plainly; rank 0 saves the result.

Usage: python predict_mlp.py OUT_FILE PLAN_YAML
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from lightning.pytorch import Trainer

import models
from dapple_lightning import DappleStrategy, Plan

plan = Plan.coerce(sys.argv[2])
trainer = Trainer(
    accelerator="cpu",
    devices=plan.world_size,
    strategy=DappleStrategy(plan),
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
predictions = trainer.predict(models.PredictMLP(), models.loader())
if trainer.global_rank == 0:
    torch.save(predictions, sys.argv[1])
