"""The one-GPU check's dry mode (benchmarks/gpu_check.py --dry): every section runs its code on CPU
processes and reports pass, fail or skipped with reasons; what needs CUDA is skipped, never passed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
NEEDS_CUDA = {"free_memory", "auto_peak_memory", "trace_fill", "host_sync", "event_timing"}
RIGHT_ON_CPU = {
    "versions",
    "one_stage_m4",
    "bf16_mixed",
    "recompute_dropout",
    "auto_plan",
    "zero_bubble_gradients",
    "zero_bubble_transient",
    "gloo_two_ranks",
    "refusals",
    "batch_bytes",
}


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dry_report(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("gpu-check") / "report.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    # The limit only turns a hang into a failure.
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry", "--out", str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), out.with_suffix(".md").read_text()


def test_the_dry_mode_reports_every_section_with_a_status_and_reasons(dry_report) -> None:
    report, table = dry_report
    sections = report["sections"]
    assert set(sections) == set(_script().SECTIONS) == NEEDS_CUDA | RIGHT_ON_CPU
    for name, section in sections.items():
        assert section["status"] in ("pass", "fail", "skipped"), name
        assert section["reasons"] and all(isinstance(r, str) and r for r in section["reasons"]), name
        assert f"| {name} | {section['status']} |" in table, name


def test_what_needs_cuda_is_skipped_in_the_dry_mode_never_passed(dry_report) -> None:
    sections = dry_report[0]["sections"]
    for name in NEEDS_CUDA:
        assert sections[name]["status"] == "skipped", sections[name]
        assert sections[name]["reasons"][0].startswith("skipped: needs CUDA"), sections[name]


def test_what_the_cpu_can_show_passes_in_the_dry_mode(dry_report) -> None:
    sections = dry_report[0]["sections"]
    failed = {name: sections[name]["reasons"] for name in RIGHT_ON_CPU if sections[name]["status"] != "pass"}
    assert not failed, failed
    assert len(sections["refusals"]["reasons"]) == 3  # the three refusals, each tried


def test_a_comparison_fails_on_different_or_missing_losses() -> None:
    compare = _script()._compare
    assert compare([1.0, 2.0], [1.0, 2.0], 1e-5, "same")["status"] == "pass"
    assert compare([1.0, 2.1], [1.0, 2.0], 1e-5, "apart")["status"] == "fail"
    assert compare([1.0], [1.0, 2.0], 1e-5, "short")["status"] == "fail"
    assert compare([], [], 1e-5, "none")["status"] == "fail"
