"""The process groups a plan needs, created once and shared by every pipeline built on them;
and the start every rank shares (rank 0's weights)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dapple_lightning.plan import Plan
from dapple_lightning.runtime import (
    P2PGroups,
    Pipeline,
    StageModule,
    Timeline,
    agree_buffers,
    broadcast,
    p2p_groups,
    stage_group,
    synchronize_batch_norms,
)
from dapple_lightning.strategy._lightning import distributed_is_initialized

__all__ = ["BUCKET_BYTES", "Buffers", "PipelineBuilder", "Staged", "broadcast_module"]

BUCKET_BYTES = 64 * 2**20
"""The most bytes of the module that :func:`broadcast_module` holds on the device at once."""


class PipelineBuilder:
    """Builds this rank's :class:`Pipeline` of a plan, keeping the process groups it creates:
    one pair of point-to-point groups for every plan (groups are costly), and each plan's stage
    group, so that a plan measured by ``plan="auto"`` and then chosen trains on the same one."""

    def __init__(self, module: nn.Module, rank: int, device: torch.device, timeout: timedelta) -> None:
        self.module, self.rank, self.device, self.timeout = module, rank, device, timeout
        self._p2p: P2PGroups | None = None
        self._p2p_plans: set[Plan] = set()
        """The plans whose pipelines the point-to-point groups carried."""
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
            self._p2p = p2p_groups(self.device, timeout=self.timeout)
        if plan.num_stages > 1:
            self._p2p_plans.add(plan)
        if plan not in self._stage_groups:
            self._stage_groups[plan] = stage_group(plan, self.rank, self.device, timeout=self.timeout)
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
            p2p_groups=self._p2p if plan.num_stages > 1 else P2PGroups(),
        )

    def keep_only(self, plan: Plan) -> None:
        """Destroy the groups that other plans (``plan="auto"``'s trials) used (collective on every
        rank, in the same order everywhere). An NCCL communicator holds device memory and its
        connections for as long as its group lives, and training uses ``plan``'s alone: the other
        plans' stage groups go, and so do the point-to-point groups if another plan's pipeline used
        them (on an unbound NCCL group its pairs' communicators stay with the group); ``plan``'s
        pipeline then gets new ones (:meth:`build`)."""
        for other in [p for p in self._stage_groups if p != plan]:
            group = self._stage_groups.pop(other)
            if group is not None:
                dist.destroy_process_group(group)
        if self._p2p is not None and (plan.num_stages == 1 or self._p2p_plans - {plan}):
            for group in self._p2p:
                if group is not None:  # None: a group gloo runs do not need (never the default one)
                    dist.destroy_process_group(group)
            self._p2p = None
            self._p2p_plans.clear()

    @property
    def groups(self) -> list[dist.ProcessGroup]:
        """The groups alive now: the point-to-point pair and the plans' stage groups."""
        stage = [g for g in self._stage_groups.values() if g is not None]
        return [*(g for g in self._p2p or () if g is not None), *stage]


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


@dataclass(frozen=True)
class Staged:
    """What :func:`broadcast_module` sent: through which device, in how many buckets, the largest's bytes."""

    device: torch.device
    buckets: int
    largest_bytes: int


@torch.no_grad()
def broadcast_module(module: nn.Module, device: torch.device, *, bucket_bytes: int = BUCKET_BYTES) -> Staged:
    """Give every rank rank 0's parameters and buffers, wherever they live (the CPU, before the cut).

    The values travel through a staging buffer on ``device``, the process group's device (NCCL
    takes CUDA tensors only), at most ``bucket_bytes`` at a time, and are copied back into the
    module where it is: moving the whole model to the device first would need a device that holds
    all of it, which a model cut into a pipeline for memory does not have. A tensor larger than a
    bucket travels in bucket-sized pieces.
    """
    if not distributed_is_initialized() or dist.get_world_size() == 1:
        return Staged(device, 0, 0)
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in module.state_dict(keep_vars=True).values():
        if isinstance(t, Tensor):
            by_dtype.setdefault(t.dtype, []).append(t)
    buckets = largest = 0
    for dtype, same in by_dtype.items():
        capacity = max(bucket_bytes // same[0].element_size(), 1)
        bucket = _Bucket(min(capacity, sum(t.numel() for t in same)), dtype, device)
        # A strided tensor (a transposed view) goes through a contiguous copy of its own.
        strided = [(t, t.data.contiguous()) for t in same if not t.is_contiguous()]
        flats = {id(t): values.view(-1) for t, values in strided}
        for t in same:
            flat = flats[id(t)] if id(t) in flats else t.data.view(-1)
            start = 0
            while start < flat.numel():
                start += bucket.add(flat, start)
                if bucket.full:
                    largest = max(largest, bucket.broadcast())
                    buckets += 1
        if bucket.filled:
            largest = max(largest, bucket.broadcast())
            buckets += 1
        for t, values in strided:
            t.data.copy_(values)
        del bucket  # before the next dtype's: one bucket on the device at a time
    return Staged(device, buckets, largest)


class _Bucket:
    """A staging buffer on the device and the pieces of flat tensors it holds."""

    def __init__(self, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        self.staging = torch.empty(capacity, dtype=dtype, device=device)
        self.pieces: list[tuple[Tensor, int, int]] = []  # (flat values, start, length)
        self.filled = 0
        self.receives = dist.get_rank() != 0

    @property
    def full(self) -> bool:
        return self.filled == self.staging.numel()

    def add(self, flat: Tensor, start: int) -> int:
        """Copy in as many of ``flat``'s values from ``start`` as fit; how many that was."""
        length = min(flat.numel() - start, self.staging.numel() - self.filled)
        self.staging[self.filled : self.filled + length].copy_(flat[start : start + length])
        self.pieces.append((flat, start, length))
        self.filled += length
        return length

    def broadcast(self) -> int:
        """Send rank 0's bucket, copy it back where its values came from; its bytes."""
        broadcast(self.staging[: self.filled], 0)
        at = 0
        for flat, start, length in self.pieces:
            if self.receives:
                flat[start : start + length].copy_(self.staging[at : at + length])
            at += length
        sent = self.filled * self.staging.element_size()
        self.pieces.clear()
        self.filled = 0
        return sent
