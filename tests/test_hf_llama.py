"""Hugging Face's Llama, pipelined through the ModuleList of its decoder layers (``model.model.layers``).

``LlamaModel.forward`` loops over ``self.layers[: config.num_hidden_layers]`` and passes every
layer keyword side inputs computed on every rank: the causal mask, ``position_embeddings`` (a
``(cos, sin)`` tuple), the position ids and a ``DynamicCache`` (``use_cache`` is on in the config).
Only the hidden states cross stages. Each run is compared with single-device Lightning on the
same batches (tests/harness.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dapple_lightning import Plan
from dapple_lightning.runtime import StageCall, StageExit
from dapple_lightning.surgery import Chain, Cut, find_container

from harness import assert_same, fit

transformers = pytest.importorskip("transformers")

VOCAB, T, LAYERS, ROWS, BATCH = 64, 8, 4, 48, 12
CONTAINER = "model.model.layers"


def tokens(batch_size: int = BATCH) -> DataLoader:
    """Token sequences, the same on every rank (the model shifts its labels itself)."""
    g = torch.Generator().manual_seed(7)
    return DataLoader(TensorDataset(torch.randint(0, VOCAB, (ROWS, T), generator=g)), batch_size=batch_size)


def padded_tokens(batch_size: int = BATCH) -> DataLoader:
    """Token sequences with an attention mask: every other row ends in two padding tokens (label -100).

    Each micro-batch of an even number of rows holds as many labelled tokens as any other, so the mean
    of the micro-batches' mean losses is the batch's mean loss, as on one device.
    """
    (ids,) = tokens().dataset.tensors
    mask = torch.ones_like(ids)
    mask[1::2, -2:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return DataLoader(TensorDataset(ids, mask, labels), batch_size=batch_size)


def llama() -> nn.Module:
    """A tiny LlamaForCausalLM built from its config: nothing is downloaded."""
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


class Counter:
    """A forward hook that counts the calls of the module it is on (picklable, for spawned ranks)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, module: nn.Module, args: tuple, output: object) -> None:
        self.calls += 1


class Llama(LightningModule):
    """An ordinary LightningModule around the Hugging Face model: nothing in it is for dapple."""

    def __init__(self) -> None:
        super().__init__()
        self.model = llama()
        # The MLP of each decoder layer computes only where that layer really runs.
        self.counters = [Counter() for _ in self.model.model.layers]
        for layer, counter in zip(self.model.model.layers, self.counters):
            layer.mlp.register_forward_hook(counter)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self.model(input_ids=x, labels=x).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        (x,) = batch
        self.log("val_loss", self.model(input_ids=x, labels=x).loss)

    def configure_optimizers(self):
        # SGD, not Adam: Adam's first steps divide tiny gradients by their own size, which would turn
        # float rounding (a micro-batch's sum in another order) into visible weight differences.
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class PaddedLlama(Llama):
    """The attention mask is a side input of every decoder layer, built on every rank from its rows."""

    def training_step(self, batch, batch_idx):
        x, mask, labels = batch
        loss = self.model(input_ids=x, attention_mask=mask, labels=labels).loss
        self.log("train_loss", loss)
        return loss


def plan(*stages: tuple[tuple[int, int], int], micro_batches: int) -> Plan:
    return Plan(stages=[{"layers": list(r), "replicas": n} for r, n in stages], micro_batches=micro_batches)


TWO_ONE = plan(((0, 3), 2), ((3, 4), 1), micro_batches=2)
ONE_ONE = plan(((0, 2), 1), ((2, 4), 1), micro_batches=3)
THREE = plan(((0, 1), 1), ((1, 3), 1), ((3, 4), 1), micro_batches=2)


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    cache = {}

    def get(model_cls=Llama, loader=tokens, val: bool = False):
        if (model_cls, val) not in cache:
            cache[model_cls, val] = fit(model_cls, tmp_path_factory.mktemp("ref"), val=val, loader=loader)
        return cache[model_cls, val]

    return get


def test_the_decoder_layers_are_the_container_and_a_stage_runs_on_what_it_received():
    model, reference = llama(), llama()
    name, container = find_container(model, "model.layers")  # the Hugging Face model itself
    cut = Cut.apply(model, Chain.of(name, container), ONE_ONE, rank=1)
    x, received = torch.randint(0, VOCAB, (2, T)), torch.randn(2, T, 32)
    call = StageCall(1, first=False, last=True, blocks=LAYERS, received=[received])
    with cut.stage.calling(call):
        got = model(input_ids=x, labels=x).loss

    inner = reference.model
    positions = torch.arange(T)[None]
    cos_sin = inner.rotary_emb(received, position_ids=positions)
    h = received
    for layer in inner.layers[2:]:
        h = layer(h, attention_mask=None, position_embeddings=cos_sin, position_ids=positions)
    logits = reference.lm_head(inner.norm(h))
    want = reference.loss_function(logits, x, vocab_size=VOCAB)
    assert call.inputs[0] is received and call.next_block == LAYERS
    torch.testing.assert_close(got, want)


def test_a_middle_stage_sends_only_the_hidden_states_and_keeps_the_cache_and_rotary_tuple_local():
    model = llama()
    name, container = find_container(model, "model.layers")
    cut = Cut.apply(model, Chain.of(name, container), THREE, rank=1)  # layers 1 and 2
    side_inputs = []
    container[1].register_forward_pre_hook(lambda _, args, kwargs: side_inputs.append(kwargs), with_kwargs=True)
    received = torch.randn(2, T, 32)
    call = StageCall(1, first=False, last=False, blocks=LAYERS, received=[received])
    x = torch.randint(0, VOCAB, (2, T))
    with cut.stage.calling(call), pytest.raises(StageExit):
        model(input_ids=x, labels=x)
    (kwargs,) = side_inputs
    assert isinstance(kwargs["cache"], transformers.DynamicCache)  # use_cache is on, as the config says
    cos, sin = kwargs["position_embeddings"]
    assert cos.shape == sin.shape == (1, T, 32 // 4)
    assert len(call.outputs) == 1 and not call.output_tuple and call.outputs[0].shape == (2, T, 32)
    assert call.next_block == 3


@pytest.mark.parametrize(
    ("shape", "p", "val"), [("2:1", TWO_ONE, False), ("1:1", ONE_ONE, True), ("1:1:1", THREE, False)]
)
def test_llama_matches_single_device(shape, p, val, tmp_path, single_device):
    got = fit(Llama, tmp_path, plan=p, val=val, loader=tokens, strategy_kwargs={"sequential": CONTAINER})
    assert_same(got, single_device(val=val))


@pytest.mark.parametrize("lazy_batch", [None, True], ids=["as-on-the-cpu", "batch-moved-on-first-read"])
def test_a_padding_mask_and_ignored_labels_match_single_device(lazy_batch, tmp_path, single_device):
    """Also with the batch's tensors moved on their first read, as on CUDA (strategy/_batch_leaves.py):
    the mask reaches transformers' mask builders as a tensor that copies itself when read."""
    strategy = {"sequential": CONTAINER, "lazy_batch": lazy_batch}
    got = fit(PaddedLlama, tmp_path, plan=ONE_ONE, loader=padded_tokens, strategy_kwargs=strategy)
    assert_same(got, single_device(PaddedLlama, padded_tokens))


class CountCalls(Callback):
    """Writes, on every rank, how often each decoder layer's MLP ran there."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        calls = [counter.calls for counter in pl_module.counters]
        (self.folder / f"calls{trainer.global_rank}.json").write_text(json.dumps(calls))


def test_each_decoder_layer_runs_only_on_its_stages_ranks(tmp_path):
    strategy = {"sequential": CONTAINER}
    fit(
        Llama,
        tmp_path,
        plan=TWO_ONE,
        loader=tokens,
        max_steps=2,
        callbacks=(CountCalls(tmp_path),),
        strategy_kwargs=strategy,
    )
    per_rank = [json.loads((tmp_path / f"calls{rank}.json").read_text()) for rank in range(3)]
    # Two steps of two micro-batches; each replica of the first stage takes half of every micro-batch.
    each = 2 * TWO_ONE.micro_batches
    assert per_rank == [[each] * 3 + [0], [each] * 3 + [0], [0, 0, 0, each]]
