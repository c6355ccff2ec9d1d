"""Fits one of tests/models.py's modules with dapple, launched plainly (the user's script path).

Usage: python fit_model.py MODEL_NAME PLAN_YAML
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning.pytorch import Trainer

import models
from dapple_lightning import DappleStrategy, Plan

model = getattr(models, sys.argv[1])()
plan = Plan.coerce(sys.argv[2])
trainer = Trainer(
    accelerator="cpu",
    devices=plan.world_size,
    strategy=DappleStrategy(plan),
    max_steps=1,
    logger=False,
    enable_progress_bar=False,
    enable_checkpointing=False,
    enable_model_summary=False,
)
trainer.fit(model, models.loader())
