"""Trains a 2:1 plan on 3 ranks, launched plainly, saving OUT/last.ckpt at steps 2 and 4; MODE injects a fault.

Usage: python checkpoint_faults.py MODE OUT_DIR

- ``full-kill``: rank 0 is SIGKILLed after writing the first tensor of the second save.
- ``sharded-kill``: rank 2 is SIGKILLed after writing its part of the second (sharded) save,
  before the metadata that completes the directory.
- ``async-kill``: as ``full-kill``, with ``async_save``: the background writer kills the process.
- ``async-overlap``: one asynchronous save at step 2, whose writer waits until training has
  finished step 3: it completes only if training goes on while it writes.
"""

import os
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed.checkpoint as dcp
from lightning.pytorch import Callback

import models
from harness import quiet_trainer
from dapple_lightning import DappleStrategy, Plan
from dapple_lightning.strategy import _stream

mode, out = sys.argv[1], Path(sys.argv[2])
PLAN = Plan(stages=[{"layers": [0, 4], "replicas": 2}, {"layers": [4, 7], "replicas": 1}], micro_batches=3)
stepped = threading.Event()


def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def arm(rank: int) -> None:
    """Install the fault for the next save."""
    if mode in ("full-kill", "async-kill") and rank == 0:
        add = _stream.StreamingFile.add

        def add_then_die(self, tensor):
            add(self, tensor)
            die()

        _stream.StreamingFile.add = add_then_die
    elif mode == "sharded-kill" and rank == 2:
        write_data = dcp.FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            write_data(self, plan, planner).wait()
            die()

        dcp.FileSystemWriter.write_data = write_then_die
    elif mode == "async-overlap" and rank == 0:
        finish = _stream.StreamingFile.finish

        def finish_after_a_step(self, obj, records=None):
            if not stepped.wait(timeout=120):
                raise RuntimeError("training did not go on while the checkpoint was written")
            finish(self, obj, records)

        _stream.StreamingFile.finish = finish_after_a_step


class Saves(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step == 3:
            stepped.set()
        if step == 2 or (step == 4 and mode != "async-overlap"):
            if step == 4 or mode == "async-overlap":
                arm(trainer.global_rank)
            trainer.save_checkpoint(out / "last.ckpt")


strategy = DappleStrategy(
    PLAN,
    state_dict_type="sharded" if mode == "sharded-kill" else "full",
    async_save=mode.startswith("async"),
    timeout=120,  # seconds, as a number: the background writer's group takes the parsed timeout
)
trainer = quiet_trainer(devices=PLAN.world_size, strategy=strategy, max_steps=4, callbacks=[Saves()])
trainer.fit(models.ScheduledHeadMLP(), train_dataloaders=models.loader())
