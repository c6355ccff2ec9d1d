"""Layers from a chain of containers with the user's code between them (torchvision's VGG layout).

A plan's layers are the children of ``features`` then those of ``classifier``; pooling and
flatten run between them as written. The paper's own plan shape, every convolution on most
devices and the classifier on one, is the first test. Each run is compared with single-device
Lightning on the same batches (tests/harness.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from dapple_lightning import Plan
from dapple_lightning.runtime import Placeholder, StageCall, StageExit
from dapple_lightning.surgery import Cut, find_chain, split_ties

from harness import assert_same, fit

ROWS, CLASSES, SIZE = 48, 10, 16
FEATURES, CLASSIFIER = 8, 4  # layers in each container
LAYERS = FEATURES + CLASSIFIER
CHAIN = ["features", "classifier"]


def images(batch_size: int) -> DataLoader:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(ROWS, 3, SIZE, SIZE, generator=g)
    y = torch.randint(0, CLASSES, (ROWS,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def _count(layer: nn.Module, args: tuple) -> None:
    layer.calls += 1


class VGG(LightningModule):
    """torchvision's VGG: a ``features`` Sequential, adaptive pooling and ``torch.flatten`` in
    forward, a ``classifier`` Sequential (dropout off, so one device and the pipeline draw alike)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        conv = lambda i, o: nn.Conv2d(i, o, kernel_size=3, padding=1)  # noqa: E731
        self.features = nn.Sequential(
            conv(3, 8), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            conv(8, 16), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            conv(16, 16), nn.ReLU(inplace=True),
        )  # fmt: skip
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(
            nn.Linear(16 * 2 * 2, 32), nn.ReLU(inplace=True), nn.Dropout(p=0.0), nn.Linear(32, CLASSES)
        )
        for layer in [*self.features, *self.classifier]:
            layer.calls = 0  # counted on every rank, read by CountCalls
            layer.register_forward_pre_hook(_count)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class ClassifierFirst(VGG):
    """Runs the containers in the other order than the plan names them."""

    def forward(self, x):
        return self.features(self.classifier(x))


def plan(*stages: tuple[tuple[int, int], int], micro_batches: int = 2) -> Plan:
    return Plan(stages=[{"layers": list(r), "replicas": n} for r, n in stages], micro_batches=micro_batches)


CONVS_THEN_CLASSIFIER = plan(((0, FEATURES), 2), ((FEATURES, LAYERS), 1))  # the paper's VGG shape
ACROSS = plan(((0, 4), 1), ((4, 10), 1), ((10, LAYERS), 1), micro_batches=3)  # stage 1 spans both containers


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    cache = {}

    def get(val=False):
        if val not in cache:
            cache[val] = fit(VGG, tmp_path_factory.mktemp("ref"), val=val, loader=images)
        return cache[val]

    return get


# ------------------------------------------------------------------ one process: the surgery


def test_nested_containers_are_found_when_only_one_is_outermost_and_listed_otherwise():
    from test_hf_llama import CONTAINER, Llama
    from test_modulelist import HFGPT2, TinyGPT

    assert find_chain(HFGPT2()).paths == ("model.transformer.h",)
    assert find_chain(Llama()).paths == (CONTAINER,)
    assert find_chain(TinyGPT()).paths == ("blocks",)  # not the MLP Sequentials inside its blocks
    wrapped = nn.Module()
    wrapped.net = VGG()
    with pytest.raises(ValueError, match=r"several .*sequential=\['net\.features', 'net\.classifier'\]"):
        find_chain(wrapped)


def test_the_chain_indexes_the_children_of_each_container_in_turn():
    model = VGG()
    chain = find_chain(model, CHAIN)
    assert len(chain) == LAYERS and chain.paths == ("features", "classifier")
    names = [name for name, _ in chain.named_layers()]
    assert names[:2] == ["features.0", "features.1"] and names[FEATURES] == "classifier.0"
    with pytest.raises(ValueError, match=r"several .*sequential=\['features', 'classifier'\]"):
        find_chain(model)
    with pytest.raises(ValueError, match=r"'features' and 'features\.0', which overlap"):
        find_chain(model, ["features", "features.0"])
    with pytest.raises(TypeError, match="'avgpool' is a AdaptiveAvgPool2d"):
        find_chain(model, ["features", "avgpool"])


def test_a_cut_across_containers_keeps_their_classes_names_and_keys_and_restores_them():
    model = VGG()
    features, classifier = model.features, model.classifier
    keys = list(model.state_dict())
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    cut = Cut.apply(model, find_chain(model, CHAIN), ACROSS, rank=1)  # layers 4..9
    assert type(model.features) is nn.Sequential and type(model.classifier) is nn.Sequential
    assert [type(m) is Placeholder for m in model.features] == [True] * 4 + [False] * 4
    assert [type(m) is Placeholder for m in model.classifier] == [False] * 2 + [True] * 2
    assert model.features[3].entry and not model.features[2].entry
    assert model.features[5] is features[5] and model.classifier[0] is classifier[0]
    assert [k for k in keys if k in model.state_dict()] == list(model.state_dict())
    assert set(model.state_dict()) == {
        "features.6.weight", "features.6.bias", "classifier.0.weight", "classifier.0.bias"
    }  # fmt: skip
    assert all(p.is_meta for p in features[0].parameters()) and all(p.is_meta for p in classifier[3].parameters())
    with cut.whole():
        assert model.features is features and model.classifier is classifier
    cut.restore(weights, torch.device("cpu"))
    assert model.features is features and model.classifier is classifier
    assert list(model.state_dict()) == keys
    for key, value in model.state_dict().items():
        assert torch.equal(value, weights[key]), key


def test_the_code_between_containers_runs_on_what_the_stage_received():
    torch.manual_seed(1)
    model, reference = VGG(), VGG()
    cut = Cut.apply(model, find_chain(model, CHAIN), CONVS_THEN_CLASSIFIER, rank=2)  # the classifier
    received = torch.randn(5, 16, 4, 4)  # what the features' last layer made on another rank
    call = StageCall(1, first=False, last=True, blocks=LAYERS, received=[received])
    with cut.stage.calling(call):
        got = model(torch.randn(5, 3, SIZE, SIZE))  # the images themselves only pass placeholders
    want = reference.classifier(torch.flatten(reference.avgpool(received), 1))
    torch.testing.assert_close(got, want)
    assert call.inputs[0] is received and call.next_block == LAYERS
    assert [m.calls for m in cut.chain.containers[0]] == [0] * FEATURES
    assert [m.calls for m in cut.chain.containers[1]] == [1] * CLASSIFIER


def test_a_stage_leaves_after_its_last_layer_even_in_the_first_container():
    model = VGG()
    cut = Cut.apply(model, find_chain(model, CHAIN), ACROSS, rank=0)
    call = StageCall(0, first=True, last=False, blocks=LAYERS)
    x = torch.randn(2, 3, SIZE, SIZE)
    with cut.stage.calling(call), pytest.raises(StageExit):
        model(x)
    assert call.inputs[0] is x and call.outputs[0].shape == (2, 16, 8, 8) and call.next_block == 4


def test_containers_run_in_another_order_than_named_are_refused_by_path():
    model = ClassifierFirst()
    cut = Cut.apply(model, find_chain(model, CHAIN), CONVS_THEN_CLASSIFIER, rank=2)
    call = StageCall(1, first=False, last=True, blocks=LAYERS, received=[torch.randn(2, 64)], names=cut.stage.names)
    with (
        cut.stage.calling(call),
        pytest.raises(RuntimeError, match=r"layer 'classifier\.0' was called before layer 'features\.0'.*in the order"),
    ):
        model(torch.randn(2, 3, SIZE, SIZE))


VOCAB, WIDTH = 16, 8


class TiedLM(LightningModule):
    """A language model whose embedding and head share one weight, both inside the pipelined
    Sequential (as a model written for a single Sequential would have them)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        embed, head = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)
        head.weight = embed.weight
        self.layers = nn.Sequential(embed, nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), head)

    def training_step(self, batch, batch_idx):
        idx, target = batch
        loss = F.cross_entropy(self.layers(idx).reshape(-1, VOCAB), target.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)


class TiedOutside(TiedLM):
    """The Sequential's first layer shares its weight with a head outside the containers."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = self.layers[:4]
        self.out = nn.Linear(WIDTH, VOCAB, bias=False)
        self.out.weight = self.layers[0].weight

    def training_step(self, batch, batch_idx):
        idx, target = batch
        loss = F.cross_entropy(self.out(self.layers(idx)).reshape(-1, VOCAB), target.reshape(-1))
        self.log("train_loss", loss)
        return loss


def words(batch_size: int) -> DataLoader:
    g = torch.Generator().manual_seed(5)
    seq = torch.randint(0, VOCAB, (ROWS, 7), generator=g)
    return DataLoader(TensorDataset(seq[:, :-1], seq[:, 1:]), batch_size=batch_size, shuffle=False)


def test_the_parameters_a_plan_splits_are_found_in_the_models_order():
    model = TiedLM()
    chain = find_chain(model)
    weight = model.layers[0].weight
    assert split_ties(model, chain, plan(((0, 2), 1), ((2, 5), 1))) == [weight]
    assert split_ties(model, chain, Plan.data_parallel(5, 2)) == []
    outside = TiedOutside()
    assert split_ties(outside, find_chain(outside, "layers"), Plan.data_parallel(4, 2)) == [outside.out.weight]


def test_a_split_tie_stays_one_parameter_on_every_rank():
    model = TiedLM()
    weight = model.layers[0].weight
    cut = Cut.apply(model, find_chain(model), plan(((0, 2), 1), ((2, 5), 1)), rank=1)
    assert cut.stage.shared == (weight,) and model.layers[-1].weight is weight and not weight.is_meta
    assert cut.chain.containers[0][0].weight is weight  # the other stage's layer keeps it too
    assert all(p.is_meta for p in cut.chain.containers[0][1].parameters())


@pytest.mark.parametrize(
    ("model_cls", "p"),
    [
        (TiedLM, plan(((0, 2), 1), ((2, 5), 1))),
        (TiedLM, plan(((0, 1), 2), ((1, 3), 1), ((3, 5), 1), micro_batches=3)),
        (TiedOutside, plan(((0, 2), 1), ((2, 4), 2))),
    ],
    ids=["embed|head", "embed|middle|head, 2:1:1", "layer|outside, 1:2"],
)
def test_tied_parameters_split_by_the_plan_train_like_one_device(model_cls, p, tmp_path):
    options = {"loader": words, "gradient_clip_val": 0.5}
    want = fit(model_cls, tmp_path / "one", **options)
    got = fit(model_cls, tmp_path / "dapple", plan=p, strategy_kwargs={"sequential": "layers"}, **options)
    assert_same(got, want)


# ------------------------------------------------------------ real processes vs one device


class CountCalls(Callback):
    """Writes, on every rank, how often each layer's own forward ran there."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        layers = [*pl_module.features, *pl_module.classifier]  # placeholders read their meta layer's count
        (self.folder / f"calls{trainer.global_rank}.json").write_text(json.dumps([m.calls for m in layers]))


@pytest.mark.parametrize(("shape", "p"), [("2:1", CONVS_THEN_CLASSIFIER), ("1:1:1", ACROSS)], ids=["2:1", "1:1:1"])
def test_vgg_matches_single_device_and_each_layer_runs_only_on_its_stages_ranks(shape, p, tmp_path, single_device):
    val = shape == "1:1:1"
    got = fit(
        VGG,
        tmp_path,
        plan=p,
        val=val,
        loader=images,
        callbacks=(CountCalls(tmp_path),),
        strategy_kwargs={"sequential": CHAIN},
    )
    assert_same(got, single_device(val=val))
    per_rank = [json.loads((tmp_path / f"calls{rank}.json").read_text()) for rank in range(p.world_size)]
    each = 4 * p.micro_batches  # steps x micro-batches
    for rank, calls in enumerate(per_rank):
        stage = p.stages[p.stage_of(rank)]
        if val:  # validation adds forwards: each layer runs, on its stage's ranks only
            assert [c > 0 for c in calls] == [stage.start <= i < stage.end for i in range(LAYERS)], (rank, calls)
        else:
            assert calls == [each if stage.start <= i < stage.end else 0 for i in range(LAYERS)], (rank, calls)


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_a_checkpoint_saved_under_a_chain_plan_loads_on_one_device(state_dict_type, tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from dapple_lightning.strategy import consolidate_checkpoint

    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    _, trained = fit(
        VGG,
        tmp_path,
        plan=ACROSS,
        loader=images,
        max_steps=2,
        enable_checkpointing=True,
        callbacks=(saver,),
        strategy_kwargs={"sequential": CHAIN, "state_dict_type": state_dict_type},
    )
    path = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    if state_dict_type == "sharded":
        path = consolidate_checkpoint(path, tmp_path / "whole.ckpt")
    state = torch.load(path, weights_only=False)["state_dict"]
    assert list(state) == list(VGG().state_dict())
    fresh = VGG()
    fresh.load_state_dict(state)
    for key, value in fresh.state_dict().items():
        torch.testing.assert_close(value, trained[key], rtol=0, atol=0, msg=key)
