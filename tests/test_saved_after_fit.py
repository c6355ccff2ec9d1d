"""Checkpoints saved as users save them: ``trainer.save_checkpoint`` after ``fit`` returns.

The run is launched plainly (Lightning re-launches the script per rank), so the ranks are still
alive after ``fit`` and the plan's optimizer state is spread over them. The reference is
single-device Lightning saving after its own ``fit`` and resuming from that file.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from dapple_lightning import Plan
from dapple_lightning.strategy import consolidate_checkpoint

import models
from harness import assert_close_tree, assert_same, fit, quiet_trainer

SCRIPT = Path(__file__).parent / "scripts" / "save_after_fit.py"
MODEL = models.ScheduledHeadMLP


def plan(*stages, micro_batches=3) -> Plan:
    return Plan(stages=[{"layers": list(layers), "replicas": r} for layers, r in stages], micro_batches=micro_batches)


PLAN_2_1 = plan(((0, 4), 2), ((4, 7), 1))
PLAN_1_1 = plan(((0, 3), 1), ((3, 7), 1), micro_batches=2)
PLAN_1_2 = plan(((0, 3), 1), ((3, 7), 2), micro_batches=2)
PLAN_1_1_1 = plan(((0, 2), 1), ((2, 5), 1), ((5, 7), 1), micro_batches=4)


def save_after_fit(out: Path, plan: Plan, url: bool = False, **strategy_kwargs) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    target = f"file://{out}" if url else str(out)
    command = [sys.executable, str(SCRIPT), target, MODEL.__name__, json.dumps(plan.to_dict())]
    proc = subprocess.run([*command, json.dumps(strategy_kwargs)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@dataclass
class Reference:
    """Single-device Lightning used as the script uses dapple."""

    saved: dict  # the file saved after a 4-step fit
    resumed: tuple  # a fit resumed from that file to 8 steps: (logged metrics, final state dict)
    validated: dict  # the file saved after validate, which followed the fit
    evaluated: dict  # what validate and predict returned after the fit
    second_fit: dict  # the file saved after a second fit on the same trainer, to 8 steps


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Reference:
    root = tmp_path_factory.mktemp("single")
    model = MODEL()
    trainer = quiet_trainer(devices=1, max_steps=4, limit_val_batches=2, limit_predict_batches=2)
    trainer.fit(model, models.loader())
    trainer.save_checkpoint(root / "single.ckpt")
    validated = trainer.validate(model, models.loader(), verbose=False)
    trainer.save_checkpoint(root / "validated.ckpt")
    evaluated = {"validate": validated, "predict": trainer.predict(model, models.loader())}
    trainer.fit_loop.epoch_loop.max_steps = 8
    trainer.fit(model, models.loader())
    trainer.save_checkpoint(root / "second.ckpt")
    resumed = fit(MODEL, root / "resumed", max_steps=8, ckpt_path=str(root / "single.ckpt"))
    return Reference(
        saved=torch.load(root / "single.ckpt", weights_only=False),
        resumed=resumed,
        validated=torch.load(root / "validated.ckpt", weights_only=False),
        evaluated=evaluated,
        second_fit=torch.load(root / "second.ckpt", weights_only=False),
    )


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    return save_after_fit(tmp_path_factory.mktemp("full"), PLAN_2_1)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return save_after_fit(tmp_path_factory.mktemp("sharded"), PLAN_2_1, state_dict_type="sharded")


def _assert_single_device_file(path: Path, want: dict, steps: int = 4) -> None:
    got = torch.load(path, weights_only=False)
    assert list(got["state_dict"]) == list(want["state_dict"])
    assert_close_tree(got["state_dict"], want["state_dict"])
    num_params = len(list(MODEL().parameters()))
    for optimizer in got["optimizer_states"]:
        assert len(optimizer["state"]) == num_params, "a parameter has no optimizer state in the file"
    assert_close_tree(got["optimizer_states"], want["optimizer_states"])
    assert_close_tree(got["lr_schedulers"], want["lr_schedulers"])
    assert_close_tree(got["loops"], want["loops"])
    assert got["global_step"] == want["global_step"] == steps


def test_the_file_saved_after_fit_is_complete(single, full):
    _assert_single_device_file(full / "after_fit.ckpt", single.saved)


@pytest.fixture(scope="module", params=["full", "grads"])
def sharded_stage(request, tmp_path_factory):
    """The 2:1 plan with its 2-replica stage sharded (``shard: full`` or ``grads``), used after fit."""
    plan = Plan(stages=[{"layers": [0, 4], "replicas": 2, "shard": request.param}, {"layers": [4, 7], "replicas": 1}])
    return save_after_fit(tmp_path_factory.mktemp(f"shard-{request.param}"), plan)


def test_the_file_saved_after_fit_with_a_sharded_stage_is_complete(single, sharded_stage):
    """After fit the sharded stage's replicas hold its whole weights again, and the optimizers follow them."""
    _assert_single_device_file(sharded_stage / "after_fit.ckpt", single.saved)


def test_validate_predict_and_a_second_fit_after_fit_give_single_device_numbers(single, full):
    _assert_used_after_fit_as_one_device(full, single)


def test_validate_predict_and_a_second_fit_with_a_sharded_stage_give_single_device_numbers(single, sharded_stage):
    """The stage is sharded again for validate, predict and the second fit; the optimizers kept from the
    first fit follow it onto the shards and back, so each save in between is the single-device file."""
    _assert_used_after_fit_as_one_device(sharded_stage, single)


def _assert_used_after_fit_as_one_device(out: Path, single: Reference) -> None:
    assert_close_tree(torch.load(out / "evaluated.pt", weights_only=False), single.evaluated)
    _assert_single_device_file(out / "after_validate.ckpt", single.validated)
    _assert_single_device_file(out / "after_second_fit.ckpt", single.second_fit, steps=8)


def test_validate_after_fit_keeps_the_optimizer_state(single, full):
    want = torch.load(full / "after_fit.ckpt", weights_only=False)
    got = torch.load(full / "after_validate.ckpt", weights_only=False)
    assert_close_tree(got["optimizer_states"], want["optimizer_states"])
    assert_close_tree(got["state_dict"], want["state_dict"])


@pytest.mark.parametrize("under", [PLAN_1_1, None], ids=["1:1 on 2 ranks", "one device, plain Lightning"])
def test_resuming_the_file_gives_single_device_losses(single, full, under, tmp_path):
    got = fit(MODEL, tmp_path, plan=under, max_steps=8, ckpt_path=str(full / "after_fit.ckpt"))
    assert_same(got, single.resumed)


def test_each_owner_writes_its_own_part_of_a_sharded_checkpoint(sharded):
    import torch.distributed.checkpoint as dcp

    directory = sharded / "after_fit.ckpt"
    metadata = dcp.FileSystemReader(directory).read_metadata()
    files = {index.fqn: info.relative_path for index, info in metadata.storage_data.items()}
    # Stage 0 (layers 0-3, ranks 0 and 1) is written by rank 0, stage 1 (layers 4-6) by rank 2, even
    # after fit has put every weight back on rank 0; rank 0 also writes what is outside the container.
    for key, file in files.items():
        want = "__2_0.distcp" if key.startswith(("model/layers.5.", "optim/0/layers.5.")) else "__0_0.distcp"
        assert file == want, (key, file)
    assert "model/layers.5.weight" in files and "optim/0/layers.5.weight/exp_avg" in files
    assert "model/head.weight" in files and "model/layers.1.weight" in files


@pytest.mark.parametrize("under", [PLAN_1_2, PLAN_1_1_1], ids=["1:2", "1:1:1"])
def test_resuming_a_sharded_checkpoint_under_another_plan(single, sharded, under, tmp_path):
    got = fit(MODEL, tmp_path, plan=under, max_steps=8, ckpt_path=str(sharded / "after_fit.ckpt"))
    assert_same(got, single.resumed)


def test_a_consolidated_sharded_checkpoint_is_the_single_device_file(single, sharded, tmp_path):
    path = consolidate_checkpoint(sharded / "after_fit.ckpt", tmp_path / "one.ckpt")
    _assert_single_device_file(path, single.saved)
    model = MODEL.load_from_checkpoint(path, map_location="cpu")
    assert_close_tree(dict(model.state_dict()), dict(single.saved["state_dict"]))
    assert_same(fit(MODEL, tmp_path / "resumed", max_steps=8, ckpt_path=str(path)), single.resumed)


def test_the_consolidation_command(sharded, tmp_path):
    out = tmp_path / "one.ckpt"
    command = [
        sys.executable,
        "-m",
        "dapple_lightning.strategy.consolidate",
        str(sharded / "after_validate.ckpt"),
        str(out),
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert torch.load(out, weights_only=False)["global_step"] == 4


def test_saving_in_the_main_process_after_a_spawned_fit_is_refused(tmp_path):
    from dapple_lightning import DappleStrategy

    trainer = quiet_trainer(devices=2, strategy=DappleStrategy(PLAN_1_1, start_method="spawn"), max_steps=1)
    trainer.fit(MODEL(), models.loader())
    with pytest.raises(RuntimeError, match="stayed in the spawned ranks"):
        trainer.save_checkpoint(tmp_path / "x.ckpt")
    assert not (tmp_path / "x.ckpt").exists()


def test_a_checkpoint_to_a_url_round_trips(single, tmp_path):
    """fsspec URLs go through Lightning's checkpoint IO, on every rank, unmangled."""
    save_after_fit(tmp_path / "saved", PLAN_2_1, url=True)
    url = f"file://{tmp_path}/saved/after_fit.ckpt"
    assert_same(fit(MODEL, tmp_path / "resumed", plan=PLAN_1_1, max_steps=8, ckpt_path=url), single.resumed)


def test_a_checkpoint_to_memory_round_trips(tmp_path):
    script = Path(__file__).parent / "scripts" / "remote_checkpoint.py"
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["written"]
    torch.testing.assert_close(torch.tensor(result["dapple"]), torch.tensor(result["single"]), rtol=1e-5, atol=1e-7)


class SaveToURL(Callback):
    def on_train_end(self, trainer, pl_module):
        trainer.save_checkpoint("memory://bucket/x.ckpt")


def test_a_sharded_checkpoint_to_a_url_is_refused(tmp_path):
    with pytest.raises(Exception, match="writes a directory on a local or mounted shared filesystem"):
        fit(MODEL, tmp_path, plan=PLAN_1_1, callbacks=(SaveToURL(),), strategy_kwargs={"state_dict_type": "sharded"})
