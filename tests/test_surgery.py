"""Model surgery on one process: finding the container, cutting a stage, putting it back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dapple_lightning.plan import Plan
from dapple_lightning.runtime import StageModule
from dapple_lightning.surgery import Chain, Cut, capture_input, find_sequential, set_submodule, standing_in, unchanged


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.layers = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh())
        self.logged = []

    def log(self, *args, **kwargs):
        self.logged.append(args)

    def training_step(self, batch, _):
        out = self.layers(self.embed(batch))
        self.log("loss", out.sum())
        return out.sum()


def two_stages() -> Plan:
    return Plan.coerce(
        {"micro_batches": 1, "stages": [{"layers": [0, 2], "replicas": 1}, {"layers": [2, 4], "replicas": 1}]}
    )


def test_find_sequential_finds_the_only_one_or_the_named_one_and_says_why_not() -> None:
    net = Net()
    assert find_sequential(net) == ("layers", net.layers)
    with pytest.raises(TypeError, match="'embed' is a Linear"):
        find_sequential(net, "embed")
    with pytest.raises(ValueError, match="no submodule 'nope'"):
        find_sequential(net, "nope")
    net.other = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"several nn.Sequential/nn.ModuleList attributes \('layers', 'other'\)"):
        find_sequential(net)


def test_a_cut_keeps_the_stage_under_its_original_names_and_restores_the_very_modules() -> None:
    net = Net()
    container, layers = net.layers, list(net.layers)
    weights = {f"layers.{k}": v.clone() for k, v in container.state_dict().items()}
    cut = Cut.apply(net, Chain.of("layers", container), two_stages(), rank=1)
    assert isinstance(net.layers, StageModule)
    assert [name for name, _ in net.layers.named_children()] == ["2", "3"]
    assert net.layers[0] is layers[2]  # re-indexed from 0, the same module
    assert all(p.is_meta for p in layers[0].parameters())  # other stages' layers are freed
    assert set(net.state_dict()) == {"embed.weight", "embed.bias", "layers.2.weight", "layers.2.bias"}
    cut.restore(weights, torch.device("cpu"))
    assert net.layers is container and list(container) == layers
    for key, value in container.state_dict().items():
        assert torch.equal(value, weights[f"layers.{key}"]), key


def test_capture_input_stops_the_step_at_the_container_before_it_logs() -> None:
    net = Net()
    x = torch.randn(5, 3)
    got = capture_input(net, lambda m: set_submodule(net, "layers", m), net.layers, lambda: net.training_step(x, 0))
    assert torch.allclose(got, net.embed(x))
    assert net.logged == []  # the step's log call went nowhere
    assert isinstance(net.layers, nn.Sequential) and not isinstance(net.layers, StageModule)
    with standing_in(lambda m: set_submodule(net, "layers", m), net.layers, nn.Identity()):
        assert isinstance(net.layers, nn.Identity)
    assert "log" not in net.__dict__


def test_capture_input_says_when_the_step_never_calls_the_container() -> None:
    net = Net()
    with pytest.raises(RuntimeError, match="never called it"):
        capture_input(net, lambda m: set_submodule(net, "layers", m), net.layers, lambda: net.embed(torch.randn(2, 3)))


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
