"""Saves to an fsspec ``memory://`` URL under dapple and resumes from it, next to single-device Lightning.

Usage: python remote_checkpoint.py OUT_DIR

``memory://`` lives in this process, so the dapple run has one rank. Writes OUT_DIR/result.json:
the losses logged by the run resumed from the URL and by single-device Lightning resumed from
its own checkpoint of the same step.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fsspec
from lightning.pytorch.loggers import CSVLogger

import models
from dapple_lightning import DappleStrategy, Plan
from harness import quiet_trainer, read_metrics

out = Path(sys.argv[1])
PLAN = Plan(stages=[{"layers": [0, 7], "replicas": 1}], micro_batches=3)


def run(name: str, path: str, dapple: bool) -> list[float]:
    def trainer(max_steps: int, version: int):
        placement = {"strategy": DappleStrategy(PLAN)} if dapple else {}
        logger = CSVLogger(out, name=name, version=version)
        return quiet_trainer(devices=1, max_steps=max_steps, logger=logger, log_every_n_steps=1, **placement)

    first = trainer(4, 0)
    first.fit(models.ScheduledHeadMLP(), models.loader())
    first.save_checkpoint(path)
    resumed = trainer(8, 1)
    resumed.fit(models.ScheduledHeadMLP(), models.loader(), ckpt_path=path)
    return read_metrics(out / name / "version_1" / "metrics.csv")["train_loss"]


url = "memory://bucket/run/last.ckpt"
result = {"dapple": run("dapple", url, dapple=True), "single": run("single", str(out / "single.ckpt"), dapple=False)}
result["written"] = fsspec.filesystem("memory").exists("/bucket/run/last.ckpt")
(out / "result.json").write_text(json.dumps(result))
