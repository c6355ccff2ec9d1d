"""Lightning's spawn launcher, with ranks that leave the process group together."""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.pytorch import Trainer
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import (
    _disable_module_memory_sharing,
    _GlobalStateSnapshot,
)
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

__all__ = ["FORKSERVER_PRELOAD", "STATE_LEFT_IN_SPAWNED_RANKS", "SpawnLauncher"]

FORKSERVER_PRELOAD = ("torch", "lightning.pytorch", "dapple_lightning.strategy")
"""What the fork server imports once, so that no rank forked from it imports them again."""

STATE_LEFT_IN_SPAWNED_RANKS = (
    "dapple: after fit with start_method='spawn' (or 'forkserver') the optimizer, scheduler and loop state stayed in the spawned "
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
        if self._start_method == "forkserver":
            # Takes effect when this process starts its fork server, i.e. on the first launch.
            multiprocessing.get_context("forkserver").set_forkserver_preload(list(FORKSERVER_PRELOAD))
            # Lightning hands this snapshot (seeds, deterministic flags) only to spawned ranks; a
            # forked rank would otherwise carry the fork server's RNG, not this process's. The
            # launcher travels to the ranks with the bound method they run, and the snapshot with it.
            self._parent_globals = _GlobalStateSnapshot.capture()
            # A forked rank has the fork server's environment, which predates variables set
            # since (Lightning's PL_GLOBAL_SEED, a user's settings); a spawned rank has this one.
            self._parent_environ = dict(os.environ)
        result = super().launch(function, *args, trainer=trainer, **kwargs)
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            self._strategy._spawned_ranks_kept_state = True
        return result

    @override
    def _wrapping_function(
        self, process_idx: int, trainer: Any, function: Any, args: Any, kwargs: Any, *rest: Any
    ) -> None:
        if self._start_method == "forkserver":
            os.environ.clear()
            os.environ.update(self._parent_environ)
            self._parent_globals.restore()
            # The model reaches a forked rank in shared memory, as it does a spawned one: unshare
            # it, or every rank (and this process) would update the same parameters.
            args, kwargs = _disable_module_memory_sharing((args, kwargs))
        super()._wrapping_function(process_idx, trainer, function, args, kwargs, *rest)

    @override
    def _collect_rank_zero_results(self, trainer: Trainer, results: Any) -> Any:
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            # Leave together: a rank that exits while a peer still talks to it aborts that peer.
            if _distributed_is_initialized():
                dist.barrier()
                dist.destroy_process_group()
