"""Point-to-point pairs open in one order common to every rank, before any of the schedule's messages.

NCCL creates a pair's communicator on the pair's first message and blocks both ranks until the
other joins: ranks that first touch different pairs wait on each other forever. Gloo does not
block there, so these runs record, on real gloo processes, the first message of every (group,
pair) on each rank, and check the order NCCL would need.
"""

from __future__ import annotations

import graphlib
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn

from dapple_lightning.plan import Plan
from dapple_lightning.runtime import Pipeline, p2p_groups, stage_group
from dapple_lightning.surgery import partition

from distributed import run_ranks
from user_steps import LossStep

BATCH = 12
PLANS = {
    "2x1": [((0, 3), 1), ((3, 5), 1)],
    "3x1": [((0, 2), 1), ((2, 4), 1), ((4, 5), 1)],
    "2:1": [((0, 3), 2), ((3, 5), 1)],
}


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def _recording(groups: dict[int, str], log: list[tuple[str, int, int]], rank: int):
    """Wrap ``isend``/``irecv`` (``send``/``recv`` go through them) to log (group, low, high) per message."""
    originals = {name: getattr(c10d, name) for name in ("isend", "irecv")}

    def wrap(name):
        original = originals[name]

        def recorded(tensor, *args, **kwargs):
            group = kwargs.get("group")
            peer = args[0] if args else kwargs.get("dst", kwargs.get("src"))
            if peer is None:
                local = kwargs.get("group_dst", kwargs.get("group_src"))
                peer = dist.get_global_rank(group, local) if group is not None else local
            log.append((groups.get(id(group), "default"), min(rank, peer), max(rank, peer)))
            return original(tensor, *args, **kwargs)

        return recorded

    for name in originals:
        setattr(c10d, name, wrap(name))
        setattr(dist, name, getattr(c10d, name))

    def undo():
        for name, original in originals.items():
            setattr(c10d, name, original)
            setattr(dist, name, original)

    return undo


def first_messages(rank: int, world_size: int, plan: Plan) -> list[tuple[str, int, int]]:
    stage = partition(make_model(), plan, rank)
    groups = p2p_groups()
    names = {id(groups[0]): "activations", id(groups[1]): "gradients"}
    pipe = Pipeline(
        plan, rank, stage, device=torch.device("cpu"), stage_group=stage_group(plan, rank), p2p_groups=groups
    )
    x, y = make_batch()

    def forward(m, rows):
        out = stage(x[rows.start : rows.stop])
        return nn.functional.mse_loss(out, y[rows.start : rows.stop]) * (len(rows) / BATCH)

    log: list[tuple[str, int, int]] = []
    undo = _recording(names, log, rank)
    try:
        for _ in range(2):
            pipe.run(BATCH, LossStep(forward))
    finally:
        undo()
    return log


@pytest.mark.parametrize("shape", sorted(PLANS))
def test_every_pair_opens_in_one_global_order_before_schedule_traffic(shape: str) -> None:
    plan = Plan(stages=[{"layers": list(layers), "replicas": r} for layers, r in PLANS[shape]], micro_batches=3)
    logs = run_ranks(first_messages, plan.world_size, plan)
    order = graphlib.TopologicalSorter()
    for rank, log in enumerate(logs):
        firsts = list(dict.fromkeys(log))
        assert {kind for kind, _, _ in firsts} == {"activations", "gradients"}, firsts
        # Every pair's first message comes before any pair's second: the pairs open before traffic.
        assert log[: len(firsts)] == firsts, f"rank {rank} sends schedule traffic before opening every pair: {log}"
        for before, after in itertools.pairwise(firsts):
            order.add(after, before)
    # One order all ranks follow: the ranks' orders together have no cycle (a cycle is a deadlock on NCCL).
    try:
        order.prepare()
    except graphlib.CycleError as e:
        pytest.fail(f"ranks open pairs in conflicting orders {e.args[1]}: {logs}")


class _CountingLink:
    """A link whose receives arrive at once; it counts the receives posted and not yet taken."""

    def __init__(self) -> None:
        self.open = 0

    def post(self, src: int, rows: int):
        self.open += 1
        link = self

        class Arrived:
            def wait(self):
                link.open -= 1
                return [], False

        return Arrived()


WINDOW_PLANS = {
    "4x1": [((0, 1), 1), ((1, 2), 1), ((2, 3), 1), ((3, 5), 1)],
    "2:1": [((0, 3), 2), ((3, 5), 1)],
    "1:2": [((0, 3), 1), ((3, 5), 2)],
}


@pytest.mark.parametrize("schedule", ["dapple", "gpipe", "zb-h1"])
@pytest.mark.parametrize("shape", sorted(WINDOW_PLANS))
def test_receives_are_posted_one_action_ahead_never_at_the_step_start(shape: str, schedule: str) -> None:
    from dapple_lightning.runtime._executor import _Inbox
    from dapple_lightning.schedule import lower

    stages = [{"layers": list(layers), "replicas": r} for layers, r in WINDOW_PLANS[shape]]
    plan = Plan(stages=stages, micro_batches=4, schedule=schedule)
    for rank, program in enumerate(lower(plan, 16)):
        links = {"F": _CountingLink(), "B": _CountingLink()}
        inbox = _Inbox(program, links)
        for position, op in enumerate(program):
            inbox.reach(position)
            # Every posted receive feeds this action or the next one, not one further on.
            for posted, _ in inbox.posted.values():
                index = program.index(posted, position)
                actions = sum(o.kind in _Inbox.ACTIONS for o in program[position:index])
                assert actions <= 1, f"rank {rank}: {posted} posted at op {position} ({op}), {actions} actions early"
            if op.kind.startswith("RECV"):
                inbox.take(op)
        assert not inbox.waiting and not inbox.posted
        assert links["F"].open == links["B"].open == 0
        # At most one action's receives and the next one's: one per peer replica and direction.
        assert 1 <= inbox.most_posted <= 2 * max(s.replicas for s in plan.stages) or not any(
            op.kind.startswith("RECV") for op in program
        )
    # The first of four stages waits through its warm-up forwards before its first gradient: that
    # receive is posted while the last warm-up forward runs, not when the step starts.
    if shape == "4x1":
        first = lower(plan, 16)[0]
        inbox = _Inbox(first, {"F": _CountingLink(), "B": _CountingLink()})
        inbox.reach(0)
        assert not inbox.posted


def builder_groups(rank: int, world_size: int) -> list[tuple[str, int, int]]:
    from datetime import timedelta

    from dapple_lightning.runtime import Timeline
    from dapple_lightning.strategy._pipelines import PipelineBuilder

    plans = {
        name: Plan(stages=[{"layers": list(layers), "replicas": r} for layers, r in stages], micro_batches=2)
        for name, stages in {
            "3|2": [((0, 3), 1), ((3, 5), 1)],
            "2|3": [((0, 2), 1), ((2, 5), 1)],
            "dp": [((0, 5), 2)],
        }.items()
    }
    destroyed: list[dist.ProcessGroup] = []
    original = dist.destroy_process_group

    def counted(group=None):
        destroyed.append(group)
        original(group)

    dist.destroy_process_group = counted
    counts = []
    try:
        builder = PipelineBuilder(make_model(), rank, torch.device("cpu"), timedelta(seconds=60))
        x, y = make_batch()

        def trial(name: str) -> None:
            stage = partition(make_model(), plans[name], rank)
            pipe = builder.build(plans[name], stage, Timeline(rank, plans[name].stage_of(rank), enabled=False))

            def forward(m, rows):
                out = stage(x[rows.start : rows.stop])
                return nn.functional.mse_loss(out, y[rows.start : rows.stop]) * (len(rows) / BATCH)

            pipe.run(BATCH, LossStep(forward))
            pipe.close()

        for name in ("3|2", "dp"):
            trial(name)
        alive = len(builder.groups)
        builder.keep_only(plans["3|2"])  # only the data-parallel plan's stage group goes
        counts.append(("one other plan's stage group", alive, len(destroyed)))
        trial("2|3")
        destroyed.clear()
        builder.keep_only(plans["2|3"])  # the pair groups carried 3|2 too: they go
        counts.append(("pair groups another plan used", len(builder.groups), len(destroyed)))
        trial("2|3")  # on new pair groups
        counts.append(("new pair groups", len(builder.groups), 0))
    finally:
        dist.destroy_process_group = original
    return counts


def test_trial_plans_groups_are_destroyed_and_the_chosen_plan_gets_fresh_pair_groups() -> None:
    for counts in run_ranks(builder_groups, 2):
        assert counts == [
            ("one other plan's stage group", 3, 1),  # two pair groups (gloo) and one stage group alive
            ("pair groups another plan used", 0, 2),
            ("new pair groups", 2, 0),
        ], counts
