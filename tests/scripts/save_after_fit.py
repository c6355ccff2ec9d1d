"""Fits a tests/models.py module with dapple, launched plainly, then saves as a user would: after fit returns.

Usage: python save_after_fit.py OUT MODEL_NAME PLAN_JSON [DappleStrategy kwargs as JSON]

OUT is a directory or an fsspec URL of one (``file:///...``).

Writes OUT/after_fit.ckpt, then runs ``trainer.validate`` and writes OUT/after_validate.ckpt.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import models
from harness import quiet_trainer
from dapple_lightning import DappleStrategy, Plan

out, model_name, plan = sys.argv[1].rstrip("/"), sys.argv[2], Plan.coerce(json.loads(sys.argv[3]))
extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
model = getattr(models, model_name)()
trainer = quiet_trainer(
    devices=plan.world_size, strategy=DappleStrategy(plan, **extra), max_steps=4, limit_val_batches=2
)
trainer.fit(model, train_dataloaders=models.loader())
trainer.save_checkpoint(f"{out}/after_fit.ckpt")
if any(stage.shard is not None for stage in plan.stages):
    sys.exit(0)  # validate after fit does not work yet with a sharded stage (docs/memory.md, limits)
trainer.validate(model, models.loader(), verbose=False)
trainer.save_checkpoint(f"{out}/after_validate.ckpt")
