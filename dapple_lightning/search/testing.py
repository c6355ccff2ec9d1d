"""Tiny model factories for tests and smoke runs of the search (``"dapple_lightning.search.testing:mlp"``).

:func:`mlp` is a small MLP whose layers form one ``nn.Sequential`` (``2 * layers`` modules:
``Linear`` and ``Tanh`` pairs), with random regression data. Its keyword arguments can make a
trial fail on purpose, chosen by the plan's micro-batch count so that one study can hold
failing and succeeding trials::

    run_search(SearchConfig(trial=TrialConfig(
        "dapple_lightning.search.testing:mlp", world_size=2, global_batch=8,
        model_kwargs={"crash_on": [2], "hang_on": [4]})))
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["MLP", "mlp"]


class MLP(LightningModule):
    """``layers`` pairs of ``Linear(width, width)`` + ``Tanh`` in ``self.layers`` (on ``features``
    inputs); MSE loss, SGD.

    The other arguments make a trial misbehave on purpose, chosen by its plan's micro-batch count:

    Args:
        crash_on: micro-batch counts whose plans raise in ``training_step`` (on the last rank).
        hang_on: micro-batch counts whose plans sleep forever in ``training_step`` from the second
            step on (the first completes: a trial that trained, then stalled).
        oom_on: micro-batch counts whose plans get SIGKILL, as from the OOM killer (last rank).
        step_delay_s: sleep this long in every ``training_step`` call (a slow model, without the CPU).
        failure_stamp: a file an ``oom_on`` rank writes its ``time.time()`` to just before it dies.
        started_file: a file rank 0 of a trial writes when its first step starts (a test waits on
            it to act while a trial runs).
        devices_file: a file rank 0 writes the ``CUDA_VISIBLE_DEVICES`` it sees to (``<unset>``)
            when its first step starts (the test of device leases reads it).
        hold_until: every rank waits in its first step until this file exists (a trial that
            holds its devices until the test lets it end).
    """

    def __init__(
        self,
        features: int = 8,
        width: int = 16,
        layers: int = 3,
        crash_on: Sequence[int] = (),
        hang_on: Sequence[int] = (),
        oom_on: Sequence[int] = (),
        step_delay_s: float = 0.0,
        failure_stamp: str | None = None,
        started_file: str | None = None,
        devices_file: str | None = None,
        hold_until: str | None = None,
    ) -> None:
        super().__init__()
        self.features = features
        self.step_delay_s = step_delay_s
        self.failure_stamp = failure_stamp
        self.started_file = started_file
        self.devices_file = devices_file
        self.hold_until = hold_until
        blocks: list[nn.Module] = []
        for i in range(layers):
            blocks += [nn.Linear(features if i == 0 else width, width), nn.Tanh()]
        self.layers = nn.Sequential(*blocks)
        self.head = nn.Linear(width, 1)
        self.crash_on, self.hang_on, self.oom_on = set(crash_on), set(hang_on), set(oom_on)

    def _fail_if_asked(self, batch_idx: int) -> None:
        if self._trainer is None:  # called outside a Trainer (the search's model probe)
            return
        plan = getattr(self.trainer.strategy, "plan", None)
        m = getattr(plan, "micro_batches", None)
        if m in self.hang_on and batch_idx >= 1:
            while True:  # the injected hang: only the trial's time limit ends it
                time.sleep(0.5)
        if m in self.crash_on and self.trainer.global_rank == self.trainer.world_size - 1:
            raise RuntimeError(f"injected crash (micro_batches={m})")
        if m in self.oom_on and self.trainer.global_rank == self.trainer.world_size - 1:
            if self.failure_stamp:  # when the rank died, for benchmarks/search_launcher.py
                Path(self.failure_stamp).write_text(repr(time.time()))
            # What the kernel's OOM killer does to a process: SIGKILL, no traceback.
            os.kill(os.getpid(), signal.SIGKILL)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 0 and self._trainer is not None:
            self._first_step()
        self._fail_if_asked(batch_idx)
        if self.step_delay_s:
            time.sleep(self.step_delay_s)  # a slow model that costs no CPU
        x, y = batch
        return nn.functional.mse_loss(self.head(self.layers(x)), y)

    def _first_step(self) -> None:
        if self.trainer.global_rank == 0:
            if self.devices_file:
                # Written whole, then renamed: a reader sees the devices or nothing.
                part = Path(self.devices_file + ".part")
                part.write_text(os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"))
                part.rename(self.devices_file)
            if self.started_file:
                Path(self.started_file).write_text("trial started\n")
        if self.hold_until:
            while not Path(self.hold_until).exists():  # the test says when the trial may end
                time.sleep(0.05)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def mlp(batch_size: int, *, batches: int = 16, max_rows: int | None = None, **options: Any) -> tuple[MLP, DataLoader]:
    """An :class:`MLP` built with ``options`` (its arguments) and a loader of ``batches`` batches of
    ``batch_size`` rows, or of ``max_rows`` when fewer (plans that need more are then infeasible)."""
    model = MLP(**options)
    rows = batch_size if max_rows is None else min(batch_size, max_rows)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows * batches, model.features, generator=g)
    y = torch.randn(rows * batches, 1, generator=g)
    return model, DataLoader(TensorDataset(x, y), batch_size=rows, shuffle=False)
