"""The command line: tables, JSON, profile formats and errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dapple_lightning.plan import Plan
from dapple_lightning.planner import REFERENCE_PROFILES, LayerProfile, ModelProfile
from dapple_lightning.planner.__main__ import main

VGG = str(REFERENCE_PROFILES / "vgg-19-pbs-32.txt")


def test_table_lists_plans_and_baselines(capsys):
    assert main(["--profile", VGG, "--cluster", "16x1", "--global-batch", "1024", "--top", "2", "--baselines"]) == 0
    out = capsys.readouterr().out
    assert "26 layers at batch 32" in out
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("#"))
    for column in ("plan", "cuts", "M", "step s", "sim s", "mem GB", "vs DP", "pivot"):
        assert column in header
    methods = ("dapple", "pipedream", "straight", "data-parallel")
    rows = [line for line in lines if len(line.split()) > 2 and line.split()[1] in methods]
    assert [r.split()[1] for r in rows] == ["dapple", "dapple", "pipedream", "straight", "data-parallel"]
    assert rows[0].split()[2] == "15:1"  # the paper's VGG-19 plan, on V100 constants
    assert "replicas: 15" in out


def test_json_is_the_best_plan(capsys):
    assert main(["--profile", VGG, "--cluster", "2x8", "--global-batch", "1024", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    plan = Plan.from_dict(data["plan"])
    assert plan.world_size == 16 and plan.num_layers == 26
    assert data["predicted_step_s"] > 0 and data["speedup_vs_dp"] > 1
    assert data["cluster"] == "2x8" and data["global_batch"] == 1024
    assert {"pivot", "warmup_s", "steady_s", "ending_s", "simulated_step_s", "stage_memory_bytes"} <= set(data)


def test_json_profile_and_overrides(tmp_path, capsys):
    layers = tuple(LayerProfile(f"l{i}", 1e-3, 2e-3, 10**6, 10**8) for i in range(4))
    path = tmp_path / "model.json"
    ModelProfile(layers, 8).save(path)
    args = ["--profile", str(path), "--cluster", "1x4", "--global-batch", "32", "--json"]
    assert main([*args, "--micro-batches", "2,4", "--p2p-gbps", "50,2", "--allreduce-gbps", "10"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["micro_batches"] in (2, 4)
    assert main([*args, "--schedule", "gpipe", "--placements", "append"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["schedule"] == "gpipe"


def test_errors_exit_2_with_a_message(tmp_path, capsys):
    layers = (LayerProfile("big", 1e-3, 2e-3, 10**6, 10**10),)  # 40 GB with Adam
    path = tmp_path / "big.json"
    ModelProfile(layers, 8).save(path)
    assert main(["--profile", str(path), "--cluster", "1x2", "--global-batch", "8"]) == 2
    assert "no plan fits in 16.00 GB" in capsys.readouterr().err
    assert main(["--profile", str(tmp_path / "missing.json"), "--global-batch", "8"]) == 2
    assert "missing.json" in capsys.readouterr().err
    text = tmp_path / "model.txt"
    text.write_text(
        "node1 -- A -- forward_compute_time=1, backward_compute_time=1, activation_size=1, parameter_size=1\n"
    )
    assert main(["--profile", str(text), "--global-batch", "8"]) == 2
    assert "--profile-batch" in capsys.readouterr().err
    assert main(["--profile", str(text), "--profile-batch", "1", "--cluster", "1x1", "--global-batch", "8"]) == 0


def test_bad_bandwidth_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--profile", "x", "--global-batch", "8", "--p2p-gbps", "fast"])
    assert info.value.code == 2
    assert "GB/s" in capsys.readouterr().err


def test_the_planner_and_its_cli_import_neither_torch_nor_lightning():
    # A pure planner starts in a fraction of torch's own import time; run in a fresh process so
    # that what other tests imported does not count.
    script = (
        "import runpy, sys\n"
        "sys.argv = ['planner', '--help']\n"
        "try:\n"
        "    runpy.run_module('dapple_lightning.planner', run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'lightning', 'optuna')))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60)
    assert "usage: python -m dapple_lightning.planner" in done.stdout
    assert done.stdout.splitlines()[-1] == "[]"


def _memory_unbalanced(tmp_path):
    # The first layer has the most compute and almost no weights, the other three 300 MB each
    # (1.2 GB with gradients and Adam): balanced for time, the second stage holds all three.
    heavy = tuple(LayerProfile(f"l{i}", 1e-3, 2e-3, 10**6, 3 * 10**8) for i in range(3))
    path = tmp_path / "unbalanced.json"
    ModelProfile((LayerProfile("a", 3e-3, 6e-3, 10**6, 10**7), *heavy), 8).save(path)
    return ["--profile", str(path), "--cluster", "1x2", "--global-batch", "16", "--memory-gb", "8"]


def test_each_stage_peak_is_printed_beside_the_budget(tmp_path, capsys):
    args = _memory_unbalanced(tmp_path)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "predicted peak memory per device, best plan (budget 8.00 GB per device):" in out
    assert "  stage 0 (layers 0-0, 1 replica): 0.04 GB of 8.00 GB (1%)" in out
    assert "  stage 1 (layers 1-3, 1 replica): 3.60 GB of 8.00 GB (45%)" in out
    assert main([*args, "--objective", "memory"]) == 0
    out = capsys.readouterr().out
    assert "(budget 8.00 GB per device; objective memory allows 2.40 GB):" in out
    assert "  stage 0 (layers 0-1, 1 replica): 1.24 GB of 8.00 GB (16%)" in out
    assert "  stage 1 (layers 2-3, 1 replica): 2.40 GB of 8.00 GB (30%)" in out


def test_objective_and_margin_reach_the_planner(tmp_path, capsys):
    args = [*_memory_unbalanced(tmp_path), "--json"]
    assert main([*args, "--objective", "time-within-memory", "--memory-margin", "0.1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["objective"] == "time-within-memory" and data["memory_budget_bytes"] == 8e9
    assert max(data["stage_memory_bytes"]) <= data["peak_limit_bytes"] < 8e9
    assert [s["layers"] for s in data["plan"]["stages"]] == [[0, 2], [2, 4]]
    # A margin wide enough lets the time-balanced plan back in.
    assert main([*args, "--objective", "time-within-memory", "--memory-margin", "1"]) == 0
    assert [s["layers"] for s in json.loads(capsys.readouterr().out)["plan"]["stages"]] == [[0, 1], [1, 4]]


def test_bad_objective_or_margin_is_refused(tmp_path, capsys):
    args = _memory_unbalanced(tmp_path)
    with pytest.raises(SystemExit) as info:
        main([*args, "--objective", "speed"])
    assert info.value.code == 2
    assert "invalid choice: 'speed'" in capsys.readouterr().err
    assert main([*args, "--objective", "time-within-memory", "--memory-margin", "-0.5"]) == 2
    assert "memory_margin must be a finite number >= 0" in capsys.readouterr().err


def test_a_memory_limit_as_text_keeps_the_fastest_plan_out_when_it_does_not_fit(tmp_path, capsys):
    args = [*_memory_unbalanced(tmp_path)[:-2], "--json"]  # without --memory-gb 8
    assert main([*args, "--memory-limit", "3GB"]) == 0
    data = json.loads(capsys.readouterr().out)
    # The time-balanced plan's 3.60 GB stage is over the limit: a plan that fits is chosen.
    assert data["memory_budget_bytes"] == 3e9 and max(data["stage_memory_bytes"]) <= 3e9
    assert [s["layers"] for s in data["plan"]["stages"]] != [[0, 1], [1, 4]]
    with pytest.raises(SystemExit):
        main([*args, "--memory-limit", "3 parsecs"])
    assert "--memory-limit='3 parsecs' is not a size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*args, "--memory-limit", "3GB", "--memory-gb", "3"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_recompute_lets_a_stage_fit_that_would_not(tmp_path, capsys):
    # Each layer saves 2 GB for its backward and passes on 1 MB (tests/planner/test_dp.py).
    layer = LayerProfile("l", 1e-3, 2e-3, 10**6, 10**6, saved_bytes=2 * 10**9, peak_bytes=2 * 10**9)
    path = tmp_path / "saves.json"
    ModelProfile((layer,) * 4, 1, cut_bytes=(0, 10**6, 10**6, 10**6, 0)).save(path)
    args = ["--profile", str(path), "--cluster", "1x2", "--global-batch", "1", "--memory-gb", "3"]
    assert main(args) == 2
    assert "no plan fits" in capsys.readouterr().err
    assert main([*args, "--recompute"]) == 0
    assert "  stage 1 (layers 1-3, 1 replica, recomputing): 2.02 GB of 3.00 GB" in capsys.readouterr().out
    assert main([*args, "--recompute", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["stages"][1]["recompute"] is True
