"""Lightning's checkpoint hooks for :class:`~._strategy.DappleStrategy`: each rank saves and loads
only what it holds, in the single-device layout (:mod:`._checkpoint`), and a state recovered after
torchrun's restart (:mod:`._resume`) loads in the rank's own layout."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.fabric.utilities.optimizer import _optimizers_to_device
from torch.optim import Optimizer
from typing_extensions import override

from dapple_lightning.strategy._collectives import Collectives
from dapple_lightning.strategy._launcher import STATE_LEFT_IN_SPAWNED_RANKS
from dapple_lightning.strategy._resume import RECOVERED, load_optimizers

__all__ = ["CheckpointHooks"]


class CheckpointHooks(Collectives):
    _checkpoints: Any
    _recovery: Any
    _spawned_ranks_kept_state: bool

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # After the cut, each rank loads only what it holds (a sharded checkpoint reads only that).
        return True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The unpartitioned state dict (collective); on rank 0, meta stand-ins for other ranks' entries,
        which :meth:`save_checkpoint` fills in as it writes."""
        attached = self._checkpoints.module is not None
        return self._checkpoints.model_state() if attached else self.lightning_module.state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state in the single-device layout (collective; stand-ins as above)."""
        known = bool(self._checkpoints.optimizers)
        return self._checkpoints.optimizer_state(optimizer) if known else optimizer.state_dict()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write a file (or a sharded directory) under a temporary name, then rename (collective)."""
        if self._spawned_ranks_kept_state:
            raise RuntimeError(STATE_LEFT_IN_SPAWNED_RANKS)
        self._checkpoints.save(checkpoint, filepath, storage_options, self.checkpoint_io)
        self._recovery.checkpointed(filepath, checkpoint.get("global_step", 0))

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous save in flight is written; raise its error (collective-free)."""
        self._checkpoints.wait()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if self._recovery.recovered is not None:  # newer than the script's checkpoint, which it started from
            return self._recovery.recovered
        return self._checkpoints.load(checkpoint_path, self.checkpoint_io, weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._checkpoints.module is None:
            super().load_model_state_dict(checkpoint, strict)
        else:
            self._checkpoints.load_model(checkpoint, strict and RECOVERED not in checkpoint)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if RECOVERED in checkpoint:
            load_optimizers(self.optimizers, checkpoint)
        else:
            self._checkpoints.load_optimizers(checkpoint)
        _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        self._checkpoints.remove(filepath, self.checkpoint_io)
