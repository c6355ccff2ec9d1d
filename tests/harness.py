"""Fit a test model with dapple or on one device, and compare what the runs logged and learned."""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import CSVLogger

from dapple_lightning import DappleStrategy, Plan

import models


def fit(
    model_cls,
    tmp_path: Path,
    *,
    plan: Plan | None = None,
    val: bool = False,
    max_steps: int = 4,
    ckpt_path: str | None = None,
    callbacks: tuple = (),
    strategy_kwargs: dict[str, Any] | None = None,
    batch_size: int = models.BATCH,
    loader: Callable[[int], Any] = models.loader,
    **trainer_kwargs: Any,
):
    """Train ``model_cls`` on ``loader(batch_size)`` (tests/models.loader); return (logged metrics, final state dict)."""
    model = model_cls()
    if plan is not None:
        placement = {
            "strategy": DappleStrategy(plan, start_method="forkserver", **(strategy_kwargs or {})),
            "devices": plan.world_size,
        }
    else:
        placement = {"devices": 1}
    placement.update({k: trainer_kwargs.pop(k) for k in ("devices", "strategy") if k in trainer_kwargs})
    options = {
        "accelerator": "cpu",
        "max_steps": max_steps,
        "logger": CSVLogger(tmp_path, name="run", version=0),
        "log_every_n_steps": 1,
        "enable_progress_bar": False,
        "enable_checkpointing": False,
        "enable_model_summary": False,
        "limit_val_batches": 2 if val else 0,
        "val_check_interval": 2 if val else None,
        "num_sanity_val_steps": 0,
        "callbacks": list(callbacks),
        **placement,
        **trainer_kwargs,
    }
    trainer = Trainer(**options)
    trainer.fit(
        model,
        train_dataloaders=loader(batch_size),
        val_dataloaders=loader(batch_size) if val else None,
        ckpt_path=ckpt_path,
    )
    return read_metrics(Path(tmp_path) / "run" / "version_0" / "metrics.csv"), model.state_dict()


def quiet_trainer(**kwargs: Any) -> Trainer:
    """A CPU Trainer without logger, progress bar, checkpointing or model summary; ``kwargs`` override."""
    options = {
        "accelerator": "cpu",
        "logger": False,
        "enable_progress_bar": False,
        "enable_checkpointing": False,
        "enable_model_summary": False,
    }
    return Trainer(**{**options, **kwargs})


def read_metrics(path: Path) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    with path.open() as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key not in ("epoch", "step") and value:
                    out.setdefault(key, []).append(float(value))
    return out


def assert_close_tree(got: Any, want: Any, path: str = "") -> None:
    if isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=path)
    elif isinstance(want, dict):
        assert set(got) == set(want), f"{path}: keys {sorted(map(str, got))} != {sorted(map(str, want))}"
        for key in want:
            assert_close_tree(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close_tree(g, w, f"{path}[{i}]")
    elif isinstance(want, float):
        assert abs(got - want) <= 1e-6 * max(1.0, abs(want)), path
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def assert_same(got, want) -> None:
    got_metrics, got_state = got
    want_metrics, want_state = want
    assert got_metrics.keys() == want_metrics.keys()
    for key in want_metrics:
        torch.testing.assert_close(
            torch.tensor(got_metrics[key]), torch.tensor(want_metrics[key]), rtol=1e-5, atol=1e-7, msg=key
        )
    assert list(got_state) == list(want_state)
    assert_close_tree(dict(got_state), dict(want_state))


class SaveAtEnd(Callback):
    """Saves a checkpoint with ``trainer.save_checkpoint`` when training ends, as a user would."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: Trainer, pl_module) -> None:
        trainer.save_checkpoint(self.path)


def single_device_resumed(root: Path):
    """Single-device Lightning on ScheduledMLP: 4 steps and a checkpoint, then resumed from it to 8
    steps; (the checkpoint, the first run, the resumed run)."""
    ckpt = root / "single.ckpt"
    first = fit(models.ScheduledMLP, root / "a", callbacks=(SaveAtEnd(ckpt),))
    resumed = fit(models.ScheduledMLP, root / "b", max_steps=8, ckpt_path=str(ckpt))
    return ckpt, first, resumed
