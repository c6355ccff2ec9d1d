"""Every rank trains on the same batch, even when loading draws random numbers in each process.

Each rank loads the global batch itself. A collate function that masks inputs at random (as
Hugging Face's DataCollatorForLanguageModeling masks tokens) draws different masks on
different ranks, so stage 0's inputs and the last stage's labels would no longer belong
together. The strategy detects the difference (on the host, before anything moves) and trains
every rank on rank 0's batch, of which each rank moves to its device only the rows it reads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import seed_everything
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from dapple_lightning import DappleStrategy, Plan
from dapple_lightning.microbatch import Rows
from dapple_lightning.strategy._batch import RankBatches, fingerprint

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
    # Each replica of stage 0 moved only its half of each micro-batch (x and y), stage 1's one rank all of it.
    half, whole = models.BATCH // 2, models.BATCH
    assert moved_rows(record, 0) == moved_rows(record, 1) == [[half, half]] * 8
    assert moved_rows(record, 2) == [[whole, whole]] * 8


class Held:
    """A pipeline's rows as a rank's batches ask for them."""

    def __init__(self, rows: list[Rows]) -> None:
        self.held = rows

    def rows(self, batch_rows: int) -> list[Rows]:
        assert batch_rows == 10
        return self.held


def test_a_rank_holds_its_slice_of_every_micro_batch_and_finds_it():
    x = torch.arange(10).reshape(10, 1)
    batch = {"x": x, "names": [f"s{i}" for i in range(10)], "tag": "t"}
    held = [Rows(2, 4), Rows(6, 7)]  # e.g. replica 1 of 2 in micro-batches [0, 4) and [4, 7)
    batches = RankBatches()
    mine = batches.keep(batches.narrow(batch, Held(held), None))
    assert mine["x"].flatten().tolist() == [2, 3, 6] and mine["names"] == ["s2", "s3", "s6"] and mine["tag"] == "t"
    rows = batches.rows_of(mine)
    assert rows is not None and rows.total == 10
    assert (rows.local(Rows(2, 4)), rows.local(Rows(6, 7)), rows.local(Rows(3, 4))) == (
        Rows(0, 2),
        Rows(2, 3),
        Rows(1, 2),
    )
    assert batches.rows_of(batch) is None  # a batch it did not cut is whole
    whole = batches.keep(batches.narrow(batch, Held([Rows(0, 5), Rows(5, 10)]), None))
    assert whole is batch and batches.rows_of(whole) is None


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rows_cut_from_a_pinned_batch_stay_pinned():
    batch = [torch.randn(10, 2).pin_memory(), torch.arange(10).pin_memory()]
    mine = RankBatches().narrow(batch, Held([Rows(2, 4), Rows(6, 7)]), None)
    assert [len(t) for t in mine] == [3, 3] and all(t.is_pinned() for t in mine)
