"""Schedules against tables drawn by hand, and their invariants over many shapes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dapple_lightning.schedule import (
    Action,
    dapple_schedule,
    gpipe_schedule,
    grid,
    peak_in_flight,
    schedule,
    simulate,
    warmup_depth,
)


def actions(text: str) -> list[Action]:
    return [Action.parse(a) for a in text.split()]


def test_dapple_per_stage_lists_three_stages_four_micro_batches() -> None:
    assert dapple_schedule(3, 4, 0) == actions("F0 F1 F2 B0 F3 B1 B2 B3")
    assert dapple_schedule(3, 4, 1) == actions("F0 F1 B0 F2 B1 F3 B2 B3")
    assert dapple_schedule(3, 4, 2) == actions("F0 B0 F1 B1 F2 B2 F3 B3")


def test_gpipe_per_stage_list() -> None:
    assert gpipe_schedule(2, 3, 1) == actions("F0 F1 F2 B0 B1 B2")


def test_more_stages_than_micro_batches_warms_up_with_all_of_them() -> None:
    assert dapple_schedule(4, 2, 0) == actions("F0 F1 B0 B1")
    assert warmup_depth(4, 2, 0) == 2


DAPPLE_3x4 = """\
t   stage0  stage1  stage2
0   F0
1   F1      F0
2   F2      F1      F0
3                   B0
4           B0      F1
5   B0      F2      B1
6   F3      B1      F2
7   B1      F3      B2
8           B2      F3
9   B2              B3
10          B3
11  B3"""

GPIPE_2x3 = """\
t  stage0  stage1
0  F0
1  F1      F0
2  F2      F1
3          F2
4          B0
5  B0      B1
6  B1      B2
7  B2"""


def test_dapple_grid_drawn_on_paper() -> None:
    assert grid(schedule("dapple", 3, 4)) == DAPPLE_3x4


def test_gpipe_grid_drawn_on_paper() -> None:
    assert grid(schedule("gpipe", 2, 3)) == GPIPE_2x3


def test_unknown_schedule_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown schedule 'pipedream'.*dapple.*gpipe"):
        schedule("pipedream", 2, 2)


def test_simulate_detects_a_deadlock() -> None:
    # Stage 0 waits for B0 from stage 1 before it sends F1; stage 1 needs F1 before B0.
    stages = [actions("F0 B0 F1 B1"), actions("F0 F1 B0 B1")]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(stages)


@given(num_stages=st.integers(1, 8), micro_batches=st.integers(1, 16), name=st.sampled_from(["dapple", "gpipe"]))
def test_invariants(num_stages: int, micro_batches: int, name: str) -> None:
    stages = schedule(name, num_stages, micro_batches)
    for s, acts in enumerate(stages):
        # every micro-batch exactly once each way, forward before backward
        assert sorted(acts) == sorted(
            [Action("F", m) for m in range(micro_batches)] + [Action("B", m) for m in range(micro_batches)]
        )
        for m in range(micro_batches):
            assert acts.index(Action("F", m)) < acts.index(Action("B", m))
        # activations alive: K_s under DAPPLE, all M under GPipe
        limit = warmup_depth(num_stages, micro_batches, s) if name == "dapple" else micro_batches
        assert peak_in_flight(acts) == limit
        # micro-batches cross each stage in the same order both ways (what point-to-point relies on)
        assert [a.micro_batch for a in acts if a.kind == "F"] == list(range(micro_batches))
        assert [a.micro_batch for a in acts if a.kind == "B"] == list(range(micro_batches))
    timed = simulate(stages)  # raises on deadlock
    assert len(timed) == 2 * num_stages * micro_batches


@given(num_stages=st.integers(1, 6), micro_batches=st.integers(1, 12))
def test_equal_stages_bubble(num_stages: int, micro_batches: int) -> None:
    # With forward = backward = 1 unit, both schedules take 2(M + S - 1) units: bubble (S-1)/(M+S-1).
    for name in ("dapple", "gpipe"):
        timed = simulate(schedule(name, num_stages, micro_batches))
        makespan = max(t.end for t in timed)
        assert makespan == 2 * (micro_batches + num_stages - 1)
