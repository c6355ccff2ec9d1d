"""Stages whose replicas shard their state (``shard:``): several training steps on real processes
against one device's autograd and optimizer, without Lightning."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dapple_lightning.plan import Plan
from dapple_lightning.runtime import Pipeline, full_value, p2p_groups, stage_group, unshard_stage
from dapple_lightning.strategy._step import clip_grad_norm_over_stages
from dapple_lightning.surgery import partition

from distributed import run_ranks
from user_steps import LossStep

BATCH, STEPS, CLIP = 12, 3, 0.1


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 15), nn.Tanh(), nn.Linear(15, 16), nn.Tanh(), nn.Linear(16, 4)
    )


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=0.05)
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def reference(optimizer: str, clip: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = make_model()
    opt = make_optimizer(optimizer, model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = make_batch(step)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if clip:  # it clips: the gradients' norm is above CLIP in every step
            assert torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP) > CLIP
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.state_dict().items()}


def trained(rank: int, world_size: int, plan: Plan, optimizer: str, clip: bool) -> tuple[list[float], dict, dict]:
    """``STEPS`` steps of ``plan``; the last stage's losses, the stage's final weights (whole) and
    what each sharded parameter holds on this rank."""
    stage = partition(make_model(), plan, rank)
    pipe = Pipeline(
        plan, rank, stage, device=torch.device("cpu"), stage_group=stage_group(plan, rank), p2p_groups=p2p_groups()
    )
    opt = make_optimizer(optimizer, stage.parameters())
    first_replica = plan.replica_of(rank) == 0
    losses = []
    for step in range(STEPS):
        x, y = make_batch(step)

        def forward(m, rows, x=x, y=y):
            out = stage(x[rows.start : rows.stop])
            return nn.functional.mse_loss(out, y[rows.start : rows.stop]) * (len(rows) / BATCH)

        opt.zero_grad()
        user = LossStep(forward)
        stats = pipe.run(BATCH, user)
        if pipe.is_last:
            total = stats.replica_sum if stats.replica_sum is not None else user.total
            losses.append(float(total[0]))
        if clip:
            owned = {id(p) for p in stage.parameters()} if first_replica else set()
            clip_grad_norm_over_stages(opt, CLIP, owned=lambda owned=owned: owned, device=torch.device("cpu"))
        opt.step()
        if step == 0:  # an evaluation between steps changes nothing (shard: grads keeps what it gathers)
            with torch.no_grad():
                pipe.run(BATCH, LossStep(forward), train=False)
    shards = {n: tuple(p.to_local().shape) for n, p in stage.named_parameters() if isinstance(p, DTensor)}
    weights = {n: full_value(v).detach().clone() for n, v in stage.state_dict().items()}
    # Undone, the stage is the user's layers again, whole on every replica, and runs as they do.
    unshard_stage(stage)
    assert all(type(layer) in (nn.Linear, nn.Tanh) for layer in stage)
    assert not any(isinstance(p, DTensor) for p in stage.parameters())
    for name, value in stage.state_dict().items():
        torch.testing.assert_close(value, weights[name], rtol=0, atol=0)
    first = next(layer for layer in stage if isinstance(layer, nn.Linear))
    assert stage(torch.randn(2, first.in_features)).isfinite().all()
    dist.barrier()
    return losses, weights, shards


PLANS = {
    "2:1 grads": [((0, 4), 2, "grads"), ((4, 7), 1, None)],
    "2:1 full": [((0, 4), 2, "full"), ((4, 7), 1, None)],
    "3:1 first": [((0, 4), 3, "full"), ((4, 7), 1, None)],
    "1:2 last": [((0, 3), 1, None), ((3, 7), 2, "grads")],
}


@pytest.mark.parametrize(
    ("shape", "optimizer", "clip", "schedule"),
    [
        ("2:1 grads", "adam", False, "dapple"),
        ("2:1 full", "adamw", True, "dapple"),
        ("3:1 first", "adam", True, "gpipe"),
        ("1:2 last", "adamw", True, "dapple"),
    ],
)
def test_sharded_stages_train_as_one_device(shape: str, optimizer: str, clip: bool, schedule: str) -> None:
    plan = Plan(
        stages=[{"layers": list(layers), "replicas": r, "shard": s} for layers, r, s in PLANS[shape]],
        micro_batches=3,
        schedule=schedule,
    )
    ref_losses, ref_weights = reference(optimizer, clip)
    results = run_ranks(trained, plan.world_size, plan, optimizer, clip)
    last = plan.stage_ranks(plan.num_stages - 1)
    for rank in last:
        # Each last-stage rank learns the whole batch's loss (summed over its replicas, if any).
        assert results[rank][0] == pytest.approx(ref_losses, rel=1e-5)
    for rank, (_, weights, shards) in enumerate(results):
        for name, value in weights.items():
            torch.testing.assert_close(
                value, ref_weights[name], rtol=1e-5, atol=1e-6, msg=f"{shape} rank {rank} {name}"
            )
        stage = plan.stages[plan.stage_of(rank)]
        if stage.shard is None:
            assert shards == {}
        else:  # each replica holds its own part of every parameter, no more
            whole = {n: tuple(ref_weights[n].shape) for n in weights}
            assert set(shards) == set(whole)
            for name, shape_here in shards.items():
                assert shape_here[0] == shard_rows(whole[name][0], stage.replicas, plan.replica_of(rank)), name


def shard_rows(rows: int, replicas: int, replica: int) -> int:
    """Rows of dim 0 that ``replica`` holds when ``rows`` are chunked over ``replicas`` (``torch.chunk``)."""
    chunks = torch.arange(rows).chunk(replicas)
    return len(chunks[replica]) if replica < len(chunks) else 0


def test_a_plan_names_what_a_stage_shards_and_refuses_what_cannot_shard() -> None:
    plan = Plan.from_yaml(
        "micro_batches: 2\nstages:\n  - {layers: [0, 4], replicas: 2, shard: full}\n  - {layers: [4, 7], replicas: 1}\n"
    )
    assert plan.stages[0].shard == "full" and plan.stages[1].shard is None
    assert Plan.from_dict(plan.to_dict()) == plan
    assert "shard=0:full" in plan.describe() and "full" in plan.table()
    with pytest.raises(ValueError, match="one replica has no one to split its state with; give the stage 2 or more"):
        Plan(stages=[{"layers": [0, 7], "replicas": 1, "shard": "grads"}])
    with pytest.raises(ValueError, match="must be one of \\['grads', 'full'\\]"):
        Plan(stages=[{"layers": [0, 7], "replicas": 2, "shard": "params"}])
    with pytest.raises(ValueError, match="sets both shard and recompute; choose one"):
        Plan(stages=[{"layers": [0, 7], "replicas": 2, "shard": "full", "recompute": True}])
    with pytest.raises(ValueError, match="use schedule 'dapple' or 'gpipe' with shard"):
        Plan(stages=[{"layers": [0, 7], "replicas": 2, "shard": "full"}], schedule="zb-h1")


def test_sharding_refuses_tied_weights_recovery_and_stages_across_nodes_naming_the_fix() -> None:
    from dapple_lightning.strategy._refusals import sharding_refusal
    from dapple_lightning.surgery import find_chain

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = make_model()
            self.layers[6].weight = nn.Parameter(torch.randn(4, 16))
            self.layers[4].weight = self.layers[2].weight = nn.Parameter(torch.randn(16, 16))

    module = Tied()
    chain = find_chain(module, "layers")
    split = [{"layers": [0, 3], "replicas": 2, "shard": "full"}, {"layers": [3, 7], "replicas": 1}]
    tied = sharding_refusal(module, chain, Plan(stages=split), None, False)
    assert tied is not None and "stages [0, 1] share a parameter (tied weights)" in tied and "drop `shard`" in tied
    together = [{"layers": [0, 5], "replicas": 2}, {"layers": [5, 7], "replicas": 2, "shard": "grads"}]
    assert sharding_refusal(module, chain, Plan(stages=together), 4, False) is None
    across = sharding_refusal(module, chain, Plan(stages=together), 3, False)
    assert across is not None and "hybrid sharding" in across and "on nodes [0, 1]" in across
    recovery = sharding_refusal(module, chain, Plan(stages=together), 4, True)
    assert recovery is not None and "recovery=False" in recovery
    assert sharding_refusal(module, chain, Plan(stages=[{"layers": [0, 7], "replicas": 2}]), 1, True) is None
