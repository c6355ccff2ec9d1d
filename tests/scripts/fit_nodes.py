"""Trains tests/models.MLP with dapple on 2 nodes x 2 processes, each node a torchrun agent.

Usage: torchrun --nnodes 2 --nproc-per-node 2 ... fit_nodes.py OUT_DIR PLAN_YAML|auto

Rank 0 writes the logged metrics (CSVLogger under OUT_DIR), the final weights (``final.pt``) and,
with ``auto``, the cluster the planner measured (``cluster.json``).
"""

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from lightning.pytorch.loggers import CSVLogger

import models
from harness import quiet_trainer
from dapple_lightning import DappleStrategy, Plan

out, spec = Path(sys.argv[1]), sys.argv[2]
torch.set_num_threads(1)
plan = "auto" if spec == "auto" else Plan.coerce(spec)
strategy = DappleStrategy(plan)
trainer = quiet_trainer(
    num_nodes=2,
    devices=2,
    strategy=strategy,
    max_steps=3,
    logger=CSVLogger(out, name="run", version=0),
    log_every_n_steps=1,
    limit_val_batches=0,
)
trainer.fit(models.MLP(), train_dataloaders=models.loader())
state = trainer.strategy.lightning_module_state_dict()  # collective: every rank takes part
if trainer.global_rank == 0:
    torch.save(state, out / "final.pt")
    if strategy.auto_plan is not None:
        cluster = dataclasses.asdict(strategy.auto_plan.cluster)
        (out / "cluster.json").write_text(json.dumps({"cluster": cluster, "plan": strategy.plan.to_dict()}))
