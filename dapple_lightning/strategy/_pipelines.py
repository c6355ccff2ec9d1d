"""The process groups a plan needs, created once and shared by every pipeline built on them;
and the start every rank shares (rank 0's weights)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from torch import Tensor, nn

from dapple_lightning.plan import Plan
from dapple_lightning.runtime import (
    Pipeline,
    StageModule,
    Timeline,
    agree_buffers,
    p2p_groups,
    stage_group,
    synchronize_batch_norms,
)

__all__ = ["Buffers", "Pipelines", "broadcast_module"]


class Pipelines:
    """Builds this rank's :class:`Pipeline` of a plan, keeping the process groups it creates:
    one pair of point-to-point groups for every plan (groups are costly), and each plan's stage
    group, so that a plan measured by ``plan="auto"`` and then chosen trains on the same one."""

    def __init__(self, module: nn.Module, rank: int, device: torch.device, timeout: timedelta) -> None:
        self.module, self.rank, self.device, self.timeout = module, rank, device, timeout
        self._p2p: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None
        self._stage_groups: dict[Plan, dist.ProcessGroup | None] = {}

    def build(self, plan: Plan, stage: StageModule, timeline: Timeline, *, track_memory: bool = False) -> Pipeline:
        """``plan``'s pipeline on this rank (collective: may create process groups), with
        ``stage`` already standing in for the container; parameters outside it, and the stage's
        tied ones (``stage.shared``), are summed over every rank."""
        tied = {id(p) for p in stage.shared}
        local = {id(p) for p in stage.parameters()}
        # Every rank lists them in the same order: those outside the stage, then the tied ones.
        outside = [p for p in self.module.parameters() if id(p) not in local and id(p) not in tied]
        outside += stage.shared
        held = {id(p) for p in self.module.parameters()}
        idle = [p for p in stage.shared if id(p) not in held]  # only other stages' layers use them
        if plan.num_stages > 1 and self._p2p is None:
            self._p2p = p2p_groups(timeout=self.timeout)
        if plan not in self._stage_groups:
            self._stage_groups[plan] = stage_group(plan, self.rank, timeout=self.timeout)
        return Pipeline(
            plan,
            self.rank,
            stage,
            device=self.device,
            timeline=timeline,
            stage_group=self._stage_groups[plan],
            shared_params=outside,
            idle_params=idle,
            track_memory=track_memory,
            p2p_groups=self._p2p if plan.num_stages > 1 else (None, None),
        )


class Buffers:
    """Buffers (batch norm's running statistics) that stay equal where ranks share them.

    After each training step a stage's replicas take its first replica's buffers, and every rank
    takes rank 0's buffers outside the container, as DDP broadcasts rank 0's. With
    ``sync_batchnorm`` the stage's batch norms normalise over its replicas (until :meth:`close`).
    """

    def __init__(self, module: nn.Module, pipeline: Pipeline, plan: Plan, sync_batchnorm: bool) -> None:
        stage = pipeline.module
        local = {id(b) for b in stage.buffers()}
        self.stage_buffers = list(stage.buffers()) if pipeline.replicas > 1 else []
        self.outside = [b for b in module.buffers() if id(b) not in local] if dist.get_world_size() > 1 else []
        self.first_replica = plan.stage_ranks(pipeline.stage)[0]
        self.group = pipeline.stage_group
        sync = sync_batchnorm and self.group is not None
        self._undo = synchronize_batch_norms(stage, self.group) if sync else None

    def agree(self) -> None:
        if self.stage_buffers:
            agree_buffers(self.stage_buffers, self.first_replica, self.group)
        if self.outside:
            agree_buffers(self.outside, 0, None)

    def close(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None


@torch.no_grad()
def broadcast_module(module: nn.Module) -> None:
    """Give every rank rank 0's parameters and buffers."""
    if not _distributed_is_initialized() or dist.get_world_size() == 1:
        return
    tensors = [t for t in module.state_dict(keep_vars=True).values() if isinstance(t, Tensor)]
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        dist.broadcast(flat, 0)
        offset = 0
        for t in same:
            n = t.numel()
            t.data.copy_(flat[offset : offset + n].view_as(t))
            offset += n
