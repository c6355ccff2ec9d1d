"""Every rank trains on the same batch, even when loading draws random numbers in each process.

Each rank loads the global batch itself. A collate function that masks inputs at random (as
Hugging Face's DataCollatorForLanguageModeling masks tokens) draws different masks on
different ranks, so stage 0's inputs and the last stage's labels would no longer belong
together. The strategy detects the difference (on the host, before anything moves) and trains
every rank on rank 0's batch. The batch stays on the host, where callbacks see all of it; each
rank moves only its micro-batches' rows to its device, through the module's transfer hooks.
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
    """Writes, per rank, the rows of what the transfer hook moves to the device, and of the batch
    ``on_train_batch_end`` sees, with the step they belong to."""

    def __init__(self, record: Path) -> None:
        super().__init__()
        self.record = str(record)

    def _write(self, what: str, batch) -> None:
        with open(Path(self.record) / f"rank{self.global_rank}.jsonl", "a") as f:
            f.write(json.dumps([what, self.trainer.global_step, [len(t) for t in batch]]) + "\n")

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        self._write("moved", batch)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self._write("seen", batch)


def recorded(record: Path, rank: int, what: str) -> dict[int, list[list[int]]]:
    """By step: the rows of each record of kind ``what``."""
    by_step: dict[int, list[list[int]]] = {}
    for line in (record / f"rank{rank}.jsonl").read_text().splitlines():
        kind, step, rows = json.loads(line)
        if kind == what:
            by_step.setdefault(step, []).append(rows)
    return by_step


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
    whole = models.BATCH
    for rank, share in ((0, whole // 2), (1, whole // 2), (2, whole)):  # stage 0 has 2 replicas, stage 1 one
        # Callbacks see the whole batch (x and y), as on one device ...
        assert recorded(record, rank, "seen") == {step: [[whole, whole]] for step in range(1, 9)}, rank  # after it
        # ... while each rank moved to its device only the rows it computes: its replica's share, in
        # one transfer per micro-batch of the plan's 3.
        moved = recorded(record, rank, "moved")
        assert sorted(moved) == list(range(8)), rank
        for pieces in moved.values():
            assert len(pieces) == 3 and all(x == y for x, y in pieces), (rank, pieces)
            assert sum(x for x, _ in pieces) == share, (rank, pieces)


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
        {**batch, "x": x.index_put((torch.tensor([4]), torch.tensor([1])), x[4, 1] * (1 + 2**-20))},  # one value
        {**batch, "x": x[:, [2, 1, 0]]},  # values reordered within the rows
        {**batch, "y": torch.arange(6).masked_fill(torch.arange(6) == 5, 0)},  # one token masked
    ]
    for other in others:
        assert not torch.equal(fingerprint(batch, cpu), fingerprint(other, cpu)), other
    square = torch.randn(4, 4)
    assert not torch.equal(fingerprint(square, cpu), fingerprint(square.T.contiguous(), cpu))


def test_the_fingerprint_tells_apart_one_changed_value_in_every_dtype():
    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int16, torch.uint8, torch.complex64):
        x = (torch.randn(5, 7, generator=g) * 50).to(dtype)
        changed = x.clone()
        changed[3, 2] = changed[3, 2] + 1
        assert not torch.equal(fingerprint(x, cpu), fingerprint(changed, cpu)), dtype
        assert torch.equal(fingerprint(x, cpu), fingerprint(x.clone(), cpu)), dtype
    mask = torch.rand(5, 7, generator=g) > 0.5
    flipped = mask.clone()
    flipped[0, 0] = ~flipped[0, 0]
    assert not torch.equal(fingerprint(mask, cpu), fingerprint(flipped, cpu))
    strided = torch.randn(7, 5, generator=g).T  # laid out by a copy of its own, same values
    assert torch.equal(fingerprint(strided, cpu), fingerprint(strided.contiguous(), cpu))


def test_the_fingerprint_makes_no_copy_of_the_batch():
    """Every step fingerprints the whole batch: what it allocates stays far below the batch's size."""
    cpu = torch.device("cpu")
    batch = {"x": torch.randn(256, 64, 16), "ids": torch.randint(0, 50_000, (256, 512))}
    batch_bytes = sum(t.nbytes for t in batch.values())
    with torch.profiler.profile(profile_memory=True) as prof:
        fingerprint(batch, cpu)
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < largest <= batch_bytes // 32, (largest, batch_bytes)


def test_the_step_batch_is_pinned_once_on_cuda_only():
    import pytest

    from dapple_lightning.strategy._step import PipelinedSteps

    batch = {"x": torch.randn(4, 3), "ids": ["a", "b"]}
    on_cpu = PipelinedSteps(torch.nn.Linear(1, 1), torch.device("cpu"))
    on_cpu.dataloader_idx = 0
    assert on_cpu.pinned(batch) is batch  # nothing to gain: used as it is
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    steps = PipelinedSteps(torch.nn.Linear(1, 1), torch.device("cuda"))
    assert steps.pinned(batch) is batch  # the batch was moved already: no loader index set
    steps.dataloader_idx = 0
    pinned = steps.pinned(batch)
    assert pinned["x"].is_pinned() and pinned["x"][1:3].is_pinned() and pinned["ids"] == ["a", "b"]
    assert torch.equal(pinned["x"], batch["x"]) and not batch["x"].is_pinned()
