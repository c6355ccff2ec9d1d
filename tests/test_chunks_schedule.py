"""Plans with several stages per rank group (chunks) and their schedules, as data: no process."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

from dapple_lightning.plan import Plan, Stage
from dapple_lightning.schedule import (
    Action,
    Op,
    chunked_schedule,
    grid,
    lower,
    peak_bound,
    peak_in_flight,
    simulate,
)

LAYOUT = {"interleaved": "looped", "zb-v": "v", "v-half": "v"}


def chunked(name: str, replicas: tuple[int, ...], micro_batches: int, chunks: int = 2) -> Plan:
    """One layer per stage, group ``g`` replicated ``replicas[g]`` times."""
    groups = len(replicas)
    probe = Plan(
        stages=[Stage(s, s + 1) for s in range(groups * chunks)],
        chunks=chunks,
        layout=LAYOUT[name],
        micro_batches=2 * groups,
        schedule=name,
    )
    stages = [Stage(s, s + 1, replicas[probe.group_of_stage(s)]) for s in range(groups * chunks)]
    return Plan(stages=stages, micro_batches=micro_batches, schedule=name, chunks=chunks, layout=LAYOUT[name])


# ------------------------------------------------------------------------------ plans


def test_a_chunked_plan_is_one_line_and_shows_its_chunks():
    plan = Plan.chunked(8, "2:1", layout="v")
    assert (plan.num_groups, plan.num_stages, plan.world_size, plan.schedule) == (2, 4, 3, "zb-v")
    assert [plan.stages_of(r) for r in range(3)] == [(0, 3), (0, 3), (1, 2)]
    assert plan.stage_ranks(3) == (0, 1) and plan.stage_ranks(2) == (2,)
    assert plan.table().splitlines() == [
        "stage  layers  replicas  ranks  group  chunk",
        "0      [0, 2)  2         0,1    0      0",
        "1      [2, 4)  1         2      1      0",
        "2      [4, 6)  1         2      1      1",
        "3      [6, 8)  2         0,1    0      1",
        "4 stage(s) in 2 rank group(s) x 2 chunks (v) [2:1] on 3 rank(s), micro_batches=4, schedule=zb-v",
    ]
    assert plan.describe() == "2:1 cuts=2,4,6 M=4 zb-v chunks=2 v"
    assert Plan.from_yaml(plan.to_yaml()) == plan
    looped = Plan.chunked(12, [3, 1], chunks=3, micro_batches=4)
    assert [looped.group_of_stage(s) for s in range(6)] == [0, 1, 0, 1, 0, 1]
    assert looped.stages_of(3) == (1, 3, 5) and looped.schedule == "interleaved"


def test_a_chunked_plan_has_no_single_stage_per_rank():
    with pytest.raises(ValueError, match=r"holds 2 stages \[0, 3\].*stages_of"):
        Plan.chunked(4, "1:1", layout="v").stage_of(0)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {
                "chunks": 2,
                "schedule": "interleaved",
                "micro_batches": 2,
                "stages": [[0, 1, 2], [1, 2, 1], [2, 3, 2], [3, 4, 2]],
            },
            "share rank group 1 .* replicas 1 and 2: give every stage of a group the same",
        ),
        (
            {
                "chunks": 2,
                "schedule": "interleaved",
                "micro_batches": 3,
                "stages": [[0, 1, 1], [1, 2, 1], [2, 3, 1], [3, 4, 1]],
            },
            "micro_batches must be a multiple of the 2 rank groups, got 3",
        ),
        (
            {
                "chunks": 2,
                "layout": "v",
                "schedule": "zb-v",
                "micro_batches": 3,
                "stages": [[0, 1, 1], [1, 2, 1], [2, 3, 1], [3, 4, 1]],
            },
            "at least 2 x \\(rank groups\\) = 4 micro-batches",
        ),
        (
            {
                "chunks": 2,
                "schedule": "zb-v",
                "micro_batches": 4,
                "stages": [[0, 1, 1], [1, 2, 1], [2, 3, 1], [3, 4, 1]],
            },
            "layout: looped runs schedule interleaved, not 'zb-v'",
        ),
        (
            {
                "chunks": 3,
                "layout": "v",
                "schedule": "zb-v",
                "micro_batches": 4,
                "stages": [[0, 1, 1], [1, 2, 1], [2, 3, 1]],
            },
            "V layout gives each rank group 2 stages",
        ),
        (
            {"chunks": 2, "schedule": "interleaved", "stages": [[0, 1, 1], [1, 2, 1], [2, 3, 1]]},
            "got 3 stages, which 2 does not divide",
        ),
        ({"schedule": "zb-v", "stages": [[0, 1, 1]]}, "set chunks: 2 \\(and layout: v\\)"),
        ({"chunks": 2, "layout": "w", "schedule": "zb-v", "stages": [[0, 1, 1]]}, "unknown layout 'w'"),
        (
            {
                "chunks": 2,
                "schedule": "interleaved",
                "micro_batches": 2,
                "stages": [[0, 1, 1], [1, 2, 1], [2, 3, 1, True], [3, 4, 1]],
            },
            "recompute, offload and shard are not supported with chunks",
        ),
    ],
)
def test_a_chunked_plan_that_cannot_run_is_refused_with_the_fix(data, message):
    stages = [
        {"layers": s[:2], "replicas": s[2], **({"recompute": True} if len(s) > 3 else {})} for s in data["stages"]
    ]
    with pytest.raises(ValueError, match=message):
        Plan.from_dict({**data, "stages": stages})


# -------------------------------------------------------------------------- schedules


def test_interleaved_grid_two_groups_four_micro_batches():
    assert grid(chunked_schedule("interleaved", 2, 2, 4)) == "\n".join(
        [
            "t   group0  group1",
            "0   F0@0",
            "1   F1@0    F0@1",
            "2   F0@2    F1@1",
            "3   F1@2    F0@3",
            "4   F2@0    B0@3",
            "5   B0@2    F1@3",
            "6   F3@0    B1@3",
            "7   B1@2    F2@1",
            "8   F2@2    B0@1",
            "9   B0@0    F3@1",
            "10  F3@2    B1@1",
            "11  B1@0    F2@3",
            "12          B2@3",
            "13  B2@2    F3@3",
            "14          B3@3",
            "15  B3@2    B2@1",
            "16  B2@0    B3@1",
            "17  B3@0",
        ]
    )


def test_zb_v_grid_two_groups_four_micro_batches():
    orders = chunked_schedule("zb-v", 2, 2, 4)
    assert [" ".join(map(str, o)) for o in orders] == [
        "F0@0 F1@0 F2@0 F0@3 B0@3 W0@3 F1@3 B1@3 W1@3 F3@0 B0@0 W0@0 F2@3 B2@3 W2@3 B1@0 W1@0 F3@3 B3@3 W3@3 "
        "B2@0 W2@0 B3@0 W3@0",
        "F0@1 F0@2 F1@1 F1@2 B0@2 W0@2 F2@1 B0@1 W0@1 F2@2 B1@2 W1@2 F3@1 B1@1 W1@1 F3@2 B2@2 W2@2 B2@1 B3@2 "
        "B3@1 W2@1 W3@2 W3@1",
    ]
    # Group 0 is never idle from its first action to its last: zero bubble in the steady state.
    timed = [t for t in simulate(orders) if t.rank == 0]
    assert max(t.end for t in timed) - min(t.start for t in timed) == len(timed) == 24


def test_v_half_grid_two_groups_four_micro_batches():
    orders = chunked_schedule("v-half", 2, 2, 4)
    assert [" ".join(map(str, o)) for o in orders] == [
        "F0@0 F1@0 F0@3 B0@3 W0@3 B0@0 W0@0 F2@0 F1@3 B1@3 W1@3 B1@0 W1@0 F3@0 F2@3 B2@3 W2@3 B2@0 W2@0 F3@3 "
        "B3@3 W3@3 B3@0 W3@0",
        "F0@1 F0@2 B0@2 B0@1 W0@2 F1@1 F1@2 W0@1 B1@2 B1@1 W1@2 F2@1 F2@2 W1@1 B2@2 B2@1 W2@2 F3@1 F3@2 W2@1 "
        "B3@2 B3@1 W3@2 W3@1",
    ]


@pytest.mark.parametrize("name", ["interleaved", "zb-v", "v-half"])
@pytest.mark.parametrize("groups", [1, 2, 3, 4])
def test_every_small_chunked_plan_lowers_free_of_deadlocks_at_its_published_peak(name, groups):
    """Brute force: every replica pattern (1..3 per group, up to 8 ranks), M = 1..8, two chunks."""
    proved = 0
    for micro_batches in range(1, 9):
        try:
            orders = chunked_schedule(name, groups, 2, micro_batches)
        except ValueError:
            with pytest.raises(ValueError):
                chunked(name, (1,) * groups, micro_batches)
            continue
        peaks = [peak_in_flight(order) for order in orders]
        assert peaks == [peak_bound(name, groups, 2, micro_batches, g) for g in range(groups)]
        for replicas in itertools.product((1, 2, 3), repeat=groups):
            if sum(replicas) > 8:
                continue
            plan = chunked(name, replicas, micro_batches)
            program = lower(plan, 6 * micro_batches)
            simulate(program)  # raises on a deadlock, a mismatched message or a backward before its forward
            for rank, ops in enumerate(program.ranks):
                for op in ops:
                    if op.kind.startswith(("SEND", "RECV")):
                        assert op.local == (op.peer == rank)
                        other = op.stage + (1 if op.kind in ("SEND_F", "RECV_B") else -1)
                        assert op.local == (plan.group_of_stage(op.stage) == plan.group_of_stage(other))
                reduces = [op.stage for op in ops if op.kind == "REDUCE"]
                assert sorted(reduces) == list(plan.stages_of(rank))
            proved += 1
    assert proved > 0


def test_interleaved_holds_megatrons_warmup_plus_one_and_three_chunks_run():
    # Group g: 2(G - 1 - g) + (C - 1)G warm-up forwards, plus the one in flight.
    assert [peak_in_flight(o) for o in chunked_schedule("interleaved", 4, 2, 8)] == [11, 9, 7, 5]
    assert [peak_in_flight(o) for o in chunked_schedule("interleaved", 2, 3, 4)] == [7, 5]
    simulate(lower(chunked("interleaved", (2, 1), 4, chunks=3), 12))


def test_the_v_family_holds_no_more_than_one_f1b_and_v_half_half_of_it():
    for groups in (2, 3, 4):
        # A chunk micro-batch is half a stage's under an even cut: 1F1B's first stage holds G stage micro-batches.
        assert max(map(peak_in_flight, chunked_schedule("zb-v", groups, 2, 8))) == 2 * groups
        assert max(map(peak_in_flight, chunked_schedule("v-half", groups, 2, 8))) == groups + 1


def test_a_lowered_chunked_program_reads_back_and_marks_local_messages():
    plan = chunked("zb-v", (2, 1), 4)
    program = lower(plan, 8)
    rank2 = " ".join(map(str, program[2][:7]))
    assert (
        rank2
        == "RECV_F0@1<0[0:1] RECV_F0@1<1[1:2] F0@1 SEND_F0@1>local[0:2] RECV_F0@2<local[0:2] F0@2 SEND_F0@2>0[0:1]"
    )
    for ops in program.ranks:
        for op in ops:
            back = Op.parse(str(op))
            assert (back.kind, back.micro_batch, back.stage, back.rows, back.local) == (
                op.kind,
                op.micro_batch,
                op.stage,
                op.rows,
                op.local,
            )
    assert Action.parse("W3@2") == Action("W", 3, 2) and str(Action("F", 1)) == "F1"


def test_the_command_line_draws_a_chunked_schedule():
    out = subprocess.run(
        [sys.executable, "-m", "dapple_lightning.schedule", "2", "4", "zb-v"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.splitlines()[:3] == ["t   group0  group1", "0   F0@0", "1   F1@0    F0@1"]
