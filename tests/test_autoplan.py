"""plan='auto' helpers on one process: the optimizer the profile times, the step outside the Sequential."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dapple_lightning.autoplan import AutoPlan, _with_step_outside, optimizer_factory, pick, time_step_outside
from dapple_lightning.planner import GB, Cluster, LayerProfile, ModelProfile, estimate


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
    # 1 s forward and 2 s backward per layer for 8 samples; the parameters set how much the
    # all-reduce of data parallelism costs.
    layers = tuple(LayerProfile(f"l{i}", 1.0, 2.0, 1000, param_bytes) for i in range(2))
    return ModelProfile(layers, profile_batch_size=8)


CLUSTER = Cluster.v100(1, 2, intra_allreduce_bw=1 * GB, intra_p2p_bw=100 * GB)


def test_a_pipeline_must_beat_data_parallelism_by_the_margin():
    # 4 GB of gradients to all-reduce at 1 GB/s: data parallelism takes about 10 s, the pipeline
    # (16 micro-batches of one sample) about 6.5.
    profile = _two_layers(2 * 10**9)
    plan, predicted, dp_step, declined = pick(profile, CLUSTER, 16, optimizer_factor=0.0, margin=0.1)
    assert plan.num_stages == 2 and declined is None
    assert predicted == estimate(plan, profile, CLUSTER, 16, optimizer_factor=0.0).step_s < 0.9 * dp_step
    # Demand more than the pipeline's gain: data parallelism it is, and the pipeline is reported.
    gain = 1 - predicted / dp_step
    plan, chosen_s, dp_again, declined = pick(profile, CLUSTER, 16, optimizer_factor=0.0, margin=gain + 0.01)
    assert plan.num_stages == 1 and plan.stages[0].replicas == 2 and plan.micro_batches == 1
    assert chosen_s == dp_again == dp_step and declined == predicted
    report = AutoPlan(plan, chosen_s, dp_again, profile, CLUSTER, 1.0, declined).report()
    assert "within the cost model's margin of error, so data parallelism it is" in report
    with pytest.raises(ValueError, match="margin"):
        pick(profile, CLUSTER, 16, margin=1.0)


def test_data_parallelism_that_does_not_fit_is_never_the_fallback():
    # 6 GB of parameters (with gradients and Adam state 24 GB) do not fit one 16 GB device; a
    # layer per device does.
    profile = _two_layers(3 * 10**9)
    plan, _, dp_step, declined = pick(profile, CLUSTER, 16, margin=0.99)
    assert plan.num_stages == 2 and dp_step is None and declined is None
