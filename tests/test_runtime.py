"""The runtime on real processes against one-device autograd, without Lightning."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dapple_lightning.plan import Plan
from dapple_lightning.runtime import GradientReducer, Pipeline, p2p_groups, stage_group
from dapple_lightning.surgery import partition

from distributed import run_ranks
from user_steps import LossStep

BATCH = 12


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 4),
    )


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def reference() -> tuple[float, dict[str, torch.Tensor]]:
    model = make_model()
    x, y = make_batch()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def pipelined(rank: int, world_size: int, plan: Plan, *also: str) -> list[tuple[float, dict[str, torch.Tensor], int]]:
    """One step of ``plan`` from the same initial weights under its schedule and then each of
    ``also``, on the same process groups (one launch for several schedules of one shape)."""
    groups, replicas = p2p_groups(), stage_group(plan, rank)
    results = []
    for name in (plan.schedule, *also):
        stage = partition(make_model(), plan, rank)
        pipe = Pipeline(
            dataclasses.replace(plan, schedule=name),
            rank,
            stage,
            device=torch.device("cpu"),
            stage_group=replicas,
            track_memory=True,
            p2p_groups=groups,
        )
        x, y = make_batch()

        def forward(m, rows, stage=stage, x=x, y=y):
            out = stage(x[rows.start : rows.stop])
            return nn.functional.mse_loss(out, y[rows.start : rows.stop]) * (len(rows) / BATCH)

        step = LossStep(forward)
        stats = pipe.run(BATCH, step)
        loss = float(sum(stats.losses)) if stats.losses else float("nan")
        summed = None if stats.replica_sum is None else (stats.replica_sum.tolist(), step.shared)
        grads = {n: p.grad.clone() for n, p in stage.named_parameters()}
        results.append((loss, grads, stats.peak_live_microbatches, summed))
    return results


PLANS = {
    "1x2": [((0, 7), 2)],
    "2x1": [((0, 3), 1), ((3, 7), 1)],
    "3x1": [((0, 2), 1), ((2, 5), 1), ((5, 7), 1)],
    "2:1": [((0, 4), 2), ((4, 7), 1)],
    "1:2": [((0, 4), 1), ((4, 7), 2)],
    "2:2": [((0, 4), 2), ((4, 7), 2)],
    "1:3": [((0, 2), 1), ((2, 7), 3)],
}


# The zero-bubble schedules share a launch per shape: one step of each on the same processes.
@pytest.mark.parametrize("schedules", [("dapple",), ("gpipe",), ("zb-h1", "zb-h2", "zb-tail")], ids="+".join)
@pytest.mark.parametrize("shape", sorted(PLANS))
def test_gradients_match_one_device(shape: str, schedules: tuple[str, ...]) -> None:
    plan = Plan(
        stages=[{"layers": list(layers), "replicas": r} for layers, r in PLANS[shape]],
        micro_batches=3,
        schedule=schedules[0],
    )
    ref_loss, ref_grads = reference()
    results = run_ranks(pipelined, plan.world_size, plan, *schedules[1:])
    # A zero-bubble schedule holds a micro-batch until its W: ZB-H1 min(S, M) on every stage
    # (DAPPLE's first-stage peak), ZB-H2 and zb-tail min(2S - 1, M).
    deep = min(2 * plan.num_stages - 1, 3)
    held = {"gpipe": 3, "zb-h1": min(plan.num_stages, 3), "zb-h2": deep, "zb-tail": deep}
    for index, schedule in enumerate(schedules):
        for rank, per_schedule in enumerate(results):
            _, grads, peak, summed = per_schedule[index]
            for name, grad in grads.items():
                torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6)
            assert peak == held.get(schedule, min(plan.num_stages - plan.stage_of(rank), 3)), schedule
            # The last stage's replicas sum what the step shares, once per step, with their gradients.
            if plan.stage_of(rank) == plan.num_stages - 1 and plan.stages[-1].replicas > 1:
                assert summed is not None and summed[1] == 1
                assert summed[0] == [pytest.approx(ref_loss, rel=1e-5)]
            else:
                assert summed is None
        # Each last-stage replica holds the loss of its own rows; the replicas sum to the whole.
        last = [results[r][index][0] for r in plan.stage_ranks(plan.num_stages - 1)]
        assert sum(last) == pytest.approx(ref_loss, rel=1e-5)


def reduced(rank: int, world_size: int, dtype: torch.dtype, in_place_bytes: int) -> dict:
    """One step of a GradientReducer: on rank r every used gradient is (r + 1) times rank 0's."""
    torch.manual_seed(0)
    shapes = {"big": (16, 16), "small": (3,), "some": (4,), "none": (2,)}
    params = {name: nn.Parameter(torch.randn(*shape).to(dtype)) for name, shape in shapes.items()}
    reducer = GradientReducer(params.values(), None, in_place_bytes=in_place_bytes, first_bucket_bytes=8)
    scale = rank + 1.0
    loss = scale * (params["big"].sum() + params["small"].pow(2).sum())
    if rank == 0:  # the others have no gradient for it; "none" has none anywhere
        loss = loss + params["some"].sum()
    reducer.arm(extra=lambda: torch.tensor([scale, -2 * scale], dtype=torch.float64))
    loss.backward()
    extra_sum = reducer.finish()
    reducer.remove()
    names = {id(p): n for n, p in params.items()}
    return {
        "grads": {n: None if p.grad is None else p.grad.double() for n, p in params.items()},
        "params": {n: p.detach().double() for n, p in params.items()},
        "extra_sum": extra_sum,
        "buckets": [([names[id(p)] for p in b], in_place) for b, in_place in zip(reducer.buckets, reducer.in_place)],
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_place_bytes", [1, 64, 2**20])
def test_gradient_reducer_sums_in_place_and_sums_extra_values(dtype: torch.dtype, in_place_bytes: int) -> None:
    world = 3
    results = run_ranks(reduced, world, dtype, in_place_bytes)
    total = sum(r + 1.0 for r in range(world))
    for result in results:
        grads, params = result["grads"], result["params"]
        tol = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 1e-6}
        torch.testing.assert_close(grads["big"], torch.full((16, 16), total, dtype=torch.float64), **tol)
        torch.testing.assert_close(grads["small"], 2 * params["small"] * total, **tol)
        torch.testing.assert_close(grads["some"], torch.ones(4, dtype=torch.float64), **tol)
        assert grads["none"] is None  # as on one device: no replica produced a gradient
        # The loss-like values come back exactly, in float64, whatever the gradients' dtype.
        assert result["extra_sum"].dtype == torch.float64
        assert result["extra_sum"].tolist() == [total, -2 * total]
        buckets = result["buckets"]
        assert sorted(n for names, _ in buckets for n in names) == ["big", "none", "small", "some"]
        assert buckets[-1][1] is False  # the flags and extra values end a flat bucket
        in_place = {names[0] for names, is_in_place in buckets if is_in_place}
        assert in_place == {1: {"big", "small", "some", "none"}, 64: {"big"}, 2**20: set()}[in_place_bytes]


def extra_without_parameters(rank: int, world_size: int) -> list[float]:
    reducer = GradientReducer([], None)
    reducer.arm(extra=lambda: torch.tensor([rank + 0.5], dtype=torch.float64))
    return reducer.finish().tolist()


def test_gradient_reducer_without_parameters_still_sums_extra_values() -> None:
    assert run_ranks(extra_without_parameters, 2) == [[2.0], [2.0]]


def recorded_then_replayed(rank: int, world_size: int) -> dict:
    """A step with every send recorded, then the same step run again by each rank alone on the record."""
    plan = Plan(stages=[{"layers": [0, 3], "replicas": 1}, {"layers": [3, 7], "replicas": 1}], micro_batches=3)
    stage = partition(make_model(), plan, rank)
    pipe = Pipeline(plan, rank, stage, device=torch.device("cpu"), p2p_groups=p2p_groups())
    x, y = make_batch()

    def forward(m, rows):
        out = stage(x[rows.start : rows.stop])
        return nn.functional.mse_loss(out, y[rows.start : rows.stop]) * (len(rows) / BATCH)

    sent: dict[tuple[str, int], list] = {}

    def record(link: str, dst: int, tensors: list[torch.Tensor], as_tuple: bool) -> None:
        sent.setdefault((link, dst), []).append(([t.detach().clone() for t in tensors], as_tuple))

    pipe.record_sends(record)
    pipe.run(BATCH, LossStep(forward))
    pipe.record_sends(None)
    first = {n: p.grad.clone() for n, p in stage.named_parameters()}
    records: list = [None] * world_size
    dist.all_gather_object(records, sent)
    inbox = {
        (link, src): messages
        for src, record in enumerate(records)
        for (link, dst), messages in record.items()
        if dst == rank
    }
    for p in stage.parameters():
        p.grad = None
    dist.barrier()  # from here on no rank talks to another: each runs alone
    with pipe.replay(inbox):
        inside = pipe.replaying
        stats = pipe.run(BATCH, LossStep(forward))
    again = {n: p.grad.clone() for n, p in stage.named_parameters()}
    return {
        "same": first.keys() == again.keys() and all(torch.equal(first[n], again[n]) for n in first),
        "replaying": (inside, pipe.replaying),
        "messages": sum(len(m) for m in sent.values()),
        "losses": len(stats.losses),
    }


def test_a_stage_replays_its_step_alone_on_the_record_of_its_receives() -> None:
    results = run_ranks(recorded_then_replayed, 2)
    for rank, result in enumerate(results):
        assert result["same"], rank
        assert result["replaying"] == (True, False)
        # Three activations go down, three gradients up; the replay's sends were not recorded.
        assert result["messages"] == 3
    assert [r["losses"] for r in results] == [0, 3]
