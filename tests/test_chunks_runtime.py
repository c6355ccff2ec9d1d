"""Plans with several stages per rank group on real processes (gloo) against one device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dapple_lightning.plan import Plan
from dapple_lightning.runtime import Pipeline, p2p_groups, stage_group
from dapple_lightning.schedule import peak_bound
from dapple_lightning.surgery import partition

from distributed import run_ranks
from user_steps import LossStep

BATCH = 12
STEPS = 2


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 16), nn.Tanh()]
    for _ in range(5):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(16, 4))  # 13 layers


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for step in range(STEPS):
        x, y = make_batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def trained(rank: int, world_size: int, plans: list[Plan]) -> list[dict]:
    """``STEPS`` steps of each plan from the same weights (Adam), on the same processes."""
    groups = p2p_groups()
    results = []
    for plan in plans:
        stage = partition(make_model(), plan, rank)
        pipe = Pipeline(
            plan,
            rank,
            stage,
            device=torch.device("cpu"),
            stage_group=stage_group(plan, rank),
            track_memory=True,
            p2p_groups=groups,
        )
        optimizer = torch.optim.Adam(stage.parameters(), lr=0.01)
        losses, peaks = [], []
        for step in range(STEPS):
            x, y = make_batch(step)

            def forward(m, rows, x=x, y=y, stage=stage):
                out = stage(x[rows.start : rows.stop])
                return nn.functional.mse_loss(out, y[rows.start : rows.stop]) * (len(rows) / BATCH)

            optimizer.zero_grad()
            stats = pipe.run(BATCH, LossStep(forward))
            optimizer.step()
            losses.append(float(sum(stats.losses)) if stats.losses else None)
            peaks.append(stats.peak_live_microbatches)
        pipe.close()
        weights = {n: p.detach().clone() for n, p in stage.named_parameters()}
        results.append({"losses": losses, "weights": weights, "peak": peaks[-1]})
    return results


def cut(replicas: str, layout: str, micro_batches: int, schedule: str | None = None) -> Plan:
    return Plan.chunked(13, replicas, layout=layout, micro_batches=micro_batches, schedule=schedule)


SHAPES = {
    "1:1": [cut("1:1", "looped", 4), cut("1:1", "v", 4, "zb-v"), cut("1:1", "v", 4, "v-half")],
    "2:1": [cut("2:1", "looped", 4), cut("2:1", "v", 4, "zb-v"), cut("2:1", "v", 4, "v-half")],
    "1:1:1": [cut("1:1:1", "looped", 6), cut("1:1:1", "v", 6, "zb-v")],
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_chunked_plans_train_as_one_device(shape: str) -> None:
    plans = SHAPES[shape]
    ref_losses, ref_weights = reference()
    results = run_ranks(trained, plans[0].world_size, plans)
    for index, plan in enumerate(plans):
        # Each last-stage replica holds the loss of its own rows; together the whole batch's.
        last = plan.stage_ranks(plan.num_stages - 1)
        for step in range(STEPS):
            total = sum(results[r][index]["losses"][step] for r in last)
            assert total == pytest.approx(ref_losses[step], rel=1e-5), (plan.describe(), step)
        seen = set()
        for rank, per_plan in enumerate(results):
            result = per_plan[index]
            for name, weight in result["weights"].items():
                torch.testing.assert_close(weight, ref_weights[name], rtol=1e-5, atol=1e-6)
                seen.add(name)
            group = plan.group_of(rank)
            # The runtime holds what the schedule's published bound says, chunks counted apart.
            assert result["peak"] == peak_bound(plan.schedule, plan.num_groups, 2, plan.micro_batches, group)
        assert seen == set(ref_weights), plan.describe()  # every layer trained somewhere
