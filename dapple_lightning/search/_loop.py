"""The one search loop: open a study, ask for plans, hand them to a runner, tell what came back.

Both fronts drive it, as Optuna's ``Study.optimize`` is one call into ``_optimize``:

- :class:`~dapple_lightning.search.PlanSearch` (the API and ``python -m dapple_lightning.search
  run``) runs each plan with :func:`~dapple_lightning.trials.run_trial`, in fresh processes;
- the Hydra sweeper (``_hydra``) hands each batch of plans to Hydra's launcher as jobs.

What the loop owns, the same for both: the study's identity (fingerprint, searched choices,
objectives; resuming refuses another setup), the sampler's seed offset on resume (a resumed search
does not replay the first run's random start-up choices), trials orphaned by a dead search (marked,
their plans queued again), repeated proposals (answered from the earlier measurement), ``n_trials``
as the study's total, an optional time limit, the confirmation round that measures the contenders
again before the study's choice is read (``_confirm``), and interruption: Ctrl-C or SIGTERM marks
the running trials FAIL, queues their plans again and propagates. A runner's own error (an
``Exception``) fails the trials it was given and the loop goes on; what a candidate does to its
processes is the runner's business and comes back as an :class:`Outcome`.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from dapple_lightning.plan import Plan
from dapple_lightning.search._bookkeeping import (
    CONFIRMS,
    RepeatGuard,
    distinct_finished,
    draw_plan,
    exploring_elsewhere,
    finished_count,
    mark_interrupted,
    recover_stale_trials,
    repeat_trial,
)
from dapple_lightning.search._choice import choose_plan, throughput_study
from dapple_lightning.search._confirm import pending, plan_round, round_key, take_queued
from dapple_lightning.search._redact import cause, redact, storage_error
from dapple_lightning.search._report import clip
from dapple_lightning.search._results import best_trial
from dapple_lightning.search._seed import BASELINES, baseline_plans
from dapple_lightning.search._space import PlanSpace, describe_plan
from dapple_lightning.trials import Fingerprint, check_fingerprint

__all__ = [
    "Drawn",
    "Outcome",
    "Runner",
    "create_sampler",
    "enqueue_plans",
    "existing_study",
    "open_study",
    "optimize",
]


@dataclass(frozen=True)
class Drawn:
    """A trial the loop asked for, with the plan drawn for it."""

    trial: optuna.Trial
    plan: Plan
    confirms: int | None = None
    """For a confirmation trial, the trial whose plan it measures again: a runner does not prune it,
    since a repeat cut short would leave the plan's median to its luckier runs."""


@dataclass(frozen=True)
class Outcome:
    """How a trial ended, as a runner reports it: the loop tells the study."""

    state: TrialState
    """``COMPLETE`` (with ``values``), ``PRUNED`` or ``FAIL``."""
    values: tuple[float, ...] = ()
    """One value per direction of the study, for a complete trial."""
    attrs: Mapping[str, Any] = field(default_factory=dict)
    """User attributes to store on the trial (measurements, ``fail_reason``, a job's directory)."""
    summary: str = ""
    """The outcome in the progress line."""


Runner = Callable[[Sequence[Drawn]], Sequence[Outcome]]
"""Runs a batch of drawn plans (one per trial), an :class:`Outcome` for each, in order."""


def create_sampler(kind: str = "tpe", seed: int = 0, tpe_startup_trials: int = 10) -> optuna.samplers.BaseSampler:
    """The sampler of a plan search: ``tpe`` (what :class:`PlanSearch` and the sweeper use) or ``random``.

    TPE is multivariate and grouped: the replica and cut parameters of each stage count form
    their own group (they only exist together), and ``constant_liar`` keeps parallel workers on one
    study from proposing the same plan.
    """
    if kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if kind != "tpe":
        raise ValueError(f"unknown sampler {kind!r}; choose tpe or random")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(
            seed=seed, n_startup_trials=tpe_startup_trials, multivariate=True, group=True, constant_liar=True
        )


# ------------------------------------------------------------------------------------ opening


def existing_study(storage: str, study_name: str) -> optuna.Study | None:
    """The study if the storage holds it, else ``None``.

    Raises:
        ValueError: When the storage cannot be opened.
    """
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        names = optuna.get_all_study_names(storage)
        return optuna.load_study(study_name=study_name, storage=storage) if study_name in names else None
    except Exception as e:
        raise storage_error(storage, e) from cause(e, storage)


def _space_attrs(space: PlanSpace) -> dict[str, Any]:
    chunked = {"choices": choices} if (choices := space.categorical_choices()) else {}
    return {**space.to_dict(), "max_stages": space.stage_limit, "size": space.size, **chunked}


def _check_resumable(
    study: optuna.Study, fingerprint: Fingerprint, space: PlanSpace, objectives: list[str], allow_mismatch: bool
) -> list[str]:
    """Refuse to resume ``study`` for another setup; the fingerprint differences ``allow_mismatch`` let pass."""
    stored = study.user_attrs.get("objectives")
    if stored is not None and list(stored) != objectives:
        raise ValueError(
            f"study {study.study_name!r} optimizes {stored}, this run asks for {objectives}; "
            "optimize the same objectives or use another study name"
        )
    diffs = check_fingerprint(
        study.user_attrs.get("fingerprint"), fingerprint, study_name=study.study_name, allow_mismatch=allow_mismatch
    )
    searched = study.user_attrs.get("space")
    if isinstance(searched, Mapping):
        now = _space_attrs(space)
        # Optuna refuses to change a categorical parameter's choices within a study.
        changed = [
            f"{k}: study {searched.get(k)} != now {now[k]}"
            for k in ("micro_batches", "schedules", *(("chunks", "choices") if "chunks" in now else ()))
            if searched.get(k) != now[k]
        ]
        if changed:
            raise ValueError(
                f"study {study.study_name!r} searched other choices ({'; '.join(changed)}); Optuna cannot change "
                "a categorical parameter's choices within a study: search the same ones or use another study name"
            )
    return diffs


def open_study(
    storage: str | optuna.storages.BaseStorage,
    study_name: str,
    *,
    fingerprint: Fingerprint,
    space: PlanSpace,
    directions: Sequence[str],
    objectives: list[str],
    sampler: Callable[[int], optuna.samplers.BaseSampler],
    pruner: optuna.pruners.BasePruner | None = None,
    attrs: Mapping[str, Any] | None = None,
    existing: optuna.Study | None = None,
    allow_mismatch: bool = False,
    say: Callable[[str], None] = print,
) -> optuna.Study:
    """Create or resume the study of a plan search over ``space``.

    A new study records ``fingerprint``, the space, ``objectives`` and ``attrs``; a resumed one
    (``existing``, from :func:`existing_study`) must match them. ``sampler`` is called with the
    number of trials already in the study, to offset its seed. Trials a dead search left running
    are marked interrupted and their plans queued again.

    Raises:
        FingerprintMismatch: A study made for another setup (unless ``allow_mismatch``).
        ValueError: Other objectives or other searched choices than the study's.
    """
    if existing is not None:
        diffs = _check_resumable(existing, fingerprint, space, objectives, allow_mismatch)
        if diffs:
            say(f"warning: fingerprint differs ({'; '.join(diffs)}); continuing as asked")
    study = optuna.create_study(
        storage=storage,
        study_name=study_name,
        directions=list(directions),
        sampler=sampler(len(existing.trials) if existing is not None else 0),
        pruner=pruner,
        load_if_exists=True,
    )
    _record_identity(
        study,
        {"space": _space_attrs(space), "objectives": list(objectives), **(attrs or {})},
        fingerprint.to_dict(),
    )
    for number in recover_stale_trials(study):
        say(f"trial {number:>3} was running when its search process died: marked FAIL, plan queued again")
    return study


def _record_identity(study: optuna.Study, attrs: Mapping[str, Any], fingerprint: Mapping[str, Any]) -> None:
    """Store what identifies a new study, ``fingerprint`` last, as the mark that the record is whole.

    Optuna's storages set one attribute per call. A study counts as recorded only once it holds
    its fingerprint, so a search that died half-way through leaves a study without one (and
    without trials: none runs before the record is whole), which the next open records again:
    never a study that holds a fingerprint but not the space and objectives that resuming
    compares.
    """
    if "fingerprint" in study.user_attrs:
        return
    for key, value in attrs.items():
        study.set_user_attr(key, value)
    study.set_user_attr("fingerprint", dict(fingerprint))


def enqueue_plans(study: optuna.Study, space: PlanSpace, plans: Sequence[Any], source: str = "user") -> None:
    """Queue ``plans`` (anything :meth:`Plan.coerce` takes) to be measured first; ones already queued
    or measured are skipped."""
    for item in plans:
        plan = Plan.coerce(item)
        try:
            params = space.params(plan)
        except ValueError as e:
            raise ValueError(f"enqueued plan {describe_plan(plan)} is not in the search space: {e}") from e
        study.enqueue_trial(params, user_attrs={"source": source}, skip_if_exists=True)


def enqueue_baselines(study: optuna.Study, space: PlanSpace, names: Sequence[str] = BASELINES) -> None:
    """Queue the baseline plans (data parallelism, a straight pipeline) once per study, ahead of
    anything else; a resumed study does not queue them again (an interrupted one is retried as such)."""
    if study.user_attrs.get("baselines_enqueued") is not None:
        return
    plans = baseline_plans(space, tuple(names))
    for name, plan in plans:
        study.enqueue_trial(space.params(plan), user_attrs={"source": name}, skip_if_exists=True)
    study.set_user_attr("baselines_enqueued", [name for name, _ in plans])


# --------------------------------------------------------------------------------------- loop


def optimize(
    study: optuna.Study,
    space: PlanSpace,
    run: Runner,
    *,
    n_trials: int,
    batch_size: int = 1,
    timeout_s: float | None = None,
    seed: int = 0,
    confirm_repeats: int = 0,
    label: str = "",
    say: Callable[[str], None] = print,
) -> None:
    """Run trials with ``run`` until ``study`` holds ``n_trials`` counted finished trials, then the
    confirmation round.

    Each round asks for up to ``batch_size`` trials (never more than the budget has left), answers
    repeated proposals from the earlier measurement, and hands the rest to ``run`` at once. It stops
    early when every plan of ``space`` has been tried or ``timeout_s`` seconds have passed (the
    running batch finishes). Then, unless the time ran out, the contenders are measured
    ``confirm_repeats`` more times each, interleaved (``_confirm``; 0: no round). ``label`` names
    the first objective in the progress lines.

    Raises:
        KeyboardInterrupt: (or another ``BaseException``) passed on after the running trials are
            marked FAIL and their plans queued again.
    """
    front = _Front(study, space, n_trials, RepeatGuard(seed=seed), label, say)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    done = finished_count(study)
    if done >= n_trials:
        say(f"study {study.study_name!r} already holds {done} finished trials (n_trials={n_trials})")
    while done < n_trials:
        if _out_of_time(deadline):
            later = "; the confirmation round comes with the next run of this search" if confirm_repeats else ""
            say(f"time limit of {timeout_s:g} s reached after {done} finished trials{later}")
            return
        if distinct_finished(study) >= space.size:
            say(f"every one of the {space.size} plans of the space has been tried")
            break
        batch = front.draw(min(batch_size, n_trials - done))
        if batch:
            front.run(batch, run)
        done = finished_count(study)
    if confirm_repeats > 0:
        _confirmation_round(front, run, confirm_repeats, batch_size, deadline, timeout_s)


def _out_of_time(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def _confirmation_round(
    front: _Front, run: Runner, repeats: int, batch_size: int, deadline: float | None, timeout_s: float | None
) -> None:
    """The confirmation round (see ``_confirm``): planned once, its queued trials measured in queue order."""
    study, say = front.study, front.say
    if not throughput_study(study):
        say("no confirmation round: the study does not maximize one throughput")
        return
    others = exploring_elsewhere(study)
    if others:
        numbers = ", ".join(str(t.number) for t in others)
        say(f"no confirmation round here: other workers still measure trial(s) {numbers}; the last of them runs it")
        return
    planned = plan_round(study, repeats, say)
    queued = pending(study)
    if planned is None and not queued and round_key(study) in study.user_attrs:
        say(f"the confirmation round of these trials ({round_key(study)}) was measured already")
    while queued:
        if _out_of_time(deadline):
            say(f"time limit of {timeout_s:g} s reached: {len(queued)} confirmation trial(s) left for the next run")
            return
        batch = front.take(queued[:batch_size])
        if batch:
            front.run(batch, run)
        queued = pending(study)


class _Front:
    """One loop's drawing and telling, with its progress lines."""

    def __init__(
        self,
        study: optuna.Study,
        space: PlanSpace,
        n_trials: int,
        repeats: RepeatGuard,
        label: str,
        say: Callable[[str], None],
    ) -> None:
        self.study, self.space, self.n_trials, self.repeats = study, space, n_trials, repeats
        self.label, self.say = label, say

    def draw(self, count: int) -> list[Drawn]:
        """Up to ``count`` trials to measure; repeated proposals are told here and not returned."""
        batch: list[Drawn] = []
        for _ in range(count):
            trial = self.study.ask()
            drawn = self._draw(trial, batch)
            if drawn is None:
                continue
            plan, previous = drawn
            if previous is None:
                self.repeats.measured()
                batch.append(Drawn(trial, plan, trial.user_attrs.get(CONFIRMS)))
                continue
            self._progress(trial.number, repeat_trial(self.study, trial, previous))
            explore = self.repeats.repeated(self.study, self.space)
            if explore is not None:
                self.say(f"the sampler keeps repeating itself: queued the unmeasured plan {describe_plan(explore)}")
        return batch

    def take(self, numbers: Sequence[int]) -> list[Drawn]:
        """The queued confirmation trials ``numbers`` that no other worker took first, drawn."""
        batch: list[Drawn] = []
        for number in numbers:
            trial = take_queued(self.study, number)
            drawn = None if trial is None else self._draw(trial, batch)
            if drawn is not None:
                batch.append(Drawn(trial, drawn[0], trial.user_attrs.get(CONFIRMS)))
        return batch

    def _draw(self, trial: optuna.Trial, batch: list[Drawn]) -> tuple[Plan, FrozenTrial | None] | None:
        """``trial``'s plan and an earlier measurement of it (see ``draw_plan``); ``None`` after a search error."""
        try:
            return draw_plan(self.study, trial, self.space)
        except Exception as e:
            self._search_error([trial], e)
            return None
        except BaseException:
            self._interrupt([trial, *(d.trial for d in batch)])
            raise

    def run(self, batch: list[Drawn], run: Runner) -> None:
        trials = [d.trial for d in batch]
        try:
            outcomes = list(run(batch))
            if len(outcomes) != len(batch):
                raise RuntimeError(f"the runner returned {len(outcomes)} outcomes for {len(batch)} trials")
        except Exception as e:
            # A bug of ours or a storage error, not the candidate's: record it and go on.
            self._search_error(trials, e)
            return
        except BaseException:
            self._interrupt(trials)
            raise
        for trial, outcome in zip(trials, outcomes):
            self._tell(trial, outcome)

    def _tell(self, trial: optuna.Trial, outcome: Outcome) -> None:
        stored = next(t for t in self.study.get_trials(deepcopy=False) if t.number == trial.number)
        if stored.state.is_finished():
            # Another worker took this trial for a dead one (its heartbeat was late) and queued it again.
            self._progress(trial.number, f"{outcome.summary} (not recorded: another worker ended this trial)")
            return
        for key, value in outcome.attrs.items():
            trial.set_user_attr(key, value)
        if outcome.state == TrialState.COMPLETE:
            self.study.tell(trial, list(outcome.values))
        else:
            self.study.tell(trial, state=outcome.state)
        self._progress(trial.number, outcome.summary)

    def _search_error(self, trials: list[optuna.Trial], error: Exception) -> None:
        reason = redact(f"search error: {type(error).__name__}: {error}")  # a storage error may quote its URL
        for trial in trials:
            try:
                trial.set_user_attr("fail_reason", reason)
                self.study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
            except Exception:  # the storage may be what failed
                pass
            self.say(f"trial {trial.number:>3} {reason}")

    def _interrupt(self, trials: list[optuna.Trial]) -> None:
        for trial in trials:
            try:
                trial.set_user_attr("fail_reason", "interrupted: the search was stopped; the plan is queued again")
                mark_interrupted(self.study, trial.number, trial.params, attrs=trial.user_attrs)
                self.say(f"trial {trial.number:>3} interrupted; run the same command again to resume")
            except Exception:  # never hide the interruption behind a storage error
                pass

    def _progress(self, number: int, outcome: str) -> None:
        attrs = self.study.trials[number].user_attrs
        plan = attrs.get("plan_str", "?")
        try:
            tail = self._leader()
        except ValueError:
            tail = "no completed trial yet"
        step = f"confirms {attrs[CONFIRMS]}" if CONFIRMS in attrs else f"{finished_count(self.study)}/{self.n_trials}"
        self.say(f"trial {number:>3} [{step}] {plan:<28} {clip(outcome, 60):<30} | {tail}")

    def _leader(self) -> str:
        """The progress line's tail: the fastest plan by median (the fastest trial, for other studies)."""
        unit = f" {self.label}" if self.label else ""
        if throughput_study(self.study):
            leader = choose_plan(self.study).leader
            return f"best {leader.figure()}{unit} (trial {leader.number})"
        best = best_trial(self.study)
        tail = f"best {best.values[0]:.1f}{unit} (trial {best.number})"
        if len(self.study.directions) > 1:
            tail += f", Pareto front of {len(self.study.best_trials)}"
        return tail
