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
    peak_stashed,
    schedule,
    simulate,
    split_backwards,
    warmup_depth,
    zb_h1_schedule,
    zb_h2_schedule,
    zb_tail_schedule,
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


# ZB-H1 on the paper's example (Qi et al., Figure 3: S = 4, M = 8). Each stage keeps DAPPLE's
# forwards and input backwards; stage s stashes s weight backwards before its first W, so every
# stage holds at most 4 micro-batches between F and W (DAPPLE's first stage holds 4 too).
ZB_H1_4x8_LISTS = [
    "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7",
    "F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7",
    "F0 F1 B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7",
    "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7",
]

ZB_H1_4x8 = """\
t   stage0  stage1  stage2  stage3
0   F0
1   F1      F0
2   F2      F1      F0
3   F3      F2      F1      F0
4                           B0
5                   B0      F1
6           B0      F2      B1
7   B0      F3      B1      F2
8   W0      B1      F3      B2
9   F4      W0      B2      F3
10  B1      F4      W0      B3
11  W1      B2      F4      W0
12  F5      W1      B3      F4
13  B2      F5      W1      B4
14  W2      B3      F5      W1
15  F6      W2      B4      F5
16  B3      F6      W2      B5
17  W3      B4      F6      W2
18  F7      W3      B5      F6
19  B4      F7      W3      B6
20  W4      B5      F7      W3
21  B5      W4      B6      F7
22  W5      B6      W4      B7
23  B6      W5      B7      W4
24  W6      B7      W5      W5
25  B7      W6      W6      W6
26  W7      W7      W7      W7"""


def test_zb_h1_per_stage_lists_four_stages_eight_micro_batches() -> None:
    for stage, text in enumerate(ZB_H1_4x8_LISTS):
        assert zb_h1_schedule(4, 8, stage) == actions(text)
    assert [peak_in_flight(actions(t)) for t in ZB_H1_4x8_LISTS] == [4, 4, 4, 4]
    assert [peak_stashed(actions(t)) for t in ZB_H1_4x8_LISTS] == [1, 2, 3, 4]


def test_zb_h1_grid_drawn_on_paper() -> None:
    # 27 slots: 3M + S - 1, where DAPPLE with a backward of two units (B and W) takes 3M + 3(S - 1) = 33.
    assert grid(schedule("zb-h1", 4, 8)) == ZB_H1_4x8


def test_zb_h1_with_fewer_micro_batches_than_stages() -> None:
    assert zb_h1_schedule(4, 2, 0) == actions("F0 F1 B0 W0 B1 W1")
    assert zb_h1_schedule(4, 2, 3) == actions("F0 B0 F1 B1 W0 W1")


def test_a_weight_backward_before_its_input_backward_is_refused() -> None:
    with pytest.raises(RuntimeError, match="runs W0 before B0"):
        simulate([actions("F0 W0 B0")])


@given(num_stages=st.integers(1, 8), micro_batches=st.integers(1, 16))
def test_zb_h1_invariants(num_stages: int, micro_batches: int) -> None:
    stages = schedule("zb-h1", num_stages, micro_batches)
    cap = min(num_stages, micro_batches)
    for s, acts in enumerate(stages):
        assert sorted(acts) == sorted(Action(k, m) for k in "FBW" for m in range(micro_batches))
        for m in range(micro_batches):
            assert acts.index(Action("F", m)) < acts.index(Action("B", m)) < acts.index(Action("W", m))
        # the paper's bound: activations of min(S, M) micro-batches, DAPPLE's first-stage peak, on every
        # stage; stage s stashes the W's of up to min(S, M) - K_s + 1 of them (s + 1 when M >= S)
        assert peak_in_flight(acts) == cap
        assert peak_stashed(acts) == cap - warmup_depth(num_stages, micro_batches, s) + 1
        # DAPPLE's order of forwards and input backwards, so the messages are DAPPLE's
        assert [a for a in acts if a.kind != "W"] == dapple_schedule(num_stages, micro_batches, s)
    timed = simulate(stages)  # raises on deadlock
    assert len(timed) == 3 * num_stages * micro_batches
    if micro_batches >= num_stages:  # unit F, B and W: the bubble is S - 1 units, a third of DAPPLE's
        assert max(t.end for t in timed) == 3 * micro_batches + num_stages - 1
        dapple = simulate(schedule("dapple", num_stages, micro_batches), lambda s, a: 2.0 if a.kind == "B" else 1.0)
        assert max(t.end for t in dapple) == 3 * micro_batches + 3 * (num_stages - 1)


# ZB-H2 on the paper's example (Qi et al., Figure 3: S = 4, M = 8). Stage s runs 2(S - s) - 1
# forwards before its first B (7, 5, 3, 1) and stashes 2s W's before its first W, so every stage
# holds at most 2S - 1 = 7 micro-batches between F and W (ZB-H1: 4).
ZB_H2_4x8_LISTS = [
    "F0 F1 F2 F3 F4 F5 F6 B0 W0 F7 B1 W1 B2 W2 B3 W3 B4 W4 B5 W5 B6 W6 B7 W7",
    "F0 F1 F2 F3 F4 B0 F5 B1 F6 B2 W0 F7 B3 W1 B4 W2 B5 W3 B6 W4 B7 W5 W6 W7",
    "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 W0 F7 B5 W1 B6 W2 B7 W3 W4 W5 W6 W7",
    "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 W0 F7 B7 W1 W2 W3 W4 W5 W6 W7",
]

# The paper's parallelogram: stage s is busy without a gap from slot s to slot 3M + s, and each
# later stage's stashed W's run while the earlier stages have finished.
ZB_H2_4x8 = """\
t   stage0  stage1  stage2  stage3
0   F0
1   F1      F0
2   F2      F1      F0
3   F3      F2      F1      F0
4   F4      F3      F2      B0
5   F5      F4      B0      F1
6   F6      B0      F3      B1
7   B0      F5      B1      F2
8   W0      B1      F4      B2
9   F7      F6      B2      F3
10  B1      B2      F5      B3
11  W1      W0      B3      F4
12  B2      F7      F6      B4
13  W2      B3      B4      F5
14  B3      W1      W0      B5
15  W3      B4      F7      F6
16  B4      W2      B5      B6
17  W4      B5      W1      W0
18  B5      W3      B6      F7
19  W5      B6      W2      B7
20  B6      W4      B7      W1
21  W6      B7      W3      W2
22  B7      W5      W4      W3
23  W7      W6      W5      W4
24          W7      W6      W5
25                  W7      W6
26                          W7"""


def test_zb_h2_with_fewer_micro_batches_than_its_bound() -> None:
    # M = 3 < 2S - 1: every stage holds all 3; the first two stages run all their forwards first.
    assert [zb_h2_schedule(4, 3, s) for s in range(4)] == [
        actions("F0 F1 F2 B0 W0 B1 W1 B2 W2"),
        actions("F0 F1 F2 B0 W0 B1 W1 B2 W2"),
        actions("F0 F1 F2 B0 W0 B1 W1 B2 W2"),
        actions("F0 B0 F1 B1 F2 B2 W0 W1 W2"),
    ]


@given(num_stages=st.integers(1, 8), micro_batches=st.integers(1, 16))
def test_zb_h2_invariants(num_stages: int, micro_batches: int) -> None:
    stages = schedule("zb-h2", num_stages, micro_batches)
    cap = min(2 * num_stages - 1, micro_batches)
    for s, acts in enumerate(stages):
        assert sorted(acts) == sorted(Action(k, m) for k in "FBW" for m in range(micro_batches))
        for m in range(micro_batches):
            assert acts.index(Action("F", m)) < acts.index(Action("B", m)) < acts.index(Action("W", m))
        warmup = next(i for i, a in enumerate(acts) if a.kind != "F")
        assert warmup == min(2 * (num_stages - s) - 1, micro_batches)
        # the paper's bound, min(2S - 1, M) micro-batches on every stage; stashed W's as ZB-H1's rule
        assert peak_in_flight(acts) == cap
        assert peak_stashed(acts) == cap - warmup + 1
    timed = simulate(stages)  # raises on deadlock
    assert len(timed) == 3 * num_stages * micro_batches
    zb_h1 = simulate(schedule("zb-h1", num_stages, micro_batches))
    assert max(t.end for t in timed) <= max(t.end for t in zb_h1)
    if micro_batches >= 2 * num_stages - 1:  # unit passes: no stage idles between its first and last
        for s in range(num_stages):
            mine = [t for t in timed if t.stage == s]
            assert sum(t.end - t.start for t in mine) == max(t.end for t in mine) - min(t.start for t in mine)


# zb-tail on the same example: ZB-H2's warm-up (7, 5, 3, 1 forwards), whole backwards after it,
# and the last 2s + 1 backwards of stage s > 0 split, their W's last.
ZB_TAIL_4x8_LISTS = [
    "F0 F1 F2 F3 F4 F5 F6 B0 F7 B1 B2 B3 B4 B5 B6 B7",
    "F0 F1 F2 F3 F4 B0 F5 B1 F6 B2 F7 B3 B4 B5 B6 B7 W5 W6 W7",
    "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7 W3 W4 W5 W6 W7",
    "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 W1 W2 W3 W4 W5 W6 W7",
]

ZB_TAIL_4x8 = """\
t   stage0  stage1  stage2  stage3
0   F0
1   F1      F0
2   F2      F1      F0
3   F3      F2      F1      F0
4   F4      F3      F2      B0
5   F5      F4      B0      F1
6   F6      B0      F3      B1
7   B0      F5      B1      F2
8   F7      B1      F4      B2
9   B1      F6      B2      F3
10          B2      F5      B3
11  B2      F7      B3      F4
12          B3      F6      B4
13  B3              B4      F5
14          B4      F7      B5
15  B4              B5      F6
16          B5              B6
17  B5              B6      F7
18          B6              B7
19  B6              B7      W1
20          B7      W3      W2
21  B7      W5      W4      W3
22          W6      W5      W4
23          W7      W6      W5
24                  W7      W6
25                          W7"""


@pytest.mark.parametrize(
    ("name", "lists", "table", "live", "stashed"),
    [
        ("zb-h2", ZB_H2_4x8_LISTS, ZB_H2_4x8, [7, 7, 7, 7], [1, 3, 5, 7]),
        ("zb-tail", ZB_TAIL_4x8_LISTS, ZB_TAIL_4x8, [7, 5, 5, 7], [0, 3, 5, 7]),
    ],
)
def test_zero_bubble_per_stage_lists_four_stages_eight_micro_batches(name, lists, table, live, stashed) -> None:
    make = {"zb-h2": zb_h2_schedule, "zb-tail": zb_tail_schedule}[name]
    for stage, text in enumerate(lists):
        assert make(4, 8, stage) == actions(text)
    assert [peak_in_flight(actions(t)) for t in lists] == live
    assert [peak_stashed(actions(t)) for t in lists] == stashed
    # One slot per action (a whole backward drawn as one): the order, not the timing. For
    # zb-h2, 27 slots, ZB-H1's: a step that ends in the update cannot overlap the next step's
    # first forwards with the last stage's stashed W's, where the paper's ZB-H2 gains its last S - 1.
    assert grid(schedule(name, 4, 8)) == table


def unit_step(stages: list[list[Action]]) -> float:
    """The step with F, B and W one unit each and a whole backward (a B without a W) two."""
    split = [split_backwards(acts) for acts in stages]
    timed = simulate(stages, lambda s, a: 2.0 if a.kind == "B" and a.micro_batch not in split[s] else 1.0)
    return max(t.end for t in timed)


@given(num_stages=st.integers(1, 8), micro_batches=st.integers(1, 16))
def test_zb_tail_invariants(num_stages: int, micro_batches: int) -> None:
    stages = schedule("zb-tail", num_stages, micro_batches)
    for s, acts in enumerate(stages):
        warmup = min(2 * (num_stages - s) - 1, micro_batches)
        tail = 0 if s == 0 else min(2 * s + 1, micro_batches)
        assert [a.micro_batch for a in acts if a.kind == "W"] == list(range(micro_batches - tail, micro_batches))
        # whole backwards in DAPPLE's alternation after ZB-H2's warm-up, the W's after the last B
        assert [a for a in acts if a.kind != "W"] == _alternating(warmup, micro_batches)
        assert all(a.kind == "W" for a in acts[len(acts) - tail :])
        assert peak_in_flight(acts) == min(max(warmup, tail), micro_batches) <= min(2 * num_stages - 1, micro_batches)
        assert peak_stashed(acts) == tail
    unit = unit_step(stages)  # raises on deadlock
    # at unit passes ZB-H2's step on two stages, and never DAPPLE's or worse with a pipeline
    assert unit <= unit_step(schedule("dapple", num_stages, micro_batches)) - (num_stages > 1)
    if num_stages <= 2:
        assert unit == unit_step(schedule("zb-h2", num_stages, micro_batches))


def _alternating(warmup: int, micro_batches: int) -> list[Action]:
    out = [Action("F", m) for m in range(warmup)]
    for m in range(micro_batches):
        out += [Action("B", m)] + [Action("F", m + warmup)] * (m + warmup < micro_batches)
    return out


LOWERED_2_1_ZB = """\
rank 0 (stage 0): F0 SEND_F0>2[0:1] F1 SEND_F1>2[0:1] RECV_B0<2[0:1] B0 W0 RECV_B1<2[0:1] B1 REDUCE W1
rank 1 (stage 0): F0 SEND_F0>2[0:1] F1 SEND_F1>2[0:1] RECV_B0<2[0:1] B0 W0 RECV_B1<2[0:1] B1 REDUCE W1
rank 2 (stage 1): RECV_F0<0[0:1] RECV_F0<1[1:2] F0 B0 SEND_B0>0[0:1] SEND_B0>1[1:2] \
RECV_F1<0[0:1] RECV_F1<1[1:2] F1 B1 SEND_B1>0[0:1] SEND_B1>1[1:2] W0 REDUCE W1"""


def test_zb_h1_lowered_program_drawn_on_paper() -> None:
    # The input gradient goes upstream right after B; REDUCE stands before the last W, which
    # finishes the weights' gradients.
    assert lower(plan_of([2, 1], 2, "zb-h1"), 4).table() == LOWERED_2_1_ZB


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2", "zb-tail"])
@pytest.mark.parametrize("replicas", [[1], [2], [1, 1], [2, 1], [1, 2], [1, 2, 1], [2, 1, 1], [1, 1, 3], [1, 1, 1, 1]])
@pytest.mark.parametrize("micro_batches", [1, 2, 3, 4, 8])
def test_zero_bubble_lowers_for_every_plan_shape(replicas: list[int], micro_batches: int, name: str) -> None:
    plan = plan_of(replicas, micro_batches, name)
    deep = 2 * plan.num_stages - 1
    make, held = {
        "zb-h1": (zb_h1_schedule, plan.num_stages),
        "zb-h2": (zb_h2_schedule, deep),
        "zb-tail": (zb_tail_schedule, deep),
    }[name]
    for rows in {micro_batches * max(replicas), micro_batches * max(replicas) + 1, 7 * micro_batches}:
        program = lower(plan, rows)
        timed = simulate(program)  # raises on any deadlock or mis-ordered message
        lists = [make(plan.num_stages, micro_batches, stage) for stage in program.stage_of]
        assert len(timed) == sum(map(len, lists))
        for rank, rank_ops in enumerate(program.ranks):
            order = [op.action for op in rank_ops if op.kind in ("F", "B", "W")]
            assert order == lists[rank]
            peak = peak_in_flight(order)
            assert peak == min(held, micro_batches) if name != "zb-tail" else peak <= min(held, micro_batches)
            # REDUCE stands before the last W; on a stage without W's (zb-tail's first), before
            # the last B and the gradients it receives.
            weights = [i for i, op in enumerate(rank_ops) if op.kind == "W"]
            last = weights[-1] if weights else max(i for i, op in enumerate(rank_ops) if op.kind == "B")
            (reduce,) = [i for i, op in enumerate(rank_ops) if op.kind == "REDUCE"]
            assert reduce < last and all(op.kind == "RECV_B" for op in rank_ops[reduce + 1 : last])


def draw(capsys, *argv: str) -> tuple[int, str, str]:
    """``python -m dapple_lightning.schedule ARGV``, in this process: (exit code, out, err)."""
    import runpy
    import sys

    saved, sys.argv = sys.argv, ["schedule", *argv]
    try:
        runpy.run_module("dapple_lightning.schedule", run_name="__main__")
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    finally:
        sys.argv = saved
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_drawing_command(capsys) -> None:
    assert draw(capsys, "4", "8", "zb-tail") == (0, ZB_TAIL_4x8 + "\n", "")
    code, out, _ = draw(capsys, "--help")
    assert code == 0 and "zb-tail" in out and "micro_batches" in out
    code, _, err = draw(capsys, "2", "8", "zb-h3")
    assert code == 2 and "invalid choice: 'zb-h3'" in err
    code, _, err = draw(capsys, "0", "8")
    assert code == 2 and "num_stages >= 1" in err
