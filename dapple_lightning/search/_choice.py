"""Which plan a study's measurements support: each plan's median and spread, and the choice among them.

A trial is one short run on a machine that other work shares, so one measurement of a plan says
little: runs of one plan differ by more than many plans differ from each other (design notes), and
the fastest of many noisy measurements is, more often than not, a lucky one. So the choice is made
over plans, not trials, and only where the numbers can carry it:

1. **A plan's measurements** are its completed trials: its first measurement and any repeats (the
   confirmation round's, ``_loop``). A sampler's repeated proposal answered from an earlier
   measurement (``duplicate_of``) is not a measurement and does not count.
2. **Its number** is the median of its measurements; **its spread** the larger of how much its
   trials' step times vary (the median of their recorded spreads, each at least
   :data:`MIN_SPREAD`) and how far its measurements disagree (half their range over their median).
3. **Two plans can be told apart** when the faster leads the slower by more than the sum of their
   spreads.
4. **The choice** is the simplest plan that cannot be told apart from the fastest: data parallelism
   first, then fewer stages, then the one measured first. A pipeline must also beat data
   parallelism by more than both spreads; data parallelism always qualifies. When the simplest is
   not the fastest, the note names the plans that could not be told apart, with their numbers.

This is the rule of the study's "best" everywhere: :func:`best_plan`, ``optuna://`` plan specs,
the command line's ``best``, the sweeper's results and ``search plot``'s ranking.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import optuna
from optuna.trial import FrozenTrial, TrialState

from dapple_lightning.plan import Plan
from dapple_lightning.search._fingerprint import Fingerprint
from dapple_lightning.search._space import describe_plan, plan_from_params

__all__ = [
    "MIN_SPREAD",
    "Choice",
    "PlanResult",
    "choice_lines",
    "choose_plan",
    "compare_with_data_parallel",
    "no_completed_trial",
    "plan_results",
    "relative_spread",
    "spread",
    "throughput_study",
    "trial_plan",
]

MIN_SPREAD = 0.03
"""Relative measurement spread assumed for a trial that recorded none (or less)."""


def relative_spread(step_times: Sequence[float]) -> float | None:
    """Half the interquartile range of ``step_times`` over their median (``None`` for fewer than 4)."""
    if len(step_times) < 4:
        return None
    q1, median, q3 = statistics.quantiles(step_times, n=4)
    return (q3 - q1) / 2 / median if median > 0 else None


def spread(trial: FrozenTrial) -> float:
    """The trial's relative measurement spread (half the interquartile range of its step times over
    their median), at least :data:`MIN_SPREAD`."""
    value = trial.user_attrs.get("spread")
    return max(float(value), MIN_SPREAD) if isinstance(value, int | float) else MIN_SPREAD


def trial_plan(trial: FrozenTrial, study: optuna.Study | None = None) -> Plan:
    """The plan a trial measured (from its ``plan`` attribute, else decoded from its parameters)."""
    data = trial.user_attrs.get("plan")
    if isinstance(data, Mapping):
        return Plan.from_dict(data)
    stored = study.user_attrs.get("fingerprint") if study is not None else None
    if not isinstance(stored, Mapping):
        raise ValueError(f"trial {trial.number} stores no plan and the study no fingerprint to decode its parameters")
    fp = Fingerprint.from_dict(stored)
    return plan_from_params(trial.params, num_layers=fp.num_layers, world_size=fp.world_size)


def throughput_study(study: optuna.Study) -> bool:
    """Whether the study maximizes one number, a throughput: the studies the choice rule is for (a
    Pareto front or a minimized loss keeps Optuna's own best)."""
    return len(study.directions) == 1 and study.directions[0] == optuna.study.StudyDirection.MAXIMIZE


@dataclass(frozen=True)
class PlanResult:
    """One plan's measurements in a study, summed up."""

    plan: Plan
    trials: tuple[FrozenTrial, ...]
    """Its completed measurements, in trial order: its first measurement, then any repeats."""
    samples_per_s: float
    """The median of the measurements."""
    spread: float
    """Relative: the larger of its trials' spread and how far its measurements disagree."""

    @classmethod
    def of(cls, plan: Plan, trials: Sequence[FrozenTrial]) -> PlanResult:
        values = [t.values[0] for t in trials]
        median = statistics.median(values)
        within = statistics.median(spread(t) for t in trials)
        between = (max(values) - min(values)) / 2 / median if median > 0 else 0.0
        return cls(plan, tuple(trials), median, max(within, between))

    @property
    def trial(self) -> FrozenTrial:
        """The plan's first measurement: the trial that names it (repeats say they confirm it)."""
        return self.trials[0]

    @property
    def number(self) -> int:
        return self.trials[0].number

    @property
    def data_parallel(self) -> bool:
        return self.plan.num_stages == 1

    def beats(self, other: PlanResult) -> bool:
        """Whether this plan leads ``other`` by more than the two spreads: a lead the noise does not explain."""
        return self.samples_per_s > other.samples_per_s * (1 + self.spread + other.spread)

    def told_apart(self, other: PlanResult) -> bool:
        return self.beats(other) or other.beats(self)

    def figure(self) -> str:
        """``"412.0 ± 3%"``: the median samples/s and the spread."""
        return f"{self.samples_per_s:.1f} ± {self.spread:.0%}"

    def describe(self) -> str:
        """``"trial 3 (1:1 cuts=3 M=4 dapple, 412.0 ± 3%)"``."""
        runs = f", {len(self.trials)} runs" if len(self.trials) > 1 else ""
        return f"trial {self.number} ({describe_plan(self.plan)}, {self.figure()}{runs})"


def plan_results(study: optuna.Study) -> list[PlanResult]:
    """Every measured plan, the best median of the first objective first (ties: the one measured first)."""
    groups: dict[tuple, list[FrozenTrial]] = {}
    plans: dict[tuple, Plan] = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if t.user_attrs.get("duplicate_of") is not None or not t.values:
            continue
        key = tuple(sorted(t.params.items())) if t.params else (("plan", repr(t.user_attrs.get("plan"))),)
        groups.setdefault(key, []).append(t)
        plans.setdefault(key, trial_plan(t, study))
    results = [PlanResult.of(plans[key], trials) for key, trials in groups.items()]
    sign = -1.0 if study.directions[0] == optuna.study.StudyDirection.MAXIMIZE else 1.0
    return sorted(results, key=lambda r: (sign * r.samples_per_s, r.number))


def no_completed_trial(study: optuna.Study) -> ValueError:
    """The error for a study with nothing to choose from yet, with its trials counted by state."""
    counts = {s.name: 0 for s in TrialState}
    for t in study.get_trials(deepcopy=False):
        counts[t.state.name] += 1
    summary = ", ".join(f"{n} {k.lower()}" for k, n in counts.items() if n)
    return ValueError(f"study {study.study_name!r} has no completed trial yet ({summary or 'no trials'})")


def _simplicity(result: PlanResult) -> tuple[int, int]:
    return result.plan.num_stages, result.number


@dataclass(frozen=True)
class Choice:
    """The plan a study's measurements support (see the module docstring for the rule)."""

    chosen: PlanResult
    ranked: tuple[PlanResult, ...]
    """Every measured plan, the highest median first."""
    tied: tuple[PlanResult, ...]
    """The plans that cannot be told apart from the fastest, the fastest among them (first)."""
    note: str | None
    """Why the chosen plan is not simply the fastest, with the numbers; ``None`` when it is, clearly."""

    @property
    def leader(self) -> PlanResult:
        return self.ranked[0]

    @property
    def data_parallel(self) -> PlanResult | None:
        """The fastest data-parallel plan (one stage), if one was measured."""
        return next((r for r in self.ranked if r.data_parallel), None)

    @property
    def trial(self) -> FrozenTrial:
        return self.chosen.trial


def choose_plan(study: optuna.Study) -> Choice:
    """The plan to train with, by the rule of the module docstring.

    Raises:
        ValueError: When no trial has completed yet, or the study does not maximize one
            throughput (see :func:`throughput_study`).
    """
    if not throughput_study(study):
        raise ValueError(f"study {study.study_name!r} does not maximize one value: no plan choice by throughput")
    ranked = plan_results(study)
    if not ranked:
        raise no_completed_trial(study)
    leader = ranked[0]
    dp = next((r for r in ranked if r.data_parallel), None)
    tied = tuple(r for r in ranked if not leader.told_apart(r))
    eligible = [r for r in tied if dp is None or r.data_parallel or r.beats(dp)]
    chosen = min(eligible, key=_simplicity)
    return Choice(chosen, tuple(ranked), tied, _note(chosen, leader, tied))


def _note(chosen: PlanResult, leader: PlanResult, tied: Sequence[PlanResult]) -> str | None:
    if len(tied) == 1:
        return None
    if chosen.data_parallel and not leader.data_parallel:
        why = "data parallelism, the simplest"
    elif chosen is not leader:
        why = "fewer stages" if chosen.plan.num_stages < leader.plan.num_stages else "measured first"
        why = f"the simpler: {why}"
    elif any(_simplicity(r) < _simplicity(leader) for r in tied):
        why = "the fastest; the simpler ones do not beat data parallelism by more than the spreads"
    else:
        why = "the fastest, and the simplest of them"
    names = ", ".join(r.describe() for r in tied)
    return (
        f"cannot be told apart (each within the summed spreads of the fastest): {names}; "
        f"chosen: trial {chosen.number}, {why}"
    )


def choice_lines(choice: Choice, *, top: int = 6) -> list[str]:
    """The choice as text: the plans (every repeated one, and the fastest up to ``top``), each
    measurement, the note, and the chosen plan against data parallelism in numbers."""
    shown = [r for i, r in enumerate(choice.ranked) if i < top or len(r.trials) > 1 or r is choice.chosen]
    lines = [f"{len(choice.ranked)} plans measured, by median samples/s (± the spread that tells plans apart):"]
    for r in shown:
        mark = "  <- chosen" if r is choice.chosen else ""
        runs = " ".join(f"{t.values[0]:.1f}" for t in r.trials)
        label = f"{len(r.trials)} runs: {runs}" if len(r.trials) > 1 else "1 run"
        lines.append(f"  trial {r.number:>3}  {r.figure():>14}  {label:<30} {describe_plan(r.plan)}{mark}")
    if choice.note:
        lines.append(choice.note)
    lines.append(compare_with_data_parallel(choice))
    return lines


def compare_with_data_parallel(choice: Choice) -> str:
    """One line: the chosen plan, and how it compares with data parallelism, in numbers."""
    chosen, dp = choice.chosen, choice.data_parallel
    head = f"chosen: {chosen.describe()}"
    if dp is None:
        return f"{head}; data parallelism was not measured in this study"
    if dp is chosen:
        return f"{head}: data parallelism"
    lead = chosen.samples_per_s / dp.samples_per_s - 1
    return (
        f"{head}: {chosen.samples_per_s / dp.samples_per_s:.2f}x data parallelism's {dp.figure()} "
        f"(trial {dp.number}), a lead of {lead:+.1%} against spreads of {chosen.spread + dp.spread:.0%}"
    )
