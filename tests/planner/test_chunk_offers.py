"""plan='auto''s chunked offers without a process group: which chunked plans the shortlist adds and
why, what the report says of them, and what their measurements teach the profile."""

from __future__ import annotations

import dataclasses

import pytest

from dapple_lightning.plan import Plan
from dapple_lightning.planner import (
    GB,
    AutoPlan,
    Cluster,
    CostModel,
    LayerProfile,
    Measured,
    ModelProfile,
    Trial,
    predicted_step,
    refine,
    shortlist,
)
from dapple_lightning.planner._chunks import best_chunked_offers, estimate_chunked


def _profile(param_bytes: int = 10**9, weight_s: float | None = 1e-3) -> ModelProfile:
    # 8 equal layers of 1 ms forward and 2 ms backward for 4 samples; a gigabyte of parameters
    # each makes data parallelism's all-reduce slow, so the shortlist is pipelines.
    layers = tuple(LayerProfile(f"l{i}", 1e-3, 2e-3, 10**6, param_bytes, weight_s=weight_s) for i in range(8))
    return ModelProfile(layers, profile_batch_size=4)


def _cluster(link_bw: float = 10**6 * GB, memory: float = 1e12) -> Cluster:
    return Cluster.v100(1, 2, intra_p2p_bw=link_bw, memory_bytes=memory)


def test_a_chunked_variant_predicted_faster_is_shortlisted_with_its_reason():
    profile, cluster = _profile(), _cluster()
    # 8 micro-batches on 2 stages: 1F1B idles a fifth of the step, which the V schedule fills.
    close, dp_step, offers = shortlist(profile, cluster, 8, optimizer_factor=0.0, margin=0.5)
    chunked = [(plan, step) for plan, step in close if plan.chunks > 1]
    assert len(chunked) == 1, close  # once, though two of the planner's pipelines re-cut to it
    plan, step = chunked[0]
    assert plan.schedule == "zb-v" and plan.layout == "v" and plan.num_groups == 2 and plan.micro_batches == 8
    model = CostModel(profile, cluster, 8, 0.0)
    assert step == pytest.approx(estimate_chunked(model, plan).step_s)
    # Faster than the plain pipeline it was made from, and than that pipeline's zero-bubble variants.
    assert step < model.estimate(Plan.straight(8, 2, 8)).step_s
    assert close == sorted(close, key=lambda c: c[1]) and close[0][0] == plan
    assert set(offers) == {plan}
    assert offers[plan].startswith("zb-v with 2 stages per group (v): predicted") and "under dapple" in offers[plan]
    # The same shortlist without chunks has none, and no reasons.
    plain_only, same_dp, no_offers = shortlist(profile, cluster, 8, optimizer_factor=0.0, margin=0.5, chunks=False)
    assert all(p.chunks == 1 for p, _ in plain_only) and same_dp == dp_step and no_offers == {}


def test_no_chunked_variant_is_offered_where_its_transfers_cost_more_than_the_bubble():
    profile = _profile()
    slow = _cluster(link_bw=2e5)  # a megabyte per cut at 200 kB/s: seconds per message
    close, _, offers = shortlist(profile, slow, 8, optimizer_factor=0.0, margin=0.9)
    assert offers == {} and all(p.chunks == 1 for p, _ in close)
    # Nor from a pipeline whose stages recompute (chunked plans run none), where the same stages without it get one.
    plain = Plan.straight(8, 2, 8)
    recomputing = dataclasses.replace(plain, stages=[dataclasses.replace(s, recompute=True) for s in plain.stages])
    model = CostModel(profile, _cluster(), 8, 0.0)
    assert best_chunked_offers(model, [plain])
    assert best_chunked_offers(model, [recomputing]) == []


def test_the_report_says_why_a_chunked_plan_was_offered_and_chosen():
    profile, cluster = _profile(), _cluster()
    close, dp_step, offers = shortlist(profile, cluster, 8, optimizer_factor=0.0, margin=0.5)
    ((chunked, why),) = offers.items()
    step, memory = predicted_step(chunked, profile, cluster, 8, optimizer_factor=0.0)
    trials = tuple(Trial(plan, predicted, predicted) for plan, predicted in close)
    report = AutoPlan(chunked, step, dp_step, profile, cluster, 1.0, trials, memory, offers=((chunked, why),)).report()
    assert f"chosen {chunked.describe()}: {why}" in report
    plain = close[1][0]
    other = AutoPlan(plain, close[1][1], dp_step, profile, cluster, 1.0, trials, offers=((chunked, why),)).report()
    assert f"offered {chunked.describe()}: {why}" in other
    refused = AutoPlan(plain, close[1][1], dp_step, profile, cluster, 1.0, chunks_refused="recovery is on").report()
    assert "plans with several stages per rank group were not offered: recovery is on" in refused
    # Each stage's peak is its rank group's.
    peaks = estimate_chunked(CostModel(profile, cluster, 8, 0.0), chunked).memory_bytes
    assert memory == tuple(peaks[g] for g in (0, 1, 1, 0))  # V layout: group 0 holds stages 0 and 3


def test_a_chunked_plans_measured_passes_refine_the_layers_of_its_stages():
    profile, cluster = _profile(weight_s=None), _cluster()
    plan = Plan.chunked(8, "1:1", micro_batches=8)  # interleaved, looped: stages of layers 0-1, 2-3, 4-5, 6-7
    model = CostModel(profile, cluster, 32, 0.0)
    passes = [model.passes(s.start, s.end, 8, model.samples(8, s.replicas)) for s in plan.stages]
    # The stages of group 0 (0 and 2) ran twice as slow as predicted, those of group 1 as predicted.
    scale = [2.0, 1.0, 2.0, 1.0]
    measured = Measured(
        1.0, tuple(f * k for (f, _), k in zip(passes, scale)), tuple(b * k for (_, b), k in zip(passes, scale))
    )
    refined = refine(profile, cluster, 32, [(plan, measured)], optimizer_factor=0.0)
    factors = [r.forward_s / p.forward_s for r, p in zip(refined.layers, profile.layers)]
    assert factors == pytest.approx([2, 2, 1, 1, 2, 2, 1, 1])
    assert [r.backward_s / p.backward_s for r, p in zip(refined.layers, profile.layers)] == pytest.approx(factors)
