"""The user's random streams (torch, numpy, Python's ``random``), as one device finds them.

A seeded single-device run draws its first ``collate_fn`` masks, augmentations and dropout from
the streams that ``seed_everything`` and the script's own draws before ``fit`` (building the
model, say) left. Under dapple every rank starts from those states: rank 0's, which are the
launching process's (a spawned rank gets them from Lightning's launcher). Lightning's DDP
re-seeds every rank instead, which forgets the script's draws since seeding; dapple hands rank 0's
states to the others.

The strategy's own setup (the initial weights' broadcast, ``plan="auto"``'s profiling with drawn
batches and trial steps, materialising a meta-device model, ...) must then leave the streams as
it found them: :class:`RngStates` takes them when setup begins and puts them back before the
user's ``configure_optimizers`` runs, as one device's setup would reach it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["RngStates", "share_rng_states"]


@dataclass(frozen=True)
class RngStates:
    """The torch (CPU, and the rank's CUDA device where it has one), numpy and Python states."""

    torch_cpu: torch.Tensor
    numpy: Any
    python: Any
    cuda: torch.Tensor | None = None
    device: torch.device | None = None
    """The CUDA device whose state ``cuda`` is; ``None`` on CPU ranks."""

    @classmethod
    def take(cls, device: torch.device) -> RngStates:
        """The states now, with ``device``'s generator if it is a CUDA device."""
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(
            torch.get_rng_state(),
            np.random.get_state(),
            random.getstate(),
            cuda,
            device if device.type == "cuda" else None,
        )

    def restore(self, device: torch.device | None = None) -> None:
        """Put the states back; the CUDA one on ``device`` (default: the one it was taken from)."""
        torch.set_rng_state(self.torch_cpu)
        np.random.set_state(self.numpy)
        random.setstate(self.python)
        target = device if device is not None else self.device
        if self.cuda is not None and target is not None and target.type == "cuda":
            torch.cuda.set_rng_state(self.cuda, target)


def share_rng_states(device: torch.device, group: dist.ProcessGroup | None) -> None:
    """Every rank takes rank 0's states (collective over ``group``, a gloo group over every rank, or
    ``None`` for the default group when that is gloo); rank 0's CUDA state goes to each rank's own
    ``device``, the one its training draws from, as one device's draws from its only one."""
    box = [RngStates.take(device) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, 0, group=group)
    shared = box[0]
    assert shared is not None
    shared.restore(device)
