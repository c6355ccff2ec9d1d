"""When no plan fits the memory budget, plan='auto' recomputes, then offloads (planner._levers)."""

from __future__ import annotations

import pytest

from dapple_lightning.planner import GB, Cluster, LayerProfile, ModelProfile, estimate, shortlist_with_levers


def test_recomputation_comes_first_when_activations_are_what_does_not_fit():
    # Each layer saves 2 GB for its backward but passes on 1 MB: only recomputing stages fit in 3 GB.
    layers = tuple(
        LayerProfile(f"l{i}", 1e-3, 2e-3, 10**6, 10**6, saved_bytes=2 * 10**9, peak_bytes=2 * 10**9) for i in range(4)
    )
    profile = ModelProfile(layers, 1, cut_bytes=(0, 10**6, 10**6, 10**6, 0))
    close, dp_step, lever, offers = shortlist_with_levers(profile, Cluster.v100(1, 2, memory_bytes=3 * GB), 1)
    (plan, _), *_ = close
    assert any(s.recompute for s in plan.stages) and not any(s.offload for s in plan.stages)
    assert dp_step is None and lever is not None and "recompute theirs" in lever
    assert offers == {}  # a recomputing plan has no chunked variant (chunked plans run no recompute)


def test_offload_comes_next_when_the_weights_are_what_does_not_fit():
    # 8 layers of 0.25 GB of parameters (1 GB with gradients and Adam's state): on 2 devices a stage holds
    # at least 4 GB in memory, over 3 GB even recomputing; offloaded it holds a window's worth.
    layers = tuple(LayerProfile(f"l{i}", 1e-3, 2e-3, 10**6, GB // 4, optimizer_state_bytes=GB // 2) for i in range(8))
    profile = ModelProfile(layers, 1)
    cluster = Cluster.v100(1, 2, memory_bytes=3 * GB)
    close, _, lever, offers = shortlist_with_levers(profile, cluster, 8)
    (plan, predicted), *_ = close
    priced = estimate(plan, profile, cluster, 8)
    assert priced.fits and any(s.offload == "auto" for s in plan.stages), plan.describe()
    assert offers == {}
    assert predicted == priced.step_s  # the transfers are not priced
    assert lever is not None and "offload: auto on stage" in lever and "leaves out the transfers" in lever
    with pytest.raises(ValueError, match="offload cannot run here: not on a GPU"):
        shortlist_with_levers(profile, cluster, 8, offload_refused="not on a GPU")
    with pytest.raises(ValueError, match="neither recomputing nor offloading"):
        shortlist_with_levers(profile, Cluster.v100(1, 2, memory_bytes=GB), 8)
