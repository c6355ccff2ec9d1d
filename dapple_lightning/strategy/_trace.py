"""``DappleStrategy(trace=...)``: every rank's timeline in one Chrome trace, written by rank 0."""

from __future__ import annotations

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from dapple_lightning.runtime import Pipeline, write_chrome_trace
from dapple_lightning.strategy._checkpoint import gather_on_zero

__all__ = ["write_trace"]


def write_trace(pipeline: Pipeline, path: str) -> None:
    """Gather every rank's timeline events on rank 0 and write them to ``path`` (collective)."""
    if (gathered := gather_on_zero(pipeline.timeline.events)) is not None:
        written = write_chrome_trace([e for part in gathered for e in part], path)
        rank_zero_info(f"dapple: wrote Chrome trace to {written}")
