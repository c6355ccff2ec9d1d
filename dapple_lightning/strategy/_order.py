"""The training loader's order, resumable at a step: what recovery keeps of the data position.

A recovered step must see the batches an uninterrupted run sees. :class:`EpochOrder` sits under
the loader's batch sampler, remembers the state of the sampler's generator at the epoch's start,
and can start an epoch at a given batch of that order; :func:`track` puts it in place where the
order can be told again.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler, SequentialSampler

from dapple_lightning.strategy._lightning import Patches

__all__ = ["EpochOrder", "track"]


class EpochOrder(Sampler):
    """The training loader's sampler, with the epoch's start remembered and a resumable position."""

    def __init__(self, inner: Sampler, batch_size: int) -> None:
        self.inner, self.batch_size = inner, batch_size
        self.epoch_start: torch.Tensor | None = None
        self._resume: Mapping[str, Any] | None = None

    def resume(self, position: Mapping[str, Any]) -> None:
        """The next epoch's iteration starts where ``position`` (from :meth:`position`) was."""
        self._resume = position

    def position(self, trainer: Any) -> dict[str, Any]:
        """Where the epoch stands at a safe point: its order's seed state and the batches done."""
        # Processed, not completed: a state taken in on_train_batch_end is restored with the batch completed.
        done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        return {"generator": self.epoch_start, "skip": done}

    def __iter__(self) -> Iterator[Any]:
        generator = getattr(self.inner, "generator", None)
        skip = 0
        if self._resume is not None:
            if generator is not None and self._resume["generator"] is not None:
                generator.set_state(self._resume["generator"])
            skip, self._resume = self._resume["skip"] * self.batch_size, None
        self.epoch_start = generator.get_state() if isinstance(generator, torch.Generator) else None
        indices = iter(self.inner)
        for _ in range(skip):
            next(indices, None)
        yield from indices

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]


def track(patches: Patches, dataloader: object, pending: Mapping[str, Any] | None) -> EpochOrder | None:
    """Put an :class:`EpochOrder` under ``dataloader``'s batch sampler (once); ``None`` where the
    order cannot be told again: no plain ``BatchSampler`` over a map-style dataset, a loader that
    restores its own position (Lightning's stateful ones), or a sampler whose order is drawn from
    the global RNG (neither sequential nor with a ``generator``). Its epoch then restarts from its
    first batch after a recovery, as Lightning warns. ``patches`` records the sampler it replaces."""
    if not isinstance(dataloader, DataLoader) or type(dataloader.batch_sampler) is not BatchSampler:
        return None
    if isinstance(dataloader.dataset, IterableDataset) or callable(getattr(dataloader, "load_state_dict", None)):
        return None
    batches = dataloader.batch_sampler
    inner = batches.sampler.inner if isinstance(batches.sampler, EpochOrder) else batches.sampler
    if not isinstance(inner, SequentialSampler) and not isinstance(getattr(inner, "generator", None), torch.Generator):
        return None
    if not isinstance(batches.sampler, EpochOrder):
        patches.set(batches, "sampler", EpochOrder(batches.sampler, batches.batch_size))
    if pending is not None:
        batches.sampler.resume(pending)
    return batches.sampler
