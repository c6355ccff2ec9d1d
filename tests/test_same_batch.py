"""Every rank trains on the same batch, even when loading draws random numbers in each process.

Each rank loads the global batch itself. A collate function that masks inputs at random (as
Hugging Face's DataCollatorForLanguageModeling masks tokens) draws different masks on
different ranks, so stage 0's inputs and the last stage's labels would no longer belong
together. The strategy detects the difference (on the host, before anything moves) and trains
every rank on rank 0's batch, which every rank moves to its device whole.
"""

from __future__ import annotations

import json
from pathlib import Path

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


class RecordsTransfers(models.MLP):
    """Writes, per rank, the rows of each batch Lightning's transfer hook moves to the device."""

    def __init__(self, record: Path) -> None:
        super().__init__()
        self.record = str(record)

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        with open(Path(self.record) / f"rank{self.global_rank}.jsonl", "a") as f:
            f.write(json.dumps([len(t) for t in batch]) + "\n")
        return super().transfer_batch_to_device(batch, device, dataloader_idx)


def moved_rows(record: Path, rank: int) -> list[list[int]]:
    return [json.loads(line) for line in (record / f"rank{rank}.jsonl").read_text().splitlines()]


def losses(tmp_path, model=None, **placement) -> list[float]:
    model = model or models.MLP()
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
    (record := tmp_path / "moved").mkdir()
    strategy = DappleStrategy(PLAN_2_1, start_method="forkserver")
    got = losses(tmp_path / "dapple", RecordsTransfers(record), devices=3, strategy=strategy)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-7)
    # Every rank moved the whole batch (x and y): its hooks and callbacks see what one device sees.
    whole = models.BATCH
    assert moved_rows(record, 0) == moved_rows(record, 1) == moved_rows(record, 2) == [[whole, whole]] * 8


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
