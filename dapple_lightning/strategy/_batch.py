"""Every rank trains on the same batch (rank 0's), and moves to its device only the rows it reads.

Each rank loads the whole global batch on the host. Loading is deterministic in most
pipelines, but not all: a ``collate_fn`` that masks tokens at random (Hugging Face's
``DataCollatorForLanguageModeling``), random augmentation in the dataset, workers seeded per
process. Then inputs and labels would silently stop belonging together. So every step the ranks
compare a fingerprint of their batch, computed on the host before anything moves and compared
over a gloo group (a few numbers; no device work, no wait for the device). Where any rank's
differs from rank 0's, rank 0's batch is sent to the others over the same group and used
everywhere, and the user is told once; with deterministic loading nothing more is paid.

Which rows a rank moves to its device: the user's step runs on every rank once per micro-batch,
on that rank's slice of it (its replica's rows of the micro-batch, see ``Pipeline.rows``), and
nowhere else. Every field of those rows may be read: code before the pipelined container runs on
every rank and derives side inputs (masks, position ids) from any field, and which fields a step
reads cannot be told before it runs. So a rank moves every field of its own rows and no other row:
a stage of ``r`` replicas moves ``1/r`` of the batch, a one-replica stage all of it.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader, RandomSampler

from dapple_lightning.microbatch import Rows, batch_size_of, concat_slices, map_tensors, slice_batch

__all__ = ["HeldRows", "RankBatches", "SameBatch", "same_order"]

_PERIOD = 8191  # position weights (1 to 8191): a reordering of rows changes the weighted sum


class SameBatch:
    """Makes every rank's batch rank 0's (collective over ``group``, on the host, once per step)."""

    def __init__(self) -> None:
        self.broadcasts = 0
        """Steps whose batch had to come from rank 0."""

    def __call__(self, batch: Any, group: dist.ProcessGroup | None = None) -> Any:
        """``batch`` (on the host), or rank 0's where they differ. ``group`` must be a gloo group over
        every rank (``None``: the default group, when that is gloo)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return batch
        mine = fingerprint(batch, torch.device("cpu"))
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine, group=group)
        if all(torch.equal(other, everyone[0]) for other in everyone[1:]):
            return batch
        if self.broadcasts == 0:
            rank_zero_warn(
                "dapple: the ranks loaded different batches (a collate_fn, dataset or worker that draws random "
                "numbers in each process?). Every rank now trains on rank 0's batch, sent to the others in each "
                "step where they differ; seed the randomness identically on every rank to avoid the transfer."
            )
        self.broadcasts += 1
        box = [move_data_to_device(batch, "cpu") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, 0, group=group)
        return box[0]


@dataclass(frozen=True)
class HeldRows:
    """The rows of a global batch of ``total`` rows that a rank holds: ``held``, one range per
    micro-batch, stored one after the other (the first range's rows first)."""

    total: int
    held: tuple[Rows, ...]

    def local(self, rows: Rows) -> Rows:
        """Where the global ``rows`` (within one held range) are in the rank's batch."""
        offset = 0
        for part in self.held:
            if part.start <= rows.start and rows.stop <= part.stop:
                return rows.shift(offset - part.start)
            offset += len(part)
        raise ValueError(f"rows [{rows.start}, {rows.stop}) are not among this rank's rows {self.held}")


class _HasRows(Protocol):
    def rows(self, batch_rows: int) -> list[Rows]: ...


class RankBatches:
    """Per step, on the host before the transfer: rank 0's batch on every rank, cut to this rank's rows.

    :meth:`narrow` keeps the batch it returned (after the caller moved it) so that the step that
    receives it knows which global rows it holds (:meth:`rows_of`).
    """

    def __init__(self) -> None:
        self.same = SameBatch()
        self._pending: HeldRows | None = None
        self._last: tuple[Any, HeldRows] | None = None

    def narrow(self, batch: Any, pipeline: _HasRows | None, group: dist.ProcessGroup | None) -> Any:
        """Rank 0's ``batch`` (collective over the gloo ``group``), cut to the rows ``pipeline.rows(total)``
        lists when they are not all of them; :meth:`keep` records what the caller moved. Without a
        pipeline (``plan="auto"``'s batch, or a batch moved to a device named by the caller), ``batch``."""
        self._last = self._pending = None  # the previous step's device batch is not kept alive by us
        if pipeline is None:
            return batch
        batch = self.same(batch, group)
        total = batch_size_of(batch)
        held = tuple(pipeline.rows(total))
        self._pending = HeldRows(total, held) if sum(map(len, held)) < total else None
        if self._pending is None:
            return batch
        mine = concat_slices([slice_batch(batch, r) for r in held], [len(r) for r in held], "the batch")
        pinned: list[bool] = []
        map_tensors(batch, lambda t: pinned.append(t.is_pinned()))
        # A loader's pinned batch moves to a GPU without the host waiting; the rows cut from it keep that.
        return map_tensors(mine, lambda t: t.pin_memory()) if any(pinned) else mine

    def keep(self, moved: Any) -> Any:
        """``moved`` (what :meth:`narrow` just returned, on the device): remembered as holding those rows."""
        pending, self._pending = self._pending, None
        if pending is not None:
            if (count := batch_size_of(moved)) != sum(map(len, pending.held)):
                raise ValueError(
                    f"the batch has {count} rows after transfer_batch_to_device/on_after_batch_transfer, but this "
                    f"rank handed them {sum(map(len, pending.held))}; under dapple these hooks must keep "
                    "every row (each rank passes them only the rows its micro-batches read)"
                )
            self._last = (moved, pending)
        return moved

    def rows_of(self, batch: Any) -> HeldRows | None:
        """Which global rows ``batch`` holds when :meth:`narrow` cut it; ``None`` for a whole batch."""
        return self._last[1] if self._last is not None and self._last[0] is batch else None


def same_order(dataloader: object, seed: int) -> object:
    """``dataloader``, drawing the same order on every rank. A RandomSampler without a generator
    draws its order from each process's global RNG, which the ranks consume differently (dropout in
    different layers), so it gets a generator seeded identically on every rank."""
    sampler = getattr(dataloader, "sampler", None)
    if isinstance(dataloader, DataLoader) and isinstance(sampler, RandomSampler) and sampler.generator is None:
        sampler.generator = torch.Generator().manual_seed(seed)
    return dataloader


def fingerprint(batch: Any, device: torch.device) -> Tensor:
    """Four integers that differ, but for a vanishing chance, between batches that differ in any
    value, order, shape or structure. Computed on the values' bits with wrapping integer sums, so
    it does not depend on the order of a parallel reduction."""
    digest = torch.zeros(4, dtype=torch.int64, device=device)
    for index, leaf in enumerate(_leaves(batch), start=1):
        if isinstance(leaf, Tensor):
            bits = _bits(leaf.detach().to(device))
            weights = torch.arange(bits.numel(), device=device, dtype=torch.int64).remainder_(_PERIOD).add_(1)
            shape = _hash((str(leaf.dtype), tuple(leaf.shape)))
            part = torch.stack([bits.sum(), bits.mul(weights).sum(), torch.tensor(shape, device=device)])
        else:
            part = torch.tensor([0, 0, _hash(leaf)], dtype=torch.int64, device=device)
        digest[:3] += part * index
        digest[3] += index
    return digest


def _bits(tensor: Tensor) -> Tensor:
    """The tensor's values as integers of the same width, widened to int64."""
    flat = tensor.contiguous().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    return flat.view(as_int).to(torch.int64)


def _leaves(obj: Any) -> list[Any]:
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [*obj.keys(), *(leaf for v in obj.values() for leaf in _leaves(v))]
    if isinstance(obj, list | tuple):
        return [len(obj), *(leaf for v in obj for leaf in _leaves(v))]
    return [obj]


def _hash(obj: Any) -> int:
    try:
        data = pickle.dumps(obj)
    except Exception:  # an unpicklable leaf: its text
        data = repr(obj).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little")
