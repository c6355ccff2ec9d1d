"""Lightning's spawn launcher, with ranks that leave the process group together."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.pytorch import Trainer
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from typing_extensions import override

__all__ = ["SpawnLauncher"]


class SpawnLauncher(_MultiProcessingLauncher):
    """Lightning's spawn launcher; ranks leave the process group together."""

    @override
    def _collect_rank_zero_results(self, trainer: Trainer, results: Any) -> Any:
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            # Leave together: a rank that exits while a peer still talks to it aborts that peer.
            if _distributed_is_initialized():
                dist.barrier()
                dist.destroy_process_group()
