"""Bad input is refused with a message that names the problem and the fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import MixedPrecision

from dapple_lightning import DappleStrategy, Plan

import models


def plan(*stages, micro_batches=2) -> Plan:
    return Plan(stages=[{"layers": list(layers), "replicas": r} for layers, r in stages], micro_batches=micro_batches)


TWO = plan(((0, 3), 1), ((3, 7), 1))


def run(model, strategy, devices, batch_size=models.BATCH, **kwargs):
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        **kwargs,
    )
    trainer.fit(model, models.loader(batch_size))


def spawn(p: Plan, **kwargs) -> DappleStrategy:
    return DappleStrategy(p, start_method="forkserver", **kwargs)


# Refused in every rank before the process group starts.
@pytest.mark.parametrize(
    ("model", "strategy", "devices", "message"),
    [
        (models.MLP, spawn(TWO), 3, r"needs 2 ranks \(replicas 1:1\) but the Trainer runs 3"),
        (models.MLP, spawn(plan(((0, 3), 1), ((3, 9), 1))), 2, "model's Sequential has 7 layers"),
        (models.NoSequential, spawn(TWO), 2, "has no nn.Sequential or nn.ModuleList attribute"),
        (models.TwoSequentials, spawn(TWO), 2, r"several nn.Sequential/nn.ModuleList attributes \('layers', 'other'\)"),
        (models.MLP, spawn(TWO, sequential="body"), 2, "no submodule 'body'"),
    ],
    ids=["world-size", "layer-range", "no-sequential", "two-sequentials", "unknown-name"],
)
def test_refused_before_any_collective(model, strategy, devices, message):
    with pytest.raises(Exception, match=message):
        run(model(), strategy, devices)


def test_unsupported_precision():
    # Lightning turns precision="16-mixed" into bf16 on CPU, so hand the plugin over directly.
    fp16 = MixedPrecision(precision="16-mixed", device="cpu")
    with pytest.raises(Exception, match=r"precision='16-mixed' is not supported.*bf16-mixed"):
        run(models.MLP(), spawn(TWO, precision_plugin=fp16), 2)


# Found on the first micro-batch by the stage that sees it; the other ranks end as they lose it.
# Run as a plain script: spawn would report whichever rank it notices first.
@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("CallsTwice", "called the pipelined Sequential more than once"),
        ("NeverCalls", "did not call the pipelined Sequential"),
        ("DictActivation", "output of stage 0 is of type dict; what flows between pipeline stages must be a tensor"),
        (
            "T5LikeBlocks",  # 6 rows per micro-batch; the bias is one row, shared by every row
            "the output of stage 0 is a 3-item tuple whose item 2 is None, not a tensor (item 0: a tensor of shape "
            "(6, 16); item 1: a tensor of shape (1, 16), whose dim 0 is not the batch's 6 rows; item 2: None); what "
            "flows between pipeline stages must be a tensor or a tuple of tensors, each with the batch in dim 0: the "
            "tuple of items [0] would pass",
        ),
    ],
    ids=["twice", "never", "dict-activation", "t5-like-tuple"],
)
def test_step_contract(model, message, tmp_path):
    layers = len(getattr(models, model)().layers)
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(plan(((0, 2), 1), ((2, layers), 1)).to_yaml())
    script = Path(__file__).parent / "scripts" / "fit_model.py"
    proc = subprocess.run(
        [sys.executable, str(script), model, str(plan_file)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0
    assert (proc.stdout + proc.stderr).count(message) == 1, proc.stderr[-3000:]


def test_batch_too_small_for_the_plan():
    too_many = plan(((0, 3), 2), ((3, 7), 1), micro_batches=4)  # needs 4 x 2 rows
    with pytest.raises(
        Exception, match="micro-batch 1 has 1 rows but stage 0 has 2 replicas; use a global batch of at least 8 rows"
    ):
        run(models.MLP(), spawn(too_many), 3, batch_size=5)


def test_uneven_batches_split_and_still_match(tmp_path):
    """A batch that does not divide evenly is split near-evenly; numbers still match one device."""
    from harness import assert_same, fit

    uneven = plan(((0, 3), 2), ((3, 7), 1), micro_batches=5)  # 12 rows -> 3,3,2,2,2 then 2:1 splits
    assert_same(fit(models.MLP, tmp_path / "d", plan=uneven), fit(models.MLP, tmp_path / "s"))


def test_plan_given_as_garbage_fails_in_the_constructor():
    with pytest.raises(ValueError, match="unknown plan keys"):
        DappleStrategy({"stagez": []})
