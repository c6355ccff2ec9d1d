"""plan='auto' helpers on one process: the optimizer the profile times, the step outside the Sequential,
the report (the selection policy it calls is tested in ``tests/planner/test_select.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dapple_lightning.autoplan import AutoPlan, _with_step_outside, optimizer_factory, time_step_outside
from dapple_lightning.plan import Plan
from dapple_lightning.planner import GB, Cluster, LayerProfile, ModelProfile, Trial


class Model(nn.Module):
    def __init__(self, returns) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        self.returns = returns
        self.logged: list[str] = []

    def log(self, name, value, **kwargs):
        self.logged.append(name)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.layers(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return self.returns(self.parameters())


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.3)


@pytest.mark.parametrize(
    "returns",
    [
        adamw,
        lambda p: {"optimizer": adamw(p), "lr_scheduler": None},
        lambda p: ([adamw(p)], []),
        lambda p: [{"optimizer": adamw(p)}],
    ],
    ids=["optimizer", "dict", "lists", "list of dicts"],
)
def test_factory_builds_the_users_optimizer_over_other_parameters(returns):
    build = optimizer_factory(Model(returns))
    assert build is not None
    params = [nn.Parameter(torch.zeros(5))]
    opt = build(params)
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.param_groups[0]["params"] == params
    assert opt.defaults["lr"] == 0.01 and opt.defaults["weight_decay"] == 0.3


def test_factory_without_an_optimizer_is_none():
    assert optimizer_factory(Model(lambda p: None)) is None
    assert optimizer_factory(nn.Linear(2, 2)) is None


def test_step_outside_times_the_loss_and_puts_everything_back():
    torch.manual_seed(0)
    model = Model(adamw)
    sequential = model.layers
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))

    def set_sequential(module):
        model.layers = module

    fwd, bwd = time_step_outside(model, set_sequential, sequential, lambda: model.training_step((x, y), 0), x)
    assert fwd > 0 and bwd > 0
    assert model.layers is sequential
    assert model.logged == []  # logging was silenced while timing
    assert all(p.grad is None for p in model.parameters())


class Pair(nn.Module):
    def forward(self, x):
        return x, x.tanh()


def test_step_outside_replays_a_tuple_output_as_fresh_leaves():
    model = Model(adamw)
    model.layers = nn.Sequential(nn.Linear(4, 3), Pair())
    sequential = model.layers
    model.training_step = lambda batch, _: sum(t.sum() for t in model.layers(batch[0]))
    x = torch.randn(8, 4)

    def set_sequential(module):
        model.layers = module

    fwd, bwd = time_step_outside(model, set_sequential, sequential, lambda: model.training_step((x,), 0), x)
    assert fwd > 0 and bwd > 0  # the step's backward ends at the replayed pair
    assert model.layers is sequential and all(p.grad is None for p in model.parameters())


def test_step_outside_goes_to_the_last_layer_split_like_the_layers():
    layers = (LayerProfile("a", 1.0, 2.0, 0, 0), LayerProfile("b", 1.0, 2.0, 0, 0, forward_fixed_s=0.5))
    profile = ModelProfile(layers, profile_batch_size=8)
    # 0.4 s forward at 8 rows and 0.25 s at 2: 0.2 s fixed, 0.025 s per row.
    out = _with_step_outside(profile, (8, 0.4, 0.0), (2, 0.25, 0.0))
    assert out.layers[0] == layers[0]
    assert out.layers[1].forward_s == pytest.approx(1.4)
    assert out.layers[1].forward_fixed_s == pytest.approx(0.5 + 0.2)
    assert out.layers[1].backward_s == 2.0 and out.layers[1].backward_fixed_s == 0.0


def _two_layers(param_bytes: int) -> ModelProfile:
    layers = tuple(LayerProfile(f"l{i}", 1.0, 2.0, 1000, param_bytes) for i in range(2))
    return ModelProfile(layers, profile_batch_size=8)


CLUSTER = Cluster.v100(1, 2, intra_allreduce_bw=1 * GB, intra_p2p_bw=100 * GB)


def test_report_shows_the_measured_plans_and_the_choice():
    profile = _two_layers(10**6)
    pipe = Plan.straight(2, 2, micro_batches=4)
    dp = Plan.data_parallel(2, 2)
    trials = (Trial(pipe, 0.100, 0.130, 1), Trial(dp, 0.105, 0.120, 3))
    report = AutoPlan(dp, 0.105, 0.105, profile, CLUSTER, 2.0, trials).report()
    assert "measured 2 close plans" in report
    lines = [line for line in report.splitlines() if line.startswith("  ") and "measured" in line]
    assert len(lines) == 2 and lines[1].endswith("(3 turns)  <- chosen") and "130.0 (1 turn)" in lines[0]
