"""Batches, predictions and logged values that are not plain tensors and means, under dapple on
real processes, each against single-device Lightning."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from dapple_lightning import DappleStrategy, Plan

import models
from harness import assert_close_tree, assert_same, fit, quiet_trainer

FIRST_REPLICATED = Plan(stages=[{"layers": [0, 4], "replicas": 2}, {"layers": [4, 7], "replicas": 1}], micro_batches=3)
LAST_REPLICATED = Plan(stages=[{"layers": [0, 4], "replicas": 1}, {"layers": [4, 7], "replicas": 2}], micro_batches=3)


def test_batch_encodings_with_per_sample_lists_train_like_single_device(tmp_path):
    pytest.importorskip("transformers")
    want = fit(models.RecordsMLP, tmp_path / "single", val=True)
    got = fit(models.RecordsMLP, tmp_path / "dapple", plan=FIRST_REPLICATED, val=True)
    assert_same(got, want)


class WritePredictions(Callback):
    """Each rank saves what predict_step gave it for each batch."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        torch.save(outputs, self.folder / f"rank{trainer.global_rank}-batch{batch_idx}.pt")


def test_predictions_of_any_pytree_come_back_in_batch_order_on_every_rank(tmp_path):
    pytest.importorskip("transformers")
    # 16 rows: micro-batches of 6, 5 and 5 rows, cut 3+3, 3+2 and 3+2 over the last stage's replicas.
    want = quiet_trainer(devices=1).predict(models.RecordsMLP(), models.loader(16))
    assert set(want[0]) == {"pred", "id", "top", "pair", "fields", "batch"}
    strategy = DappleStrategy(LAST_REPLICATED, start_method="forkserver")
    trainer = quiet_trainer(
        devices=LAST_REPLICATED.world_size, strategy=strategy, callbacks=[WritePredictions(tmp_path)]
    )
    trainer.predict(models.RecordsMLP(), models.loader(16))
    for rank in range(LAST_REPLICATED.world_size):
        got = [torch.load(tmp_path / f"rank{rank}-batch{i}.pt") for i in range(len(want))]
        assert_close_tree(got, want, f"rank {rank}")


def test_logged_max_min_and_sums_match_single_device(tmp_path):
    want = fit(models.ReduceMLP, tmp_path / "single", val=True)
    got = fit(models.ReduceMLP, tmp_path / "dapple", plan=LAST_REPLICATED, val=True)
    assert {"train_max_step", "train_max_epoch", "train_sse_epoch", "train_rows_epoch", "val_min", "val_sse"} <= set(
        want[0]
    )
    assert_same(got, want)


# Found on the first micro-batch by the stage that sees it; the other ranks end as they lose it.
# Run as a plain script: spawn would report whichever rank it notices first.
@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("MedianLogMLP", "reduce_fx=<built-in method median"),
        ("StackedSamplesMLP", "the pipelined Sequential's input has shape (12, 4) in micro-batch 0"),
    ],
    ids=["custom-reduce_fx", "misread-per-sample-list"],
)
def test_refused_on_the_first_micro_batch(model, message, tmp_path):
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(Plan(stages=[{"layers": [0, 2]}, {"layers": [2, 7]}], micro_batches=2).to_yaml())
    script = Path(__file__).parent / "scripts" / "fit_model.py"
    proc = subprocess.run(
        [sys.executable, str(script), model, str(plan_file)], capture_output=True, text=True, timeout=180
    )
    assert proc.returncode != 0
    assert (proc.stdout + proc.stderr).count(message) == 1, proc.stderr[-3000:]
