"""The memory meters (planner._memory) against tensors of known size, and how the profile records them."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from dapple_lightning.planner._measure import profile_layers
from dapple_lightning.planner._memory import SavedBytes, live_bytes, optimizer_state_bytes
from dapple_lightning.planner._profile import LayerProfile, ModelProfile

F32 = 4

# ------------------------------------------------------------------------ live-bytes tracker


def test_the_peak_is_the_sum_of_the_temporaries_alive_together_and_freeing_lowers_the_total():
    with live_bytes() as tracker:
        a = torch.ones(1000)
        b = torch.ones(2000)
        total = (a.sum() + b.sum()).reshape(1)
        assert tracker.peak >= (1000 + 2000) * F32
        del a, b
        assert tracker.live == total.nbytes
    # with a and b alive: the two sums and their total (which reshape views)
    assert tracker.peak == (1000 + 2000) * F32 + 3 * F32


def test_views_of_one_storage_count_once_and_free_with_their_last_view():
    with live_bytes() as tracker:
        a = torch.zeros(1000)
        views = [a.view(10, 100), a[10:], a.view(10, 100).t(), a.reshape(100, 10)]
        assert tracker.live == 1000 * F32
        del a
        assert tracker.live == 1000 * F32  # the views keep the storage
        del views
        assert tracker.live == 0
    assert tracker.peak == 1000 * F32


def test_in_place_ops_and_out_arguments_add_nothing():
    with live_bytes() as tracker:
        a = torch.zeros(1000)
        a.add_(1).mul_(2)
        torch.relu_(a)
        torch.add(a, 1, out=a)
        assert tracker.live == 1000 * F32
    assert tracker.peak == 1000 * F32


def test_tensors_made_before_are_the_baseline_and_only_new_storages_count():
    x = torch.randn(1000)
    with live_bytes() as tracker:
        x.add_(1)
        view = x.view(10, 100)
        assert tracker.live == 0
        doubled = x * 2
        assert tracker.live == doubled.nbytes == 1000 * F32
        del x, view  # freeing the baseline does not go below it
        assert tracker.live == 1000 * F32


def test_a_counted_storage_that_grows_counts_its_new_size():
    with live_bytes() as tracker:
        a = torch.empty(10)
        a.resize_(1000)
        assert tracker.live == 1000 * F32


def test_storage_resizes_are_followed_on_baseline_and_new_storages_and_undone_on_exit():
    # FSDP2 frees a gathered parameter and takes its memory back by resizing its storage, not by an op.
    before, torchs_own = torch.zeros(1000), torch.UntypedStorage.resize_  # 4000 bytes, the baseline
    with live_bytes() as tracker:
        assert torch.UntypedStorage.resize_ is not torchs_own
        before.untyped_storage().resize_(0)
        assert tracker.live == -4000
        before.untyped_storage().resize_(6000)
        assert (tracker.live, tracker.peak) == (2000, 2000)
        made = torch.zeros(500)
        made.untyped_storage().resize_(0)
        assert tracker.live == 2000
        made.untyped_storage().resize_(8000)
        assert tracker.live == 10000
        del made
        assert tracker.live == 2000
        del before
        assert tracker.live == 0
    assert torch.UntypedStorage.resize_ is torchs_own


def test_what_only_the_graph_holds_is_freed_with_it():
    leaf = torch.randn(1000, requires_grad=True)
    with live_bytes() as tracker:
        out = leaf.exp().sin()  # exp's output lives on only in the graph (both ops save it)
        assert tracker.live == 2 * 1000 * F32
        base = tracker.reset_peak()
        out.backward(torch.ones_like(out))
        assert tracker.peak > base
        assert tracker.live == out.nbytes + leaf.grad.nbytes  # the grad output and exp's result are gone


def test_reset_peak_starts_from_what_is_live():
    with live_bytes() as tracker:
        a = torch.ones(1000)
        del a
        assert tracker.reset_peak() == 0 and tracker.peak == 0
        b = torch.ones(10)
        assert tracker.peak == b.nbytes


# ------------------------------------------------------------------------ saved-tensor meter


def test_linear_saves_its_input_and_its_weight_is_left_to_the_parameters():
    layer = nn.Linear(16, 32)
    x = torch.randn(8, 16, requires_grad=True)
    with SavedBytes(layer.parameters()) as saved:
        layer(x)
    assert saved.bytes == x.nbytes
    with SavedBytes() as everything:
        layer(x)
    assert everything.bytes == x.nbytes + layer.weight.nbytes  # the exclusion is what removes it


def test_relu_saves_its_output():
    x = torch.randn(8, 16, requires_grad=True)
    with SavedBytes() as saved:
        y = torch.relu(x * 1)
    assert saved.bytes == y.nbytes  # mul by a number saves nothing


def test_a_tensor_saved_twice_or_through_two_views_counts_once():
    x = torch.randn(8, 16, requires_grad=True)
    with SavedBytes() as twice:
        x * x
    assert twice.bytes == x.nbytes
    with SavedBytes() as views:
        x[:, :8] * x[:, 8:]
    assert views.bytes == x.nbytes


class Saves(nn.Module):
    """Saves four tensors as large as its output (tanh saves its output)."""

    def forward(self, x):
        for _ in range(4):
            x = torch.tanh(x)
        return x


def test_a_layer_that_saves_several_tensors_counts_them_all_and_no_grad_saves_nothing():
    x = torch.randn(8, 16, requires_grad=True)
    with SavedBytes() as saved:
        y = Saves()(x)
    assert saved.bytes == 4 * y.nbytes
    with SavedBytes() as none, torch.no_grad():
        Saves()(x)
    assert none.bytes == 0


# ------------------------------------------------------------------------ optimizer state


def _stepped(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    return optimizer


def test_adam_keeps_two_moments_per_parameter_and_a_step_scalar():
    params = list(nn.Linear(16, 32).parameters())
    opt = torch.optim.Adam(params)
    assert optimizer_state_bytes(opt, params) == 0  # no state before a step
    _stepped(opt, params)
    steps = sum(opt.state[p]["step"].nbytes for p in params)
    assert steps == len(params) * F32  # a float32 scalar tensor each, as torch stores it
    assert optimizer_state_bytes(opt, params) == 2 * sum(p.nbytes for p in params) + steps


def test_sgd_state_is_its_momentum_and_only_the_given_parameters_count():
    first, second = nn.Linear(4, 8), nn.Linear(8, 2)
    params = [*first.parameters(), *second.parameters()]
    plain = _stepped(torch.optim.SGD(params, lr=0.1), params)
    assert optimizer_state_bytes(plain, params) == 0
    momentum = _stepped(torch.optim.SGD(params, lr=0.1, momentum=0.9), params)
    assert optimizer_state_bytes(momentum, params) == sum(p.nbytes for p in params)
    assert optimizer_state_bytes(momentum, first.parameters()) == sum(p.nbytes for p in first.parameters())


# ------------------------------------------------------------------------ the profile


def test_a_cpu_profile_records_saved_bytes_and_tracker_peaks_and_prices_them():
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(16, 32), Saves())
    profile = profile_layers(layers, torch.randn(8, 16), repeats=1, warmup=0)
    linear, saves = profile.layers
    assert linear.saved_bytes == 8 * 16 * F32 and saves.saved_bytes == 4 * saves.activation_bytes
    assert linear.peak_source == saves.peak_source == "tracker"
    # The linear layer keeps its output and makes its input's gradient; its parameters' gradients
    # are counted with the parameters.
    assert linear.peak_bytes == linear.activation_bytes + 8 * 16 * F32
    assert saves.peak_bytes >= 4 * saves.activation_bytes
    # What a micro-batch keeps is what the layer saved; the rest of its peak is needed once.
    assert [x.activation_memory for x in profile.layers] == [8 * 16 * F32, 4 * saves.activation_bytes]
    assert linear.transient_memory == linear.activation_bytes  # its output beyond the saved input
    assert saves.transient_memory == saves.peak_bytes - 4 * saves.activation_bytes
    assert all(p.grad is None for p in layers.parameters())


def test_the_profile_holds_the_optimizer_state_the_optimizer_allocates():
    layers = nn.Sequential(nn.Linear(16, 32), nn.Tanh())
    profile = profile_layers(layers, torch.randn(8, 16), repeats=1, warmup=0, optimizer=torch.optim.Adam)
    linear, tanh = profile.layers
    assert linear.optimizer_state_bytes == 2 * linear.param_bytes + 2 * F32
    assert tanh.optimizer_state_bytes == 0
    # Adam's step makes temporaries (its denominator) at least as large as the weight, freed after
    assert 32 * 16 * F32 <= linear.update_peak_bytes <= 2 * linear.param_bytes
    assert tanh.update_peak_bytes == 0
    without = profile_layers(layers, torch.randn(8, 16), repeats=1, warmup=0)
    assert [x.optimizer_state_bytes for x in without.layers] == [None, None]
    assert [x.update_peak_bytes for x in without.layers] == [None, None]


def test_the_memory_fields_round_trip_through_json(tmp_path):
    layer = LayerProfile("a", 1.0, 2.0, 100, 10, peak_bytes=300, peak_source="tracker", saved_bytes=200)
    profile = ModelProfile((layer,), profile_batch_size=4)
    profile.save(tmp_path / "p.json")
    assert ModelProfile.load(tmp_path / "p.json") == profile
    written = json.loads((tmp_path / "p.json").read_text())["layers"][0]
    assert written["saved_bytes"] == 200 and written["peak_source"] == "tracker"


def test_profiles_without_the_new_fields_load_and_price_as_before():
    old = {"name": "a", "forward_s": 1.0, "backward_s": 2.0, "activation_bytes": 100, "param_bytes": 10}
    layer = LayerProfile.from_dict(old)
    assert layer.saved_bytes is None and layer.peak_source is None and layer.activation_memory == 100
    assert "saved_bytes" not in layer.to_dict() and "peak_source" not in layer.to_dict()
    # A peak written before peak_source existed came from CUDA's allocator and is still used.
    assert LayerProfile.from_dict({**old, "peak_bytes": 300}).activation_memory == 300
    assert LayerProfile.from_dict({**old, "peak_bytes": 300, "peak_source": "allocator"}).activation_memory == 300


def test_bad_memory_fields_are_refused():
    with pytest.raises(ValueError, match="peak_source must be one of"):
        LayerProfile("a", 1.0, 2.0, 100, 10, peak_bytes=1, peak_source="guess")
    with pytest.raises(ValueError, match="without peak_bytes"):
        LayerProfile("a", 1.0, 2.0, 100, 10, peak_source="tracker")
    with pytest.raises(ValueError, match="saved_bytes"):
        LayerProfile("a", 1.0, 2.0, 100, 10, saved_bytes=-1)
