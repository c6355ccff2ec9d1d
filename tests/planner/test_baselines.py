"""Baseline planners: their plans, judged by the same cost model as DAPPLE's."""

from __future__ import annotations

from dapple_lightning.planner import (
    REFERENCE_PROFILES,
    Cluster,
    CostModel,
    LayerProfile,
    ModelProfile,
    baselines,
    data_parallel_plan,
    pipedream_plan,
    plan_dapple,
    read_pipedream,
    straight_plan,
)


def chain(costs, params=10**8):
    return ModelProfile(tuple(LayerProfile(f"l{i}", c, 2 * c, 10**6, params) for i, c in enumerate(costs)), 8)


def test_data_parallel_is_one_stage_on_every_device():
    planned = data_parallel_plan(chain([1e-3] * 4), Cluster.parse("1x4"), 64)
    assert planned is not None
    assert planned.notation == "4" and planned.method == "data-parallel"
    assert planned.speedup_vs_dp == 1.0


def test_straight_pipeline_balances_forward_plus_backward():
    planned = straight_plan(chain([1e-3, 1e-3, 2e-3, 2e-3]), Cluster.parse("1x2"), 16)
    assert planned is not None
    assert planned.notation == "1:1"
    assert planned.cuts == (3,)  # 3 | 4 units of work: the best split of 1, 1, 2, 2


def test_straight_pipeline_with_more_devices_than_layers_replicates_stages():
    planned = straight_plan(chain([1e-3] * 3), Cluster.parse("2x4"), 64)
    assert planned is not None
    # 8 devices, 3 layers: the most stages dividing 8 is 2, each on 4 devices.
    assert planned.notation == "4:4"


def test_pipedream_minimises_its_slowest_stage():
    # Weight sync every micro-batch makes replication costly; PipeDream pipelines instead.
    profile = chain([1e-3] * 4, params=4 * 10**8)
    planned = pipedream_plan(profile, Cluster.parse("1x4"), 64)
    assert planned is not None
    assert planned.notation == "1:1:1:1"
    assert planned.method == "pipedream"


def test_every_baseline_is_predicted_and_simulated_by_the_shared_models():
    profile = chain([1e-3, 3e-3, 2e-3, 1e-3, 1e-3])
    cluster = Cluster.parse("2x2")
    model = CostModel(profile, cluster, 64)
    found = baselines(profile, cluster, 64)
    assert [p.method for p in found] == ["pipedream", "straight", "data-parallel"]
    for planned in found:
        est = model.estimate(planned.plan)
        assert planned.predicted_step_s == est.step_s and est.fits
        assert planned.simulated_step_s is not None and planned.simulated_step_s >= planned.predicted_step_s
    # DAPPLE searches a space holding all three, so it is never slower by its own model.
    best = plan_dapple(profile, cluster, 64)[0]
    assert best.predicted_step_s <= min(p.predicted_step_s for p in found)


def test_dapple_beats_pipedream_on_vgg19():
    profile = read_pipedream(REFERENCE_PROFILES / "vgg-19-pbs-32.txt")
    cluster = Cluster.paper_2x8()
    best = plan_dapple(profile, cluster, 1024)[0]
    pipedream = pipedream_plan(profile, cluster, 1024)
    assert pipedream is not None
    assert pipedream.predicted_step_s / best.predicted_step_s > 2.0


def test_nothing_fits_gives_none():
    profile = chain([1e-3] * 2, params=10**10)  # 40 GB per layer with Adam
    assert data_parallel_plan(profile, Cluster.parse("1x2"), 8) is None
    assert straight_plan(profile, Cluster.parse("1x2"), 8) is None
