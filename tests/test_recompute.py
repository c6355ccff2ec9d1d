"""A stage with ``recompute: true`` trains as on one device and holds less at its peak."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dapple_lightning import Plan
from dapple_lightning.planner import live_bytes
from dapple_lightning.runtime import StageModule

import models
from harness import assert_same, fit

ROWS, WIDTH = 256, 32


def block() -> nn.Module:
    # Saves its input and its 4x wider hidden activation: five times what it takes in.
    return nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.Tanh(), nn.Linear(4 * WIDTH, WIDTH))


class Wide(models.MLP):
    """Blocks whose saved activations (128 rows per micro-batch) outweigh their weights."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            nn.Linear(models.IN, WIDTH), block(), block(), block(), nn.Linear(WIDTH, models.OUT)
        )


def wide_loader(batch_size: int) -> DataLoader:
    g = torch.Generator().manual_seed(5)
    data = TensorDataset(torch.randn(2 * ROWS, models.IN, generator=g), torch.randn(2 * ROWS, models.OUT, generator=g))
    return DataLoader(data, batch_size=batch_size, shuffle=False)


class Peak(Callback):
    """Each rank's live-bytes peak over training, written to ``folder/peak<rank>.json``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_start(self, trainer, pl_module) -> None:
        self.tracker = live_bytes()
        self.tracker.__enter__()

    def on_train_end(self, trainer, pl_module) -> None:
        self.tracker.__exit__(None, None, None)
        (self.folder / f"peak{trainer.global_rank}.json").write_text(json.dumps(self.tracker.peak))


def plan(recompute: bool) -> Plan:
    stages = [{"layers": [0, 4], "recompute": recompute}, {"layers": [4, 5]}]
    return Plan.coerce({"micro_batches": 2, "stages": stages})


def test_a_recomputing_stage_matches_one_device_and_holds_less(tmp_path):
    runs = {}
    for name, p in (("recompute", plan(True)), ("keep", plan(False))):
        folder = tmp_path / name
        folder.mkdir()
        got = fit(Wide, folder, plan=p, batch_size=ROWS, loader=wide_loader, max_steps=2, callbacks=(Peak(folder),))
        peaks = [json.loads((folder / f"peak{rank}.json").read_text()) for rank in range(2)]
        runs[name] = got, peaks
    single = fit(Wide, tmp_path / "single", batch_size=ROWS, loader=wide_loader, max_steps=2)
    assert_same(runs["recompute"][0], single)
    recompute, keep = runs["recompute"][1], runs["keep"][1]
    # Stage 0 keeps two micro-batches. Recomputing, each keeps its blocks' inputs (16 KiB each),
    # not the 80 KiB each block saves (one block's come back during its backward): at least one
    # micro-batch's 3 x 64 KiB less.
    assert recompute[0] < keep[0] - 3 * 64 * 1024
    assert recompute[1] == keep[1]


def test_recompute_refuses_what_it_cannot_recompute_faithfully():
    with pytest.raises(ValueError, match=r"layer '1' .*\(BatchNorm1d\).* update twice"):
        StageModule([("0", nn.Linear(2, 2)), ("1", nn.BatchNorm1d(2))], recompute=True)
    with pytest.raises(ValueError, match=r"needs the pipelined layers in one nn\.Sequential"):
        StageModule([("0", nn.Linear(2, 2))], blocks=3, recompute=True)
    # Without autograd recording (validation, prediction) there is nothing to recompute.
    stage = StageModule([("0", nn.Linear(2, 2))], recompute=True)
    with torch.no_grad():
        assert stage(torch.ones(1, 2)).grad_fn is None
