"""Every rank trains on the same batch, even when loading draws random numbers in each process.

Each rank loads the global batch itself. A collate function that masks inputs at random (as
Hugging Face's DataCollatorForLanguageModeling masks tokens) draws different masks on
different ranks, so stage 0's inputs and the last stage's labels would no longer belong
together. The strategy detects the difference and trains every rank on rank 0's batch.
"""

from __future__ import annotations

import torch
from lightning.pytorch import seed_everything
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from dapple_lightning import DappleStrategy, Plan
from dapple_lightning.strategy._batch import fingerprint

import models
from harness import quiet_trainer, read_metrics

PLAN_2_1 = Plan(stages=[{"layers": [0, 4], "replicas": 2}, {"layers": [4, 7], "replicas": 1}], micro_batches=3)


def masking_collate(samples):
    """Zero 30% of the inputs at random; the label says how many were masked (so it depends on the draw)."""
    x = torch.stack([s[0] for s in samples])
    y = torch.stack([s[1] for s in samples])
    mask = torch.rand(x.shape) < 0.3
    return x.masked_fill(mask, 0.0), y + 0.1 * mask.sum(dim=1, keepdim=True)


def losses(tmp_path, **placement) -> list[float]:
    model = models.MLP()
    # Lightning seeds each loader worker from the seed, the worker's index and the *global rank*:
    # the masks differ from rank to rank, and rank 0's are single-device Lightning's.
    seed_everything(7, workers=True)
    loader = DataLoader(models.dataset(), batch_size=models.BATCH, collate_fn=masking_collate, num_workers=1)
    logger = CSVLogger(tmp_path, name="run", version=0)
    trainer = quiet_trainer(max_steps=8, logger=logger, log_every_n_steps=1, **placement)
    trainer.fit(model, loader)
    return read_metrics(tmp_path / "run" / "version_0" / "metrics.csv")["train_loss"]


def test_random_collation_trains_like_one_device(tmp_path):
    want = losses(tmp_path / "single", devices=1)
    got = losses(tmp_path / "dapple", devices=3, strategy=DappleStrategy(PLAN_2_1, start_method="forkserver"))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-7)


def test_the_fingerprint_tells_batches_apart():
    cpu = torch.device("cpu")
    x = torch.randn(6, 3)
    batch = {"x": x, "y": torch.arange(6), "ids": ["a", "b"]}
    same = {"x": x.clone(), "y": torch.arange(6), "ids": ["a", "b"]}
    assert torch.equal(fingerprint(batch, cpu), fingerprint(same, cpu))
    others = [
        {**batch, "x": x[[1, 0, 2, 3, 4, 5]]},  # rows reordered
        {**batch, "x": x.reshape(3, 6)},  # same values, another shape
        {**batch, "ids": ["a", "c"]},  # a non-tensor leaf
        {**batch, "y": torch.arange(6).double()},  # another dtype
        {"x": x, "y": torch.arange(6)},  # another structure
    ]
    for other in others:
        assert not torch.equal(fingerprint(batch, cpu), fingerprint(other, cpu)), other
