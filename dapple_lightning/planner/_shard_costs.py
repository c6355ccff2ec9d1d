"""What FSDP2 adds to a sharded layer's passes, measured per call, and the calls a step makes.

The runtime shards each layer of a stage that holds parameters as its own FSDP2 unit
(``runtime._sharding``). Each of the unit's forward and backward passes then does more than the
unsharded layer's: an all-gather of its parameters (with FSDP2's copy into the gathered buffer and
out of it, and the buffer's free), a reduce-scatter of its gradient, or, where nothing is
communicated, FSDP2's hooks alone. :func:`~._links.measure_shard_costs` times each kind of pass on a
unit of each of a few parameter sizes, on a group of the stage's replica count, against the same
unit unsharded; :class:`ShardCosts` holds the differences, fitted as ``fixed + bytes x per_byte``.

A step of ``M`` micro-batches calls, for each sharded unit of ``p`` parameter bytes::

    shard: full    M x gather(p) + M x gather_scatter(p)
    shard: grads   gather(p) + (M - 1) x (kept_forward(p) + kept_backward(p)) + scatter(p)

(``full`` gathers before every forward, frees after it, gathers again for the backward and
reduce-scatters each micro-batch's gradient; ``grads`` gathers by the step's first forward, keeps the
parameters and whole gradients through the step, and reduce-scatters once in the step's last
backward: :meth:`ShardCosts.added`.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["SHARD_PASSES", "Affine", "ShardCosts", "fit_affine"]

SHARD_PASSES = ("gather", "gather_scatter", "kept_forward", "kept_backward", "scatter")
"""The kinds of a sharded unit's pass that :class:`ShardCosts` prices, in its field order."""


@dataclass(frozen=True)
class Affine:
    """Seconds ``fixed_s + bytes x per_byte_s``."""

    fixed_s: float
    per_byte_s: float

    def __post_init__(self) -> None:
        for name in ("fixed_s", "per_byte_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not (0 <= value < math.inf):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    def at(self, nbytes: float) -> float:
        return self.fixed_s + nbytes * self.per_byte_s


def fit_affine(sizes: Sequence[float], seconds: Sequence[float]) -> Affine:
    """The least-squares line ``seconds = fixed + size x per_byte`` through the timings, kept at or
    above zero: a negative slope (time that does not grow with size: noise) gives the mean as a
    constant, a negative intercept a line through zero, a negative mean nothing."""
    fixed, slope, mean = least_squares(sizes, seconds, "fit_affine")
    if slope <= 0:
        return Affine(max(mean, 0.0), 0.0)
    if fixed < 0:
        return Affine(0.0, max(slope_through_zero(sizes, seconds), 0.0))
    return Affine(fixed, slope)


def least_squares(sizes: Sequence[float], seconds: Sequence[float], caller: str) -> tuple[float, float, float]:
    """``(intercept, slope, mean seconds)`` of the least-squares line through the timings (slope 0
    where all sizes are equal); ``caller`` names the function in the error for unequal lengths."""
    if len(sizes) != len(seconds) or not sizes:
        raise ValueError(f"{caller} needs as many timings as sizes, got {len(seconds)} for {len(sizes)}")
    n = len(sizes)
    mean_x, mean_t = sum(sizes) / n, sum(seconds) / n
    spread = sum((x - mean_x) ** 2 for x in sizes)
    slope = sum((x - mean_x) * (t - mean_t) for x, t in zip(sizes, seconds)) / spread if spread > 0 else 0.0
    return mean_t - slope * mean_x, slope, mean_t


def slope_through_zero(sizes: Sequence[float], seconds: Sequence[float]) -> float:
    """The least-squares slope of the line through the origin."""
    return sum(x * t for x, t in zip(sizes, seconds)) / sum(x * x for x in sizes)


@dataclass(frozen=True)
class ShardCosts:
    """Seconds FSDP2 adds to one sharded unit's pass over the unit unsharded, on ``replicas`` ranks, as
    :func:`~._links.measure_shard_costs` measured them (each an :class:`Affine` in the unit's
    parameter bytes)."""

    replicas: int
    gather: Affine
    """A forward that all-gathers the parameters first (and, under ``full``, frees them after)."""
    gather_scatter: Affine
    """A backward that all-gathers the parameters again and reduce-scatters the gradient (``full``)."""
    kept_forward: Affine
    """A forward on parameters kept gathered from an earlier micro-batch (``grads``)."""
    kept_backward: Affine
    """A backward that adds to the whole gradient, no collective (``grads``, before the step's last)."""
    scatter: Affine
    """A backward on kept parameters that reduce-scatters the gradient and frees them (``grads``, the last)."""

    def __post_init__(self) -> None:
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 2:
            raise ValueError(f"shard costs are for a group of >= 2 replicas, got {self.replicas!r}")
        for name in SHARD_PASSES:
            if not isinstance(getattr(self, name), Affine):
                raise TypeError(f"ShardCosts.{name} must be an Affine, got {getattr(self, name)!r}")

    def added(self, mode: str, unit_bytes: Sequence[float], micro_batches: int) -> float:
        """Seconds per step that sharding by ``mode`` adds to a stage's passes whose sharded units hold
        ``unit_bytes`` of parameters each, over ``micro_batches`` micro-batches (see the module's doc)."""
        m = micro_batches
        if mode == "full":
            return sum(m * (self.gather.at(p) + self.gather_scatter.at(p)) for p in unit_bytes)
        if mode == "grads":
            return sum(
                self.gather.at(p) + (m - 1) * (self.kept_forward.at(p) + self.kept_backward.at(p)) + self.scatter.at(p)
                for p in unit_bytes
            )
        raise ValueError(f"shard must be 'grads' or 'full', got {mode!r}")

    @classmethod
    def coerce(cls, value: ShardCosts | Mapping[str, Any]) -> ShardCosts:
        """``value``, or the costs a mapping of the fields gives (``dataclasses.asdict`` of them, read
        back from JSON)."""
        if isinstance(value, ShardCosts):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"shard costs must be ShardCosts or a mapping of their fields, got {value!r}")
        affine = {
            name: value[name] if isinstance(value[name], Affine) else Affine(**value[name]) for name in SHARD_PASSES
        }
        return cls(value["replicas"], **affine)

    def as_numbers(self) -> list[float]:
        """The ten figures, in :data:`SHARD_PASSES` order, fixed then per byte (to broadcast them)."""
        return [v for name in SHARD_PASSES for v in (getattr(self, name).fixed_s, getattr(self, name).per_byte_s)]

    @classmethod
    def from_numbers(cls, replicas: int, numbers: Sequence[float]) -> ShardCosts:
        if len(numbers) != 2 * len(SHARD_PASSES):
            raise ValueError(f"shard costs take {2 * len(SHARD_PASSES)} numbers, got {len(numbers)}")
        pairs = {name: Affine(numbers[2 * i], numbers[2 * i + 1]) for i, name in enumerate(SHARD_PASSES)}
        return cls(replicas, **pairs)
