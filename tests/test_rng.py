"""The user's random streams (torch, numpy, Python's ``random``) are as one device finds them.

A script seeds with ``seed_everything``, builds its model (drawing its initial weights) and
fits. On one device the first ``collate_fn`` and the first ``training_step`` draw from what is
left; under dapple every rank must find exactly that (no re-seeding that forgets the model's
draws, no draw of the strategy's own during setup or ``plan="auto"``'s profiling), so that a
loader that masks at random with the global streams, as an MLM collator does, gives one device's
masks and losses, with no workers and no generator of its own.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import seed_everything
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from dapple_lightning import DappleStrategy, Plan
from dapple_lightning.strategy._rng import RngStates

import models
from harness import quiet_trainer, read_metrics

PLAN_2_1 = Plan(stages=[{"layers": [0, 4], "replicas": 2}, {"layers": [4, 7], "replicas": 1}], micro_batches=2)


def streams() -> dict[str, str]:
    """A digest of each global stream's state."""
    states = {
        "torch": torch.get_rng_state().numpy().tobytes(),  # a tensor's pickle is not its bytes alone
        "numpy": pickle.dumps(np.random.get_state()),
        "python": pickle.dumps(random.getstate()),
    }
    return {name: hashlib.sha1(state).hexdigest()[:12] for name, state in states.items()}


class RecordsStreams(models.MLP):
    """Writes the streams' states at the first ``training_step`` and the first ``collate_fn`` of its rank."""

    def __init__(self, record: Path) -> None:
        super().__init__()
        self.record = str(record)
        self.started = False

    def on_train_start(self) -> None:
        self.started = True

    def write(self, what: str) -> None:
        if not self.started:  # plan="auto" profiles through the collate_fn and training_step in setup
            return
        path = Path(self.record) / f"{what}-rank{self.global_rank}.json"
        if not path.exists():  # the first one only
            path.write_text(json.dumps(streams()))

    def training_step(self, batch, batch_idx):
        self.write("training_step")
        return super().training_step(batch, batch_idx)

    def masking_collate(self, samples):
        """Masks 30% of the inputs with torch's stream, as an MLM collator does; numpy's and Python's
        streams add noise to the labels, so a loss depends on every stream's draws."""
        self.write("collate_fn")
        x = torch.stack([s[0] for s in samples])
        y = torch.stack([s[1] for s in samples])
        mask = torch.rand(x.shape) < 0.3
        noise = torch.from_numpy(np.random.standard_normal(y.shape).astype(np.float32)) * 0.1
        shift = random.random()
        return x.masked_fill(mask, 0.0), y + noise + shift


def fit(tmp_path: Path, **placement) -> tuple[list[float], dict[str, dict[str, dict[str, str]]]]:
    """Seed, build the model, fit 4 steps; the per-step losses and, by file, the streams recorded."""
    record = tmp_path / "streams"
    record.mkdir(parents=True)
    seed_everything(0)
    model = RecordsStreams(record)  # draws its initial weights from the seeded stream, after seeding
    loader = DataLoader(models.dataset(), batch_size=models.BATCH, collate_fn=model.masking_collate)
    logger = CSVLogger(tmp_path, name="run", version=0)
    quiet_trainer(max_steps=4, logger=logger, log_every_n_steps=1, **placement).fit(model, loader)
    recorded = {path.stem: json.loads(path.read_text()) for path in sorted(record.iterdir())}
    return read_metrics(tmp_path / "run" / "version_0" / "metrics.csv")["train_loss"], recorded


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    return fit(tmp_path_factory.mktemp("one"), devices=1)


@pytest.fixture(scope="module")
def plan_2_1(tmp_path_factory):
    return fit(
        tmp_path_factory.mktemp("dapple"), devices=3, strategy=DappleStrategy(PLAN_2_1, start_method="forkserver")
    )


def test_random_masking_collate_trains_like_one_device(one_device, plan_2_1):
    (want, _), (got, _) = one_device, plan_2_1
    assert len(want) == 4
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-7)


def assert_streams_as_one_device(recorded: dict, want: dict, ranks: int) -> None:
    for what in ("collate_fn", "training_step"):
        for rank in range(ranks):
            got = recorded[f"{what}-rank{rank}"]
            assert got == want[f"{what}-rank0"], f"rank {rank}'s streams at its first {what}: {got} != {want}"


def test_streams_at_the_first_step_are_one_devices(one_device, plan_2_1):
    assert_streams_as_one_device(plan_2_1[1], one_device[1], 3)


def test_auto_plans_profiling_leaves_the_streams_as_one_device(one_device, tmp_path):
    """plan="auto" draws a batch through the collate_fn and runs trial steps before choosing."""
    _, recorded = fit(tmp_path, devices=2, strategy=DappleStrategy("auto", start_method="forkserver"))
    assert_streams_as_one_device(recorded, one_device[1], 2)


def test_taken_states_come_back_after_draws_from_every_stream():
    before = streams()
    states = RngStates.take(torch.device("cpu"))
    torch.rand(3), np.random.rand(3), random.random()
    assert streams() != before
    states.restore()
    assert streams() == before
