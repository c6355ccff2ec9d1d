"""plan="auto" under a memory_limit that no whole-state plan meets shards a replicated stage, and trains as one device."""

from __future__ import annotations

import dataclasses
import json

import pytest
from test_offload import Chosen

from dapple_lightning import DappleStrategy
from dapple_lightning.autoplan import optimizer_factory
from dapple_lightning.planner import Cluster, estimate, plan_dapple, profile_layers, shortlist_with_levers

import models
from harness import assert_same, fit

MODEL, RANKS = models.WideMiddleMLP, 3


def test_auto_shards_a_replicated_stage_when_no_plan_fits_whole_and_trains_as_one_device(tmp_path):
    module = MODEL()
    x, _ = next(iter(models.loader()))
    # The profile plan='auto' takes on 3 ranks (a third of the batch), priced here to set the budget
    # between the least a whole-state plan needs and what the sharded plan needs.
    profile = profile_layers(list(module.layers), x[: len(x) // RANKS], optimizer=optimizer_factory(module), repeats=1)
    lifted = Cluster(1, RANKS, 1e9, 1e9, 1e9, 1e9, latency_s=0.0, memory_bytes=1e12)
    leanest = plan_dapple(profile, lifted, len(x), objective="memory")[0].plan
    whole = max(estimate(leanest, profile, lifted, len(x)).memory_bytes)  # the least any whole-state plan needs
    [(sharded, _)], _, _, _ = shortlist_with_levers(
        profile, dataclasses.replace(lifted, memory_bytes=whole - 1), len(x)
    )
    least = max(estimate(sharded, profile, lifted, len(x)).memory_bytes)
    assert least < 0.8 * whole, (least, whole)
    limit = (least + whole) / 2  # halfway: the profile plan='auto' takes again may measure a little differently
    within = dataclasses.replace(lifted, memory_bytes=limit)
    with pytest.raises(ValueError, match="no plan fits in"):
        plan_dapple(profile, within, len(x), recompute=True)
    _, _, lever, _ = shortlist_with_levers(profile, within, len(x), offload_refused="not here")
    assert "shards its state over its" in lever

    strategy = DappleStrategy(start_method="forkserver", memory_limit=limit)
    metrics, weights = fit(MODEL, tmp_path / "auto", devices=RANKS, strategy=strategy, callbacks=(Chosen(tmp_path),))
    chosen = json.loads((tmp_path / "chosen0.json").read_text())
    sharded = [k for k, s in enumerate(chosen["plan"]["stages"]) if s.get("shard") is not None]
    assert sharded and all(s.get("offload") is None for s in chosen["plan"]["stages"]), chosen
    assert f"stage {sharded[0]} (layers" in chosen["report"] and "shards its state over its" in chosen["report"]
    assert "OVER BUDGET" not in chosen["report"]
    assert_same((metrics, weights), fit(MODEL, tmp_path / "single"))
