"""Lightning's collective hooks for :class:`~._strategy.DappleStrategy`, as DDP has them, except
that barriers wait on the strategy's host group (gloo) when the world's backend is not gloo."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _all_gather_ddp_if_available,
    _distributed_is_initialized,
    _sync_ddp_if_available,
)
from lightning.pytorch.strategies import ParallelStrategy
from torch import Tensor
from typing_extensions import override

__all__ = ["Collectives"]


class Collectives(ParallelStrategy):
    _host_group: Any = None  # gloo, for barriers, when the world's backend is not gloo

    @override
    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            dist.barrier(group=self._host_group)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, Tensor) or not _distributed_is_initialized():
            return tensor
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)
