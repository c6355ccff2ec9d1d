"""Measuring a profile by running torch layers (CPU)."""

from __future__ import annotations

import pytest
import torch

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
