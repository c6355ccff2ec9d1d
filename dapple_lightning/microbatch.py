"""Cutting batches: the rows of a (nested) batch that a micro-batch slice holds.

The row arithmetic itself (which rows, how slices of two stages overlap) is pure and lives in
:mod:`dapple_lightning.rows`; this module applies it to the tensors of a batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dapple_lightning.rows import Rows, Transfer, even_split, transfers

__all__ = ["Rows", "Transfer", "batch_size_of", "even_split", "slice_batch", "transfers"]


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_map_tensors(o, fn) for o in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(_map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _map_tensors(v, fn)) for k, v in obj.items())
    return obj


def _tensors(obj: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _map_tensors(obj, found.append)
    return found


def batch_size_of(batch: Any) -> int:
    """Rows of a batch: dim 0 of its tensors, which must agree."""
    sizes = {t.shape[0] for t in _tensors(batch) if t.dim() > 0}
    if not sizes:
        raise ValueError(
            "the batch holds no tensor with a batch dimension; dapple splits batches along dim 0 of their tensors"
        )
    if len(sizes) > 1:
        raise ValueError(
            f"the batch's tensors disagree on dim 0 {sorted(sizes)}; dapple needs the batch in dim 0 of every "
            "tensor so it can cut micro-batches"
        )
    return sizes.pop()


def slice_batch(batch: Any, rows: Rows) -> Any:
    """The rows ``rows`` of every tensor in a (nested) batch; other values pass through."""
    return _map_tensors(batch, lambda t: t[rows.start : rows.stop] if t.dim() > 0 else t)
