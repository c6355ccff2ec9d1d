"""Lightning features under dapple, each against single-device Lightning."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

from dapple_lightning import DappleStrategy, Plan

import models
from harness import assert_same, fit, quiet_trainer

PLAN = Plan(stages=[{"layers": [0, 4], "replicas": 2}, {"layers": [4, 7], "replicas": 1}], micro_batches=3)


@pytest.mark.parametrize(
    "options",
    [
        {"gradient_clip_val": 0.05},
        {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"},
        {"accumulate_grad_batches": 2},
    ],
    ids=["clip-norm", "clip-value", "accumulate"],
)
def test_training_options_match_single_device(options, tmp_path):
    want = fit(models.ScheduledMLP, tmp_path / "single", **options)
    got = fit(models.ScheduledMLP, tmp_path / "dapple", plan=PLAN, **options)
    assert_same(got, want)


def test_bf16_mixed_on_cpu_trains_like_single_device(tmp_path):
    # Autocast rounds per matmul, and micro-batches are smaller matmuls: equal up to bf16 rounding.
    want, _ = fit(models.MLP, tmp_path / "single", precision="bf16-mixed")
    got, _ = fit(models.MLP, tmp_path / "dapple", plan=PLAN, precision="bf16-mixed")
    torch.testing.assert_close(torch.tensor(got["train_loss"]), torch.tensor(want["train_loss"]), rtol=3e-2, atol=1e-3)


def _trainer(**kwargs):
    return Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **kwargs,
    )


def test_predict_returns_predictions_in_batch_order(tmp_path):
    # Lightning returns predictions only from launchers that keep rank 0 in this process (not spawn).
    want = _trainer(devices=1).predict(models.PredictMLP(), models.loader())
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(PLAN.to_yaml())
    script = Path(__file__).parent / "scripts" / "predict_mlp.py"
    out = tmp_path / "predictions.pt"
    subprocess.run([sys.executable, str(script), str(out), str(plan_file)], check=True, timeout=300, cwd=tmp_path)
    got = torch.load(out)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


class RecordEpochs(Callback):
    """Rank 0 writes each epoch's val_loss and, at the end, the epoch training stopped at
    (spawn does not hand the loop's state back)."""

    def __init__(self, path: Path) -> None:
        self.path, self.values = path, []

    def on_validation_epoch_end(self, trainer: Trainer, pl_module) -> None:
        self.values.append(trainer.callback_metrics["val_loss"].item())

    def on_train_end(self, trainer: Trainer, pl_module) -> None:
        if trainer.is_global_zero:
            self.path.write_text(json.dumps({"epoch": trainer.current_epoch, "val": self.values}))


def test_early_stopping_and_checkpoint_monitor_decide_alike(tmp_path):
    def run(name, stop_below=None, **placement):
        stop = [] if stop_below is None else [EarlyStopping(monitor="val_loss", stopping_threshold=stop_below)]
        best = ModelCheckpoint(dirpath=tmp_path / name, monitor="val_loss", save_top_k=2)
        record = RecordEpochs(tmp_path / f"{name}.json")
        callbacks = [*stop, best, record]
        trainer = quiet_trainer(
            max_epochs=6, callbacks=callbacks, enable_checkpointing=True, num_sanity_val_steps=0, **placement
        )
        trainer.fit(models.MLP(), models.loader(), models.loader())
        return json.loads(record.path.read_text()), sorted(p.name for p in (tmp_path / name).glob("*.ckpt"))

    # Stop once val_loss falls below a threshold halfway between two epochs' values of one device:
    # the stopping epoch and the two best checkpoints depend on the values agreeing.
    history, _ = run("free", devices=1)
    val = history["val"]
    assert val[2] > val[3], val
    threshold = (val[2] + val[3]) / 2
    want, want_checkpoints = run("single", threshold, devices=1)
    got, got_checkpoints = run("dapple", threshold, devices=3, strategy=DappleStrategy(PLAN, start_method="forkserver"))
    assert want["epoch"] == got["epoch"] == 4 and len(got["val"]) == 4, (want, got)  # stopped after epoch 3
    torch.testing.assert_close(torch.tensor(got["val"]), torch.tensor(want["val"]), rtol=1e-5, atol=1e-7)
    assert got_checkpoints == want_checkpoints and len(want_checkpoints) == 2
    models.MLP.load_from_checkpoint(tmp_path / "dapple" / got_checkpoints[-1], map_location="cpu")


def test_tensorboard_receives_the_single_device_values(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def scalars(name, **placement):
        logger = TensorBoardLogger(tmp_path, name=name, version=0)
        trainer = quiet_trainer(max_steps=4, logger=logger, log_every_n_steps=1, **placement)
        trainer.fit(models.MLP(), models.loader())
        events = EventAccumulator(str(tmp_path / name / "version_0"))
        events.Reload()
        return [(e.step, e.value) for e in events.Scalars("train_loss")]

    want = scalars("single", devices=1)
    got = scalars("dapple", devices=3, strategy=DappleStrategy(PLAN, start_method="forkserver"))
    assert [s for s, _ in got] == [s for s, _ in want] and len(want) == 4
    torch.testing.assert_close(
        torch.tensor([v for _, v in got]), torch.tensor([v for _, v in want]), rtol=1e-5, atol=1e-7
    )
