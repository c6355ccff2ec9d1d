"""What recovery, the logbook and fine-tuning use of the strategy, named: its parts for one fit."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torch.optim import Optimizer

from dapple_lightning.runtime import Pipeline
from dapple_lightning.strategy._checkpoint import Checkpoints
from dapple_lightning.strategy._step import PipelinedSteps
from dapple_lightning.surgery import Cut

__all__ = ["FitParts"]


@dataclass(frozen=True)
class FitParts:
    """The strategy's parts for one fit, as its ``setup`` left them (the model cut, the optimizers made)."""

    module: Any
    """The user's LightningModule, cut to this rank's stage."""
    pipeline: Pipeline
    """This rank's pipeline (its stage, links and schedule)."""
    steps: PipelinedSteps
    """Runs the user's step over a global batch's micro-batches."""
    checkpoints: Checkpoints
    """Saves and loads this rank's part in the single-device layout."""
    cut: Cut
    """The cut of the user's containers, which can put the whole containers back for a while."""
    optimizers: list[Optimizer]
    """This rank's optimizers, over its own parameters."""
    timeout: timedelta
    """How long a rank waits on a peer."""
    train_step_context: Callable[[], Any]
    """The precision plugin's context for a training step."""
    load_checkpoint: Callable[[str], dict[str, Any]]
    """The strategy's ``load_checkpoint``: this rank's part of a checkpoint the strategy saved."""
