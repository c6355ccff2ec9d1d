"""A :class:`~dapple_lightning.runtime.UserStep` for tests that drive a :class:`Pipeline` directly."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from dapple_lightning.rows import Rows


class LossStep:
    """Runs ``loss(m, rows)`` per micro-batch; the last stage's replicas sum their losses (float64).

    On the last stage ``loss`` returns the micro-batch's loss, scaled by its share of the batch;
    elsewhere the stage's exit ends it before it returns.
    """

    def __init__(self, loss: Callable[[int, Rows], torch.Tensor]) -> None:
        self.loss = loss
        self.total = torch.zeros(1, dtype=torch.float64)
        self.shared = 0
        """How often the executor asked for :meth:`replica_share`."""

    def run(self, micro_batch: int, rows: Rows) -> torch.Tensor:
        out = self.loss(micro_batch, rows)
        self.total = self.total + out.detach().double().reshape(1)
        return out

    def context(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def replica_share(self) -> torch.Tensor:
        self.shared += 1
        return self.total
