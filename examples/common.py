"""What the Hydra apps share: the Trainer with its DappleStrategy, and a loss report.

Why ranks start with ``spawn`` here (``strategy.start_method``), not Lightning's default
``popen``: ``popen`` re-runs the command line once per extra rank. For a Hydra app Lightning
re-runs it with ``hydra.run.dir=<this run's dir> hydra.output_subdir=null`` from the original
working directory, which is enough for a single run (``strategy.start_method=popen`` works and is
tested). A multirun is another matter. The re-run command still carries ``-m`` and the sweep, so
rank 1 runs a whole sweep of its own (with its own sweep directory when the default
``${now:...}`` one is used); and rank 0 launches rank 1 only in its first job, because the
launcher leaves ``LOCAL_RANK``, ``WORLD_SIZE`` and ``MASTER_PORT`` in its environment and every
later job takes the processes as created outside. The two sweeps then meet job by job as long as
every job has the same number of processes and the sweep order is the same in both; a sweep over
``trainer.devices=2,3`` fails in its second job (a 2-process group for a 3-rank plan). With
``spawn`` the ranks are child processes of each Hydra job: no command line is re-run, the config
is composed once, and single runs and multiruns behave alike. The price: the LightningModule and
DataModule are pickled to the ranks, so their classes live in importable modules
(``gpt_model.py``, ``cnn_model.py``) and the data are built in ``setup()`` or on demand rather
than in the constructor.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig, OmegaConf

from dapple_lightning import DappleStrategy
from dapple_lightning.microbatch import batch_size_of
from dapple_lightning.search import explain_choice, resolve_plan_spec

__all__ = ["LossReport", "make_trainer", "output_dir"]

REPORT_FILE = "losses.json"


def output_dir() -> Path:
    """This Hydra job's output directory (``outputs/...``; the working directory does not change)."""
    return Path(HydraConfig.get().runtime.output_dir)


class LossReport(Callback):
    """Records the first and last ``train_loss`` and ``val_loss``; rank 0 prints them at the end.

    The first ``val_loss`` is the sanity check's (before any step). Runs on every rank (the
    strategy makes logged values known everywhere), prints and writes ``losses.json`` on rank 0.
    """

    warmup_steps = 2
    """Steps left out of the throughput (first steps pay for allocation and connection set-up)."""

    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir = Path(out_dir)
        self.first: dict[str, tuple[int, float]] = {}
        self.last: dict[str, tuple[int, float]] = {}
        self.step_s: list[float] = []
        self.rows = 0
        self._start = 0.0

    def _record(self, trainer: Trainer, name: str) -> None:
        value = trainer.callback_metrics.get(name)
        if value is None:
            return
        entry = (trainer.global_step, float(value))
        self.first.setdefault(name, entry)
        self.last[name] = entry

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, *args: Any
    ) -> None:
        self.step_s.append(time.perf_counter() - self._start)
        self.rows = batch_size_of(batch)
        self._record(trainer, "train_loss")

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._record(trainer, "val_loss")

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        report = {
            name: {
                "first_step": first[0],
                "first": first[1],
                "last_step": self.last[name][0],
                "last": self.last[name][1],
            }
            for name, first in self.first.items()
        }
        timed = self.step_s[self.warmup_steps :] or self.step_s
        if timed:
            median = statistics.median(timed)
            report["samples_per_s"] = self.rows / median
            if len(timed) >= 4:  # half the interquartile range, relative: how far apart plans must be
                q1, _, q3 = statistics.quantiles(timed, n=4)
                report["samples_per_s_spread"] = (q3 - q1) / 2 / median
        self.out_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.out_dir / f".{REPORT_FILE}.tmp"
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        os.replace(tmp, self.out_dir / REPORT_FILE)  # never a half-written report
        lines = [f"losses ({self.out_dir / REPORT_FILE}):"]
        for name, r in report.items():
            if name == "samples_per_s":
                lines.append(f"  throughput {r:.1f} samples/s (median step after {self.warmup_steps} warm-up steps)")
                continue
            if name == "samples_per_s_spread":
                continue
            lines.append(
                f"  {name:<10} first {r['first']:.4f} (after step {r['first_step']})  "
                f"final {r['last']:.4f} (after step {r['last_step']})"
            )
        print("\n".join(lines), flush=True)


def job_result(out_dir: str | Path) -> dict[str, float] | None:
    """What a Hydra job returns (the plan sweeper optimises one of these): throughput and final losses.

    ``None`` on ranks other than 0 of a plainly launched job, which write no report.
    """
    path = Path(out_dir) / REPORT_FILE
    if not path.exists():
        return None
    report = json.loads(path.read_text())
    result = {name: r["last"] for name, r in report.items() if isinstance(r, dict)}
    for key in ("samples_per_s", "samples_per_s_spread"):
        if key in report:
            result[key] = report[key]
    return result


def fit(cfg: DictConfig, model: LightningModule, data: Any) -> Trainer:
    """Check the model against the config the plan files count on, then train it with ``cfg.plan``."""
    path = cfg.strategy.sequential or "layers"
    layers = len(model.get_submodule(path))
    if layers != cfg.model.num_layers:
        raise ValueError(f"model.num_layers={cfg.model.num_layers} but the model's {path} has {layers}; do not set it")
    trainer = make_trainer(cfg)
    trainer.fit(model, datamodule=data)
    spec = cfg.plan
    if trainer.is_global_zero and isinstance(spec, str) and spec.strip().startswith("optuna://"):
        # Trained with a search's choice: show what it measured and how this run compares.
        report = json.loads((output_dir() / REPORT_FILE).read_text())
        print(explain_choice(spec, report.get("samples_per_s")), flush=True)
    return trainer


def make_trainer(cfg: DictConfig) -> Trainer:
    """A Trainer running ``cfg.plan`` with DappleStrategy; logs and reports go to the job's output dir."""
    out = output_dir()
    strategy = DappleStrategy(
        # "auto", an OmegaConf node (Plan.coerce validates it in the strategy), or a search's result
        # named "optuna://STORAGE?study=NAME" (conf/plan/best.yaml), which the search resolves here.
        plan=resolve_plan_spec(cfg.plan),
        start_method=cfg.strategy.start_method,
        timeout=timedelta(seconds=cfg.strategy.timeout_s),
        trace=cfg.strategy.trace,
        sequential=cfg.strategy.sequential,
    )
    trainer_kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    assert isinstance(trainer_kwargs, dict)
    return Trainer(
        strategy=strategy,
        default_root_dir=str(out),  # spawn's hand-back of the trained weights writes a temp file here
        logger=CSVLogger(str(out), name="", version="csv"),  # -> <out>/csv/metrics.csv
        callbacks=[LossReport(out)],
        **trainer_kwargs,
    )
