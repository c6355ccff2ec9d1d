"""What the strategy changes on objects it does not own: only through its Lightning adapter, and all undone.

A fit on two gloo ranks (each process a rank, as under torchrun) snapshots the attributes of
Lightning's objects (trainer, loops, checkpoint connector, precision plugin), the optimizer, the
user's LightningModule, loader, sampler, batch sampler and fine-tuning callback, and the class
dicts that a class-wide change would touch: before the strategy's setup (a callback's ``setup``),
during training (``on_train_batch_end``, and inside the user's ``training_step`` and
``finetune_function``, where the changes that last one block are in force) and after ``fit``.

Lightning changes its own state as it trains (counters, progress, results), so not every
difference is the strategy's. Compared are the attributes whose value before or during is a
callable, a random generator or a sampler (what a patch replaces: behaviour, not state), and
every attribute the adapter claims. Every such difference during the fit must be claimed by the
adapter (:func:`~dapple_lightning.strategy._lightning.live_changes`), and after ``fit`` every one
must be as before.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.callbacks import BaseFinetuning
from torch import nn
from torch.utils.data import DataLoader, Sampler

from dapple_lightning import DappleStrategy, Plan
from dapple_lightning.strategy._lightning import live_changes

import models
from distributed import run_ranks
from harness import quiet_trainer

_SEEN_INSIDE: dict[str, Any] = {}
"""What the user's code saw of the changes in force while it ran (per rank process)."""


def _behavioural(value: Any) -> bool:
    return callable(value) or isinstance(value, torch.Generator | Sampler)


def _state(target: Any) -> dict[str, Any]:
    return dict(vars(target))


def _changed(before: dict[str, Any], now: dict[str, Any], claimed: set[str]) -> set[str]:
    """Attributes that differ (by identity), among the behavioural ones and the ``claimed`` ones."""
    names = set(before) | set(now)
    missing = object()
    return {
        n
        for n in names
        if (_behavioural(before.get(n)) or _behavioural(now.get(n)) or n in claimed)
        and before.get(n, missing) is not now.get(n, missing)
    }


class _Model(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(models.IN, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, models.OUT)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        _SEEN_INSIDE.setdefault("log", ("log" in vars(self), (self, "log") in _claimed_pairs()))
        loss = nn.functional.mse_loss(self.head(self.layers(x)), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class _Unfreeze(BaseFinetuning):
    def freeze_before_training(self, pl_module: LightningModule) -> None:
        self.freeze(pl_module.head)

    def finetune_function(self, pl_module: LightningModule, epoch: int, optimizer: Any) -> None:
        if epoch == 1:
            own = vars(BaseFinetuning)["filter_on_optimizer"]
            claimed = (BaseFinetuning, "filter_on_optimizer") in _claimed_pairs()
            _SEEN_INSIDE["filter_on_optimizer"] = (own is not _ORIGINAL_FILTER, claimed)
            self.unfreeze_and_add_param_group(pl_module.head, optimizer)


_ORIGINAL_FILTER = vars(BaseFinetuning)["filter_on_optimizer"]


def _claimed_pairs() -> set[tuple[Any, str]]:
    return set(live_changes())


def _claimed_names(target: Any) -> set[str]:
    return {name for t, name in live_changes() if t is target}


class _Watch(Callback):
    """Snapshots the objects' attributes before the strategy's setup and during training."""

    def __init__(self, model: LightningModule, loader: DataLoader, finetuning: BaseFinetuning) -> None:
        self.model, self.loader, self.finetuning = model, loader, finetuning
        self.before: dict[str, dict[str, Any]] = {}
        self.during: dict[str, tuple[dict[str, Any], set[str]]] = {}

    def objects(self, trainer: Any) -> dict[str, Any]:
        found = {
            "trainer": trainer,
            "fit_loop": trainer.fit_loop,
            "epoch_loop": trainer.fit_loop.epoch_loop,
            "checkpoint_connector": trainer._checkpoint_connector,
            "precision": trainer.strategy.precision_plugin,
            "module": self.model,
            "loader": self.loader,
            "sampler": self.loader.sampler,
            "batch_sampler": self.loader.batch_sampler,
            "finetuning": self.finetuning,
            "class BaseFinetuning": BaseFinetuning,
            "class module": type(self.model),
            "class precision": type(trainer.strategy.precision_plugin),
            "class SGD": torch.optim.SGD,
        }
        for i, optimizer in enumerate(trainer.optimizers):  # made in the strategy's setup: none before
            found[f"optimizer {i}"] = optimizer
        return found

    def setup(self, trainer: Any, pl_module: LightningModule, stage: str) -> None:
        self.before = {name: _state(target) for name, target in self.objects(trainer).items()}

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.current_epoch == 1 and not self.during:
            self.during = {
                name: (_state(target), _claimed_names(target)) for name, target in self.objects(trainer).items()
            }


def _fit_on_rank(rank: int, world_size: int) -> dict[str, Any]:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size))
    plan = Plan.coerce({"micro_batches": 2, "stages": [{"layers": [0, 2], "offload": 1}, {"layers": [2, 4]}]})
    model = _Model()
    # torch wraps an optimizer class's step once, at its first instance: before the snapshot, not in it.
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    loader = DataLoader(models.dataset(), batch_size=models.BATCH, shuffle=True)
    finetuning = _Unfreeze()
    watch = _Watch(model, loader, finetuning)
    trainer = quiet_trainer(
        strategy=DappleStrategy(plan, recovery=True),
        devices=world_size,
        max_epochs=2,
        callbacks=[finetuning, watch],
    )
    trainer.fit(model, loader)
    after = {name: _state(target) for name, target in watch.objects(trainer).items()}
    unclaimed, not_restored, changed_during = {}, {}, {}
    for name, (during, claimed) in watch.during.items():
        if name in watch.before:
            changed = _changed(watch.before[name], during, claimed)
            back = _changed(watch.before[name], after[name], claimed)
        else:  # an optimizer, made in the strategy's setup: a change shadows a method of its class
            methods = set(dir(torch.optim.SGD))
            changed = {n for n in during if n in methods or n in claimed}
            back = {n for n in after[name] if n in methods}
        if changed - claimed:
            unclaimed[name] = sorted(changed - claimed)
        if changed:
            changed_during[name] = sorted(changed)
        if back:
            not_restored[name] = sorted(back)
    return {
        "unclaimed": unclaimed,
        "not_restored": not_restored,
        "changed_during": changed_during,
        "inside": dict(_SEEN_INSIDE),
        "live_after": [(type(t).__name__, n) for t, n in live_changes()],
    }


def test_the_strategy_changes_others_objects_only_through_the_adapter_and_undoes_it_all() -> None:
    results = run_ranks(_fit_on_rank, 2, timeout=300)
    for rank, result in enumerate(results):
        assert result["unclaimed"] == {}, f"rank {rank}: changed outside the adapter: {result['unclaimed']}"
        assert result["not_restored"] == {}, f"rank {rank}: not put back after fit: {result['not_restored']}"
        assert result["live_after"] == [], f"rank {rank}: changes left in force: {result['live_after']}"
        assert result["inside"]["log"] == (True, True), f"rank {rank}: module.log while the step ran"
        assert result["inside"]["filter_on_optimizer"] == (True, True), f"rank {rank}: inside finetune_function"
    during = results[0]["changed_during"]
    # The changes this fit makes (rank 0 holds the offloaded stage): each one must have been seen.
    assert during["precision"] == ["_after_closure", "clip_grad_by_norm"], during
    assert "module" not in during, during  # module.log is shadowed for a step only (checked inside it)
    assert during["sampler"] == ["generator"], during
    assert during["batch_sampler"] == ["sampler"], during
    assert during["finetuning"] == ["finetune_function"], during
    assert during["optimizer 0"] == ["step"], during


class _Plain:
    def method(self) -> str:
        return "class"


def test_patches_put_back_instance_and_class_attributes_in_reverse_order_also_when_a_block_raises() -> None:
    from dapple_lightning.strategy._lightning import Patches

    target, patches = _Plain(), Patches()
    target.own = "mine"
    patches.set(target, "method", lambda: "patched")
    patches.set(target, "own", "changed")
    patches.set(target, "own", "changed again")
    patches.set(_Plain, "method", lambda self: "class patched")
    assert (target.method(), target.own, _Plain().method()) == ("patched", "changed again", "class patched")
    assert (target, "method") in live_changes()
    try:
        with patches.scoped(target, "extra", 1):
            assert target.extra == 1
            raise KeyError("inside")
    except KeyError:
        pass
    assert "extra" not in vars(target) and len(patches.changes()) == 4
    patches.remove()
    assert vars(target) == {"own": "mine"} and _Plain().method() == "class" and target.method() == "class"
    assert patches.changes() == [] and all(t is not target for t, _ in live_changes())
