"""Measuring a profile by running torch layers (CPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dapple_lightning.planner import _clock
from dapple_lightning.planner._measure import profile_layers


class Split(torch.nn.Module):
    """Returns a tuple, as a layer of a pipelined Sequential may."""

    def forward(self, x):
        return x, 2 * x


class Join(torch.nn.Module):
    def forward(self, pair):
        a, b = pair
        return a + b


def test_profile_counts_bytes_and_times_each_layer():
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(16, 32), Split(), Join(), torch.nn.Linear(32, 4))
    profile = profile_layers(layers, torch.randn(8, 16), repeats=3, warmup=1)
    assert profile.profile_batch_size == 8 and profile.device == "cpu"
    assert [x.name for x in profile.layers] == ["0:Linear", "1:Split", "2:Join", "3:Linear"]
    assert [x.activation_bytes for x in profile.layers] == [8 * 32 * 4, 2 * 8 * 32 * 4, 8 * 32 * 4, 8 * 4 * 4]
    assert [x.param_bytes for x in profile.layers] == [(16 * 32 + 32) * 4, 0, 0, (32 * 4 + 4) * 4]
    assert all(x.forward_s > 0 and x.backward_s > 0 for x in profile.layers)
    assert profile.cut_bytes[2] == 2 * 8 * 32 * 4  # the tuple crosses the cut after Split
    assert all(p.grad is None for p in layers.parameters())


def test_outputs_without_gradient_take_no_backward_time():
    profile = profile_layers([torch.nn.Identity()], torch.arange(6).reshape(3, 2), repeats=1, warmup=0)
    assert profile.layers[0].backward_s == 0.0
    assert profile.layers[0].activation_bytes == 6 * 8


@pytest.mark.parametrize(
    ("layers", "sample", "kwargs", "error", "message"),
    [
        ([], torch.zeros(2, 2), {}, ValueError, "at least one layer"),
        (["relu"], torch.zeros(2, 2), {}, TypeError, "not a torch.nn.Module"),
        ([torch.nn.ReLU()], torch.zeros(2, 2), {"repeats": 0}, ValueError, "repeats"),
        ([torch.nn.ReLU()], torch.zeros(2, 2), {"warmup": -1}, ValueError, "warmup"),
        ([torch.nn.ReLU()], torch.tensor(1.0), {}, ValueError, "batch in dim 0"),
        ([torch.nn.ReLU()], "text", {}, TypeError, "tensor or a tuple of tensors"),
    ],
)
def test_bad_input_is_rejected(layers, sample, kwargs, error, message):
    with pytest.raises(error, match=message):
        profile_layers(layers, sample, **kwargs)


def test_small_batch_splits_each_time_into_fixed_and_per_sample_parts():
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    profile = profile_layers(layers, torch.randn(64, 64), repeats=3, warmup=1, small_batch=8)
    for layer in profile.layers:
        assert 0.0 <= layer.forward_fixed_s <= layer.forward_s
        assert 0.0 <= layer.backward_fixed_s <= layer.backward_s
    plain = profile_layers(layers, torch.randn(64, 64), repeats=1, warmup=0)
    assert all(x.forward_fixed_s == x.backward_fixed_s == 0.0 for x in plain.layers)
    for bad in (0, 64, 100, 2.5):
        with pytest.raises(ValueError, match="small_batch"):
            profile_layers(layers, torch.randn(64, 64), small_batch=bad)


def test_adding_into_existing_gradients_is_timed_for_layers_with_parameters(monkeypatch):
    # On a fake device clock every span lasts 1 s, and computing the Linear's weight gradient while one is
    # already there (to add into) 0.5 s more: what a second backward costs more is that, on the layer with
    # parameters alone. (On the host's clock the difference of two timed medians is noise-bound.)
    clock = _EventClock()
    monkeypatch.setattr(_clock, "device_clock", lambda device: clock.event)
    monkeypatch.setattr(_clock.time, "perf_counter", _no_host_clock)
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    weight = layers[0].weight
    weight.register_hook(lambda grad: clock.advance(0.5) if weight.grad is not None else None)
    for small in (None, 2):
        profile = profile_layers(layers, torch.randn(8, 8), repeats=3, warmup=1, small_batch=small)
        assert [x.backward_s for x in profile.layers] == [1.0, 1.0]  # the pass into no gradients
        assert [x.accumulate_s for x in profile.layers] == [pytest.approx(0.5), 0.0]  # ReLU has no parameters
    assert all(p.grad is None for p in layers.parameters())


def test_a_second_backward_that_comes_out_faster_adds_nothing(monkeypatch):
    # Noise can make the pass into existing gradients the faster one: it is priced 0, not below.
    clock = _EventClock()
    monkeypatch.setattr(_clock, "device_clock", lambda device: clock.event)
    monkeypatch.setattr(_clock.time, "perf_counter", _no_host_clock)
    layers = nn.Sequential(nn.Linear(8, 8))
    weight = layers[0].weight
    weight.register_hook(lambda grad: clock.advance(0.5) if weight.grad is None else None)
    profile = profile_layers(layers, torch.randn(8, 8), repeats=3, warmup=1)
    assert (profile.layers[0].backward_s, profile.layers[0].accumulate_s) == (1.5, 0.0)


def test_optimizer_step_is_timed_and_leaves_weights_and_gradients_alone():
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    before = {k: v.clone() for k, v in layers.state_dict().items()}

    def adamw(params):
        return torch.optim.AdamW(params, lr=0.1, weight_decay=0.5)  # would move every weight

    profile = profile_layers(layers, torch.randn(16, 32), repeats=2, warmup=1, optimizer=adamw)
    assert profile.layers[0].update_s > 0 and profile.layers[2].update_s > 0
    assert profile.layers[1].update_s == 0.0  # ReLU has no parameters
    for key, value in layers.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert all(p.grad is None for p in layers.parameters())  # cleared, as documented


def test_a_layer_that_changes_its_input_in_place_is_profiled_on_a_copy():
    # A leaf that requires grad refuses in-place changes; torchvision puts ReLU(inplace=True) everywhere.
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2), nn.ReLU(inplace=True))
    profile = profile_layers(layers, torch.randn(4, 3, 8, 8), repeats=2, warmup=1, small_batch=2)
    assert [x.name for x in profile.layers] == ["0:Conv2d", "1:ReLU", "2:MaxPool2d", "3:ReLU"]
    assert all(x.forward_s > 0 for x in profile.layers) and profile.layers[1].backward_s > 0


def test_cpu_peaks_come_from_the_tracker_and_the_saved_bytes_are_what_a_micro_batch_keeps():
    profile = profile_layers(nn.Sequential(nn.Linear(4, 8), nn.Tanh()), torch.randn(8, 4), repeats=1, warmup=0)
    assert [x.peak_source for x in profile.layers] == ["tracker", "tracker"]
    assert all(x.peak_bytes >= x.activation_bytes for x in profile.layers)
    assert [x.activation_memory for x in profile.layers] == [x.saved_bytes for x in profile.layers]


class Saves(nn.Module):
    """Saves four times its output for the backward (the intermediate of each of four tanh)."""

    def forward(self, x):
        for _ in range(4):
            x = torch.tanh(x)
        return x


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peaks_count_what_a_layer_saves_not_only_its_output():
    device = torch.device("cuda", 0)
    layers = nn.Sequential(nn.Linear(256, 256), Saves()).to(device)
    profile = profile_layers(layers, torch.randn(512, 256, device=device), repeats=2, warmup=1)
    linear, saves = profile.layers
    assert linear.peak_source == saves.peak_source == "allocator"
    assert saves.saved_bytes == 4 * saves.activation_bytes and linear.saved_bytes == 512 * 256 * 4
    assert saves.peak_bytes >= 4 * saves.activation_bytes
    # what it saved is kept per micro-batch, the rest of the allocator's peak once
    assert saves.activation_memory == saves.saved_bytes
    assert saves.transient_memory == saves.peak_bytes - saves.saved_bytes
    # the linear layer keeps its output and makes its input's gradient (as large); its parameters'
    # gradients are counted with the parameters, not here
    assert linear.activation_bytes <= linear.peak_bytes <= 2 * linear.activation_bytes + 4096


class _EventClock:
    """Device events on a clock that moves one second at each record; counts the host's waits."""

    def __init__(self) -> None:
        self.now, self.waits = 0.0, 0

    def event(self) -> _Event:
        return _Event(self)

    def advance(self, seconds: float) -> None:
        """Work inside the span being timed that lasts ``seconds`` longer."""
        self.now += seconds


class _Event:
    def __init__(self, clock: _EventClock) -> None:
        self.clock, self.at = clock, None

    def record(self) -> None:
        self.at, self.clock.now = self.clock.now, self.clock.now + 1.0

    def synchronize(self) -> None:
        self.clock.waits += 1

    def elapsed_time(self, end: _Event) -> float:
        assert self.at is not None and end.at is not None, "an event read before it was recorded"
        return (end.at - self.at) * 1e3


def test_on_an_event_clock_layers_and_steps_are_timed_by_events_read_once_per_pass(monkeypatch):
    # What the profiler does on CUDA, run on the CPU: events stand in for CUDA's, and the host's
    # clock must not be read. Every span is one second of the fake device clock.
    clock = _EventClock()
    monkeypatch.setattr(_clock, "device_clock", lambda device: clock.event)
    monkeypatch.setattr(_clock.time, "perf_counter", _no_host_clock)
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    profile = profile_layers(layers, torch.randn(4, 8), repeats=2, warmup=1, optimizer=sgd)
    assert [(x.forward_s, x.backward_s) for x in profile.layers] == [(1.0, 1.0)] * 3
    assert [x.update_s for x in profile.layers] == [1.0, 0.0, 1.0]
    assert all(x.accumulate_s == 0.0 for x in profile.layers)  # a second pass's spans last as long
    # One wait per pass through the chain (3 timed runs twice, one memory pass) and per layer's
    # optimizer timing: never one per layer and pass.
    assert clock.waits == 3 * 2 + 1 + 2


def _no_host_clock() -> float:
    raise AssertionError("a span on an event clock read the host's perf_counter")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_profile_is_timed_with_cuda_events(monkeypatch):
    monkeypatch.setattr(_clock.time, "perf_counter", _no_host_clock)
    device = torch.device("cuda", 0)
    layers = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 16)).to(device)
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    profile = profile_layers(layers, torch.randn(512, 256, device=device), repeats=3, warmup=1, optimizer=sgd)
    assert all(x.forward_s > 0 and x.backward_s > 0 for x in profile.layers)
    assert profile.layers[0].update_s > 0 and profile.layers[2].update_s > 0


def test_split_backward_times_the_weights_part_apart(monkeypatch):
    # On a fake device clock every span lasts 1 s, and computing a Linear's weight gradient 0.5 s more:
    # the inputs-only backward leaves it out, and the difference is the layer's W.
    clock = _EventClock()
    monkeypatch.setattr(_clock, "device_clock", lambda device: clock.event)
    monkeypatch.setattr(_clock.time, "perf_counter", _no_host_clock)
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    for linear in (layers[1], layers[3]):
        linear.weight.register_hook(lambda grad: clock.advance(0.5))
    profile = profile_layers(layers, torch.randint(0, 64, (8, 4)), repeats=3, warmup=1, split_backward=True)
    embed, linear, tanh, last = profile.layers
    assert (embed.weight_s, embed.backward_s) == (1.0, 1.0)  # an integer input has no gradient: all of it is W
    assert (linear.weight_s, linear.backward_s) == (last.weight_s, last.backward_s) == (pytest.approx(0.5), 1.5)
    assert (tanh.weight_s, tanh.backward_s) == (0.0, 1.0)  # nothing to update
    assert profile_layers(layers, torch.randint(0, 64, (4, 8)), repeats=1, warmup=0).layers[1].weight_s is None
