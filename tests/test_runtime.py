"""The runtime on real processes against one-device autograd, without Lightning."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dapple_lightning.plan import Plan
from dapple_lightning.runtime import Pipeline, p2p_groups, partition, stage_group

from distributed import run_ranks

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


def pipelined(rank: int, world_size: int, plan: Plan) -> tuple[float, dict[str, torch.Tensor], int]:
    stage = partition(make_model(), plan, rank)
    pipe = Pipeline(
        plan,
        rank,
        stage,
        device=torch.device("cpu"),
        stage_group=stage_group(plan, rank),
        track_memory=True,
        p2p_groups=p2p_groups(),
    )
    x, y = make_batch()

    def forward(m, rows):
        out = stage(x[rows.start : rows.stop])
        return nn.functional.mse_loss(out, y[rows.start : rows.stop]) * (len(rows) / BATCH)

    stats = pipe.run(BATCH, forward)
    loss = float(sum(stats.losses)) if stats.losses else float("nan")
    return loss, {n: p.grad.clone() for n, p in stage.named_parameters()}, stats.peak_live_microbatches


PLANS = {
    "1x2": [((0, 7), 2)],
    "2x1": [((0, 3), 1), ((3, 7), 1)],
    "3x1": [((0, 2), 1), ((2, 5), 1), ((5, 7), 1)],
    "2:1": [((0, 4), 2), ((4, 7), 1)],
    "1:2": [((0, 4), 1), ((4, 7), 2)],
    "2:2": [((0, 4), 2), ((4, 7), 2)],
    "1:3": [((0, 2), 1), ((2, 7), 3)],
}


@pytest.mark.parametrize("schedule", ["dapple", "gpipe"])
@pytest.mark.parametrize("shape", sorted(PLANS))
def test_gradients_match_one_device(shape: str, schedule: str) -> None:
    plan = Plan(
        stages=[{"layers": list(layers), "replicas": r} for layers, r in PLANS[shape]],
        micro_batches=3,
        schedule=schedule,
    )
    ref_loss, ref_grads = reference()
    results = run_ranks(pipelined, plan.world_size, plan)
    for rank, (_, grads, peak) in enumerate(results):
        stage = plan.stage_of(rank)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6)
        expected_peak = 3 if schedule == "gpipe" else min(plan.num_stages - stage, 3)
        assert peak == expected_peak
    # Each last-stage replica holds the loss of its own rows; the replicas sum to the whole.
    last = [results[r][0] for r in plan.stage_ranks(plan.num_stages - 1)]
    assert sum(last) == pytest.approx(ref_loss, rel=1e-5)
