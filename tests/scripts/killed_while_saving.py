"""Saves a checkpoint, then is SIGKILLed halfway through writing the next one to the same path.

Usage: python killed_while_saving.py PATH
"""

import os
import signal
import sys

import torch
from lightning.fabric.plugins import TorchCheckpointIO

from dapple_lightning import DappleStrategy


class DiesMidWrite(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        with open(path, "wb") as f:
            f.write(b"half a checkpoint")
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)


path = sys.argv[1]
strategy = DappleStrategy({"stages": [{"layers": [0, 1]}]})
strategy.save_checkpoint({"weights": torch.ones(3)}, path)
strategy.checkpoint_io = DiesMidWrite()
strategy.save_checkpoint({"weights": torch.zeros(3)}, path)
