"""Which trials of a study count, which were orphaned, which repeat a measured plan.

Optuna's trial states say little about a plan search: a trial interrupted by Ctrl-C ends FAIL but
must not count (its plan is queued again), a trial left RUNNING by a search that was killed must be
found and marked, and a sampler that proposes a plan already measured gets the earlier result back
instead of a second measurement. These rules are kept here, in functions of the study, so that the
search loop (``_loop``) and the benchmark's replays apply the same ones.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from dapple_lightning.plan import Plan
from dapple_lightning.search._space import PlanSpace, describe_plan

__all__ = [
    "RepeatGuard",
    "distinct_finished",
    "draw_plan",
    "finished_count",
    "mark_interrupted",
    "recover_stale_trials",
    "repeat_trial",
    "same_plan",
    "unmeasured_plan",
]

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
_INTERRUPTED = "interrupted_trial_"
"""Study attribute ``interrupted_trial_N``: trial ``N`` was interrupted."""


def _key(params: Mapping[str, Any]) -> tuple:
    return tuple(sorted(params.items()))


# ------------------------------------------------------------------------------ runner identity


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()[19]


def runner_info() -> dict[str, Any]:
    """Who runs a trial: stored in its ``runner`` attribute to find trials orphaned by a dead search."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid())}


def _runner_dead(runner: Any) -> bool:
    """Whether the search process that owns a RUNNING trial is certainly gone (same host only)."""
    if not isinstance(runner, Mapping) or runner.get("host") != socket.gethostname():
        return False
    pid = runner.get("pid")
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return runner.get("start") is not None and _start_time(pid) != runner.get("start")


# ------------------------------------------------------------------------------- what counts


def interrupted_trials(study: optuna.Study) -> set[int]:
    """Numbers of the trials a stopped or dead search left unfinished (they do not count).

    Each has an attribute of its own on the study, ``interrupted_trial_N``: workers sharing a
    study never rewrite a common list, which two of them doing at once would lose an update of.
    Studies of older versions list them in ``interrupted_trials`` instead, still read here.
    """
    attrs = study.user_attrs
    marked = {int(key[len(_INTERRUPTED) :]) for key in attrs if key.startswith(_INTERRUPTED)}
    return marked | set(attrs.get("interrupted_trials", []))


def _counted(study: optuna.Study) -> list[FrozenTrial]:
    skip = interrupted_trials(study)
    return [t for t in study.get_trials(deepcopy=False, states=FINISHED) if t.number not in skip]


def finished_count(study: optuna.Study) -> int:
    """Finished trials (complete, pruned, failed) that count towards ``n_trials``: not the interrupted
    ones, and not repeated proposals of a measured plan (they reuse its result and cost nothing)."""
    return sum(1 for t in _counted(study) if t.user_attrs.get("duplicate_of") is None)


def distinct_finished(study: optuna.Study) -> int:
    """Distinct plans (parameter sets) among the counted finished trials."""
    return len({_key(t.params) for t in _counted(study)})


def mark_interrupted(study: optuna.Study, number: int, params: Mapping[str, Any]) -> bool:
    """Mark a running trial interrupted (it will not count), end it FAIL and queue its plan again;
    whether this call ended it.

    Only the caller whose FAIL ended the trial queues the retry: of two workers that find the
    same orphaned trial, the second finds it finished and queues nothing (on storages that lock
    the trial's row while ending it, PostgreSQL and MySQL; on SQLite both may, at worst one
    extra measurement of the plan).
    """
    study.set_user_attr(f"{_INTERRUPTED}{number}", True)
    try:
        study.tell(number, state=TrialState.FAIL)
    except (RuntimeError, ValueError):  # another worker ended it first
        return False
    if params:
        study.enqueue_trial(dict(params), user_attrs={"source": "retry", "retry_of": number})
    return True


def recover_stale_trials(study: optuna.Study) -> list[int]:
    """Mark interrupted the RUNNING trials whose search process is gone (same host); the numbers
    of those this call ended (not those another worker recovering the same study ended first)."""
    stale = [
        t
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if _runner_dead(t.user_attrs.get("runner"))
    ]
    return [t.number for t in stale if mark_interrupted(study, t.number, t.params)]


# ------------------------------------------------------------------------------------ drawing


def draw_plan(study: optuna.Study, trial: optuna.Trial, space: PlanSpace) -> tuple[Plan, FrozenTrial | None]:
    """Draw ``trial``'s plan from ``space`` and record on the trial who runs it, where the plan
    came from (the sampler unless a queued trial says otherwise) and the plan itself; also the
    earlier finished trial of the same plan, if there is one (see :func:`same_plan`)."""
    trial.set_user_attr("runner", runner_info())
    if "source" not in trial.user_attrs:
        trial.set_user_attr("source", "sampler")
    plan = space.suggest(trial)
    trial.set_user_attr("plan", plan.to_dict())
    trial.set_user_attr("plan_str", describe_plan(plan))
    return plan, same_plan(study, trial)


def same_plan(study: optuna.Study, trial: optuna.Trial) -> FrozenTrial | None:
    """An earlier counted finished trial of the same plan: measuring it again would only re-sample noise."""
    key = _key(trial.params)
    return next((t for t in _counted(study) if t.number != trial.number and _key(t.params) == key), None)


def repeat_trial(study: optuna.Study, trial: optuna.Trial, previous: FrozenTrial) -> str:
    """Finish ``trial`` with ``previous``'s outcome (same plan); a progress message."""
    trial.set_user_attr("duplicate_of", previous.number)
    for k in ("samples_per_s", "median_step_s", "peak_memory_bytes", "fail_reason", "fail_kind"):
        if k in previous.user_attrs:
            trial.set_user_attr(k, previous.user_attrs[k])
    if previous.state == TrialState.COMPLETE:
        study.tell(trial, previous.values)
    else:
        study.tell(trial, state=previous.state)
    return f"same plan as trial {previous.number}, not measured again"


def unmeasured_plan(study: optuna.Study, space: PlanSpace, seed: int, tries: int = 500) -> Plan | None:
    """A random plan of ``space`` no counted finished trial of ``study`` has measured (``None``: none found)."""
    seen = {_key(t.params) for t in _counted(study)}
    scratch = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    for _ in range(tries):
        trial = scratch.ask()
        plan = space.suggest(trial)
        if _key(trial.params) not in seen:
            return plan
        scratch.tell(trial, 0.0)
    return None


class RepeatGuard:
    """Breaks a sampler's loop of repeated proposals.

    TPE proposes a plan it has already seen when it believes that region best; each repeat is
    answered from the earlier measurement at no cost, but a sampler can keep at it. After
    ``limit`` repeats in a row, a random plan not measured yet is queued (source ``explore``).
    """

    def __init__(self, limit: int = 10, seed: int = 0) -> None:
        self.limit = limit
        self.seed = seed
        self.count = 0

    def measured(self) -> None:
        """A new plan was measured: the run of repeats is over."""
        self.count = 0

    def repeated(self, study: optuna.Study, space: PlanSpace) -> Plan | None:
        """One more repeat; the plan queued to break the run, when this one ends it."""
        self.count += 1
        if self.count < self.limit:
            return None
        self.count = 0
        self.seed += 1
        plan = unmeasured_plan(study, space, self.seed)
        if plan is not None:
            study.enqueue_trial(space.params(plan), user_attrs={"source": "explore"})
        return plan
