"""Encoder-decoder models (Hugging Face's T5): refused at setup under a plan of several stages.

T5's decoder blocks take the encoder's output as a side input (``encoder_hidden_states``), and
side inputs never cross stages: a stage holding decoder blocks would run them on a stand-in.
So a plan that pipelines the layers of a model whose config says ``is_encoder_decoder`` is
refused before any process group starts, naming the reason and the fix; a one-stage plan (every
rank holds every layer) trains as one device does.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader, TensorDataset

from dapple_lightning import DappleStrategy, Plan

from harness import assert_same, fit, quiet_trainer

transformers = pytest.importorskip("transformers")

VOCAB, T, ROWS, BATCH = 32, 6, 24, 6
CHAIN = ["model.encoder.block", "model.decoder.block"]


def pairs(batch_size: int = BATCH) -> DataLoader:
    g = torch.Generator().manual_seed(7)
    source = torch.randint(0, VOCAB, (ROWS, T), generator=g)
    target = torch.randint(0, VOCAB, (ROWS, T), generator=g)
    return DataLoader(TensorDataset(source, target), batch_size=batch_size)


class T5(LightningModule):
    """A tiny T5ForConditionalGeneration built from its config (nothing downloaded), without dropout."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.T5Config(
            vocab_size=VOCAB,
            d_model=16,
            d_kv=4,
            d_ff=32,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=2,
            dropout_rate=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
        )
        torch.manual_seed(0)
        self.model = transformers.T5ForConditionalGeneration(config)

    def training_step(self, batch, batch_idx):
        source, target = batch
        loss = self.model(input_ids=source, labels=target).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_plan_of_several_stages_is_refused_at_setup():
    two = Plan(stages=[{"layers": [0, 2], "replicas": 1}, {"layers": [2, 4], "replicas": 1}], micro_batches=2)
    strategy = DappleStrategy(two, sequential=CHAIN, start_method="forkserver")
    with pytest.raises(  # in the spawned ranks, re-raised here
        Exception,
        match=r"T5ForConditionalGeneration \(model\) is an encoder-decoder model, and a plan of several stages would "
        r"pipeline its layers \['model.encoder.block', 'model.decoder.block'\]: its decoder's blocks take the "
        r"encoder's output as a side input.*Plan.data_parallel\(4, 2\)",
    ):
        quiet_trainer(max_steps=1, devices=2, strategy=strategy).fit(T5(), pairs())


def test_plan_auto_is_refused_at_setup():
    strategy = DappleStrategy("auto", sequential="model.decoder.block", start_method="forkserver")
    with pytest.raises(Exception, match=r"plan='auto', which may choose several stages, would pipeline its layers"):
        quiet_trainer(max_steps=1, devices=2, strategy=strategy).fit(T5(), pairs())


def test_a_one_stage_plan_trains_as_one_device(tmp_path):
    one_stage = Plan.data_parallel(4, 2, micro_batches=2)
    got = fit(T5, tmp_path / "dapple", plan=one_stage, loader=pairs, strategy_kwargs={"sequential": CHAIN})
    assert_same(got, fit(T5, tmp_path / "one", loader=pairs))
