"""A model built on the meta device is materialised stage by stage: each rank allocates its part only.

Built with ``trainer.init_module(empty_init=True)``; each rank allocates its stage's layers and the
modules outside the container and initialises them with ``reset_parameters()``, seeded by each
module's path, so the initial weights are the same whichever plan holds them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback
from torch import nn

from dapple_lightning import DappleStrategy, Plan
from dapple_lightning.strategy._materialize import materialize

import models
from harness import assert_close_tree, quiet_trainer

PLAN_2_1 = Plan(stages=[{"layers": [0, 3], "replicas": 2}, {"layers": [3, 7], "replicas": 1}], micro_batches=3)
PLAN_1_1_1 = Plan(
    stages=[{"layers": [0, 2], "replicas": 1}, {"layers": [2, 5], "replicas": 1}, {"layers": [5, 7], "replicas": 1}],
    micro_batches=2,
)


class Record(Callback):
    """Each rank writes the bytes of the parameters it holds (and how many are left on meta); rank 0
    saves a checkpoint at the end, while the plan is in place."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module) -> None:
        params = list(pl_module.parameters())
        held = sum(p.numel() * p.element_size() for p in params if not p.is_meta)
        record = {"bytes": held, "on_meta": sum(p.is_meta for p in params)}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))

    def on_train_end(self, trainer, pl_module) -> None:
        trainer.save_checkpoint(self.out / "end.ckpt")


class TiedMLP(models.HeadMLP):
    """HeadMLP with two more layers outside the Sequential that share one weight, before and after it."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.post = nn.Linear(16, 16), nn.Linear(16, 16)
        self.post.weight = self.pre.weight

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.head(self.post(self.layers(self.pre(self.embed(x))))), y)
        self.log("train_loss", loss)
        return loss


def run(plan: Plan, out: Path, model_cls=models.HeadMLP) -> dict:
    out.mkdir(parents=True)
    trainer = quiet_trainer(
        devices=plan.world_size,
        strategy=DappleStrategy(plan, start_method="forkserver"),
        max_steps=2,
        callbacks=[Record(out)],
    )
    with trainer.init_module(empty_init=True):
        model = model_cls()
    assert all(p.is_meta for p in model.parameters())  # nothing allocated before the cut
    trainer.fit(model, models.loader())
    return torch.load(out / "end.ckpt", weights_only=False)


def stage_bytes(plan: Plan, rank: int) -> int:
    """What a rank must hold: its stage's layers and everything outside the Sequential."""
    model = models.HeadMLP()
    stage = plan.stages[plan.stage_of(rank)]
    layers = list(model.layers)[stage.start : stage.end]
    inside = {id(p) for p in model.layers.parameters()}
    outside = [p for p in model.parameters() if id(p) not in inside]
    return sum(p.numel() * p.element_size() for p in [*outside, *(p for m in layers for p in m.parameters())])


def test_each_rank_materialises_only_its_stage_and_every_plan_starts_alike(tmp_path):
    under_2_1 = run(PLAN_2_1, tmp_path / "2-1")
    for rank in range(PLAN_2_1.world_size):
        record = json.loads((tmp_path / "2-1" / f"rank{rank}.json").read_text())
        assert record == {"bytes": stage_bytes(PLAN_2_1, rank), "on_meta": 0}, rank
    assert stage_bytes(PLAN_2_1, 2) != stage_bytes(PLAN_2_1, 0)  # the shares differ: the check means something
    under_1_1_1 = run(PLAN_1_1_1, tmp_path / "1-1-1")
    # The same initial weights under both plans, so the same training: the checkpoints agree.
    assert_close_tree(under_1_1_1["state_dict"], under_2_1["state_dict"])
    assert all(torch.isfinite(v).all() for v in under_2_1["state_dict"].values())
    assert under_2_1["state_dict"]["layers.1.weight"].abs().sum() > 0


def test_a_tie_survives_materialisation_and_takes_its_first_modules_draw(tmp_path):
    with torch.device("meta"):
        model = TiedMLP()
    materialize(model, torch.device("cpu"), seed=5)
    assert model.post.weight is model.pre.weight and not model.pre.weight.is_meta
    with torch.device("meta"):
        alone = nn.ModuleDict({"pre": nn.Linear(16, 16)})
    materialize(alone, torch.device("cpu"), seed=5)
    assert torch.equal(model.pre.weight, alone["pre"].weight)  # drawn as if "pre" alone held it
    under_2_1 = run(PLAN_2_1, tmp_path / "2-1", TiedMLP)
    under_1_1_1 = run(PLAN_1_1_1, tmp_path / "1-1-1", TiedMLP)
    state = under_2_1["state_dict"]
    assert torch.equal(state["pre.weight"], state["post.weight"])  # still one parameter after training
    assert_close_tree(under_1_1_1["state_dict"], state)


def test_a_meta_model_whose_plan_splits_a_tie_is_refused(tmp_path):
    from test_chains import TiedLM, plan, words

    trainer = quiet_trainer(
        devices=2, strategy=DappleStrategy(plan(((0, 2), 1), ((2, 5), 1)), start_method="forkserver"), max_steps=1
    )
    with trainer.init_module(empty_init=True):
        model = TiedLM()
    with pytest.raises(Exception, match="built on the meta device and the plan splits parameters that layers share"):
        trainer.fit(model, words(8))
