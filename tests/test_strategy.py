"""Trainer(strategy=DappleStrategy(...)) on real CPU processes against single-device Lightning."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

from dapple_lightning import DappleStrategy, Plan

import models
from harness import assert_same, fit, read_metrics

SHAPES = {
    "1x2": [((0, 7), 2)],
    "2x1": [((0, 3), 1), ((3, 7), 1)],
    "3x1": [((0, 2), 1), ((2, 5), 1), ((5, 7), 1)],
    "2:1": [((0, 4), 2), ((4, 7), 1)],
    "1:2": [((0, 4), 1), ((4, 7), 2)],
    "2:2": [((0, 4), 2), ((4, 7), 2)],
}


def make_plan(shape: str, schedule: str, micro_batches: int = 3) -> Plan:
    stages = [{"layers": list(layers), "replicas": r} for layers, r in SHAPES[shape]]
    return Plan(stages=stages, micro_batches=micro_batches, schedule=schedule)


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    cache = {}

    def get(model_cls, val=False):
        key = (model_cls, val)
        if key not in cache:
            cache[key] = fit(model_cls, tmp_path_factory.mktemp("ref"), val=val)
        return cache[key]

    return get


@pytest.mark.parametrize("schedule", ["dapple", "gpipe"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_losses_and_weights_match_single_device(shape, schedule, tmp_path, single_device):
    assert_same(fit(models.MLP, tmp_path, plan=make_plan(shape, schedule)), single_device(models.MLP))


@pytest.mark.parametrize("shape", ["2x1", "2:1"])
def test_tuple_activations(shape, tmp_path, single_device):
    assert_same(fit(models.TupleMLP, tmp_path, plan=make_plan(shape, "dapple")), single_device(models.TupleMLP))


@pytest.mark.parametrize("shape", ["3x1", "1:2"])
def test_parameters_outside_the_sequential(shape, tmp_path, single_device):
    assert_same(fit(models.HeadMLP, tmp_path, plan=make_plan(shape, "dapple")), single_device(models.HeadMLP))


def test_validation_logs_match_single_device(tmp_path, single_device):
    assert_same(
        fit(models.MLP, tmp_path, plan=make_plan("2:1", "dapple"), val=True),
        single_device(models.MLP, val=True),
    )


def test_script_launched_plainly_matches_single_device(tmp_path, single_device):
    """Lightning's default launcher re-runs the script for each rank (not spawn)."""
    import subprocess
    import sys

    plan_path = tmp_path / "plan.yaml"
    plan_path.write_text(make_plan("2x1", "dapple").to_yaml())
    script = Path(__file__).parent / "scripts" / "fit_mlp.py"
    subprocess.run([sys.executable, str(script), str(tmp_path), str(plan_path)], check=True, timeout=300, cwd=tmp_path)
    got = read_metrics(tmp_path / "run" / "version_0" / "metrics.csv"), torch.load(tmp_path / "final.pt")
    assert_same(got, single_device(models.MLP))


def test_chrome_trace_has_one_track_and_memory_counter_per_rank_and_a_plan_over_the_limit_is_warned(tmp_path, capfd):
    import json

    from dapple_lightning.runtime import bubble_fractions  # noqa: F401  (used by the benchmark)

    plan = make_plan("2:1", "dapple")
    trace = tmp_path / "trace.json"
    model = models.MLP()
    # spawn, not the forkserver: rank 0's warning must reach this test's captured stderr.
    strategy = DappleStrategy(plan, start_method="spawn", trace=str(trace), track_memory=True, memory_limit="1KiB")
    trainer = Trainer(
        accelerator="cpu",
        devices=plan.world_size,
        strategy=strategy,
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(model, train_dataloaders=models.loader())
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1, 2}
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0 (stage 0)", 1: "rank 1 (stage 0)", 2: "rank 2 (stage 1)"}
    for e in spans:
        assert e["dur"] >= 0 and e["ts"] >= 0 and isinstance(e["name"], str)
    # every rank ran 3 forwards and 3 backwards in each of the 2 steps
    for rank in range(3):
        assert sum(e["cat"] == "forward" for e in spans if e["pid"] == rank) == 6
        assert sum(e["cat"] == "backward" for e in spans if e["pid"] == rank) == 6
    assert {e["cat"] for e in spans} >= {"forward", "backward", "send", "recv", "allreduce"}
    # A memory sample after each pass: what the rank's live micro-batches keep, rising through
    # the warm-up (stage 0 keeps both of its first two micro-batches under 1F1B) and nothing at the end.
    for rank in range(3):
        held = [e["args"]["bytes"] for e in events if e["ph"] == "C" and e["pid"] == rank]
        assert all(e["name"] == "memory" for e in events if e["ph"] == "C")
        assert len(held) == 2 * 6 and held[5] == held[-1] == 0
        assert max(held) > 0 and (rank == 2 or held[1] > held[0] > 0)
    # The hand-given plan was predicted over memory_limit on rank 0: warned, with the stages and numbers.
    err = capfd.readouterr().err
    assert "is predicted to need more memory per rank than memory_limit 1.0 KiB: stage 0 (layers 0-3)" in err


def test_torchrun_launch_matches_single_device(tmp_path, single_device):
    """Under torchrun Lightning sees an external cluster environment and launches nothing itself."""
    import subprocess
    import sys

    plan_path = tmp_path / "plan.yaml"
    plan_path.write_text(make_plan("1:2", "dapple").to_yaml())
    script = Path(__file__).parent / "scripts" / "fit_mlp.py"
    from distributed import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3", "--master_port", str(free_port())]
    subprocess.run([*cmd, str(script), str(tmp_path), str(plan_path)], check=True, timeout=300, cwd=tmp_path)
    got = read_metrics(tmp_path / "run" / "version_0" / "metrics.csv"), torch.load(tmp_path / "final.pt")
    assert_same(got, single_device(models.MLP))


def test_auto_plan_profiles_plans_and_trains_like_single_device(tmp_path, single_device):
    got = fit(models.MLP, tmp_path, plan=None, devices=2, strategy=DappleStrategy(start_method="forkserver"))
    assert_same(got, single_device(models.MLP))


def test_registered_name_is_the_auto_plan():
    from lightning.pytorch.strategies import StrategyRegistry

    strategy = StrategyRegistry.get("dapple")
    assert isinstance(strategy, DappleStrategy) and strategy._plan_spec == "auto"


def test_short_last_batch_changes_activation_shapes(tmp_path):
    """48 rows in batches of 10: the fifth batch has 8 rows, so every shape on the wire changes."""
    plan = make_plan("2:1", "dapple")
    assert_same(
        fit(models.MLP, tmp_path / "d", plan=plan, batch_size=10, max_steps=5),
        fit(models.MLP, tmp_path / "s", batch_size=10, max_steps=5),
    )


def test_slurm_environment_matches_single_device(tmp_path, single_device):
    """Ranks started as srun would start them: Lightning's SLURM environment, no launcher of ours."""
    import os
    import subprocess
    import sys

    from distributed import free_port

    plan_path = tmp_path / "plan.yaml"
    plan_path.write_text(make_plan("2x1", "dapple").to_yaml())
    script = Path(__file__).parent / "scripts" / "fit_mlp.py"
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "SLURM_NTASKS": "2",
            "SLURM_NTASKS_PER_NODE": "2",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_NODEID": "0",
            "SLURM_NODELIST": "localhost",
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NAME": "dapple-test",
            "MASTER_PORT": port,
        }
        procs.append(
            subprocess.Popen([sys.executable, str(script), str(tmp_path), str(plan_path)], env=env, cwd=tmp_path)
        )
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    got = read_metrics(tmp_path / "run" / "version_0" / "metrics.csv"), torch.load(tmp_path / "final.pt")
    assert_same(got, single_device(models.MLP))
