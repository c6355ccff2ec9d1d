"""plan='auto' helpers on one process: the optimizer the profile times, the step outside the Sequential,
the report (the selection policy it calls is tested in ``tests/planner/test_select.py``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from dapple_lightning.autoplan import (
    AutoPlan,
    _decided,
    _with_step_outside,
    optimizer_factory,
    profile_in_windows,
    time_step_outside,
    windows,
)
from dapple_lightning.plan import Plan
from dapple_lightning.planner import GB, Cluster, LayerProfile, ModelProfile, Trial, _clock, estimate, profile_layers
from dapple_lightning.strategy._resident import Resident, parameter_bytes
from dapple_lightning.surgery import Chain


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
    assert "log" not in vars(model)  # the strategy silences logging around plan='auto' (its Lightning adapter)
    assert all(p.grad is None for p in model.parameters())


def test_on_an_event_clock_the_step_outside_is_timed_by_events(monkeypatch):
    # What happens on CUDA, on the CPU: device events stand in for CUDA's (one second per record),
    # and the host's clock must not be read.
    from test_timeline import DeviceClock

    clock = DeviceClock(step=1.0)
    monkeypatch.setattr(_clock, "device_clock", lambda device: clock.event)
    monkeypatch.setattr(_clock.time, "perf_counter", _no_host_clock)
    model = Model(adamw)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))

    def set_sequential(module):
        model.layers = module

    step = lambda: model.training_step((x, y), 0)  # noqa: E731
    assert time_step_outside(model, set_sequential, model.layers, step, x) == (1.0, 1.0)
    assert clock.waits == 1  # read once, after every run


def _no_host_clock() -> float:
    raise AssertionError("a span on an event clock read the host's perf_counter")


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
    # With the choice rule's spreads and reason, as plan="auto" fills them in.
    trials = (Trial(pipe, 0.100, 0.118, 3, 0.03), Trial(dp, 0.105, 0.120, 3, 0.04))
    report = AutoPlan(dp, 0.105, 0.105, profile, CLUSTER, 2.0, trials, reason="data parallelism, the simplest").report()
    assert "118.0 ± 3% (3 turns)" in report and "120.0 ± 4% (3 turns)  <- chosen" in report
    assert "chosen: data parallelism, the simplest (the fastest median unless" in report


def test_a_zero_bubble_choice_is_explained_against_1f1b_on_the_same_stages():
    profile = _two_layers(10**6)
    zb = replace(Plan.straight(2, 2, micro_batches=4), schedule="zb-h1")
    decided = _decided(zb, 0.09, 0.2, profile, CLUSTER, 1.0, (), 8, 2.0)
    same_split = replace(zb, schedule="dapple")
    want = estimate(same_split, profile, CLUSTER, 8, optimizer_factor=2.0).step_s
    assert decided.one_f_one_b_step_s == pytest.approx(want)
    line = next(line for line in decided.report().splitlines() if line.startswith("schedule zb-h1"))
    assert "90.0 ms/step" in line and f"{want * 1e3:.1f} ms under DAPPLE's 1F1B" in line
    assert "(both measured above)" not in line
    measured = (Trial(zb, 0.09, 0.1, 2), Trial(same_split, want, 0.11, 2))
    assert "(both measured above)" in replace(decided, trials=measured).report()
    # zb-h2 says the same, and what its memory buys: 2S - 1 = 3 micro-batches per stage against 2.
    deeper = _decided(replace(zb, schedule="zb-h2"), 0.089, 0.2, profile, CLUSTER, 1.0, (), 8, 2.0)
    line = next(line for line in deeper.report().splitlines() if line.startswith("schedule zb-h2"))
    assert "holds up to 3 micro-batches (zb-h1 and 1F1B's first stage: 2)" in line and "89.0 ms/step" in line
    assert deeper.one_f_one_b_step_s == pytest.approx(want)
    # Any other schedule says nothing of the kind.
    assert _decided(same_split, want, 0.2, profile, CLUSTER, 1.0, (), 8, 2.0).one_f_one_b_step_s is None


def test_windows_hold_consecutive_layers_up_to_the_bytes_given_and_a_larger_layer_alone():
    assert windows([4, 4, 0, 4, 9, 1], 8) == [range(0, 3), range(3, 4), range(4, 5), range(5, 6)]
    assert windows([4, 4, 0, 4, 9, 1], None) == [range(0, 6)]


class Wide(nn.Module):
    """Seven layers, their parameters unevenly spread, one that changes its input in place."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(6, 16)  # outside the pipelined layers: always on the device
        self.layers = nn.Sequential(
            nn.Linear(16, 64), nn.ReLU(inplace=True), nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 4)
        )


def test_profiling_a_window_at_a_time_holds_at_most_the_window_and_profiles_every_layer_as_the_chain():
    model = Wide()
    layers = list(model.layers)
    x = torch.randn(8, 16)
    resident = Resident(model, Chain.of("layers", model.layers), torch.device("cpu"))
    seen: list[tuple[list[int], int]] = []

    def hold(window):
        resident.hold(window)
        seen.append((list(window), resident.held_bytes))

    budget = parameter_bytes(layers) // 2
    windowed = profile_in_windows(layers, x, hold=hold, window_bytes=budget, repeats=1, warmup=0)
    whole = profile_layers(layers, x, repeats=1, warmup=0)
    assert [w for w, _ in seen] == [[0, 1], [2, 3], [4, 5], []]
    assert all(held <= budget for _, held in seen) and resident.peak_bytes <= budget
    assert [layer.name for layer in windowed.layers] == [layer.name for layer in whole.layers]
    for got, want in zip(windowed.layers, whole.layers):
        assert (got.activation_bytes, got.param_bytes, got.saved_bytes) == (
            want.activation_bytes,
            want.param_bytes,
            want.saved_bytes,
        )
    assert windowed.cut_bytes == whole.cut_bytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_only_the_held_layers_and_the_code_outside_them_are_on_the_device():
    model = Wide()
    layers = list(model.layers)
    resident = Resident(model, Chain.of("layers", model.layers), torch.device("cuda", 0))
    ids = {id(p) for p in model.layers.parameters()}
    assert all(p.is_cuda for p in model.parameters() if id(p) not in ids)  # the code outside the chain
    for window in ([0, 1], [2, 3, 4], []):
        resident.hold(window)
        on_device = [i for i, layer in enumerate(layers) if any(p.is_cuda for p in layer.parameters())]
        assert on_device == [i for i in window if list(layers[i].parameters())]
        assert resident.held_bytes == parameter_bytes([layers[i] for i in window])


def test_a_trials_step_count_follows_a_warm_step_not_the_one_that_creates_communicators() -> None:
    """The first step of a plan creates its communicators (seconds on NCCL): timed, it would make a
    fast plan's turn a step or two long. It runs untimed; the timed window holds a warm step only."""
    from dapple_lightning.strategy._auto import step_seconds

    now = [0.0]
    durations = iter([30.0, 0.01])  # creating communicators, then a warm step

    def step() -> None:
        now[0] += next(durations)

    assert step_seconds(step, lambda: now[0]) == pytest.approx(0.01)
    with pytest.raises(StopIteration):
        step()  # exactly the two steps ran
