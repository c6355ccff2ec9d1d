"""The selection policy of plan='auto' without a process group: which plans are shortlisted,
the turns they are measured in, and what the measurements teach the profile and cluster."""

from __future__ import annotations

import pytest

from dapple_lightning.plan import Plan
from dapple_lightning.planner import (
    GB,
    Cluster,
    LayerProfile,
    Measured,
    ModelProfile,
    estimate,
    measure_in_turns,
    refine,
    refine_allreduce,
    shortlist,
)


def _two_layers(param_bytes: int) -> ModelProfile:
    # 1 s forward and 2 s backward per layer for 8 samples; the parameters set how much the
    # all-reduce of data parallelism costs.
    layers = tuple(LayerProfile(f"l{i}", 1.0, 2.0, 1000, param_bytes) for i in range(2))
    return ModelProfile(layers, profile_batch_size=8)


CLUSTER = Cluster.v100(1, 2, intra_allreduce_bw=1 * GB, intra_p2p_bw=100 * GB)


def test_plans_predicted_close_to_the_best_are_shortlisted_for_measurement():
    # 4 GB of gradients to all-reduce at 1 GB/s: data parallelism takes about 10 s, the pipeline
    # (16 micro-batches of one sample) about 6.5.
    profile = _two_layers(2 * 10**9)
    close, dp_step, _ = shortlist(profile, CLUSTER, 16, optimizer_factor=0.0, margin=0.1)
    best, predicted = close[0]
    assert best.num_stages == 2 and predicted == estimate(best, profile, CLUSTER, 16, optimizer_factor=0.0).step_s
    assert dp_step == pytest.approx(10.0, rel=1e-3)
    assert all(p <= predicted / 0.9 for _, p in close) and len(close) <= 3
    assert [p for _, p in close] == sorted(p for _, p in close)
    # A margin wide enough takes data parallelism in, in place of a third pipeline if need be.
    gain = 1 - predicted / dp_step
    wide, _, _ = shortlist(profile, CLUSTER, 16, optimizer_factor=0.0, margin=gain + 0.01)
    assert len(wide) == 3 and wide[0] == close[0]
    assert (Plan.data_parallel(2, 2), dp_step) in wide
    assert shortlist(profile, CLUSTER, 16, optimizer_factor=0.0, margin=0.0)[0] == [close[0]]
    with pytest.raises(ValueError, match="margin"):
        shortlist(profile, CLUSTER, 16, margin=1.0)


def test_data_parallelism_that_does_not_fit_is_never_shortlisted():
    # 6 GB of parameters (with gradients and Adam state 24 GB) do not fit one 16 GB device; a
    # layer per device does.
    profile = _two_layers(3 * 10**9)
    close, dp_step, _ = shortlist(profile, CLUSTER, 16, margin=0.99)
    assert dp_step is None and all(plan.num_stages == 2 for plan, _ in close)


def _scripted(times: dict[int, list[float]], calls: list[int]):
    """A trial of plans with 1, 2, ... micro-batches: each turn the next of its scripted step times."""

    def trial(plan: Plan) -> Measured:
        m = plan.micro_batches
        calls.append(m)
        step = times[m][sum(c == m for c in calls) - 1]
        return Measured(step, (step / 3,), (2 * step / 3,))

    return trial


def test_close_plans_are_measured_in_rotating_turns_until_one_leads():
    plans = [Plan.data_parallel(4, 2, micro_batches=m) for m in (1, 2, 4)]
    calls: list[int] = []
    # M=4 is 10% behind after the first round, beyond two turns' spreads (3% each), and gets no
    # more turns; M=1 and M=2 alternate leads, and three rounds give M=2 the lower median.
    times = {1: [1.00, 1.03, 1.02], 2: [1.01, 1.00, 1.01], 4: [1.11]}
    runs = measure_in_turns(plans, _scripted(times, calls), rounds=3)
    assert calls == [1, 2, 4, 2, 1, 1, 2]  # each round starts one plan further on
    assert [[r.step_s for r in plan_runs] for plan_runs in runs] == [times[1], times[2], times[4]]
    best = min(range(3), key=lambda i: Measured.median(runs[i]).step_s)
    assert best == 1
    assert Measured.median(runs[0]) == Measured(1.02, (1.02 / 3,), (2 * 1.02 / 3,))


def test_turns_end_when_one_plan_is_left():
    plans = [Plan.data_parallel(4, 2, micro_batches=m) for m in (1, 2)]
    calls: list[int] = []
    runs = measure_in_turns(plans, _scripted({1: [1.0], 2: [1.2]}, calls), rounds=5)
    assert calls == [1, 2] and [len(r) for r in runs] == [1, 1]
    # 4% apart is within two turns' assumed spreads (3% each): both keep their turns.
    calls.clear()
    runs = measure_in_turns(plans, _scripted({1: [1.0] * 2, 2: [1.04] * 2}, calls), rounds=2)
    assert calls == [1, 2, 2, 1]
    with pytest.raises(ValueError, match="rounds"):
        measure_in_turns(plans, _scripted({}, []), rounds=0)
    with pytest.raises(ValueError, match="no runs"):
        Measured.median([])


def test_refine_scales_each_layer_by_how_its_stages_measured():
    profile = _two_layers(10**6)
    pipe = Plan.straight(2, 2, micro_batches=4)
    dp = Plan.data_parallel(2, 2)
    before = {p: estimate(p, profile, CLUSTER, 16, optimizer_factor=0.0) for p in (pipe, dp)}
    f, b = before[pipe].forward_s, before[pipe].backward_s
    runs = [
        # The pipeline's first stage ran 20% slow forward, its second 40% slow backward...
        (pipe, Measured(1.0, (f[0] * 1.2, f[1]), (b[0], b[1] * 1.4))),
        # ...and data parallelism's one stage as predicted.
        (dp, Measured(1.0, before[dp].forward_s, before[dp].backward_s)),
    ]
    refined = refine(profile, CLUSTER, 16, runs, optimizer_factor=0.0)
    first, second = refined.layers
    assert first.forward_s == pytest.approx(1.0 * (1.2 + 1.0) / 2)  # the mean of its two stages
    assert first.backward_s == pytest.approx(2.0) and second.forward_s == pytest.approx(1.0)
    assert second.backward_s == pytest.approx(2.0 * (1.4 + 1.0) / 2)
    assert refine(profile, CLUSTER, 16, [], optimizer_factor=0.0) == profile


def test_refine_allreduce_takes_what_data_parallel_steps_left_after_their_passes():
    profile = _two_layers(10**9)  # 2 GB of gradients: 2 s at 1 GB/s over 2 replicas
    dp = Plan.data_parallel(2, 2)
    est = estimate(dp, profile, CLUSTER, 16, optimizer_factor=0.0)
    assert est.allreduce_s[0] == pytest.approx(2.0, rel=1e-3)
    # The step took 4 s beyond its passes: the all-reduce ran at half the measured bandwidth.
    slow = Measured(est.forward_s[0] + est.backward_s[0] + 4.0, est.forward_s, est.backward_s)
    refined = refine_allreduce(profile, CLUSTER, 16, [(dp, slow)], optimizer_factor=0.0)
    assert refined.intra_allreduce_bw == pytest.approx(0.5 * GB, rel=1e-3)
    assert estimate(dp, profile, refined, 16, optimizer_factor=0.0).step_s == pytest.approx(slow.step_s, rel=1e-3)
    # Faster than predicted, or no data-parallel run: the measured bandwidth stands.
    fast = Measured(est.step_s * 0.9, est.forward_s, est.backward_s)
    assert refine_allreduce(profile, CLUSTER, 16, [(dp, fast)], optimizer_factor=0.0) == CLUSTER
    pipe = Plan.straight(2, 2, micro_batches=4)
    assert refine_allreduce(profile, CLUSTER, 16, [(pipe, slow)], optimizer_factor=0.0) == CLUSTER


def test_a_memory_objective_shortlists_only_plans_within_its_peak():
    # Data parallelism holds both layers' 8 GB of weights and gradients on each device, a
    # pipeline one layer's 4 GB: with a wide trial margin, "time" shortlists data parallelism
    # beside the pipelines, "memory" never does, and a memory margin of 1.5 lets it back in.
    profile = _two_layers(2 * 10**9)
    options = {"optimizer_factor": 0.0, "margin": 0.99}
    dp_plan = Plan.data_parallel(2, 2)
    by_time, dp_step, _ = shortlist(profile, CLUSTER, 16, **options)
    assert dp_plan in [plan for plan, _ in by_time]
    by_memory, dp_memory, _ = shortlist(profile, CLUSTER, 16, **options, objective="memory")
    assert by_memory and all(plan.num_stages == 2 for plan, _ in by_memory)
    assert dp_memory == dp_step  # still reported, for the speed-up
    wide, _, _ = shortlist(profile, CLUSTER, 16, **options, objective="time-within-memory", memory_margin=1.5)
    assert dp_plan in [plan for plan, _ in wide]
    tight, _, _ = shortlist(profile, CLUSTER, 16, **options, objective="time-within-memory", memory_margin=0.5)
    assert dp_plan not in [plan for plan, _ in tight]
    with pytest.raises(ValueError, match="unknown objective"):
        shortlist(profile, CLUSTER, 16, objective="least")
