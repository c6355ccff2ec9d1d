"""Trains a small MLP with dapple, launched plainly, and fails on purpose on one rank.

Usage: python faulty.py OUT_DIR WHERE RANK [once]
WHERE: layer | step | callback | data | kill | stop (SIGSTOP: a hung process or a lost host). Every rank writes a `pid-<rank>` file for the test
to check that no process is left behind; the failing rank writes `failed-at` (the time it fails)
for the test to measure how long the others take to end. With ``once`` (under torchrun with
restarts) only the first attempt fails, and every rank of the attempt that trains to the end writes
``done-<rank>``: its global step and attempt number.
"""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from lightning.pytorch import Callback, Trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset

import models
from dapple_lightning import DappleStrategy

out, where, bad_rank = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
FAIL_AT_STEP = 2 if ATTEMPT == 0 or sys.argv[4:] != ["once"] else -1
MESSAGE = f"injected failure ({where}) on rank {bad_rank}"


def rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def fail() -> None:
    (out / "failed-at").write_text(repr(time.time()))
    if where in ("kill", "stop"):
        os.kill(os.getpid(), signal.SIGKILL if where == "kill" else signal.SIGSTOP)
    raise ValueError(MESSAGE)


class Bomb(nn.Module):
    """Identity layer that raises on the chosen rank at the chosen step."""

    step = 0

    def forward(self, x):
        if where == "layer" and rank() == bad_rank and Bomb.step == FAIL_AT_STEP:
            fail()
        return x


class Faulty(models.MLP):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*self.layers[:3], Bomb(), *self.layers[3:], Bomb())

    def training_step(self, batch, batch_idx):
        Bomb.step = batch_idx
        if where == "step" and rank() == bad_rank and batch_idx == FAIL_AT_STEP:
            fail()
        if where in ("kill", "stop") and rank() == bad_rank and batch_idx == FAIL_AT_STEP:
            fail()
        return super().training_step(batch, batch_idx)


class Rows(Dataset):
    def __init__(self):
        self.data = models.dataset()

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        if where == "data" and rank() == bad_rank and i == FAIL_AT_STEP * models.BATCH:
            fail()
        return self.data[i]


class FailInCallback(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if where == "callback" and trainer.global_rank == bad_rank and batch_idx == FAIL_AT_STEP:
            fail()


(out / f"pid-{rank()}").write_text(str(os.getpid()))
torch.manual_seed(0)
plan = {"micro_batches": 2, "stages": [{"layers": [0, 4], "replicas": 1}, {"layers": [4, 9], "replicas": 2}]}
trainer = Trainer(
    accelerator="cpu",
    devices=3,
    strategy=DappleStrategy(plan),
    max_steps=6,
    logger=False,
    enable_progress_bar=False,
    enable_checkpointing=False,
    enable_model_summary=False,
    callbacks=[FailInCallback()],
)
trainer.fit(Faulty(), train_dataloaders=DataLoader(Rows(), batch_size=models.BATCH))
(out / f"done-{rank()}").write_text(f"{trainer.global_step} {ATTEMPT}")
