"""Trains tests/models.MLP with dapple, launched plainly: Lightning re-launches this script per rank.

Usage: python fit_mlp.py OUT_DIR PLAN_YAML [extra DappleStrategy kwargs as JSON]
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from lightning.pytorch.loggers import CSVLogger

import models
from harness import quiet_trainer
from dapple_lightning import DappleStrategy, Plan

out, plan_path = Path(sys.argv[1]), sys.argv[2]
extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
plan = Plan.coerce(plan_path)
model = models.MLP()
trainer = quiet_trainer(
    devices=plan.world_size,
    strategy=DappleStrategy(plan, **extra),
    max_steps=4,
    logger=CSVLogger(out, name="run", version=0),
    log_every_n_steps=1,
    limit_val_batches=0,
)
trainer.fit(model, train_dataloaders=models.loader())
state = trainer.strategy.lightning_module_state_dict()  # collective: every rank takes part
if trainer.global_rank == 0:
    torch.save(state, out / "final.pt")
