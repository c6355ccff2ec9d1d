"""plan='auto' with a chain of containers and the user's code between them (torchvision's VGG).

One process: the chain profiled through the user's step (one entry per layer, the layer after
the pooling and flatten run on what it really got, the bytes crossing the container boundary
those of features' last output), refusals. Real processes (gloo): trials of a plan cut at the
boundary and of data parallelism, and whole fits under plan='auto' against single-device
Lightning on the same batches.
"""

from __future__ import annotations

import contextlib
import json
from datetime import timedelta

import pytest
import torch
from test_autoplan_blocks import WritesAutoPlan
from test_chains import CHAIN, CLASSES, CLASSIFIER, FEATURES, LAYERS, VGG, ClassifierFirst, images
from torch import nn

from dapple_lightning import DappleStrategy, Plan
from dapple_lightning.autoplan import optimizer_factory, small_batch_of
from dapple_lightning.microbatch import Rows, slice_batch
from dapple_lightning.planner import profile_layers
from dapple_lightning.strategy._auto_blocks import BlockChain
from dapple_lightning.surgery import Chain, find_chain, unchanged

from distributed import run_ranks
from harness import assert_same, fit

ROWS = 8
SMALL = small_batch_of(ROWS)
BOUNDARY_BYTES = ROWS * 16 * 4 * 4 * 4  # features' last output: 16 channels of 4 x 4, fp32
NAMES = [
    f"{i}:{path}:{type(layer).__name__}" for i, (path, layer) in enumerate(find_chain(VGG(), CHAIN).named_layers())
]


def chain_of(model: VGG, rows: int = ROWS) -> BlockChain:
    batch = next(iter(images(rows)))
    step = lambda n: model.training_step(slice_batch(batch, Rows(0, n)), 0)  # noqa: E731
    return BlockChain(model, find_chain(model, CHAIN), step, rows)


def hooks(chain: Chain) -> list[int]:
    return [len(layer._forward_hooks) + len(layer._forward_pre_hooks) for _, layer in chain.named_layers()]


# ------------------------------------------------------------------ one process: the profile


def test_the_chain_profile_has_one_entry_per_layer_and_features_output_crosses_the_boundary():
    model = VGG()
    chain = find_chain(model, CHAIN)
    hooked = hooks(chain)  # VGG counts its layers' calls with a hook of its own
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with unchanged(model):
        recorded = chain_of(model)
        profile = recorded.named(
            profile_layers(recorded.layers, recorded.sample_input, repeats=2, warmup=1, small_batch=SMALL)
        )
        outside = recorded.step_outside(ROWS)
    assert profile.num_layers == LAYERS and profile.profile_batch_size == ROWS
    assert [layer.name for layer in profile.layers] == NAMES
    assert NAMES[FEATURES] == f"{FEATURES}:classifier.0:Linear"
    for layer, (_, module) in zip(profile.layers, chain.named_layers()):
        assert layer.param_bytes == sum(p.numel() * 4 for p in module.parameters())
        if layer.param_bytes:
            assert layer.forward_s > 0 and layer.backward_s > 0, layer.name
    # What the runtime sends across the boundary is features' last output, before the pooling and
    # flatten that the classifier's stage runs; the first Linear was timed on their result.
    assert profile.layers[FEATURES - 1].activation_bytes == BOUNDARY_BYTES
    assert profile.cut_bytes[FEATURES] == BOUNDARY_BYTES
    assert recorded.calls(ROWS)[FEATURES].activation.shape == (ROWS, 16 * 2 * 2)
    assert profile.layers[-1].activation_bytes == ROWS * CLASSES * 4
    # The in-place ReLUs ran on a copy of their input, the other layers on it.
    assert [block.copies for block in recorded.layers] == [isinstance(m, nn.ReLU) for _, m in chain.named_layers()]
    assert outside[0] > 0 and outside[1] > 0  # the pooling, flatten and loss around the containers
    # The step ran with hooks and stand-ins; afterwards the model is as it was built.
    assert model.features is chain.containers[0] and model.classifier is chain.containers[1]
    assert hooks(chain) == hooked
    assert all(p.grad is None for p in model.parameters())
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_the_chain_is_recorded_at_both_batch_sizes_and_its_input_is_the_first_layers():
    model = VGG()
    recorded = chain_of(model)
    assert torch.equal(recorded.sample_input, next(iter(images(ROWS)))[0])
    assert recorded.picks == [None] * LAYERS  # every layer's whole output goes on
    assert recorded.calls(SMALL)[FEATURES].activation.shape == (SMALL, 16 * 2 * 2)
    with pytest.raises(ValueError, match=r"recorded on \[1, 8\] rows, not 3"):
        recorded.calls(3)


def test_containers_called_out_of_order_are_refused_while_profiling_naming_the_layers():
    model = ClassifierFirst()
    chain = find_chain(model, CHAIN)
    hooked = hooks(chain)
    with pytest.raises(
        RuntimeError,
        match=r"it called layer 8 \(classifier\.0\) before layer 0 \(features\.0\); dapple needs forward to run "
        r"the containers \['features', 'classifier'\] in this order",
    ):
        chain_of(model)
    assert hooks(chain) == hooked


def test_plan_auto_takes_the_containers_named_and_lists_them_when_none_is():
    from dapple_lightning.strategy._refusals import check_before_start

    model = VGG()
    chain = check_before_start(model, "32-true", CHAIN, "auto", 2)
    assert chain.paths == tuple(CHAIN) and chain.containers == (model.features, model.classifier)
    with pytest.raises(
        ValueError, match=r"several .*\('features', 'classifier'\).*sequential=\['features', 'classifier'\]"
    ):
        check_before_start(model, "32-true", None, "auto", 2)


# ------------------------------------------------------- real processes: trials, whole fits


AT_BOUNDARY = Plan(
    stages=[{"layers": [0, FEATURES], "replicas": 1}, {"layers": [FEATURES, LAYERS], "replicas": 1}],
    micro_batches=2,
)


def trials_of_chain(rank: int, world_size: int) -> dict:
    """Run a 2-stage plan cut at the container boundary and data parallelism in turns, as plan='auto' does."""
    from dapple_lightning.strategy._auto import AutoSetting, Trials
    from dapple_lightning.strategy._pipelines import PipelineBuilder
    from dapple_lightning.strategy._step import PipelinedSteps

    model, device = VGG(), torch.device("cpu")
    chain = find_chain(model, CHAIN)
    hooked = hooks(chain)
    pipelines = PipelineBuilder(model, rank, device, timedelta(seconds=60))
    setting = AutoSetting(model, rank, device, 1, pipelines, PipelinedSteps(model, device), contextlib.nullcontext)
    dp = Plan.data_parallel(LAYERS, world_size)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with unchanged(model):
        trials = Trials(setting, next(iter(images(12))), chain, optimizer_factory(model))
        try:
            measured = [trials(plan) for plan in (AT_BOUNDARY, dp, AT_BOUNDARY)]
            # The 2-stage plan's stand-ins, last in turn: of the containers' own class and length.
            held = {
                path: (type(getattr(model, path)).__name__, [type(m).__name__ for m in getattr(model, path)])
                for path in CHAIN
            }
        finally:
            trials.close()
    return {
        "measured": measured,
        "held": held,
        "restored": (model.features, model.classifier) == chain.containers and hooks(chain) == hooked,
        "unchanged": all(torch.equal(v, before[k]) for k, v in model.state_dict().items()),
        "meta": [name for name, p in model.named_parameters() if p.is_meta],
    }


def test_trials_run_a_plan_cut_at_the_container_boundary_and_put_the_containers_back():
    results = run_ranks(trials_of_chain, 2)
    features = ["Conv2d", "ReLU", "MaxPool2d", "Conv2d", "ReLU", "MaxPool2d", "Conv2d", "ReLU"]
    classifier = ["Linear", "ReLU", "Dropout", "Linear"]
    assert [r["held"] for r in results] == [
        {"features": ("Sequential", features), "classifier": ("Sequential", ["Placeholder"] * CLASSIFIER)},
        {"features": ("Sequential", ["Placeholder"] * FEATURES), "classifier": ("Sequential", classifier)},
    ]
    for r in results:
        pipe, dp, again = r["measured"]
        assert len(pipe.forward_s) == 2 and all(t > 0 for t in (*pipe.forward_s, *pipe.backward_s))
        assert len(dp.forward_s) == 1 and pipe.step_s > 0 and dp.step_s > 0 and again.step_s > 0
        assert r["restored"] and r["unchanged"] and r["meta"] == []


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    return fit(VGG, tmp_path_factory.mktemp("ref"), loader=images)


@pytest.mark.parametrize("devices", [2, 3])
def test_plan_auto_trains_a_chain_of_containers_like_single_device(devices, tmp_path, single_device):
    strategy = DappleStrategy(start_method="forkserver", sequential=CHAIN)  # plan="auto", the default
    got = fit(VGG, tmp_path, loader=images, devices=devices, strategy=strategy, callbacks=(WritesAutoPlan(tmp_path),))
    assert_same(got, single_device)
    info = json.loads((tmp_path / "auto.json").read_text())
    assert info["report"].startswith(f"dapple plan='auto': profiled {LAYERS} layers")
    assert Plan.coerce(info["plan"]).table() in info["report"]
    assert info["layers"] == NAMES
