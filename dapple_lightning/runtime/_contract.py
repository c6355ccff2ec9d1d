"""The contract between a step and the executor: what :meth:`Pipeline.run` asks, what it gives back.

The executor decides the order of the work (the rank's program); the step it runs knows the
user's code. Everything the executor asks of the step is one :class:`UserStep` object, passed to
:meth:`Pipeline.run <dapple_lightning.runtime.Pipeline.run>`; what the run measured comes back as
:class:`StepStats`. The strategy's implementation runs a LightningModule hook over the
micro-batches and captures what it logs; a test's is a few lines.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from dapple_lightning.rows import Rows

__all__ = ["StepStats", "UserStep"]


class UserStep(Protocol):
    """What the executor asks of the step it runs, micro-batch by micro-batch."""

    def run(self, micro_batch: int, rows: Rows) -> torch.Tensor | None:
        """Run the user's code on this rank's ``rows`` of ``micro_batch``.

        The code must call the :class:`~dapple_lightning.runtime.StageModule` exactly once. On
        the last stage, when training, return the loss to back-propagate, already scaled by the
        micro-batch's share of the global batch; elsewhere the result is not used (on other
        stages the code ends where the stage does).
        """
        ...

    def context(self) -> AbstractContextManager[Any]:
        """A context entered around each :meth:`run` (e.g. autocast); backwards run outside it."""
        ...

    def replica_share(self) -> torch.Tensor:
        """This replica's share of values to sum over the last stage's replicas (e.g. the loss), as a 1-D tensor.

        Asked once per training step on a last stage with replicas, after the step's last
        :meth:`run`. The values are summed in the last gradient bucket's all-reduce (no collective
        of their own where that bucket is float32 or float64); the sum is
        :attr:`StepStats.replica_sum`.
        """
        ...


@dataclass
class StepStats:
    """What a step measured on this rank."""

    peak_live_microbatches: int = 0
    peak_live_bytes: int = 0
    losses: list[torch.Tensor] = field(default_factory=list)
    replica_sum: torch.Tensor | None = None
    """On a last stage with replicas, after a training step: the sum over the replicas of
    :meth:`UserStep.replica_share` (float64)."""
    batch_bytes_moved: int = 0
    """Bytes of the batch the step's lazy moves copied from the host to this rank's device
    (``DappleStrategy(lazy_batch=...)``, on by default on CUDA). 0 where the batch moves eagerly
    (``lazy_batch=False``, or the CPU by default): the strategy does not see those copies."""
