"""ZB-H1 through Lightning on real CPU processes against single-device Lightning (per-step losses
and final weights), for straight, replicated and non-uniform plans."""

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


def zero_bubble(shape: str, micro_batches: int = 4) -> Plan:
    stages = [{"layers": list(layers), "replicas": r} for layers, r in SHAPES[shape]]
    return Plan(stages=stages, micro_batches=micro_batches, schedule="zb-h1")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_zb_h1_trains_like_one_device(shape, tmp_path):
    assert_same(fit(models.MLP, tmp_path / "zb", plan=zero_bubble(shape)), fit(models.MLP, tmp_path / "one"))


def test_zb_h1_with_parameters_outside_the_sequential(tmp_path):
    # The embedding and head are shared parameters: their gradients come from the first and last
    # stages' W's and are summed over every rank.
    got = fit(models.HeadMLP, tmp_path / "zb", plan=zero_bubble("2:1"))
    assert_same(got, fit(models.HeadMLP, tmp_path / "one"))
