"""plan='auto' helpers on one process: the optimizer the profile times, the step outside the Sequential."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dapple_lightning.autoplan import (
    AutoPlan,
    Measured,
    Trial,
    _with_step_outside,
    measure_in_turns,
    optimizer_factory,
    refine,
    refine_allreduce,
    shortlist,
    time_step_outside,
)
from dapple_lightning.plan import Plan
from dapple_lightning.planner import GB, Cluster, LayerProfile, ModelProfile, estimate
from dapple_lightning.surgery import unchanged


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


def test_plans_predicted_close_to_the_best_are_shortlisted_for_measurement():
    # 4 GB of gradients to all-reduce at 1 GB/s: data parallelism takes about 10 s, the pipeline
    # (16 micro-batches of one sample) about 6.5.
    profile = _two_layers(2 * 10**9)
    close, dp_step = shortlist(profile, CLUSTER, 16, optimizer_factor=0.0, margin=0.1)
    best, predicted = close[0]
    assert best.num_stages == 2 and predicted == estimate(best, profile, CLUSTER, 16, optimizer_factor=0.0).step_s
    assert dp_step == pytest.approx(10.0, rel=1e-3)
    assert all(p <= predicted / 0.9 for _, p in close) and len(close) <= 3
    assert [p for _, p in close] == sorted(p for _, p in close)
    # A margin wide enough takes data parallelism in, in place of a third pipeline if need be.
    gain = 1 - predicted / dp_step
    wide, _ = shortlist(profile, CLUSTER, 16, optimizer_factor=0.0, margin=gain + 0.01)
    assert len(wide) == 3 and wide[0] == close[0]
    assert (Plan.data_parallel(2, 2), dp_step) in wide
    assert shortlist(profile, CLUSTER, 16, optimizer_factor=0.0, margin=0.0)[0] == [close[0]]
    with pytest.raises(ValueError, match="margin"):
        shortlist(profile, CLUSTER, 16, margin=1.0)


def test_data_parallelism_that_does_not_fit_is_never_shortlisted():
    # 6 GB of parameters (with gradients and Adam state 24 GB) do not fit one 16 GB device; a
    # layer per device does.
    profile = _two_layers(3 * 10**9)
    close, dp_step = shortlist(profile, CLUSTER, 16, margin=0.99)
    assert dp_step is None and all(plan.num_stages == 2 for plan, _ in close)


def test_report_shows_the_measured_plans_and_the_choice():
    profile = _two_layers(10**6)
    pipe = Plan.straight(2, 2, micro_batches=4)
    dp = Plan.data_parallel(2, 2)
    trials = (Trial(pipe, 0.100, 0.130, 1), Trial(dp, 0.105, 0.120, 3))
    report = AutoPlan(dp, 0.105, 0.105, profile, CLUSTER, 2.0, trials).report()
    assert "measured 2 close plans" in report
    lines = [line for line in report.splitlines() if line.startswith("  ") and "measured" in line]
    assert len(lines) == 2 and lines[1].endswith("(3 turns)  <- chosen") and "130.0 (1 turn)" in lines[0]


def _scripted(times: dict[int, list[float]], calls: list[int]):
    """A trial of plans with 1, 2, ... micro-batches: each turn the next of its scripted step times."""

    def trial(plan: Plan) -> Measured:
        m = plan.micro_batches
        calls.append(m)
        step = times[m][sum(c == m for c in calls) - 1]
        return Measured(step, (step / 3,), (2 * step / 3,))

    return trial


def test_close_plans_are_measured_in_rotating_turns_until_one_leads():
    plans = [Plan.data_parallel(4, 2, micro_batches=m) for m in (1, 2, 4)]
    calls: list[int] = []
    # M=4 is 10% behind after the first round and gets no more turns; M=1 and M=2 alternate
    # leads, and three rounds give M=2 the lower median.
    times = {1: [1.00, 1.03, 1.02], 2: [1.01, 1.00, 1.01], 4: [1.11]}
    runs = measure_in_turns(plans, _scripted(times, calls), rounds=3, drop=0.05)
    assert calls == [1, 2, 4, 2, 1, 1, 2]  # each round starts one plan further on
    assert [[r.step_s for r in plan_runs] for plan_runs in runs] == [times[1], times[2], times[4]]
    best = min(range(3), key=lambda i: Measured.median(runs[i]).step_s)
    assert best == 1
    assert Measured.median(runs[0]) == Measured(1.02, (1.02 / 3,), (2 * 1.02 / 3,))


def test_turns_end_when_one_plan_is_left():
    plans = [Plan.data_parallel(4, 2, micro_batches=m) for m in (1, 2)]
    calls: list[int] = []
    runs = measure_in_turns(plans, _scripted({1: [1.0], 2: [1.2]}, calls), rounds=5, drop=0.05)
    assert calls == [1, 2] and [len(r) for r in runs] == [1, 1]
    # No drop at all: every plan runs every round.
    calls.clear()
    runs = measure_in_turns(plans, _scripted({1: [1.0] * 2, 2: [1.2] * 2}, calls), rounds=2, drop=10.0)
    assert calls == [1, 2, 2, 1]
    with pytest.raises(ValueError, match="rounds"):
        measure_in_turns(plans, _scripted({}, []), rounds=0)
    with pytest.raises(ValueError, match="no runs"):
        Measured.median([])


def test_unchanged_puts_back_weights_buffers_gradients_and_the_rng():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    rng = torch.get_rng_state()
    draw = torch.rand(3)
    torch.set_rng_state(rng)
    with unchanged(module):
        torch.rand(100)
        module(torch.randn(8, 4)).sum().backward()  # moves BatchNorm's running statistics
        torch.optim.SGD(module.parameters(), lr=1.0).step()
    for key, value in module.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert all(p.grad is None for p in module.parameters())
    assert torch.equal(torch.rand(3), draw)


def test_refine_scales_each_layer_by_how_its_stages_measured():
    profile = _two_layers(10**6)
    pipe = Plan.straight(2, 2, micro_batches=4)
    dp = Plan.data_parallel(2, 2)
    before = {p: estimate(p, profile, CLUSTER, 16, optimizer_factor=0.0) for p in (pipe, dp)}
    f, b = before[pipe].forward_s, before[pipe].backward_s
    runs = [
        # The pipeline's first stage ran 20% slow forward, its second 40% slow backward...
        (pipe, Measured(1.0, (f[0] * 1.2, f[1]), (b[0], b[1] * 1.4))),
        # ...and data parallelism's one stage as predicted.
        (dp, Measured(1.0, before[dp].forward_s, before[dp].backward_s)),
    ]
    refined = refine(profile, CLUSTER, 16, runs, optimizer_factor=0.0)
    first, second = refined.layers
    assert first.forward_s == pytest.approx(1.0 * (1.2 + 1.0) / 2)  # the mean of its two stages
    assert first.backward_s == pytest.approx(2.0) and second.forward_s == pytest.approx(1.0)
    assert second.backward_s == pytest.approx(2.0 * (1.4 + 1.0) / 2)
    assert refine(profile, CLUSTER, 16, [], optimizer_factor=0.0) == profile


def test_refine_allreduce_takes_what_data_parallel_steps_left_after_their_passes():
    profile = _two_layers(10**9)  # 2 GB of gradients: 2 s at 1 GB/s over 2 replicas
    dp = Plan.data_parallel(2, 2)
    est = estimate(dp, profile, CLUSTER, 16, optimizer_factor=0.0)
    assert est.allreduce_s[0] == pytest.approx(2.0, rel=1e-3)
    # The step took 4 s beyond its passes: the all-reduce ran at half the measured bandwidth.
    slow = Measured(est.forward_s[0] + est.backward_s[0] + 4.0, est.forward_s, est.backward_s)
    refined = refine_allreduce(profile, CLUSTER, 16, [(dp, slow)], optimizer_factor=0.0)
    assert refined.intra_allreduce_bw == pytest.approx(0.5 * GB, rel=1e-3)
    assert estimate(dp, profile, refined, 16, optimizer_factor=0.0).step_s == pytest.approx(slow.step_s, rel=1e-3)
    # Faster than predicted, or no data-parallel run: the measured bandwidth stands.
    fast = Measured(est.step_s * 0.9, est.forward_s, est.backward_s)
    assert refine_allreduce(profile, CLUSTER, 16, [(dp, fast)], optimizer_factor=0.0) == CLUSTER
    pipe = Plan.straight(2, 2, micro_batches=4)
    assert refine_allreduce(profile, CLUSTER, 16, [(pipe, slow)], optimizer_factor=0.0) == CLUSTER
