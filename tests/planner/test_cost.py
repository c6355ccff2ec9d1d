"""The analytic cost model on literal, hand-computed plans."""

from __future__ import annotations

import dataclasses

import pytest

from dapple_lightning.plan import Plan, Stage
from dapple_lightning.planner import Cluster, CostModel, LayerProfile, ModelProfile, estimate

# Slow, round numbers: 100 bytes/s links, 1 GB/s all-reduce, no latency.
SLOW = Cluster(1, 4, intra_p2p_bw=100, inter_p2p_bw=100, intra_allreduce_bw=1e9, inter_allreduce_bw=1e9,
               latency_s=0, memory_bytes=1e12)  # fmt: skip
PROFILE = ModelProfile(
    (
        LayerProfile("l0", 1.0, 2.0, 100, 10**9),
        LayerProfile("l1", 1.0, 2.0, 100, 0),
        LayerProfile("l2", 2.0, 2.0, 100, 10**9),
        LayerProfile("l3", 1.0, 1.0, 100, 0),
    ),
    profile_batch_size=4,
)
TWO_BY_TWO = (Stage(0, 2, 2), Stage(2, 4, 2))


def test_two_stage_plan_by_hand():
    # Global batch 8 in M = 2 micro-batches of 4; each replica runs 2 samples (half the profile).
    est = estimate(Plan(TWO_BY_TWO, 2), PROFILE, SLOW, 8)
    assert est.micro_batch_size == 4
    assert est.samples == (2, 2)
    assert est.forward_s == (1.0, 1.5)
    assert est.backward_s == (2.0, 1.5)
    assert est.allreduce_s == (1.0, 1.0)  # 2 (r-1)/r * 1 GB / 1 GB/s
    assert est.send_forward_s == (0.5,)  # 100 bytes over 2 copies at 100 B/s
    # Longest chain: warm-up to stage 1 (1 + 0.5 + 1.5), its other micro-batch (3), then the
    # last backward drains to stage 0 (1.5 + 0.5 + 2) and stage 0 all-reduces (1).
    assert est.step_s == 11.0
    assert est.pivot_name == "stage 1"
    assert (est.warmup_s, est.steady_s, est.ending_s) == (3.0, 3.0, 5.0)
    # Parameters, gradients, Adam (4 GB) + K_s micro-batches of two 100-byte outputs at half size.
    assert est.memory_bytes == (4e9 + 2 * 100, 4e9 + 1 * 100)
    assert est.fits


def test_gpipe_keeps_every_micro_batch():
    est = estimate(Plan(TWO_BY_TWO, 2, "gpipe"), PROFILE, SLOW, 8)
    assert est.memory_bytes == (4e9 + 2 * 100, 4e9 + 2 * 100)
    # Stage 0 runs both forwards, waits for the first round trip, runs both backwards:
    # 2 + (0.5 + 3 + 0.5) + 4, then its all-reduce: as long as stage 1's chain; ties go later.
    assert est.step_s == 11.0
    assert est.pivot_name == "stage 1"


def test_uniform_stages_pivot_on_the_last_and_phases_add_up():
    profile = ModelProfile(tuple(LayerProfile(f"l{i}", 1.0, 2.0, 0, 0) for i in range(3)), 1)
    est = estimate(Plan.straight(3, 3, micro_batches=4), profile, Cluster.parse("1x3"), 4)
    assert est.step_s == pytest.approx((4 + 3 - 1) * 3.0)
    assert est.pivot_name == "stage 2"
    assert est.warmup_s + est.steady_s + est.ending_s == pytest.approx(est.step_s)
    assert est.bubble_fraction == pytest.approx(2 / 6)


def test_the_heavy_stage_is_the_pivot():
    layers = (LayerProfile("a", 1.0, 1.0, 0, 0), LayerProfile("b", 5.0, 5.0, 0, 0), LayerProfile("c", 1.0, 1.0, 0, 0))
    est = estimate(Plan.straight(3, 3, micro_batches=8), ModelProfile(layers, 1), Cluster.parse("1x3"), 8)
    assert est.pivot_name == "stage 1"
    # Warm-up reaches stage 1 (1 + 5), it runs 7 more micro-batches (70), the last drains (5 + 1).
    assert est.step_s == pytest.approx(6 + 70 + 6)


@pytest.mark.parametrize(
    ("plan", "batch", "message"),
    [
        (Plan((Stage(0, 3, 4),), 2), 8, "the model's Sequential has 4 layers"),
        (Plan((Stage(0, 4, 4),), 4), 8, "leaves some without samples"),
        (Plan((Stage(0, 4, 4),), 16), 8, "cannot split a global batch of 8"),
        (Plan((Stage(0, 2, 4), Stage(2, 4, 4)), 1), 8, "cluster 1x4 has 4"),
    ],
)
def test_plans_that_cannot_run_are_rejected(plan, batch, message):
    with pytest.raises(ValueError, match=message):
        estimate(plan, PROFILE, SLOW, batch)


def test_model_validation():
    with pytest.raises(ValueError, match="global_batch must be >= 1"):
        CostModel(PROFILE, SLOW, 0)
    with pytest.raises(ValueError, match="optimizer_factor"):
        CostModel(PROFILE, SLOW, 8, optimizer_factor=-1)
    with pytest.raises(TypeError, match="profile must be a ModelProfile"):
        CostModel("profile", SLOW, 8)  # type: ignore[arg-type]


def test_memory_over_the_device_does_not_fit():
    small = Cluster(1, 4, 1, 1, 1, 1, latency_s=0, memory_bytes=4e9)
    est = estimate(Plan(TWO_BY_TWO, 2), PROFILE, small, 8)
    assert not est.fits
    assert est.memory_limit == 4e9


def test_fixed_time_per_call_and_the_optimizer_step():
    # Per call: 1 s forward and 2 s backward whatever the samples; per sample at the profile
    # batch of 8: the other 3 s and 6 s. Then 0.5 s of optimizer step after the all-reduce.
    layer = LayerProfile("a", 4.0, 8.0, 0, 10**9, forward_fixed_s=1.0, backward_fixed_s=2.0, update_s=0.5)
    profile = ModelProfile((layer,), profile_batch_size=8)
    # Two replicas, M = 2 micro-batches of 4 rows: 2 rows per replica, a quarter of the batch.
    est = estimate(Plan((Stage(0, 1, 2),), 2), profile, SLOW, 8)
    assert (est.forward_s, est.backward_s) == ((1.0 + 3.0 / 4,), (2.0 + 6.0 / 4,))
    assert (est.allreduce_s, est.update_s) == ((1.0,), (0.5,))
    assert est.step_s == 2 * (1.75 + 3.5) + 1.0 + 0.5
    # With the fixed parts 0 the same times scale linearly, as before.
    linear = ModelProfile((LayerProfile("a", 4.0, 8.0, 0, 10**9),), profile_batch_size=8)
    assert estimate(Plan((Stage(0, 1, 2),), 2), linear, SLOW, 8).forward_s == (1.0,)


def test_adding_into_gradients_costs_every_micro_batch_after_the_first():
    # 0.4 s extra per backward that adds into existing gradients: M = 4 micro-batches, the
    # first creates the gradients, the other 3 add, so each backward averages 0.3 s more.
    layer = LayerProfile("a", 1.0, 2.0, 0, 0, accumulate_s=0.4)
    profile = ModelProfile((layer,), profile_batch_size=4)
    est = estimate(Plan((Stage(0, 1, 1),), 4), profile, SLOW, 4)
    assert est.backward_s == (2.0 / 4 + 0.3,)
    assert est.step_s == 4 * (1.0 / 4 + 2.0 / 4) + 3 * 0.4
    # One micro-batch never adds into gradients.
    assert estimate(Plan((Stage(0, 1, 1),), 1), profile, SLOW, 4).backward_s == (2.0,)


def test_fixed_part_cannot_exceed_the_time():
    with pytest.raises(ValueError, match=r"forward_fixed_s .* exceeds forward_s"):
        LayerProfile("a", 1.0, 1.0, 0, 0, forward_fixed_s=2.0)


def test_devices_sharing_compute_units_wait_for_them():
    # Four CPU processes on two cores: no step is shorter than all their work over two.
    shared = dataclasses.replace(SLOW, compute_units=2)
    dp, pipe = Plan.data_parallel(4, 4, 1), Plan(TWO_BY_TWO, 1)
    # Data parallelism, 2 samples per replica: F 2.5, B 3.5, all-reduce of 2 GB over 4: 3.
    # Each device works 9 s; independent devices take 9 s, two shared cores 4 * 9 / 2 = 18 s.
    alone, crowded = estimate(dp, PROFILE, SLOW, 8), estimate(dp, PROFILE, shared, 8)
    assert (alone.step_s, alone.shared_compute_s) == (9.0, 0.0)
    assert (crowded.pipeline_s, crowded.shared_compute_s, crowded.step_s) == (9.0, 18.0, 18.0)
    # 2:2 with one micro-batch keeps two devices busy at a time: work (2 + 4 + 1) * 2 +
    # (3 + 3 + 1) * 2 = 28 s over 2 cores is 14 s, under its 15 s chain, which stands.
    two = estimate(pipe, PROFILE, shared, 8)
    assert (two.pipeline_s, two.shared_compute_s, two.step_s) == (15.0, 14.0, 15.0)
    assert alone.step_s < estimate(pipe, PROFILE, SLOW, 8).step_s  # independent devices: DP wins
    assert two.step_s < crowded.step_s  # shared cores: the pipeline wins
    assert crowded.warmup_s + crowded.steady_s + crowded.ending_s == pytest.approx(crowded.step_s)


def test_enough_compute_units_change_nothing():
    roomy = dataclasses.replace(SLOW, compute_units=4)
    assert not roomy.shares_compute
    for plan in (Plan.data_parallel(4, 4, 2), Plan(TWO_BY_TWO, 2)):
        assert estimate(plan, PROFILE, roomy, 8) == estimate(plan, PROFILE, SLOW, 8)


def test_measured_peaks_replace_the_outputs_in_memory():
    peaks = ModelProfile(
        tuple(dataclasses.replace(x, peak_bytes=300) for x in PROFILE.layers[:2]) + PROFILE.layers[2:],
        profile_batch_size=4,
    )
    est = estimate(Plan(TWO_BY_TWO, 2), peaks, SLOW, 8)
    # stage 0 keeps K = 2 micro-batches of two layers at half the profile batch, now 300 bytes each
    assert est.memory_bytes == (4e9 + 2 * 300, 4e9 + 1 * 100)
    # time does not change, nor do the bytes that cross the cut
    assert est.step_s == estimate(Plan(TWO_BY_TWO, 2), PROFILE, SLOW, 8).step_s


def test_measured_memory_prices_saved_bytes_per_micro_batch_and_the_largest_excess_once():
    # Layers 0 and 1 measured: each keeps 40 saved bytes per profile batch of 4, peaks at 100 and
    # 300 (excess 60 and 260); layers 2 and 3 only have their 100-byte outputs.
    measured = tuple(
        dataclasses.replace(x, saved_bytes=40, peak_bytes=peak, peak_source="tracker")
        for x, peak in zip(PROFILE.layers[:2], (100, 300))
    )
    profile = ModelProfile(measured + PROFILE.layers[2:], profile_batch_size=4)
    est = estimate(Plan(TWO_BY_TWO, 2), profile, SLOW, 8)
    # Stage 0 at half the profile batch: K = 2 micro-batches of (40 + 40 saved + its 100-byte
    # output, which the runtime keeps), plus the larger excess, 260, once.
    assert est.memory_bytes[0] == 4e9 + 2 * (80 + 100) / 2 + 260 / 2
    # Stage 1 is priced as before: its layers' outputs per micro-batch, no transient.
    assert est.memory_bytes[1] == 4e9 + 1 * 100
    model = CostModel(profile, SLOW, 8)
    transient = [model.memory.parts(i, j, 4, 1)[2] for i, j in ((0, 1), (1, 4), (2, 4))]
    assert transient == [60, 260, 0]
    # Recomputing, stage 0 keeps per micro-batch only its layers' inputs (the model's, 0, and
    # layer 1's, 100) and its 100-byte output; its largest layer's whole peak, 300, comes once.
    lean = estimate(Plan((dataclasses.replace(TWO_BY_TWO[0], recompute=True), TWO_BY_TWO[1]), 2), profile, SLOW, 8)
    assert lean.memory_bytes == (4e9 + 2 * (0 + 100 + 100) / 2 + 300 / 2, est.memory_bytes[1])
    # and its backward runs its forward again.
    assert lean.backward_s[0] == pytest.approx(est.backward_s[0] + est.forward_s[0])
    assert lean.forward_s == est.forward_s and lean.backward_s[1] == est.backward_s[1]


def test_a_profile_measured_with_its_optimizer_prices_the_runtime_s_gradients_and_closing():
    # Two layers of 1000 parameter bytes, 2000 of optimizer state, 100 saved and a peak of 150
    # (excess 50) per profile batch of 4, outputs of 40, an optimizer step that makes 300 more.
    layer = LayerProfile("l", 1.0, 1.0, 40, 1000, optimizer_state_bytes=2000, peak_bytes=150, saved_bytes=100,
                         update_peak_bytes=300)  # fmt: skip
    profile = ModelProfile((layer, dataclasses.replace(layer, name="m")), profile_batch_size=4)
    # Two stages, M = 2, 2 samples each (half the profile batch).
    est = estimate(Plan.straight(2, 2, micro_batches=2), profile, SLOW, 4)
    # Stage 0: K = 2 = M, so after its first backward one micro-batch stays beside both sets of
    # gradients: 4000 static + max(2 x 70, 1000 + 1 x 70) + 25, where a micro-batch keeps
    # (100 saved + its 40-byte output) / 2.
    assert est.memory_bytes[0] == 4000 + 1000 + 70 + 25
    # Stage 1 keeps no output (the loss): 4000 + max(50, 1000 + 50) + 25.
    assert est.memory_bytes[1] == 4000 + 1000 + 50 + 25
    # Data parallelism on 2 replicas, M = 1: nothing is alive after the backward, but the
    # all-reduce copies the parameters beside both sets of gradients: 8000 + max(2025, 4000, 600).
    dp = estimate(Plan.data_parallel(2, 2, 1), profile, SLOW, 4)
    assert dp.memory_bytes == (8000 + 4000,)
