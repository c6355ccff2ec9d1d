"""Profiles: validation, JSON round trips, and the PipeDream graph reader."""

from __future__ import annotations

import hashlib
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dapple_lightning.planner import REFERENCE_PROFILES, LayerProfile, ModelProfile, load_profile, read_pipedream

FILES = sorted(p.name for p in REFERENCE_PROFILES.glob("*.txt"))

# A branchy graph written out of order: node 2 feeds nodes 3 and 5 (a skip over node 3..4).
BRANCHY = """\
node5 -- Add -- forward_compute_time=1.0, backward_compute_time=2.0, activation_size=50.0, parameter_size=0
node1 -- Input -- forward_compute_time=0.0, backward_compute_time=0.0, activation_size=10.0, parameter_size=0
node2 -- Conv -- forward_compute_time=3.0, backward_compute_time=6.0, activation_size=20.0, parameter_size=400
node3 -- Conv -- forward_compute_time=3.0, backward_compute_time=6.0, activation_size=30.0, parameter_size=400
node4 -- Relu -- forward_compute_time=0.5, backward_compute_time=0.5, activation_size=[40; 1], parameter_size=0
\tnode1 -- node2
\tnode2 -- node3
\tnode3 -- node4
\tnode4 -- node5
\tnode2 -- node5
"""


def test_branches_count_every_tensor_crossing_a_cut():
    profile = read_pipedream(BRANCHY, 8)
    assert [x.name for x in profile.layers] == ["Input", "Conv", "Conv", "Relu", "Add"]
    assert profile.layers[3].activation_bytes == 41  # "[40; 1]": both outputs
    # Cut before layer i: every earlier output still consumed at i or later.
    assert profile.cut_bytes == (0, 10, 20, 20 + 30, 20 + 41, 0)
    assert profile.layers[1].forward_s == pytest.approx(3e-3)
    assert profile.layers[1].backward_s == pytest.approx(6e-3)
    assert profile.profile_batch_size == 8


def test_vgg19_matches_the_file():
    profile = read_pipedream(REFERENCE_PROFILES / "vgg-19-pbs-32.txt")
    assert profile.profile_batch_size == 32  # from "pbs-32" in the name
    assert profile.num_layers == 26
    first, conv, fc1, last = profile.layers[0], profile.layers[2], profile.layers[22], profile.layers[-1]
    assert (first.name, first.forward_s, first.backward_s) == ("Input", 3.4e-3, 0.0)
    assert (conv.name, conv.forward_s, conv.backward_s) == ("Conv2d_1_2", 7.2e-3, 14.4e-3)
    assert (conv.activation_bytes, conv.param_bytes) == (384_000_000, 140_869)
    assert (fc1.name, fc1.param_bytes, fc1.activation_bytes) == ("FC1", 392_015_625, 500_000)
    assert (last.name, last.forward_s, last.backward_s, last.activation_bytes) == ("Loss", 1e-5, 2e-4, 2_000_000)
    assert sum(x.forward_s for x in profile.layers) == pytest.approx(51.41e-3)
    assert sum(x.param_bytes for x in profile.layers) == 548_047_022
    # A chain: each cut carries the previous layer's output.
    assert profile.cut_bytes[1:-1] == tuple(x.activation_bytes for x in profile.layers[:-1])


def test_the_paper_profiles_ship_unchanged_with_their_provenance():
    readme = (REFERENCE_PROFILES / "README.md").read_text()
    assert "AlibabaPAI/DAPPLE" in readme
    sums = dict(reversed(m.groups()) for m in re.finditer(r"^    ([0-9a-f]{64})  (\S+\.txt)$", readme, re.M))
    assert sorted(sums) == FILES and len(FILES) == 13
    for name, digest in sums.items():
        assert hashlib.sha256((REFERENCE_PROFILES / name).read_bytes()).hexdigest() == digest, name


@pytest.mark.parametrize("name", FILES)
def test_every_reference_file_reads(name):
    # vgg16.txt names no batch; its input node holds 128 images of 3x224x224 floats.
    profile = read_pipedream(REFERENCE_PROFILES / name, 128 if name == "vgg16.txt" else None)
    assert profile.num_layers > 10
    assert all(x.forward_s >= 0 and x.backward_s >= 0 for x in profile.layers)
    assert len(profile.cut_bytes) == profile.num_layers + 1
    assert profile.cut_bytes[0] == profile.cut_bytes[-1] == 0
    chain = (0, *(x.activation_bytes for x in profile.layers[:-1]), 0)
    # A cut carries at least the output of the layer just before it.
    assert all(c >= a for c, a in zip(profile.cut_bytes, chain))


def test_gnmt_has_residual_connections_across_cuts():
    profile = read_pipedream(REFERENCE_PROFILES / "gnmt-16-pbs-64.txt")
    chain = (0, *(x.activation_bytes for x in profile.layers[:-1]), 0)
    assert sum(c > a for c, a in zip(profile.cut_bytes, chain)) > 10


def test_pipedream_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="profile_batch_size"):
        read_pipedream(BRANCHY)
    cycle = BRANCHY + "\tnode5 -- node1\n"
    with pytest.raises(ValueError, match="cycle"):
        read_pipedream(cycle, 1)
    with pytest.raises(ValueError, match="node9"):
        read_pipedream(BRANCHY + "\tnode2 -- node9\n", 1)
    with pytest.raises(ValueError, match="lacks"):
        read_pipedream("node1 -- A -- forward_compute_time=1, backward_compute_time=1\n", 1)
    path = tmp_path / "model.txt"
    path.write_text(BRANCHY)
    with pytest.raises(ValueError, match="--profile-batch"):
        load_profile(path)
    assert load_profile(path, 4).profile_batch_size == 4


def test_json_round_trip(tmp_path):
    profile = read_pipedream(BRANCHY, 8)
    path = tmp_path / "p.json"
    profile.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == "dapple-lightning-profile" and data["version"] == 1
    assert ModelProfile.load(path) == profile
    assert load_profile(path) == profile  # detected as JSON
    assert load_profile(path, 16).profile_batch_size == 16


def test_json_errors(tmp_path):
    data = read_pipedream(BRANCHY, 8).to_dict()
    with pytest.raises(ValueError, match="version 2 is not supported"):
        ModelProfile.from_dict({**data, "version": 2})
    with pytest.raises(ValueError, match="unknown profile keys"):
        ModelProfile.from_dict({**data, "extra": 1})
    with pytest.raises(ValueError, match="lacks keys"):
        ModelProfile.from_dict({**data, "layers": [{"name": "a"}]})
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelProfile.load(path)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"forward_s": -1.0}, ValueError, "forward_s must be a finite number >= 0"),
        ({"backward_s": float("nan")}, ValueError, "backward_s"),
        ({"param_bytes": True}, TypeError, "param_bytes must be a number"),
        ({"activation_bytes": "1"}, TypeError, "activation_bytes"),
        ({"name": 3}, TypeError, "name must be a string"),
    ],
)
def test_layer_validation(kwargs, error, message):
    base = {"name": "a", "forward_s": 1.0, "backward_s": 1.0, "activation_bytes": 1, "param_bytes": 1}
    with pytest.raises(error, match=message):
        LayerProfile(**{**base, **kwargs})


def test_model_validation():
    layer = LayerProfile("a", 1e-3, 1e-3, 10, 10)
    with pytest.raises(ValueError, match="at least one layer"):
        ModelProfile((), 1)
    with pytest.raises(ValueError, match="profile_batch_size must be >= 1"):
        ModelProfile((layer,), 0)
    with pytest.raises(ValueError, match="2 in all"):
        ModelProfile((layer,), 1, cut_bytes=(0, 0, 0))
    # Without cut bytes the layers form a chain.
    assert ModelProfile((layer, layer), 1).cut_bytes == (0, 10, 0)


def test_optimizer_state_defaults_to_the_factor():
    assert LayerProfile("a", 0, 0, 0, 100).optimizer_bytes(2.0) == 200.0
    assert LayerProfile("a", 0, 0, 0, 100, optimizer_state_bytes=50).optimizer_bytes(2.0) == 50.0


layers = st.builds(
    LayerProfile,
    name=st.text(max_size=8),
    forward_s=st.floats(0, 1),
    backward_s=st.floats(0, 1),
    activation_bytes=st.integers(0, 10**12),
    param_bytes=st.integers(0, 10**12),
    optimizer_state_bytes=st.none() | st.integers(0, 10**12),
)


@settings(max_examples=50, derandomize=True)
@given(st.lists(layers, min_size=1, max_size=6), st.integers(1, 512))
def test_dict_round_trip(items, pbs):
    profile = ModelProfile(tuple(items), pbs, "cpu")
    assert ModelProfile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile


def test_peak_bytes_round_trip_and_old_profiles_still_load(tmp_path):
    old = {"name": "a", "forward_s": 1.0, "backward_s": 2.0, "activation_bytes": 100, "param_bytes": 8}
    assert LayerProfile.from_dict(old).peak_bytes is None
    assert "peak_bytes" not in LayerProfile.from_dict(old).to_dict()  # a profile without a peak is written as before
    measured = LayerProfile("b", 1.0, 2.0, 100, 8, peak_bytes=350.0)
    assert measured.peak_bytes == 350 and isinstance(measured.peak_bytes, int)
    assert LayerProfile.from_dict(measured.to_dict()) == measured
    profile = ModelProfile((LayerProfile.from_dict(old), measured), profile_batch_size=4)
    profile.save(tmp_path / "p.json")
    assert ModelProfile.load(tmp_path / "p.json") == profile
    # the planner counts the peak where measured, the output elsewhere; cuts stay the outputs
    assert [x.activation_memory for x in profile.layers] == [100, 350]
    assert profile.cut_bytes == (0, 100, 0)


@pytest.mark.parametrize(("value", "error"), [(-1, ValueError), (True, TypeError), ("9", TypeError)])
def test_bad_peak_bytes_are_refused(value, error):
    with pytest.raises(error, match="peak_bytes"):
        LayerProfile("a", 1.0, 2.0, 100, 8, peak_bytes=value)
