"""The live-bytes tracker (planner.live_bytes) on a sharded stage: it follows FSDP2's storage resizes,
and the stage's measured peak per rank is below the unsharded stage's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dapple_lightning.plan import Plan
from dapple_lightning.planner import live_bytes
from dapple_lightning.runtime import Pipeline, local_part, p2p_groups, stage_group
from dapple_lightning.surgery import partition

from distributed import run_ranks
from user_steps import LossStep

HIDDEN, LAYERS, BATCH, STEPS = 64, 4, 6, 3


def measured(rank: int, world_size: int, shard: str | None) -> dict[str, int]:
    """This rank's parameters as held plus the tracker's peak above them, over the steps after the first."""
    plan = Plan(
        stages=[{"layers": [0, 2 * LAYERS], "replicas": 2, "shard": shard}, {"layers": [2 * LAYERS, 2 * LAYERS + 1]}],
        micro_batches=2,
    )
    torch.manual_seed(0)
    blocks = [m for _ in range(LAYERS) for m in (nn.Linear(HIDDEN, HIDDEN), nn.Tanh())]
    stage = partition(nn.Sequential(*blocks, nn.Linear(HIDDEN, 4)), plan, rank)
    pipe = Pipeline(
        plan, rank, stage, device=torch.device("cpu"), stage_group=stage_group(plan, rank), p2p_groups=p2p_groups()
    )
    optimizer = torch.optim.Adam(stage.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, HIDDEN, generator=g), torch.randn(BATCH, 4, generator=g)

    def forward(m, rows):
        return nn.functional.mse_loss(stage(x[rows.start : rows.stop]), y[rows.start : rows.stop])

    held = sum(local_part(p).numel() * local_part(p).element_size() for p in stage.parameters())
    with live_bytes() as tracker:
        for step in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            pipe.run(BATCH, LossStep(forward))
            optimizer.step()
            if step == 0:  # the first step makes Adam's state and FSDP2's buffers
                tracker.reset_peak()
        dist.barrier()
    pipe.close()
    return {"peak": held + tracker.peak}


@pytest.mark.parametrize("shard", ["grads", "full"])
def test_a_sharded_stages_measured_peak_is_below_the_unsharded_ones(shard: str) -> None:
    whole = run_ranks(measured, 3, None)
    sharded = run_ranks(measured, 3, shard)
    for rank in (0, 1):  # the first stage's replicas
        assert sharded[rank]["peak"] < whole[rank]["peak"], (rank, sharded[rank], whole[rank])
