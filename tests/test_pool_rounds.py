"""The interval benchmarks/pool_rounds.py puts on pooled paired speed-ups, on cases worked by hand."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "pool_rounds", Path(__file__).resolve().parents[1] / "benchmarks" / "pool_rounds.py"
)
pool_rounds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pool_rounds)


def test_order_statistic_interval_of_the_median():
    # n = 6: the widest interval (min, max) covers the median with 1 - 2/64 = 96.9%; the next
    # narrower one (2nd smallest, 2nd largest) only 1 - 2*7/64 = 78.1%.
    values = [1.05, 0.9, 1.2, 1.1, 1.0, 1.3]
    assert pool_rounds.median_interval(values, 0.95) == (0.9, 1.3, pytest.approx(62 / 64))
    assert pool_rounds.median_interval(values, 0.75) == (1.0, 1.2, pytest.approx(50 / 64))
    with pytest.raises(ValueError, match="5 rounds cannot give 95% confidence"):
        pool_rounds.median_interval(values[:5], 0.95)


def test_speedups_pair_rounds_where_both_systems_ran(tmp_path):
    run = tmp_path / "run.json"
    wall = {"ours": [1.0, 2.0, None, 0.5], "theirs": [1.1, 1.0, 3.0, 0.6]}
    run.write_text(json.dumps({"per_round": {"wall": wall}}))
    assert pool_rounds.speedups(str(run), "ours", "theirs") == pytest.approx([1.1, 0.5, 1.2])
    assert pool_rounds.speedups(str(run), "ours", "absent") == []
