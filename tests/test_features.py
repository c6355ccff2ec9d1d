"""Lightning features under dapple, each against single-device Lightning."""

from __future__ import annotations

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
from harness import assert_same, fit

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


class RecordStop(Callback):
    """Rank 0 writes the epoch training stopped at (spawn does not hand the loop's state back)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: Trainer, pl_module) -> None:
        if trainer.is_global_zero:
            self.path.write_text(str(trainer.current_epoch))


def test_early_stopping_and_checkpoint_monitor_decide_alike(tmp_path):
    def run(name, **placement):
        stop = EarlyStopping(monitor="val_loss", patience=0, min_delta=1e3)  # no epoch improves by 1e3
        best = ModelCheckpoint(dirpath=tmp_path / name, monitor="val_loss", save_top_k=1)
        trainer = Trainer(
            accelerator="cpu",
            max_epochs=10,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[stop, best, RecordStop(tmp_path / f"{name}.epoch")],
            num_sanity_val_steps=0,
            **placement,
        )
        trainer.fit(models.MLP(), models.loader(), models.loader())
        checkpoints = sorted(p.name for p in (tmp_path / name).glob("*.ckpt"))
        epoch = int((tmp_path / f"{name}.epoch").read_text())
        return epoch, trainer.callback_metrics["val_loss"].item(), checkpoints

    epoch, val, checkpoints = run("single", devices=1)
    got_epoch, got_val, got_checkpoints = run("dapple", devices=3, strategy=DappleStrategy(PLAN, start_method="spawn"))
    assert epoch == 2 and got_epoch == epoch  # stopped after the second epoch, on every rank alike
    assert got_val == pytest.approx(val, rel=1e-5)
    assert got_checkpoints == checkpoints and len(checkpoints) == 1
    models.MLP.load_from_checkpoint(tmp_path / "dapple" / checkpoints[0], map_location="cpu")


def test_tensorboard_logger_writes_events(tmp_path):
    trainer = Trainer(
        accelerator="cpu",
        devices=3,
        strategy=DappleStrategy(PLAN, start_method="spawn"),
        max_steps=2,
        logger=TensorBoardLogger(tmp_path, name="tb", version=0),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(models.MLP(), models.loader())
    assert list((tmp_path / "tb" / "version_0").glob("events.out.tfevents.*"))


def test_manual_optimization_is_refused_with_a_clear_error(tmp_path):
    trainer = _trainer(devices=3, strategy=DappleStrategy(PLAN, start_method="spawn"), max_steps=1)
    with pytest.raises(Exception, match="automatic optimization only"):
        trainer.fit(models.ManualMLP(), models.loader())


@pytest.mark.parametrize("loop", ["validate", "test"])
def test_evaluation_loops_match_single_device(loop):
    want = getattr(_trainer(devices=1), loop)(models.EvalMLP(), models.loader())
    trainer = _trainer(devices=3, strategy=DappleStrategy(PLAN, start_method="spawn"))
    got = getattr(trainer, loop)(models.EvalMLP(), models.loader())
    assert got[0].keys() == want[0].keys()
    for key in want[0]:
        assert got[0][key] == pytest.approx(want[0][key], rel=1e-5)


def test_epoch_interval_scheduler_matches_single_device(tmp_path):
    want = fit(models.EvalMLP, tmp_path / "single", max_steps=12)
    got = fit(models.EvalMLP, tmp_path / "dapple", plan=PLAN, max_steps=12)
    assert_same(got, want)


class RecordBar(Callback):
    """Rank 0 writes what the progress bar shows for train_loss after each step."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.is_global_zero:
            shown = trainer.progress_bar_callback.get_metrics(trainer, pl_module)["train_loss"]
            with self.path.open("a") as f:
                f.write(f"{float(shown)!r}\n")


def test_progress_bar_shows_the_global_loss(tmp_path):
    def run(name, **placement):
        path = tmp_path / f"{name}.txt"
        Trainer(
            accelerator="cpu",
            max_steps=4,
            logger=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            callbacks=[RecordBar(path)],
            **placement,
        ).fit(models.BarMLP(), models.loader())
        return [float(line) for line in path.read_text().split()]

    want = run("single", devices=1)
    got = run("dapple", devices=3, strategy=DappleStrategy(PLAN, start_method="spawn"))
    assert len(got) == len(want) == 4
    assert got == pytest.approx(want, rel=1e-5)
