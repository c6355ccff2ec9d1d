"""Zero bubble through Lightning on real CPU processes against single-device Lightning (per-step
losses and final weights): ZB-H1 for straight, replicated and non-uniform plans, ZB-H2 on a
non-uniform one with parameters outside the Sequential, zb-tail (whole and split backwards on one
stage) on another (tests/test_runtime.py runs the three schedules on every plan shape, without
Lightning)."""

from __future__ import annotations

import pytest

from dapple_lightning import Plan

import models
from harness import assert_same, fit

SHAPES = {
    "3x1": [((0, 2), 1), ((2, 5), 1), ((5, 7), 1)],
    "2:1": [((0, 4), 2), ((4, 7), 1)],
    "1:2:1": [((0, 2), 1), ((2, 5), 2), ((5, 7), 1)],
}


def zero_bubble(shape: str, micro_batches: int = 4, schedule: str = "zb-h1") -> Plan:
    stages = [{"layers": list(layers), "replicas": r} for layers, r in SHAPES[shape]]
    return Plan(stages=stages, micro_batches=micro_batches, schedule=schedule)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_zb_h1_trains_like_one_device(shape, tmp_path):
    assert_same(fit(models.MLP, tmp_path / "zb", plan=zero_bubble(shape)), fit(models.MLP, tmp_path / "one"))


def test_zb_h2_with_parameters_outside_the_sequential(tmp_path):
    # The embedding and head are shared parameters: their gradients come from the first and last
    # stages' W's and are summed over every rank. Stage 0 runs 3 forwards ahead, stage 1 stashes 2 W's.
    got = fit(models.HeadMLP, tmp_path / "zb", plan=zero_bubble("2:1", schedule="zb-h2"))
    assert_same(got, fit(models.HeadMLP, tmp_path / "one"))


def test_zb_tail_mixes_whole_and_split_backwards(tmp_path):
    # 1:2:1 at M = 4: stage 0 runs every backward whole, stage 1 (two replicas) micro-batch 0's
    # whole and the last three split, stage 2 all four split; the embedding and head are shared.
    got = fit(models.HeadMLP, tmp_path / "zb", plan=zero_bubble("1:2:1", schedule="zb-tail"))
    assert_same(got, fit(models.HeadMLP, tmp_path / "one"))
