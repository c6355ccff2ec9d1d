"""The planner is exact for its cost model: it agrees with enumerating every plan."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dapple_lightning.plan import Plan, Stage
from dapple_lightning.planner import (
    GB,
    REFERENCE_PROFILES,
    Cluster,
    CostModel,
    LayerProfile,
    ModelProfile,
    PlannedPlan,
    micro_batch_candidates,
    place,
    plan_dapple,
    read_pipedream,
    replica_candidates,
)
from dapple_lightning.planner._lower_bound import stage_bound


def all_plans(layers: int, cluster: Cluster, candidates, policies, schedule="dapple"):
    """Every plan of the planner's search space, by brute force (small cases only)."""
    world = cluster.world_size
    for count in range(1, min(layers, world) + 1):
        for cuts in itertools.combinations(range(1, layers), count - 1):
            bounds = (0, *cuts, layers)
            for split in itertools.combinations(range(1, world), count - 1):
                reps = [b - a for a, b in zip((0, *split), (*split, world))]
                for policy in policies:
                    ranks = place(cluster, policy, reps)
                    consecutive = [r for group in ranks for r in group] == list(range(world))
                    stages = tuple(
                        Stage(a, b, r, None if consecutive else rk)
                        for a, b, r, rk in zip(bounds, bounds[1:], reps, ranks)
                    )
                    for m in candidates:
                        yield Plan(stages, m, schedule)


def estimates(profile, cluster, batch, candidates, policies, schedule="dapple"):
    """The cost model's estimate of every plan of the search space it accepts, by plan."""
    model = CostModel(profile, cluster, batch)
    found = {}
    for plan in all_plans(profile.num_layers, cluster, candidates, policies, schedule):
        try:
            found[plan] = model.estimate(plan)
        except ValueError:
            continue
    return found


def brute_force(profile, cluster, batch, candidates, policies, schedule="dapple", recompute=False):
    model = CostModel(profile, cluster, batch)
    found = {}
    for plan, est in estimates(profile, cluster, batch, candidates, policies, schedule).items():
        if recompute:
            est = recomputing_where_needed(model, plan, est, cluster.memory_bytes)
        if est.fits:
            found[plan] = est.step_s
    return sorted(found.values())


def recomputing_where_needed(model, plan, plain, cap):
    """The estimate of ``plan`` with exactly its stages over ``cap`` (in ``plain``, its estimate
    keeping activations) recomputing: the planner's search space when it may recompute."""
    stages = [dataclasses.replace(s, recompute=mem > cap) for s, mem in zip(plan.stages, plain.memory_bytes)]
    return model.estimate(dataclasses.replace(plan, stages=stages))


def all_recomputing(model, plan):
    return model.estimate(
        dataclasses.replace(plan, stages=[dataclasses.replace(s, recompute=True) for s in plan.stages])
    )


@st.composite
def profiles(draw):
    count = draw(st.integers(1, 5))
    layers = []
    for i in range(count):
        forward, backward = draw(st.floats(0.0, 5e-3)), draw(st.floats(0.0, 1e-2))
        # Half the profiles have per-call time that does not scale with samples, and optimizer steps.
        affine = draw(st.booleans())
        # Half the layers have measured memory: saved bytes kept per micro-batch, and a peak whose
        # excess over them a stage needs once (its largest layer's), its output kept as well.
        measured = {}
        if draw(st.booleans()):
            saved = draw(st.integers(0, 400_000_000))
            measured = {
                "saved_bytes": saved,
                "peak_bytes": saved + draw(st.integers(0, 800_000_000)),
                "update_peak_bytes": draw(st.integers(0, 3_000_000_000)),
            }
        layers.append(
            LayerProfile(
                f"l{i}",
                forward,
                backward,
                draw(st.integers(0, 400_000_000)),
                draw(st.integers(0, 2_000_000_000)),
                forward_fixed_s=forward * draw(st.floats(0.0, 1.0)) if affine else 0.0,
                backward_fixed_s=backward * draw(st.floats(0.0, 1.0)) if affine else 0.0,
                update_s=draw(st.floats(0.0, 5e-3)) if affine else 0.0,
                accumulate_s=draw(st.floats(0.0, 2e-3)) if affine else 0.0,
                **measured,
            )
        )
    layers = tuple(layers)
    # Bytes crossing each cut drawn apart from the activations, as in a graph with branches.
    cuts = (0, *(draw(st.integers(0, 2_000_000_000)) for _ in range(count - 1)), 0)
    return ModelProfile(layers, draw(st.sampled_from([1, 4, 32])), cut_bytes=cuts)


clusters = st.sampled_from([(1, 1), (1, 2), (2, 1), (1, 3), (2, 2), (2, 2), (1, 4), (4, 1)])


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    profile=profiles(),
    shape=clusters,
    batch=st.sampled_from([4, 6, 8]),
    memory_gb=st.sampled_from([4.0, 16.0, 1e6]),
    top=st.sampled_from([1, 3]),
    schedule=st.sampled_from(["dapple", "gpipe"]),
    # One policy alone makes the search go through the renamed-server states of that policy.
    policies=st.sampled_from([("append", "fresh", "scatter"), ("fresh",), ("scatter",)]),
    recompute=st.booleans(),
)
def test_planner_matches_brute_force(profile, shape, batch, memory_gb, top, schedule, policies, recompute):
    cluster = Cluster.v100(*shape, memory_bytes=memory_gb * GB)
    candidates = micro_batch_candidates(batch)
    expected = brute_force(profile, cluster, batch, candidates, policies, schedule, recompute)
    kwargs = dict(top=top, placements=policies, schedule=schedule, recompute=recompute)
    if not expected:
        with pytest.raises(ValueError, match="no plan fits"):
            plan_dapple(profile, cluster, batch, **kwargs)
        return
    got = plan_dapple(profile, cluster, batch, **kwargs)
    assert [p.predicted_step_s for p in got] == pytest.approx(expected[:top], rel=1e-9, abs=1e-15)
    assert len({(p.plan.stages, p.plan.micro_batches) for p in got}) == len(got)
    # The record's lower bound is one: no plan of the space is faster.
    assert got[0].search is not None and got[0].search.lower_bound_s <= expected[0] * (1 + 1e-12)
    # So is the one a beam's record takes (an exact search has no need of it).
    model = CostModel(profile, cluster, batch)
    assert stage_bound(model, candidates, replica_candidates(cluster), None) <= expected[0] * (1 + 1e-12)


def test_scatter_keeps_heavy_activations_inside_servers():
    # Two layers of 1 GB weights (4 GB with gradients and Adam): only one fits per 6 GB device.
    # 4 GB cross the cut per micro-batch at the profile batch, cheap over NVLink, slow across
    # servers; "scatter" puts half of each stage on each server so the rows never leave it.
    layers = (LayerProfile("a", 10e-3, 20e-3, 1000, 10**9), LayerProfile("b", 10e-3, 20e-3, 1000, 10**9))
    profile = ModelProfile(layers, 4, cut_bytes=(0, 4 * 10**9, 0))
    cluster = Cluster.v100(2, 2, memory_bytes=6 * GB)
    got = plan_dapple(profile, cluster, 8, top=3)
    best = got[0]
    assert best.placement == "scatter"
    assert [s.ranks for s in best.plan.stages] == [(0, 2), (1, 3)]
    assert best.plan.micro_batches == 4
    expected = brute_force(profile, cluster, 8, micro_batch_candidates(8), ("append", "fresh", "scatter"))
    assert [p.predicted_step_s for p in got] == pytest.approx(expected[:3], rel=1e-12)


def test_vgg19_on_two_servers_replicates_the_convolutions():
    profile = read_pipedream(REFERENCE_PROFILES / "vgg-19-pbs-32.txt")
    best = plan_dapple(profile, Cluster.paper_2x8(), 1024)[0]
    # The classifier's 470 MB of weights stay off the replicated stage: fewer bytes to all-reduce.
    assert best.plan.stages[-1].replicas < best.plan.stages[0].replicas
    assert best.plan.num_stages >= 2
    assert best.speedup_vs_dp is not None and best.speedup_vs_dp > 1.5
    assert isinstance(best, PlannedPlan)


def test_every_plan_fits_and_the_estimate_agrees():
    profile = read_pipedream(REFERENCE_PROFILES / "bert-48-pbs-2.txt")
    cluster = Cluster.paper_2x8()
    model = CostModel(profile, cluster, 128)
    for planned in plan_dapple(profile, cluster, 128, top=3):
        est = model.estimate(planned.plan)
        assert est.fits
        assert est.step_s == planned.predicted_step_s
        assert planned.stage_memory_bytes == est.memory_bytes


def test_too_little_memory_names_the_least_need():
    layers = tuple(LayerProfile(f"l{i}", 1e-3, 2e-3, 1_000_000, 2 * 10**9) for i in range(4))
    profile = ModelProfile(layers, 8)
    # Each layer alone needs 2 GB x (1 + 1 + 2 for Adam) = 8 GB, plus its activations.
    cluster = Cluster.v100(1, 4, memory_bytes=6 * GB)
    with pytest.raises(ValueError, match=r"least memory any plan needs is 8\.00 GB") as info:
        plan_dapple(profile, cluster, 8)
    assert "--memory-gb" in str(info.value)


def test_the_garbage_collector_is_as_it_was_after_a_search_returns_or_raises():
    layers = tuple(LayerProfile(f"l{i}", 1e-3, 2e-3, 1_000_000, 2 * 10**9) for i in range(4))
    profile, small = ModelProfile(layers, 8), Cluster.v100(1, 4, memory_bytes=6 * GB)
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            assert plan_dapple(profile, Cluster.v100(1, 4), 8)
            assert gc.isenabled() is enabled
            with pytest.raises(ValueError, match="no plan fits"):
                plan_dapple(profile, small, 8)
            assert gc.isenabled() is enabled
    finally:
        gc.enable()


def test_replica_candidates():
    assert replica_candidates(Cluster.parse("2x8")) == tuple(range(1, 17))
    assert replica_candidates(Cluster.parse("8x8")) == (1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 40, 48, 56, 64)
    assert replica_candidates(Cluster.parse("32x1")) == (1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32)
    # Past 64 devices: powers of two of devices, and of whole servers.
    assert replica_candidates(Cluster.parse("128x8")) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
    assert replica_candidates(Cluster.parse("12x12")) == (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def test_micro_batch_candidates_are_the_divisors():
    assert micro_batch_candidates(12) == (1, 2, 3, 4, 6, 12)
    assert micro_batch_candidates(1) == (1,)


def test_restricted_cuts_are_exact_over_their_plans():
    # Forward + backward of the 9 layers take 3, 4, 5, 3, 4, 5, 3, 4, 5 units (of 2**-10 s, so the
    # sums are exact): max_cuts=2 lets stages begin only at layers 3 and 6, which split it in thirds.
    # The activations crossing exactly those two points are dear, so the best plan cuts elsewhere.
    unit = 2**-10
    layers = tuple(LayerProfile(f"l{i}", (1 + i % 3) * unit, 2 * unit, 10**6, 10**8) for i in range(9))
    profile = ModelProfile(layers, 4, cut_bytes=(0, *(10**9 if i in (3, 6) else 10**6 for i in range(1, 9)), 0))
    cluster = Cluster.v100(1, 3)
    allowed = {3, 6}
    full = plan_dapple(profile, cluster, 12, top=1)[0]
    restricted = plan_dapple(profile, cluster, 12, top=1, max_cuts=2)[0]
    assert not set(full.cuts) <= allowed  # the restriction matters here
    assert set(restricted.cuts) <= allowed
    model = CostModel(profile, cluster, 12)
    steps = []
    for plan in all_plans(9, cluster, micro_batch_candidates(12), ("append",)):
        if {s.start for s in plan.stages[1:]} <= allowed:
            try:
                est = model.estimate(plan)
            except ValueError:
                continue
            if est.fits:
                steps.append(est.step_s)
    # Exact over the plans the restriction leaves: the best of them, found by brute force.
    assert restricted.predicted_step_s == pytest.approx(min(steps), rel=1e-12)
    assert restricted.predicted_step_s > full.predicted_step_s


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"top": 0}, "top must be"),
        ({"schedule": "1f1b"}, "unknown schedule"),
        ({"placements": ["random"]}, "unknown placement"),
        ({"micro_batches": [0]}, "micro-batch count 0"),
        ({"micro_batches": []}, "micro_batches is empty"),
        ({"replicas": [0]}, "replica counts"),
        ({"max_cuts": 0}, "max_cuts"),
    ],
)
def test_bad_arguments_say_what_to_do(kwargs, message):
    profile = ModelProfile((LayerProfile("a", 1e-3, 1e-3, 1, 1),), 1)
    with pytest.raises(ValueError, match=message):
        plan_dapple(profile, Cluster.v100(1, 2), 4, **kwargs)


def test_speedup_is_data_parallel_over_plan():
    profile = read_pipedream(REFERENCE_PROFILES / "vgg-19-pbs-32.txt")
    cluster = Cluster.paper_16x1()
    best = plan_dapple(profile, cluster, 1024)[0]
    model = CostModel(profile, cluster, 1024)
    dp = min(
        model.estimate(Plan.data_parallel(profile.num_layers, 16, m)).step_s
        for m in micro_batch_candidates(1024)
        if m <= 64 and model.estimate(Plan.data_parallel(profile.num_layers, 16, m)).fits
    )
    assert best.speedup_vs_dp == pytest.approx(dp / best.predicted_step_s)
    assert math.isfinite(best.predicted_step_s)


def test_shared_compute_units_rerank_the_plans():
    # Four processes on two cores. Alone, data parallelism's 6 s of compute + 0.6 s all-reduce
    # beats a 4-stage pipeline's 8.25 s; sharing the cores, every plan does the same 24 s of
    # compute over 2 cores, and data parallelism's all-reduces on top make it the slowest.
    layers = tuple(LayerProfile(f"l{i}", 1.0, 2.0, 100, 10**8) for i in range(4))
    profile = ModelProfile(layers, 4)
    alone = Cluster(1, 4, 1e3, 1e3, 1e9, 1e9, latency_s=0.0, memory_bytes=1e12)
    shared = dataclasses.replace(alone, compute_units=2)
    assert plan_dapple(profile, alone, 8)[0].plan.num_stages == 1
    got = plan_dapple(profile, shared, 8, top=5)
    model = CostModel(profile, shared, 8)
    assert [p.predicted_step_s for p in got] == sorted(p.predicted_step_s for p in got)
    assert all(p.predicted_step_s == model.estimate(p.plan).step_s for p in got)
    dp = model.estimate(Plan.data_parallel(4, 4, 1)).step_s
    assert got[0].predicted_step_s < dp
    assert got[0].plan.num_stages > 1


def least_peaks(profile, cluster, batch, candidates, policies, schedule="dapple", recompute=False):
    """(plan, its estimate keeping activations, its least per-device peak) of every plan of the
    search space, fitting or not; with ``recompute`` each stage recomputes if that needs less."""
    model = CostModel(profile, cluster, batch)
    for plan, est in estimates(profile, cluster, batch, candidates, policies, schedule).items():
        peaks = est.memory_bytes
        if recompute:
            peaks = [min(a, b) for a, b in zip(peaks, all_recomputing(model, plan).memory_bytes)]
        yield plan, est, max(peaks)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    profile=profiles(),
    shape=clusters,
    batch=st.sampled_from([4, 6, 8]),
    memory_gb=st.sampled_from([4.0, 16.0, 1e6]),
    top=st.sampled_from([1, 3]),
    schedule=st.sampled_from(["dapple", "gpipe"]),
    policies=st.sampled_from([("append", "fresh", "scatter"), ("scatter",)]),
    objective=st.sampled_from(["memory", "time-within-memory"]),
    margin=st.sampled_from([0.0, 0.1, 0.5]),
    recompute=st.booleans(),
)
def test_memory_objectives_match_brute_force(
    profile, shape, batch, memory_gb, top, schedule, policies, objective, margin, recompute
):
    cluster = Cluster.v100(*shape, memory_bytes=memory_gb * GB)
    candidates = micro_batch_candidates(batch)
    found = list(least_peaks(profile, cluster, batch, candidates, policies, schedule, recompute))
    least = min(peak for _, _, peak in found)
    kwargs = dict(top=top, placements=policies, schedule=schedule, objective=objective, memory_margin=margin)
    kwargs["recompute"] = recompute
    if least > cluster.memory_bytes:
        with pytest.raises(ValueError, match="no plan fits"):
            plan_dapple(profile, cluster, batch, **kwargs)
        return
    limit = least if objective == "memory" else min(cluster.memory_bytes, least * (1 + margin))
    model = CostModel(profile, cluster, batch)
    planned = (recomputing_where_needed(model, plan, est, limit) if recompute else est for plan, est, _ in found)
    expected = sorted(est.step_s for est in planned if max(est.memory_bytes) <= limit)
    got = plan_dapple(profile, cluster, batch, **kwargs)
    assert [p.predicted_step_s for p in got] == pytest.approx(expected[:top], rel=1e-9, abs=1e-15)
    assert all(max(p.stage_memory_bytes) <= limit and p.peak_limit_bytes == limit for p in got)
    if objective == "memory":
        # The least peak itself, ties broken by step time.
        assert max(got[0].stage_memory_bytes) == least
    assert len({(p.plan.stages, p.plan.micro_batches) for p in got}) == len(got)


def _memory_unbalanced() -> ModelProfile:
    # The first layer has the most compute and almost no weights; the other three, 300 MB of
    # weights each (1.2 GB with gradients and Adam). Balanced for time, the second stage holds
    # all three; balanced for memory, the first takes one of them.
    heavy = tuple(LayerProfile(f"l{i}", 1e-3, 2e-3, 10**6, 3 * 10**8) for i in range(3))
    return ModelProfile((LayerProfile("a", 3e-3, 6e-3, 10**6, 10**7), *heavy), 8)


def test_memory_objective_trades_time_for_the_least_peak():
    profile = _memory_unbalanced()
    cluster = Cluster.v100(1, 2)
    fastest = plan_dapple(profile, cluster, 16)[0]
    least = plan_dapple(profile, cluster, 16, objective="memory")[0]
    within = plan_dapple(profile, cluster, 16, objective="time-within-memory", memory_margin=0.1, top=3)
    assert fastest.cuts == (1,) and least.cuts == (2,)
    assert max(least.stage_memory_bytes) < max(fastest.stage_memory_bytes)
    assert least.predicted_step_s > fastest.predicted_step_s
    assert fastest.peak_limit_bytes == cluster.memory_bytes
    assert least.peak_limit_bytes == max(least.stage_memory_bytes)
    assert within[0].predicted_step_s == least.predicted_step_s
    assert all(max(p.stage_memory_bytes) <= 1.1 * max(least.stage_memory_bytes) for p in within)
    # A margin wide enough lets the fastest plan back in.
    wide = plan_dapple(profile, cluster, 16, objective="time-within-memory", memory_margin=1.0)[0]
    assert wide.plan == fastest.plan


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"objective": "speed"}, r"unknown objective 'speed'; choose one of \['time', 'memory'"),
        ({"objective": "time-within-memory", "memory_margin": -0.1}, "memory_margin must be a finite number >= 0"),
        ({"objective": "time-within-memory", "memory_margin": math.inf}, "memory_margin"),
        ({"objective": "memory", "memory_margin": "10%"}, "memory_margin"),
    ],
)
def test_bad_objective_or_margin_says_what_to_do(kwargs, message):
    profile = ModelProfile((LayerProfile("a", 1e-3, 1e-3, 1, 1),), 1)
    with pytest.raises(ValueError, match=message):
        plan_dapple(profile, Cluster.v100(1, 2), 4, **kwargs)


def test_memory_objective_with_nothing_that_fits_names_the_least_need():
    layers = tuple(LayerProfile(f"l{i}", 1e-3, 2e-3, 1_000_000, 2 * 10**9) for i in range(4))
    cluster = Cluster.v100(1, 4, memory_bytes=6 * GB)
    with pytest.raises(ValueError, match=r"least memory any plan needs is 8\.00 GB"):
        plan_dapple(ModelProfile(layers, 8), cluster, 8, objective="memory")


def test_recomputation_fits_what_would_not_fit_otherwise():
    # Each layer saves 2 GB for its backward but passes on 1 MB: a stage of one layer fits in
    # 3 GB, one of more only when it recomputes (then it needs one layer's 2 GB at a time).
    layers = tuple(
        LayerProfile(f"l{i}", 1e-3, 2e-3, 10**6, 10**6, saved_bytes=2 * 10**9, peak_bytes=2 * 10**9) for i in range(4)
    )
    profile = ModelProfile(layers, 1, cut_bytes=(0, 10**6, 10**6, 10**6, 0))
    cluster = Cluster.v100(1, 2, memory_bytes=3 * GB)
    with pytest.raises(ValueError, match="no plan fits"):
        plan_dapple(profile, cluster, 1)
    best = plan_dapple(profile, cluster, 1, recompute=True)[0]
    # Recomputing costs a forward per backward: 1 + 2 + 3 x (1 + 3) ms beats 2 x (2 + 6) ms. The
    # stage of one layer fits as it is, so it does not recompute.
    assert [(s.start, s.end, s.recompute) for s in best.plan.stages] == [(0, 1, False), (1, 4, True)]
    est = CostModel(profile, cluster, 1).estimate(best.plan)
    assert est.fits and est.step_s == best.predicted_step_s
    assert est.backward_s == pytest.approx((2e-3, 9e-3))
    assert "recompute" in best.plan.table() and "recompute=1" in best.plan.describe()
