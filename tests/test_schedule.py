"""Schedules against tables drawn by hand, and their invariants over many shapes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dapple_lightning.plan import Plan
from dapple_lightning.schedule import (
    Action,
    Op,
    Program,
    dapple_schedule,
    gpipe_schedule,
    grid,
    lower,
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


def ops(text: str) -> tuple[Op, ...]:
    return tuple(Op.parse(o) for o in text.split())


def plan_of(replicas: list[int], micro_batches: int, name: str = "dapple") -> Plan:
    stages = [{"layers": [s, s + 1], "replicas": r} for s, r in enumerate(replicas)]
    return Plan.coerce({"micro_batches": micro_batches, "schedule": name, "stages": stages})


# 2:1, M = 2, a global batch of 4 rows: each micro-batch's 2 rows are split over ranks 0 and 1
# and concatenated on rank 2; its gradient goes back in the same two pieces.
LOWERED_2_1 = """\
rank 0 (stage 0): F0 SEND_F0>2[0:1] F1 SEND_F1>2[0:1] RECV_B0<2[0:1] B0 REDUCE RECV_B1<2[0:1] B1
rank 1 (stage 0): F0 SEND_F0>2[0:1] F1 SEND_F1>2[0:1] RECV_B0<2[0:1] B0 REDUCE RECV_B1<2[0:1] B1
rank 2 (stage 1): RECV_F0<0[0:1] RECV_F0<1[1:2] F0 B0 SEND_B0>0[0:1] SEND_B0>1[1:2] \
RECV_F1<0[0:1] RECV_F1<1[1:2] F1 REDUCE B1 SEND_B1>0[0:1] SEND_B1>1[1:2]"""


def test_lowered_program_drawn_on_paper() -> None:
    assert lower(plan_of([2, 1], 2), 4).table() == LOWERED_2_1


def test_evaluation_lowers_to_forwards_and_activations_only() -> None:
    program = lower(plan_of([1, 1], 2), 2, train=False)
    assert program[0] == ops("F0 SEND_F0>1[0:1] F1 SEND_F1>1[0:1]")
    assert program[1] == ops("RECV_F0<0[0:1] F0 RECV_F1<0[0:1] F1")
    simulate(program)


def test_ops_print_and_parse_back() -> None:
    for text in ("F3", "B0", "SEND_F2>5", "RECV_B1<0[2:4]", "REDUCE"):
        assert str(Op.parse(text)) == text
    with pytest.raises(ValueError, match="peer"):
        Op.parse("SEND_F2<5")


def test_a_receive_posted_in_the_wrong_order_is_a_deadlock() -> None:
    # Rank 1 posts micro-batch 1's receive first; rank 0 sends micro-batch 0 first on that pair.
    good = lower(plan_of([1, 1], 2, "gpipe"), 2)
    first, second = good[1].index(Op.parse("RECV_F0<0[0:1]")), good[1].index(Op.parse("RECV_F1<0[0:1]"))
    swapped = list(good[1])
    swapped[first], swapped[second] = swapped[second], swapped[first]
    simulate(good)
    with pytest.raises(RuntimeError, match=r"deadlocks: rank 1 posts RECV_F1<0\[0:1\] but rank 0's next .* SEND_F0>1"):
        simulate(Program((good[0], tuple(swapped)), good.stage_of))


def test_waiting_for_a_gradient_before_sending_its_activation_is_a_deadlock() -> None:
    program = Program((ops("F0 RECV_B0<1 SEND_F0>1 B0"), ops("RECV_F0<0 F0 B0 SEND_B0>0")), (0, 1))
    with pytest.raises(
        RuntimeError, match=r"deadlocks: ranks wait on each other at \{0: 'RECV_B0<1', 1: 'RECV_F0<0'\}"
    ):
        simulate(program)


def test_a_message_never_received_is_reported() -> None:
    with pytest.raises(RuntimeError, match=r"rank 0's SEND_F1>1 is never received"):
        simulate(Program((ops("F0 SEND_F0>1 F1 SEND_F1>1"), ops("RECV_F0<0 F0")), (0, 1)))


def test_pieces_out_of_row_order_are_refused() -> None:
    program = Program(
        (ops("F0 SEND_F0>2[0:1]"), ops("F0 SEND_F0>2[0:1]"), ops("RECV_F0<1[1:2] RECV_F0<0[0:1] F0")), (0, 0, 1)
    )
    with pytest.raises(RuntimeError, match="out of row order"):
        simulate(program)


def _replica_shapes(world: int, max_stages: int = 4):
    def compositions(n: int, parts: int):
        if parts == 1:
            yield [n]
            return
        for first in range(1, n - parts + 2):
            for rest in compositions(n - first, parts - 1):
                yield [first, *rest]

    for stages in range(1, min(world, max_stages) + 1):
        yield from compositions(world, stages)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_every_plan_shape_lowers_to_a_program_that_runs(world: int) -> None:
    # Brute force: every replica split of up to 5 ranks, 1..4 micro-batches, several batch sizes
    # (so that split-concat pieces change), both schedules, training and evaluation.
    for replicas in _replica_shapes(world):
        for micro_batches in range(1, 5):
            for rows in {micro_batches * max(replicas), micro_batches * max(replicas) + 1, 7 * micro_batches}:
                for name in ("dapple", "gpipe"):
                    plan = plan_of(replicas, micro_batches, name)
                    for train in (True, False):
                        program = lower(plan, rows, train=train)
                        timed = simulate(program)  # raises on any deadlock or mis-ordered message
                        per_rank = 2 * micro_batches if train else micro_batches
                        assert len(timed) == world * per_rank
                        for rank_ops in program.ranks:
                            reduces = [i for i, op in enumerate(rank_ops) if op.kind == "REDUCE"]
                            backwards = [i for i, op in enumerate(rank_ops) if op.kind == "B"]
                            assert len(reduces) == (1 if train else 0)
                            if train:  # just before the last backward's receives
                                assert reduces[0] < backwards[-1]
                                assert all(rank_ops[i].kind == "RECV_B" for i in range(reduces[0] + 1, backwards[-1]))
