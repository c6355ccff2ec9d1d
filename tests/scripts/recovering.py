"""Trains under torchrun with restarts and kills a stage-0 replica at one point of step 5, once.

Usage: torchrun --nproc_per_node 3 --max-restarts 1 recovering.py OUT_DIR WHERE [auto | log | offload | chunks]
WHERE: none (the uninterrupted reference) | forward | backward | allreduce | optimizer | step (at
the start of training_step, in any stage) | validation (in the validation run after step 5's
update), or stop (SIGSTOP in the forward: a hung rank, which only the heartbeat detects). With
``auto``, the plan is ``plan="auto"``'s under ``recovery="log"`` (with a checkpoint after step 2), so that
rank 1 recovers whatever plan auto chose: from a replica where its stage has one, else by replay. With ``log``, the plan is 1:2, rank 0 (stage 0, which has
no replica) is the victim, ``recovery="log"``, and every rank saves a checkpoint after step 2: the
restarted rank 0 replays steps 2-4 from its neighbours' log. With ``offload``, both stages keep
their layers on disk (``offload: 1``): the survivors' state and the replica's hand-over are read
from there. With ``chunks``, the same 2:1 replication gives each rank group two stages (looped,
``interleaved``): layers 0-2 and 5-6 on ranks 0 and 1, layers 3-4 and 7-8 on rank 2.

Plan 2:1 over an MLP: layers 0-3 on ranks 0 and 1, the rest (with a dropout, so the last stage's
RNG state must come back too) on rank 2. Shuffled batches over 2.5 epochs and a per-step LR
schedule, so the data order, the scheduler and the optimizer's momentum must all come back; a
validation run every 2 batches. Rank 0 appends ``attempt step loss`` to ``losses.txt`` after every
step and ``attempt step val_loss`` to ``val.txt`` after every validation; after ``fit`` every rank saves
``final.ckpt`` with ``trainer.save_checkpoint`` and writes ``done-<rank>``: its global step and attempt.
"""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from torch import nn
from torch.utils.data import DataLoader

import models
from dapple_lightning import DappleStrategy

out, where = Path(sys.argv[1]), sys.argv[2]
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
AUTO, LOG, OFFLOAD, CHUNKS = (sys.argv[3:] == [option] for option in ("auto", "log", "offload", "chunks"))
KILL_AT = 5  # the sixth optimizer step
victim = 0 if LOG else 1  # a replica of stage 0 (plan="auto": whatever rank 1 holds)
STEPS = 10
step = 0  # the global step being trained


def armed(point: str) -> bool:
    return where == point and ATTEMPT == 0 and int(os.environ["RANK"]) == victim and step == KILL_AT


def die() -> None:
    os.kill(os.getpid(), signal.SIGSTOP if where == "stop" else signal.SIGKILL)


class Mine(torch.autograd.Function):
    """Identity whose backward kills the victim."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if armed("backward"):
            die()
        return grad


class Trap(nn.Module):
    def forward(self, x):
        if armed("forward") or armed("stop"):
            die()
        return Mine.apply(x)


_all_reduce = dist.all_reduce


def all_reduce(tensor, *args, **kwargs):  # the stage's gradient all-reduce is the victim's last act
    if armed("allreduce") and kwargs.get("async_op"):
        die()
    return _all_reduce(tensor, *args, **kwargs)


dist.all_reduce = all_reduce


class Model(models.MLP):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        layers = list(self.layers)
        self.layers = nn.Sequential(*layers[:2], Trap(), *layers[2:6], nn.Dropout(0.2), layers[6])

    def training_step(self, batch, batch_idx):
        global step
        step = self.trainer.global_step
        if armed("step"):
            die()
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        if armed("validation"):
            die()
        return super().validation_step(batch, batch_idx)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        optimizer.register_step_post_hook(lambda *_: die() if armed("optimizer") else None)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class Losses(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == 0:
            with open(out / "losses.txt", "a") as f:
                f.write(f"{ATTEMPT} {trainer.global_step - 1} {float(outputs['loss']):.10g}\n")

        if (LOG or AUTO) and trainer.global_step == 2:
            trainer.save_checkpoint(out / "step2.ckpt")

    def on_validation_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            with open(out / "val.txt", "a") as f:
                f.write(f"{ATTEMPT} {trainer.global_step - 1} {float(trainer.callback_metrics['val_loss']):.10g}\n")


torch.manual_seed(0)
replicas = (1, 2) if LOG else (2, 1)
plan = {
    "micro_batches": 2,
    "stages": [{"layers": [0, 4], "replicas": replicas[0]}, {"layers": [4, 9], "replicas": replicas[1]}],
}
if OFFLOAD:
    for stage in plan["stages"]:
        stage["offload"] = 1
if CHUNKS:  # the same replication, each rank group holding two stages (looped)
    plan = {
        "micro_batches": 2,
        "schedule": "interleaved",
        "chunks": 2,
        "stages": [
            {"layers": [0, 3], "replicas": 2},
            {"layers": [3, 5], "replicas": 1},
            {"layers": [5, 7], "replicas": 2},
            {"layers": [7, 9], "replicas": 1},
        ],
    }
trainer = Trainer(
    accelerator="cpu",
    devices=3,
    strategy=DappleStrategy("auto" if AUTO else plan, recovery="log" if LOG or AUTO else "auto"),
    max_steps=STEPS,
    logger=False,
    enable_progress_bar=False,
    enable_checkpointing=False,
    enable_model_summary=False,
    callbacks=[Losses()],
    val_check_interval=2,
    limit_val_batches=2,
    num_sanity_val_steps=0,
)
loader = DataLoader(models.dataset(), batch_size=models.BATCH, shuffle=True)
trainer.fit(Model(), train_dataloaders=loader, val_dataloaders=DataLoader(models.dataset(), batch_size=models.BATCH))
trainer.save_checkpoint(out / "final.ckpt")
(out / f"done-{trainer.global_rank}").write_text(f"{trainer.global_step} {ATTEMPT}")
