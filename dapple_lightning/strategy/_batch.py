"""Every rank trains on the same batch: rank 0's.

Each rank loads the whole global batch on the host. Loading is deterministic in most
pipelines, but not all: a ``collate_fn`` that masks tokens at random (Hugging Face's
``DataCollatorForLanguageModeling``), random augmentation in the dataset, workers seeded per
process. Then inputs and labels would silently stop belonging together. So every step the ranks
compare a fingerprint of their batch, computed on the host before anything moves and compared
over a gloo group (a few numbers; no device work, no wait for the device). Where any rank's
differs from rank 0's, rank 0's batch is sent to the others over the same group and used
everywhere, and the user is told once; with deterministic loading nothing more is paid.

The global batch stays on the host: Lightning hands it to the callbacks and to hooks such as
``on_train_batch_end``, which must see every row, as on one device (a throughput or metric
callback that counted only a replica's rows would report a fraction of the truth). Each rank
moves to its device only the rows of the micro-batches it computes, through the module's
transfer hooks, as each micro-batch starts (``_step``): a stage with r replicas moves 1/r of the
batch per rank, not all of it, and no rank holds the whole batch on its device.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader, RandomSampler

from dapple_lightning.strategy._lightning import Patches

__all__ = ["SameBatch", "same_order"]

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


def same_order(patches: Patches, dataloader: object, seed: int) -> object:
    """``dataloader``, drawing the same order on every rank. A RandomSampler without a generator
    draws its order from each process's global RNG, which the ranks consume differently (dropout in
    different layers), so it gets a generator seeded identically on every rank (recorded in ``patches``)."""
    sampler = getattr(dataloader, "sampler", None)
    if isinstance(dataloader, DataLoader) and isinstance(sampler, RandomSampler) and sampler.generator is None:
        patches.set(sampler, "generator", torch.Generator().manual_seed(seed))
    return dataloader


def fingerprint(batch: Any, device: torch.device) -> Tensor:
    """Five integers that differ, but for a vanishing chance, between batches that differ in any
    value, order, shape or structure.

    Each tensor is read as the integers of its own width (its bits, through a view), as a matrix of
    rows (dim 0) by the rest, and summed along both dims in that width, wrapping: no copy of the
    batch is made (only of a strided tensor, to lay it out). One changed value changes its row's
    and its column's sum (a nonzero change below the width's modulus); a reordering of rows or of
    the values within rows changes a sum weighted by position; shape, dtype and the non-tensor
    leaves are hashed. The sums do not depend on the order of a parallel reduction.
    """
    digest = torch.zeros(5, dtype=torch.int64, device=device)
    for index, leaf in enumerate(_leaves(batch), start=1):
        if isinstance(leaf, Tensor):
            rows, columns = _sums(leaf.detach().to(device))
            shape = _hash((str(leaf.dtype), tuple(leaf.shape)))
            part = torch.stack(
                [rows.sum(), _weighted(rows, 1), _weighted(columns, 2), torch.tensor(shape, device=device)]
            )
        else:
            part = torch.tensor([0, 0, 0, _hash(leaf)], dtype=torch.int64, device=device)
        digest[:4] += part * index
        digest[4] += index
    return digest


def _sums(tensor: Tensor) -> tuple[Tensor, Tensor]:
    """Wrapping sums of ``tensor``'s bits along its rows and along its columns (as int64, one per row
    and one per column; dim 0 is the rows, the rest flattened into the columns)."""
    flat = tensor.contiguous()
    if flat.is_complex():
        flat = torch.view_as_real(flat)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    bits = flat.reshape(-1).view(width)
    matrix = bits.reshape(tensor.shape[0] if tensor.dim() > 0 else 1, -1) if bits.numel() else bits.reshape(0, 0)
    # A sum into the tensor's own integer width wraps there and needs no wider copy of its input.
    return matrix.sum(dim=1, dtype=width).to(torch.int64), matrix.sum(dim=0, dtype=width).to(torch.int64)


def _weighted(sums: Tensor, step: int) -> Tensor:
    """``sums`` weighted by position (weights 1, 1 + step, ...; period :data:`_PERIOD`)."""
    weights = torch.arange(sums.numel(), device=sums.device, dtype=torch.int64).mul_(step).remainder_(_PERIOD).add_(1)
    return sums.mul(weights).sum()


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
