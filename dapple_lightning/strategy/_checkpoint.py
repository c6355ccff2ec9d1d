"""Checkpoint state of a partitioned model, in the single-device layout.

Each rank holds its stage (and the parameters outside the container); a checkpoint holds the
whole model under the unpartitioned model's keys and the optimizer state as
``configure_optimizers`` lays it out on one device. The stage's entries come from its first
replica, everything outside the container from rank 0, so each value is written once.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from torch import nn
from torch.optim import Optimizer

from dapple_lightning.checkpoint import by_name, to_local, to_single_device
from dapple_lightning.plan import Plan
from dapple_lightning.strategy._step import to_cpu
from dapple_lightning.surgery import Cut

__all__ = ["Consolidated", "gather_on_zero", "optimizer_names", "write_atomically"]


class Consolidated:
    """The single-device checkpoint state of ``module``, cut by ``cut`` under ``plan`` (collective).

    Args:
        full_state_keys: the unpartitioned model's state-dict keys, in order.
        full_optimizer_names: parameter names of each param group of each optimizer, as on one
            device (see :func:`optimizer_names`).
    """

    def __init__(
        self,
        module: nn.Module,
        cut: Cut,
        plan: Plan,
        rank: int,
        full_state_keys: list[str],
        full_optimizer_names: list[list[list[str]]],
    ) -> None:
        self.module, self.cut, self.plan, self.rank = module, cut, plan, rank
        self.full_state_keys = full_state_keys
        self.full_optimizer_names = full_optimizer_names

    def owned(self) -> set[int]:
        """Parameters this rank speaks for when something must count each parameter once."""
        local = {id(p) for p in self.cut.stage.parameters()}
        owned = local if self.plan.replica_of(self.rank) == 0 else set()
        if self.rank == 0:
            owned = owned | {id(p) for p in self.module.parameters() if id(p) not in local}
        return owned

    def state_dict(self) -> dict[str, Any] | None:
        """The full model's state dict on rank 0 (``None`` elsewhere)."""
        prefix = self.cut.prefix
        first_replica = self.plan.replica_of(self.rank) == 0
        mine = {
            key: to_cpu(value)
            for key, value in self.module.state_dict().items()
            if (first_replica if key.startswith(prefix) else self.rank == 0)
        }
        gathered = gather_on_zero(mine)
        if gathered is None:
            return None
        merged = {k: v for part in gathered for k, v in part.items()}
        order = {k: i for i, k in enumerate(self.full_state_keys)}
        return dict(sorted(merged.items(), key=lambda kv: order.get(kv[0], len(order))))

    def optimizer_state(self, optimizer: Optimizer, index: int) -> dict[str, Any] | None:
        """Optimizer ``index``'s state in the single-device layout on rank 0 (``None`` elsewhere)."""
        local = optimizer.state_dict()
        owned = self.owned()
        owned_names = {n for n, p in self.module.named_parameters() if id(p) in owned}
        mine = {
            name: to_cpu(value)
            for name, value in by_name(local, self._local_names(optimizer)).items()
            if name in owned_names
        }
        gathered = gather_on_zero(mine)
        if gathered is None:
            return None
        states = {k: v for part in gathered for k, v in part.items()}
        return to_single_device(states, local["param_groups"], self.full_optimizer_names[index])

    def local_optimizer_state(self, optimizer: Optimizer, index: int, single: Mapping[str, Any]) -> dict[str, Any]:
        """This rank's share of a single-device optimizer state, for ``optimizer.load_state_dict``."""
        return to_local(single, self.full_optimizer_names[index], self._local_names(optimizer))

    def _local_names(self, optimizer: Optimizer) -> list[list[str]]:
        name_of = {id(p): n for n, p in self.module.named_parameters()}
        return [[name_of[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def write_atomically(
    checkpoint_io: CheckpointIO, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None
) -> None:
    """Write to a temporary file, then rename: a crash mid-write keeps the old file intact."""
    path = Path(filepath)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        checkpoint_io.save_checkpoint(checkpoint, tmp, storage_options=storage_options)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def gather_on_zero(obj: Any) -> list[Any] | None:
    """Every rank's ``obj``, in rank order, on rank 0 (``None`` elsewhere); collective."""
    rank = dist.get_rank()
    gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


def optimizer_names(module: Any) -> list[list[list[str]]]:
    """Parameter names of each param group of each optimizer, as ``configure_optimizers`` builds them on one device.

    Runs ``configure_optimizers`` once on the whole model (before partitioning) and throws the
    optimizers away: only their layout is needed, so checkpoints can store it.
    """
    from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers

    optimizers, _ = _init_optimizers_and_lr_schedulers(module)
    name_of = {id(p): n for n, p in module.named_parameters()}
    return [[[name_of[id(p)] for p in group["params"]] for group in o.param_groups] for o in optimizers]
