"""The examples run end to end as their own commands, on 2 CPU processes, with tiny settings.

Each test runs ``python examples/<name>.py`` (a Hydra app) in a subprocess from the repository
root, as a user would, with Hydra's output directory under ``tmp_path``.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]

COMMON = [
    "trainer.max_steps=5",
    "trainer.val_check_interval=5",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
]
TINY = {
    "gpt": [
        "model.n_blocks=2",
        "model.d_model=32",
        "model.n_heads=2",
        "model.context=16",
        "data.batch_size=8",
        "sample_chars=20",
    ],
    "llama": [
        "model.n_layers=2",
        "model.hidden_size=32",
        "model.intermediate_size=64",
        "model.n_heads=2",
        "model.n_kv_heads=1",
        "model.context=16",
        "data.batch_size=8",
        "sample_chars=20",
    ],
    "cnn": [
        "model.image_size=16",
        "model.conv_blocks=2",
        "model.base_channels=8",
        "model.fc_width=64",
        "data.batch_size=8",
        "data.val_size=64",
    ],
}
FINAL = re.compile(r"^\s*(train_loss|val_loss)\s+first ([-\d.e+]+|nan) .*final ([-\d.e+]+|nan) ", re.MULTILINE)


def run_example(name: str, out: Path, *overrides: str, multirun: bool = False) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "examples" / f"{name}.py")]
    if multirun:
        command.append("-m")
    command += [*COMMON, *TINY[name], *overrides]
    command.append(f"hydra.sweep.dir={out}" if multirun else f"hydra.run.dir={out}")
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (
        f"{' '.join(command)}\nexited {proc.returncode}\n--- stdout\n{proc.stdout[-5000:]}\n--- stderr\n{proc.stderr[-5000:]}"
    )
    return proc


def printed_losses(stdout: str) -> dict[str, tuple[float, float]]:
    return {name: (float(first), float(last)) for name, first, last in FINAL.findall(stdout)}


def check_job(job_dir: Path) -> dict:
    assert (job_dir / "csv" / "metrics.csv").is_file(), f"no metrics in {job_dir}"
    report = json.loads((job_dir / "losses.json").read_text())
    assert report["train_loss"]["last_step"] == 5
    throughput = report.pop("samples_per_s")
    assert throughput > 0
    for entry in report.values():
        assert math.isfinite(entry["first"]) and math.isfinite(entry["last"])
    return report


@pytest.mark.parametrize("name", ["gpt", "cnn", "llama"])
def test_example_runs_a_two_stage_pipeline(name, tmp_path):
    proc = run_example(name, tmp_path)
    losses = printed_losses(proc.stdout)
    assert set(losses) == {"train_loss", "val_loss"}, proc.stdout
    assert all(math.isfinite(v) for pair in losses.values() for v in pair)
    report = check_job(tmp_path)
    assert report["val_loss"]["first_step"] == 0  # the sanity check's: before any step
    config = yaml.safe_load((tmp_path / ".hydra" / "config.yaml").read_text())
    assert len(config["plan"]["stages"]) == 2  # the default plan is a pipeline, not data parallel
    if name in ("gpt", "llama"):
        assert "sample (20 characters" in proc.stdout


def test_popen_single_run(tmp_path):
    """Lightning re-runs the command for rank 1 (with Hydra's run dir); fine for a single run."""
    proc = run_example("gpt", tmp_path, "strategy.start_method=popen")
    assert set(printed_losses(proc.stdout)) == {"train_loss", "val_loss"}, proc.stdout
    check_job(tmp_path)


def test_multirun_sweeps_micro_batches(tmp_path):
    """``-m plan.micro_batches=2,4``: two jobs, one after the other, each on 2 processes."""
    proc = run_example("gpt", tmp_path, "plan.micro_batches=2,4", multirun=True)
    assert len(FINAL.findall(proc.stdout)) == 4, proc.stdout  # train and val loss of each job
    for job, micro_batches in enumerate((2, 4)):
        check_job(tmp_path / str(job))
        config = yaml.safe_load((tmp_path / str(job) / ".hydra" / "config.yaml").read_text())
        assert config["plan"]["micro_batches"] == micro_batches
