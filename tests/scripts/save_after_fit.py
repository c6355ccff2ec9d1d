"""Fits a tests/models.py module with dapple, launched plainly, then uses the trainer as a user would
after fit returns: saves, validates, predicts and fits on.

Usage: python save_after_fit.py OUT MODEL_NAME PLAN_JSON [DappleStrategy kwargs as JSON]

OUT is a directory or an fsspec URL of one (``file:///...``).

Writes OUT/after_fit.ckpt; runs ``trainer.validate`` and writes OUT/after_validate.ckpt; runs
``trainer.predict`` where the module can predict (it defines ``predict_step`` or ``forward``); then a second ``trainer.fit`` on the same trainer to 8 steps, and writes
OUT/after_second_fit.ckpt. Rank 0 writes what validate and predict returned to OUT/evaluated.pt
(a local OUT only).
"""

import json
import sys
from pathlib import Path

import torch
from lightning.pytorch.utilities.model_helpers import is_overridden

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import models
from harness import quiet_trainer
from dapple_lightning import DappleStrategy, Plan

out, model_name, plan = sys.argv[1].rstrip("/"), sys.argv[2], Plan.coerce(json.loads(sys.argv[3]))
extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
model = getattr(models, model_name)()
trainer = quiet_trainer(
    devices=plan.world_size,
    strategy=DappleStrategy(plan, **extra),
    max_steps=4,
    limit_val_batches=2,
    limit_predict_batches=2,
)
trainer.fit(model, train_dataloaders=models.loader())
trainer.save_checkpoint(f"{out}/after_fit.ckpt")
validated = trainer.validate(model, models.loader(), verbose=False)
trainer.save_checkpoint(f"{out}/after_validate.ckpt")
can_predict = is_overridden("predict_step", model) or is_overridden("forward", model)
predicted = trainer.predict(model, models.loader()) if can_predict else None
if trainer.global_rank == 0 and "://" not in out:
    torch.save({"validate": validated, "predict": predicted}, f"{out}/evaluated.pt")
trainer.fit_loop.epoch_loop.max_steps = 8
trainer.fit(model, train_dataloaders=models.loader())
trainer.save_checkpoint(f"{out}/after_second_fit.ckpt")
