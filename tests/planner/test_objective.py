"""The peak each objective allows, read off the least peak and the device memory."""

from __future__ import annotations

import pytest

from dapple_lightning.planner import OBJECTIVES, peak_limit


@pytest.mark.parametrize(
    ("objective", "margin", "least", "budget", "allowed"),
    [
        ("time", 0.1, 4.0, 16.0, 16.0),  # DAPPLE: whatever fits
        ("memory", 0.5, 4.0, 16.0, 4.0),  # mCAP: the least peak, whatever the margin
        ("time-within-memory", 0.5, 4.0, 16.0, 6.0),
        ("time-within-memory", 0.0, 4.0, 16.0, 4.0),
        ("time-within-memory", 9.0, 4.0, 16.0, 16.0),  # never above the device memory
    ],
)
def test_peak_limit(objective, margin, least, budget, allowed):
    assert peak_limit(least, budget, objective, margin) == allowed


def test_objectives_are_named_and_checked():
    assert OBJECTIVES == ("time", "memory", "time-within-memory")
    with pytest.raises(ValueError, match=r"unknown objective 'fast'; choose one of"):
        peak_limit(4.0, 16.0, "fast", 0.1)
    with pytest.raises(ValueError, match="memory_margin must be a finite number >= 0"):
        peak_limit(4.0, 16.0, "memory", float("nan"))
    with pytest.raises(ValueError, match="memory_margin"):
        peak_limit(4.0, 16.0, "time-within-memory", True)
