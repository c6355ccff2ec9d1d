"""A per-rank memory budget: read from what the user writes, and stated against a plan's stages.

``DappleStrategy(memory_limit=...)`` and the planner take the budget as bytes or as text such
as ``"6GiB"`` or ``"512 MB"`` (:func:`parse_memory`). Plans predicted over it are never chosen
(the planner's searches cap every stage at it); a plan the user gave is checked against it and
the stages over it are named with their numbers (:func:`over_budget`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

from dapple_lightning.plan import Plan, Stage

__all__ = ["MEMORY_UNITS", "format_bytes", "over_budget", "parse_memory", "stage_memory_lines"]

MEMORY_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
"""Units :func:`parse_memory` reads (case-insensitive): decimal ``GB`` and binary ``GiB``."""

_TEXT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_memory(value: object, what: str = "memory_limit") -> float:
    """Bytes from ``value``: a positive number of bytes, or text such as ``"6GiB"``, ``"1.5 GB"``.

    Raises:
        TypeError: For anything but a number or a string (``True`` included).
        ValueError: For text that is not a number and a unit of :data:`MEMORY_UNITS`, or a value
            that is not finite and positive.
    """
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise TypeError(f"{what} must be bytes (a number) or text like '6GiB', got {value!r}")
    if isinstance(value, str):
        found = _TEXT.match(value)
        unit = found.group(2).lower() if found else None
        if found is None or unit not in MEMORY_UNITS:
            raise ValueError(
                f"{what}={value!r} is not a size; write bytes or a number and a unit, e.g. '6GiB' or '512MB' "
                f"(units: {', '.join(u for u in MEMORY_UNITS if u)})"
            )
        value = float(found.group(1)) * MEMORY_UNITS[unit]
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a finite number of bytes > 0, got {value!r}")
    return float(value)


def format_bytes(value: float) -> str:
    """``value`` in binary units (``"1.50 GiB"``, ``"12.0 MiB"``, ``"3.0 KiB"``, ``"512 B"``)."""
    for unit, size, digits in (("GiB", 2**30, 2), ("MiB", 2**20, 1), ("KiB", 2**10, 1)):
        if abs(value) >= size:
            return f"{value / size:.{digits}f} {unit}"
    return f"{value:.0f} B"


def stage_memory_lines(
    plan: Plan, stage_bytes: Sequence[float], budget: float, size: Callable[[float], str] = format_bytes
) -> list[str]:
    """One line per stage: its predicted peak per rank beside the budget (bytes written by ``size``),
    marked when over it."""
    lines = []
    for index, (stage, peak) in enumerate(zip(plan.stages, stage_bytes)):
        share = f"{peak / budget:.0%}" if budget > 0 else "n/a"
        mark = "  OVER BUDGET" if peak > budget else ""
        lines.append(
            f"  stage {index} (layers {stage.start}-{stage.end - 1}, {stage.replicas} "
            f"{'replica' if stage.replicas == 1 else 'replicas'}{_lever(stage)}): "
            f"{size(peak)} of {size(budget)} ({share}){mark}"
        )
    return lines


def over_budget(plan: Plan, stage_bytes: Sequence[float], budget: float) -> str | None:
    """Why ``plan`` is predicted not to fit ``budget`` bytes per rank (the stages over it and
    their numbers, and what to change), or ``None`` when every stage fits. With chunks,
    ``stage_bytes`` holds one peak per rank group."""
    over = [k for k, peak in enumerate(stage_bytes) if peak > budget]
    if not over:
        return None
    if plan.chunks > 1:
        named = "; ".join(
            f"rank group {k} (stages {', '.join(map(str, plan.stages_of(plan.stage_ranks(k)[0])))}) "
            f"{format_bytes(stage_bytes[k])}"
            for k in over
        )
    else:
        named = "; ".join(
            f"stage {k} (layers {plan.stages[k].start}-{plan.stages[k].end - 1}) {format_bytes(stage_bytes[k])}"
            for k in over
        )
    return (
        f"plan {plan.describe()} is predicted to need more memory per rank than memory_limit "
        f"{format_bytes(budget)}: {named}. Give the heavy stages fewer layers or more replicas, use more "
        "micro-batches (each keeps fewer rows alive), make them recompute (recompute: true) or keep their "
        "layers on disk (offload: 1 or 'auto', nn.Sequential on CPU), or let plan='auto' choose a plan that fits"
    )


def _lever(stage: Stage) -> str:
    """How the stage lowers its memory, for its line: recomputing, or offloaded with its window."""
    if stage.offload is not None:
        return f", offloaded, window {stage.offload}"
    return ", recomputing" if stage.recompute else ""
