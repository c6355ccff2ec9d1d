"""The one rule that chooses a plan from measurements: ``plan="auto"``'s turns and the search's
trials alike.

Pure: a function over plain records (each plan's throughput per run, and how much each run's
steps varied), so that every path that measures plans (``plan="auto"`` in ``setup``, the search's
study, its command line, the Hydra sweeper, ``best_plan``) chooses the same plan from the same
numbers.

A run is one short measurement on a machine that other work shares: runs of one plan differ by
more than close plans differ from each other, and the fastest of several noisy measurements is
more often than not a lucky one. So the rule compares plans, not runs, and only where the numbers
carry it:

1. **A plan's number** is the median of its runs' samples/s.
2. **Its spread** (relative) is the larger of how much its runs' steps varied (the median of
   the runs' recorded spreads, each at least :data:`MIN_SPREAD`, which is also what a run that
   recorded none is taken to have) and how far its runs disagree (half their range over their
   median).
3. **Two plans can be told apart** when the faster leads the slower by more than the sum of their
   spreads.
4. **The choice** is the simplest plan that cannot be told apart from the fastest: data
   parallelism (one stage) first, then fewer stages, then the one measured first. A pipeline must
   also beat data parallelism by more than both spreads; data parallelism always qualifies.

So the fastest median wins whenever its lead is larger than the noise, and otherwise the simpler
plan, whose speed the measurements cannot tell from it, does: it has fewer ways to go wrong
(fewer process groups, no bubble, no activations held across stages).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from dapple_lightning.plan import Plan

__all__ = ["MIN_SPREAD", "MeasuredPlan", "PlanChoice", "choose_measured", "relative_spread"]

MIN_SPREAD = 0.03
"""Relative spread assumed for a run that recorded none (or less): a floor under the noise of a
short run on a shared machine (``docs/benchmarks.md``, "Trials for what the model cannot tell apart")."""


def relative_spread(step_times: Sequence[float]) -> float | None:
    """Half the interquartile range of ``step_times`` over their median (``None`` for fewer than 4)."""
    if len(step_times) < 4:
        return None
    q1, median, q3 = statistics.quantiles(step_times, n=4)
    return (q3 - q1) / 2 / median if median > 0 else None


@dataclass(frozen=True)
class MeasuredPlan:
    """One plan's measurements, however they were taken (a search trial per run, or a turn of
    ``plan="auto"`` per run)."""

    plan: Plan
    runs: tuple[float, ...]
    """Samples/s, one per run, in the order taken."""
    run_spreads: tuple[float | None, ...] = ()
    """Per run (or none at all), how much its steps varied, relative (:func:`relative_spread`);
    ``None``: not recorded, :data:`MIN_SPREAD` assumed."""
    order: int = 0
    """When the plan was first measured (a trial number, a place in the shortlist): of equally
    simple plans that cannot be told apart, the earlier is chosen."""

    def __post_init__(self) -> None:
        if not self.runs:
            raise ValueError(f"no runs measured for plan {self.plan.describe()}: give at least one samples/s")
        if self.run_spreads and len(self.run_spreads) != len(self.runs):
            raise ValueError(
                f"{len(self.run_spreads)} run spreads for {len(self.runs)} runs: give one per run, or none"
            )

    @property
    def median(self) -> float:
        """The plan's number: the median samples/s of its runs."""
        return statistics.median(self.runs)

    @property
    def spread(self) -> float:
        """Relative: the larger of its runs' spread and how far its runs disagree."""
        recorded = self.run_spreads or (None,)
        within = statistics.median(MIN_SPREAD if s is None else max(s, MIN_SPREAD) for s in recorded)
        median = self.median
        between = (max(self.runs) - min(self.runs)) / 2 / median if median > 0 else 0.0
        return max(within, between)

    @property
    def data_parallel(self) -> bool:
        return self.plan.num_stages == 1

    def beats(self, other: MeasuredPlan) -> bool:
        """Whether this plan leads ``other`` by more than the two spreads: a lead the noise does not explain."""
        return self.median > other.median * (1 + self.spread + other.spread)

    def told_apart(self, other: MeasuredPlan) -> bool:
        return self.beats(other) or other.beats(self)

    def simplicity(self) -> tuple[int, int]:
        """Smaller is simpler: fewer stages, then measured earlier."""
        return self.plan.num_stages, self.order


@dataclass(frozen=True)
class PlanChoice:
    """The plan the measurements support, and why (see the module docstring for the rule)."""

    chosen: MeasuredPlan
    ranked: tuple[MeasuredPlan, ...]
    """Every measured plan, the highest median first (ties: measured first)."""
    tied: tuple[MeasuredPlan, ...]
    """The plans that cannot be told apart from the fastest, the fastest (first) among them."""
    reason: str
    """Why ``chosen``, in a few words: ``"the fastest, clearly"`` when no other plan is within the
    spreads of it."""

    @property
    def leader(self) -> MeasuredPlan:
        return self.ranked[0]

    @property
    def data_parallel(self) -> MeasuredPlan | None:
        """The fastest data-parallel plan (one stage), if one was measured."""
        return next((r for r in self.ranked if r.data_parallel), None)


def choose_measured(measured: Sequence[MeasuredPlan]) -> PlanChoice:
    """The plan to train with, by the rule of the module docstring.

    Raises:
        ValueError: When ``measured`` is empty.
    """
    if not measured:
        raise ValueError("no measured plans to choose from: measure at least one plan")
    ranked = tuple(sorted(measured, key=lambda m: (-m.median, m.order)))
    leader = ranked[0]
    dp = next((m for m in ranked if m.data_parallel), None)
    tied = tuple(m for m in ranked if not leader.told_apart(m))
    eligible = [m for m in tied if dp is None or m.data_parallel or m.beats(dp)]
    chosen = min(eligible, key=MeasuredPlan.simplicity)
    return PlanChoice(chosen, ranked, tied, _reason(chosen, leader, tied))


def _reason(chosen: MeasuredPlan, leader: MeasuredPlan, tied: Sequence[MeasuredPlan]) -> str:
    if len(tied) == 1:
        return "the fastest, clearly"
    if chosen.data_parallel and not leader.data_parallel:
        return "data parallelism, the simplest"
    if chosen is not leader:
        why = "fewer stages" if chosen.plan.num_stages < leader.plan.num_stages else "measured first"
        return f"the simpler: {why}"
    if any(m.simplicity() < leader.simplicity() for m in tied):
        return "the fastest; the simpler ones do not beat data parallelism by more than the spreads"
    return "the fastest, and the simplest of them"
