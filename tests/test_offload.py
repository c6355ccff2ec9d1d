"""A stage offloaded to disk (``offload: W``) trains as in memory, and holds at most W + 1 layers."""

from __future__ import annotations

import json
import subprocess
import sys
from copy import deepcopy
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback
from torch import nn

from dapple_lightning import DappleStrategy, Plan
from dapple_lightning.autoplan import optimizer_factory
from dapple_lightning.planner import (
    AUTO_WINDOW_MOST,
    Cluster,
    WindowChoice,
    choose_window,
    offloaded_plan,
    plan_dapple,
    profile_layers,
    shortlist_with_levers,
)
from dapple_lightning.planner._stage_memory import offloaded_model_bytes
from dapple_lightning.runtime import StageModule
from dapple_lightning.strategy import consolidate_checkpoint

import models
from harness import assert_close_tree, assert_same, fit

MODEL = models.DeepMLP
SCRIPT = Path(__file__).parent / "scripts" / "save_after_fit.py"


def plan(window: int | None) -> Plan:
    # The first stage: under 1F1B its program is F0 F1 B0 F2 B1 B2, so the window moves through forwards and
    # backwards of different micro-batches in turn, with two micro-batches' graphs alive.
    return Plan.coerce({"micro_batches": 3, "stages": [{"layers": [0, 6], "offload": window}, {"layers": [6, 8]}]})


def save_after_fit(out: Path, plan: Plan, **strategy: Any) -> Path:
    """Fit 4 steps launched plainly, ``trainer.save_checkpoint`` after ``fit`` returns (tests/scripts/save_after_fit.py)."""
    out.mkdir(parents=True)
    command = [sys.executable, str(SCRIPT), str(out), MODEL.__name__, json.dumps(plan.to_dict()), json.dumps(strategy)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "after_fit.ckpt"


class Resident(Callback):
    """The offloaded stage's residency peaks and layer sizes, written to ``folder/resident<rank>.json``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_end(self, trainer, pl_module) -> None:
        offload = getattr(pl_module.layers, "offload", None)
        if offload is not None:
            r = offload.residency
            numbers = {
                "tracked": r.peak_tracked,
                "storage": r.peak_storage,
                "alive": r.peak_alive,
                "layers": r.peak_layers,
                "alive_layers": r.peak_alive_layers,
                "samples": r.samples,
                "layer_bytes": offload.layer_bytes,
                "files": sorted(p.name for p in offload.directory.iterdir()),
                "window": offload.window,
                "chosen": offload.choice is not None,
            }
            (self.folder / f"resident{trainer.global_rank}.json").write_text(json.dumps(numbers))


def test_an_offloaded_stage_matches_memory_and_one_device_within_its_window(tmp_path):
    window = 2
    on = fit(MODEL, tmp_path / "on", plan=plan(window), val=True, callbacks=(Resident(tmp_path),))
    off = fit(MODEL, tmp_path / "off", plan=plan(None), val=True)
    single = fit(MODEL, tmp_path / "single", val=True)
    assert_same(on, off)
    assert_same(on, single)
    assert not (tmp_path / "resident1.json").exists()  # stage 1 keeps its layers in memory
    got = json.loads((tmp_path / "resident0.json").read_text())
    sizes = sorted(got["layer_bytes"], reverse=True)
    bound = sum(sizes[: window + 1])  # the window plus one layer
    assert sum(sizes) > bound, "the stage must have more layers than the window holds for the bound to mean anything"
    # What the memory budget prices this stage's model state at (planner._stage_memory): never less than held.
    params = [2 * sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in MODEL().layers[:6]]
    priced = max(offloaded_model_bytes(params, got["layer_bytes"], window))
    assert priced < sum(sizes)
    for what in ("tracked", "storage", "alive"):
        # The optimizer step holds one whole layer (parameters, gradients, momentum) at least.
        assert sizes[0] <= got[what] <= min(bound, priced), (what, got, priced)
    # A layer's storage that autograd kept alive after the window left it would count here.
    assert got["layers"] <= window + 1 and got["alive_layers"] <= window + 1, got
    assert got["samples"] > 0
    assert any(name.endswith(".param") for name in got["files"]) and any(".state" in n for n in got["files"])


def test_an_offloaded_stage_on_two_replicas_sums_its_gradients_and_may_choose_its_window(tmp_path):
    two = Plan.coerce(
        {"micro_batches": 2, "stages": [{"layers": [0, 2]}, {"layers": [2, 8], "replicas": 2, "offload": "auto"}]}
    )
    on = fit(MODEL, tmp_path / "on", plan=two, callbacks=(Resident(tmp_path),))
    assert_same(on, fit(MODEL, tmp_path / "single"))
    for rank in (1, 2):  # each replica measured its first step and chose a window for the next ones
        got = json.loads((tmp_path / f"resident{rank}.json").read_text())
        assert got["chosen"] and 1 <= got["window"] <= 6


def test_the_window_is_the_smallest_whose_transfers_hide_behind_compute():
    # Reads take a third of a layer's forward: one layer read ahead hides them; window 1 waits at every layer.
    assert choose_window([3.0] * 4, [6.0] * 4, [1.0] * 4, [1.0] * 4) == WindowChoice(2, 0.0, 36.0, ())
    assert choose_window([3.0] * 4, [6.0] * 4, [1.0] * 4, [1.0] * 4, most=1).stalls == (0, 1, 2, 3)
    # A slow layer (layer 2) stalls under any window: the least-waiting window names it.
    slow = choose_window([1.0] * 6, [2.0] * 6, [0.1, 0.1, 4.0, 0.1, 0.1, 0.1], [0.1] * 6)
    assert slow.stalls == (2,) and "layers [2] wait for their transfers" in slow.describe()
    # Reads slower than compute on every layer: no window keeps up, every layer waits.
    assert choose_window([1.0] * 6, [2.0] * 6, [2.0] * 6, [0.5] * 6).stalls == tuple(range(6))
    # One read of 3.5 layers' compute hides only 5 layers ahead; auto stops at AUTO_WINDOW_MOST (what the budget
    # prices it at) and names the layer that waits there.
    burst = [0.1] * 6 + [3.5] + [0.1] * 5
    assert choose_window([1.0] * 12, [2.0] * 12, burst, [0.1] * 12, most=12) == WindowChoice(5, 0.0, 36.0, ())
    capped = choose_window([1.0] * 12, [2.0] * 12, burst, [0.1] * 12)
    assert capped.window == AUTO_WINDOW_MOST == 4 and capped.stalls == (6,)
    with pytest.raises(ValueError, match="most is the largest window"):
        choose_window([1.0], [1.0], [1.0], [1.0], most=0)


def test_checkpoints_saved_with_offload_resume_without_it_and_the_reverse(tmp_path):
    on = save_after_fit(tmp_path / "on", plan(1))
    off = save_after_fit(tmp_path / "off", plan(None))
    saved_on, saved_off = torch.load(on, weights_only=False), torch.load(off, weights_only=False)
    assert_close_tree(saved_on["state_dict"], saved_off["state_dict"])
    assert_close_tree(saved_on["optimizer_states"], saved_off["optimizer_states"])
    assert len(saved_on["optimizer_states"][0]["state"]) == len(list(MODEL().parameters()))
    resumed_off = fit(MODEL, tmp_path / "r1", plan=plan(None), max_steps=8, ckpt_path=str(on))
    resumed_on = fit(MODEL, tmp_path / "r2", plan=plan(1), max_steps=8, ckpt_path=str(off))
    assert_same(resumed_on, resumed_off)
    # Sharded (torch.distributed.checkpoint): each owner writes its part, the offloaded stage's from disk.
    sharded = save_after_fit(tmp_path / "sharded", plan(1), state_dict_type="sharded")
    one = torch.load(consolidate_checkpoint(sharded, tmp_path / "one.ckpt"), weights_only=False)
    assert_close_tree(one["state_dict"], saved_off["state_dict"])
    assert_close_tree(one["optimizer_states"], saved_off["optimizer_states"])
    assert_same(fit(MODEL, tmp_path / "r3", plan=plan(None), max_steps=8, ckpt_path=str(sharded)), resumed_off)


def test_offload_refuses_what_it_cannot_keep_on_disk():
    with pytest.raises(ValueError, match=r"offload.* an integer >= 1"):
        Plan.coerce({"stages": [{"layers": [0, 2], "offload": 0}]})
    with pytest.raises(ValueError, match=r"use schedule 'dapple' or 'gpipe' with offload"):
        Plan.coerce({"schedule": "zb-h2", "stages": [{"layers": [0, 2], "offload": 1}]})
    with pytest.raises(ValueError, match=r"both recompute and offload"):
        Plan.coerce({"stages": [{"layers": [0, 2], "offload": 1, "recompute": True}]})
    with pytest.raises(ValueError, match=r"needs the pipelined layers in one nn\.Sequential"):
        StageModule([("0", nn.Linear(2, 2))], blocks=3, offload=1)
    tied = nn.Linear(2, 2)
    stage = StageModule([("0", tied), ("1", nn.Linear(2, 2))], offload=1)
    with pytest.raises(ValueError, match=r"layer 0 of an offloaded stage shares a parameter"):
        stage.offload.begin(shared=[tied.weight])
    # A copy of an offloaded stage (deepcopy, pickle) holds its values in memory.
    stage = StageModule([("0", nn.Linear(2, 2)), ("1", nn.Linear(2, 2))], offload=1)
    want = {k: v.clone() for k, v in stage.state_dict().items()}
    stage.offload.begin()
    assert stage[0].weight.numel() == 0  # on disk now
    copy = deepcopy(stage)
    assert copy.offload is None and all(torch.equal(copy.state_dict()[k], v) for k, v in want.items())
    stage.offload.close()
    assert "offload" in plan(2).table() and "window 2" in plan(2).table()
    assert Plan.coerce(plan(2).to_dict()) == plan(2)


class Chosen(Callback):
    """What plan='auto' chose and reported, and the offloaded stages' windows, in ``folder/chosen<rank>.json``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_end(self, trainer, pl_module) -> None:
        auto = trainer.strategy.auto_plan
        offload = getattr(pl_module.layers, "offload", None)
        stage = trainer.strategy.plan.stage_of(trainer.global_rank)
        numbers = {"plan": auto.plan.to_dict(), "report": auto.report(), "stage": stage}
        numbers["window"] = offload.window if offload is not None else None
        (self.folder / f"chosen{trainer.global_rank}.json").write_text(json.dumps(numbers))


TIGHT = 14000  # bytes per rank: below what any in-memory plan of MODEL on 2 ranks needs, above an offloaded one


def test_auto_offloads_a_stage_only_when_no_plan_fits_in_memory(tmp_path):
    module = MODEL()
    x, _ = next(iter(models.loader()))
    # The profile plan='auto' takes on 2 ranks (half the batch), priced here against the budgets.
    profile = profile_layers(list(module.layers), x[: len(x) // 2], optimizer=optimizer_factory(module), repeats=1)

    def within(limit: float) -> Cluster:
        return Cluster(1, 2, 1e9, 1e9, 1e9, 1e9, latency_s=0.0, memory_bytes=limit)

    close, _, lever, _ = shortlist_with_levers(profile, within(2**30), len(x))
    assert lever is None and all(s.offload is None for plan, _ in close for s in plan.stages)
    with pytest.raises(ValueError, match="no plan fits in"):
        plan_dapple(profile, within(TIGHT), len(x), recompute=True)
    assert offloaded_plan(profile, within(TIGHT), len(x)) is not None
    strategy = DappleStrategy(start_method="forkserver", memory_limit=TIGHT)
    metrics, weights = fit(MODEL, tmp_path / "auto", devices=2, strategy=strategy, callbacks=(Chosen(tmp_path),))
    chosen = json.loads((tmp_path / "chosen0.json").read_text())
    offloaded = [k for k, s in enumerate(chosen["plan"]["stages"]) if s.get("offload") == "auto"]
    assert offloaded and f"offload: auto on stage {offloaded[0]} (layers" in chosen["report"], chosen
    assert "OVER BUDGET" not in chosen["report"]
    for rank in (0, 1):  # an offloaded stage's ranks measured their first step and chose a window
        got = json.loads((tmp_path / f"chosen{rank}.json").read_text())
        assert (got["window"] is not None) == (got["stage"] in offloaded), got
        assert got["window"] is None or 1 <= got["window"] <= AUTO_WINDOW_MOST, got
    assert_same((metrics, weights), fit(MODEL, tmp_path / "single"))
