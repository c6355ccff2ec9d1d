"""Lightning's spawn launcher, with ranks that leave the process group together."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.pytorch import Trainer
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

__all__ = ["STATE_LEFT_IN_SPAWNED_RANKS", "SpawnLauncher"]

STATE_LEFT_IN_SPAWNED_RANKS = (
    "dapple: after fit with start_method='spawn' the optimizer, scheduler and loop state stayed in the spawned "
    "ranks; this process has the trained weights only. Save inside the run (a ModelCheckpoint or a callback's "
    "on_train_end), launch with start_method='popen' (the default), or save the weights with "
    "torch.save(model.state_dict(), path)"
)


class SpawnLauncher(_MultiProcessingLauncher):
    """Lightning's spawn launcher; ranks leave the process group together.

    After ``fit`` the launching process has the trained weights but not the optimizer, scheduler
    or loop state, which stayed in the ranks: the strategy is told, so it refuses to write a
    checkpoint that would silently lack them.
    """

    @override
    def launch(self, function: Any, *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
        result = super().launch(function, *args, trainer=trainer, **kwargs)
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            self._strategy._spawned_ranks_kept_state = True
        return result

    @override
    def _collect_rank_zero_results(self, trainer: Trainer, results: Any) -> Any:
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            # Leave together: a rank that exits while a peer still talks to it aborts that peer.
            if _distributed_is_initialized():
                dist.barrier()
                dist.destroy_process_group()
