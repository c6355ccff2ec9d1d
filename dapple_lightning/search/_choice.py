"""Which plan a study's measurements support: the study's trials read as the planner's measurement
records and chosen by its one rule (``planner.choose_measured``, whose docstring states it), which
``plan="auto"`` uses too, so that both choose the same plan from the same numbers.

The study's side of it: **a plan's runs** are its completed trials, its first measurement and any
repeats (the confirmation round's, ``_loop``), each trial's samples/s its value and its spread the
``spread`` attribute (half the interquartile range of its step times over their median). A
sampler's repeated proposal answered from an earlier measurement (``duplicate_of``) is not a
measurement and does not count. A plan's order is its first trial's number.

This is the rule of the study's "best" everywhere: :func:`best_plan`, ``optuna://`` plan specs,
the command line's ``best``, the sweeper's results and ``search plot``'s ranking.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import optuna
from optuna.trial import FrozenTrial, TrialState

from dapple_lightning.plan import Plan
from dapple_lightning.planner import MeasuredPlan, PlanChoice, choose_measured
from dapple_lightning.search._space import describe_plan, plan_from_params
from dapple_lightning.trials import Fingerprint

__all__ = [
    "Choice",
    "PlanResult",
    "choice_lines",
    "choose_plan",
    "compare_with_data_parallel",
    "no_completed_trial",
    "plan_results",
    "throughput_study",
    "trial_plan",
]


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
class PlanResult(MeasuredPlan):
    """One plan's measurements in a study: the record the choice rule reads, with its trials."""

    trials: tuple[FrozenTrial, ...] = ()
    """Its completed measurements, in trial order: its first measurement, then any repeats."""

    @classmethod
    def of(cls, plan: Plan, trials: Sequence[FrozenTrial]) -> PlanResult:
        spreads = tuple(_recorded_spread(t) for t in trials)
        return cls(plan, tuple(t.values[0] for t in trials), spreads, trials[0].number, tuple(trials))

    @property
    def samples_per_s(self) -> float:
        """The median of the measurements."""
        return self.median

    @property
    def trial(self) -> FrozenTrial:
        """The plan's first measurement: the trial that names it (repeats say they confirm it)."""
        return self.trials[0]

    @property
    def number(self) -> int:
        return self.order

    def figure(self) -> str:
        """``"412.0 ± 3%"``: the median samples/s and the spread."""
        return f"{self.samples_per_s:.1f} ± {self.spread:.0%}"

    def describe(self) -> str:
        """``"trial 3 (1:1 cuts=3 M=4 dapple, 412.0 ± 3%)"``."""
        runs = f", {len(self.trials)} runs" if len(self.trials) > 1 else ""
        return f"trial {self.number} ({describe_plan(self.plan)}, {self.figure()}{runs})"


def _recorded_spread(trial: FrozenTrial) -> float | None:
    value = trial.user_attrs.get("spread")
    return float(value) if isinstance(value, int | float) else None


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


@dataclass(frozen=True)
class Choice(PlanChoice):
    """The plan a study's measurements support (the rule: ``planner.choose_measured``); its plans
    are the study's :class:`PlanResult`."""

    chosen: PlanResult
    ranked: tuple[PlanResult, ...]
    tied: tuple[PlanResult, ...]

    @property
    def note(self) -> str | None:
        """Why the chosen plan is not simply the fastest, with the numbers; ``None`` when it is, clearly."""
        if len(self.tied) == 1:
            return None
        names = ", ".join(r.describe() for r in self.tied)
        return (
            f"cannot be told apart (each within the summed spreads of the fastest): {names}; "
            f"chosen: trial {self.chosen.number}, {self.reason}"
        )


def choose_plan(study: optuna.Study) -> Choice:
    """The plan to train with: the study's measured plans (:func:`plan_results`) chosen by the
    planner's rule (``planner.choose_measured``).

    Raises:
        ValueError: When no trial has completed yet, or the study does not maximize one
            throughput (see :func:`throughput_study`).
    """
    if not throughput_study(study):
        raise ValueError(f"study {study.study_name!r} does not maximize one value: no plan choice by throughput")
    results = plan_results(study)
    if not results:
        raise no_completed_trial(study)
    picked = choose_measured(results)
    return Choice(picked.chosen, picked.ranked, picked.tied, picked.reason)


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
