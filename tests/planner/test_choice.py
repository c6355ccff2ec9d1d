"""The one choice rule over measurements: the fastest median, unless a simpler plan is within the
spreads of it; data parallelism first, then fewer stages, then the plan measured first."""

from __future__ import annotations

import pytest

from dapple_lightning.plan import Plan
from dapple_lightning.planner import MIN_SPREAD, MeasuredPlan, choose_measured, relative_spread

DP = Plan.data_parallel(6, 4)


def stages(*spans: tuple[int, int, int], micro_batches: int = 4) -> Plan:
    """A plan of (first layer, end layer, replicas) stages."""
    return Plan.from_dict(
        {"micro_batches": micro_batches, "stages": [{"layers": [a, b], "replicas": r} for a, b, r in spans]}
    )


TWO = stages((0, 3, 2), (3, 6, 2))
TWO_B = stages((0, 2, 2), (2, 6, 2))
THREE = stages((0, 2, 2), (2, 4, 1), (4, 6, 1))


def runs(*table: tuple[Plan, tuple[float, ...]]) -> list[MeasuredPlan]:
    return [MeasuredPlan(plan, speeds, order=i) for i, (plan, speeds) in enumerate(table)]


@pytest.mark.parametrize(
    ("table", "chosen", "reason"),
    [
        # plan,  samples/s per run                                  chosen  reason
        ([(DP, (100.0,)), (TWO, (110.0,))], TWO, "the fastest, clearly"),  # +10% > 3% + 3%
        ([(DP, (100.0,)), (TWO, (105.0,))], DP, "data parallelism, the simplest"),  # +5% < 6%
        ([(DP, (100.0, 100.0, 100.0)), (TWO, (104.0, 130.0, 104.0))], DP, "data parallelism, the simplest"),
        ([(DP, (90.0,)), (THREE, (120.0,)), (TWO, (116.0,))], TWO, "the simpler: fewer stages"),
        ([(DP, (110.0,)), (THREE, (120.0,)), (TWO, (114.0,))], THREE, "do not beat data parallelism"),
        ([(DP, (90.0,)), (TWO, (118.0,)), (TWO_B, (121.0,))], TWO, "the simpler: measured first"),
        ([(TWO, (121.0,)), (THREE, (118.0,))], TWO, "the fastest, and the simplest of them"),
    ],
)
def test_the_fastest_median_unless_a_simpler_plan_is_within_the_spreads(table, chosen, reason):
    choice = choose_measured(runs(*table))
    assert choice.chosen.plan == chosen
    assert reason in choice.reason


def test_a_plans_spread_is_the_larger_of_its_runs_spread_and_how_far_its_runs_disagree():
    one = MeasuredPlan(DP, (100.0,))
    assert one.median == 100.0 and one.spread == MIN_SPREAD  # nothing recorded: the floor
    noisy = MeasuredPlan(DP, (100.0, 101.0), (0.08, 0.10))
    assert noisy.spread == pytest.approx(0.09)  # the median of the runs' spreads
    apart = MeasuredPlan(DP, (90.0, 100.0, 110.0), (0.01, None, 0.02))
    assert apart.spread == pytest.approx(10 / 100)  # half the range over the median
    assert relative_spread([1.0, 1.0, 1.0]) is None
    assert relative_spread([1.0, 1.0, 1.2, 1.2]) == pytest.approx(0.1 / 1.1)


def test_measurements_that_cannot_be_read_are_refused():
    with pytest.raises(ValueError, match="no runs measured"):
        MeasuredPlan(DP, ())
    with pytest.raises(ValueError, match="2 run spreads for 1 runs"):
        MeasuredPlan(DP, (100.0,), (0.01, 0.02))
    with pytest.raises(ValueError, match="no measured plans"):
        choose_measured([])
