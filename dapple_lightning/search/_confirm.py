"""The confirmation round: the plans in contention measured again, interleaved, before one is chosen.

A trial is one short run on a machine that other work shares, and the fastest of many such runs
is, more often than not, one that was lucky: the search's leader is the plan most likely to have
been overrated. So when the search's own trials are done, the loop (``_loop``) measures the
**contenders** again before the study's choice (``_choice``) is read from it: the fastest plan by
median, data parallelism when it was measured (what any other plan must beat), and the plans that
cannot be told apart from the fastest, at most :data:`MAX_CONTENDERS` in all. Each is measured
``repeats`` more times, the contenders' turns interleaved (A B C A B C), as ``plan="auto"``'s
turns are, so that a drift in the machine's load falls on all of them alike rather than on one.
Each repeat is a new trial of the same plan, queued with the attributes ``confirms`` (the number of
the plan's first trial) and ``confirmation_round``: ``_bookkeeping`` neither answers it from the
earlier measurement nor counts it towards ``n_trials``, the runners do not prune it, and the choice
takes the median of all. Its parameters are fixed when it is queued, so no sampler proposes it
and the repeat guard never sees it; a sampler that goes on (a larger ``n_trials``) sees it for
what it is, one more measurement of a plan.

When data parallelism leads and no plan is within the spreads of it, there is nothing to confirm:
data parallelism is what a plan must beat, not a candidate that must prove itself.

**Once per state of the study.** A round is keyed by the number of the search's counted trials
(``confirmation_after_K``, a study attribute holding the contenders). A search resumed without new
trials finds its round planned and measures only what is left of it: the trials still queued and
the retries of interrupted ones (Ctrl-C, a dead worker: they are queued again as any interrupted
trial is, and stay confirmation trials). A study that has gained trials since gets a round of its
own, since its leader may have changed; it brings each contender to ``1 + repeats`` runs, so a
contender an earlier round measured is not measured again.

**Once among workers.** Workers that end the search at the same moment would each plan the round.
The attribute is therefore claimed (:func:`claim`), not set: on an RDB storage (SQLite, PostgreSQL,
MySQL) it is inserted as a row of the table whose (study, key) pairs are unique, so the database
lets exactly one insert in. Whoever claims it queues the round; every worker then takes the
round's trials off the queue, each taken by one worker (:func:`take_queued`). A worker that ends
while others still measure search trials leaves the round to the last of them, whose results may
change the leader. Limits: on storages other than RDB (in memory, journal) the claim checks and
sets, exact within one process only; a worker killed between claiming a round and queuing its
trials leaves that round empty (the study stays consistent, and the choice rests on the
measurements it has); and when two workers end the search within a moment and one of them starts
a search trial too many (the loop's race at the end of a study, see ``finished_count``), that
trial makes a new state of the study, whose round measures only the contenders that lack runs.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import optuna
import sqlalchemy
from optuna.trial import TrialState

from dapple_lightning.planner import choose_measured
from dapple_lightning.search._bookkeeping import CONFIRMS, explored_count
from dapple_lightning.search._choice import PlanResult, plan_results
from dapple_lightning.trials import runner_info

__all__ = ["MAX_CONTENDERS", "claim", "contenders", "pending", "plan_round", "round_key", "take_queued"]

MAX_CONTENDERS = 3
"""Plans a round measures again, at most: the leader, data parallelism, the closest rival."""


def contenders(study: optuna.Study) -> list[PlanResult]:
    """The plans a round measures again: the fastest by median, data parallelism (when measured), then
    the plans that cannot be told apart from the fastest (the choice's ``tied``), the closest first;
    at most :data:`MAX_CONTENDERS`."""
    results = plan_results(study)
    if not results:
        return []
    choice = choose_measured(results)
    dp = choice.data_parallel
    picked = [choice.leader]
    if dp is not None and dp is not choice.leader:
        picked.append(dp)
    picked += [r for r in choice.tied[1:] if r is not dp]
    return picked[:MAX_CONTENDERS]


def round_key(study: optuna.Study) -> str:
    """The study attribute that records the round of the study as it stands (its counted trials)."""
    return f"confirmation_after_{explored_count(study)}"


def plan_round(study: optuna.Study, repeats: int, say: Callable[[str], None]) -> list[PlanResult] | None:
    """Claim and queue the round of the study as it stands: every contender is brought to
    ``1 + repeats`` runs, the turns interleaved; the contenders, or ``None`` when there is nothing to
    queue: the round was planned already (by an earlier run or another worker), nothing has
    completed, data parallelism leads alone, or the contenders have their runs already."""
    key = round_key(study)
    if key in study.user_attrs:
        return None
    plans = contenders(study)
    if not plans:
        return None
    if len(plans) == 1 and plans[0].data_parallel:
        # Data parallelism is what a plan must beat, not a candidate that must prove itself.
        say(f"no confirmation round: data parallelism leads, and no plan is within the spreads of it ({key})")
        return None
    # An earlier round may have measured some contenders already (the leader stayed, a new rival came).
    running = (TrialState.WAITING, TrialState.RUNNING)
    queued = Counter(
        t.user_attrs[CONFIRMS] for t in study.get_trials(deepcopy=False, states=running) if CONFIRMS in t.user_attrs
    )
    missing = {r.number: 1 + repeats - len(r.trials) - queued[r.number] for r in plans}
    names = ", ".join(r.describe() for r in plans)
    if max(missing.values()) <= 0:
        say(f"no confirmation round: the contenders have {1 + repeats} runs each already: {names}")
        return None
    record = {"contenders": [r.number for r in plans], "repeats": repeats, "by": runner_info()}
    if not claim(study, key, record):
        return None
    for turn in range(1, max(missing.values()) + 1):
        for r in plans:
            if missing[r.number] >= turn:
                attrs = {"source": "confirm", CONFIRMS: r.number, "confirmation_round": key, "turn": turn}
                study.enqueue_trial(dict(r.trial.params), user_attrs=attrs)
    say(f"confirmation round: each contender to {1 + repeats} runs, the turns interleaved: {names}")
    return plans


def pending(study: optuna.Study) -> list[int]:
    """The queued confirmation trials, in queue order: what is left of the rounds planned so far."""
    waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    return [t.number for t in waiting if CONFIRMS in t.user_attrs]


def take_queued(study: optuna.Study, number: int) -> optuna.Trial | None:
    """Start the queued trial ``number``; ``None`` when another worker took it first.

    ``study.ask()`` starts the oldest queued trial, whatever it is: a search that ended with plans
    still queued (a grid larger than ``n_trials``, seeds beyond the budget) would measure those
    instead of the round's. This takes one trial by number, with the step ``ask`` takes: the
    storage's WAITING -> RUNNING change, which only one worker's call makes.
    """
    if all(t.number != number for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))):
        return None
    # Optuna has no public call that pops one queued trial by number; this is the storage call its
    # own `Study.ask` makes on the oldest.
    storage = _storage(study)
    trial_id = storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(study.study_name), number)
    try:
        if not storage.set_trial_state_values(trial_id, state=TrialState.RUNNING):
            return None
    except optuna.exceptions.UpdateFinishedTrialError:
        return None
    return optuna.Trial(study, trial_id)


def _storage(study: optuna.Study) -> optuna.storages.BaseStorage:
    """The study's storage, which the public Study keeps to itself; what is called on it is Optuna's
    public storage API (and, for :func:`claim`, the engine behind the cache, ``_backend``)."""
    return study._storage


_ATTRS = sqlalchemy.table(
    "study_user_attributes", sqlalchemy.column("study_id"), sqlalchemy.column("key"), sqlalchemy.column("value_json")
)
"""Optuna's table of study attributes: unique over (study_id, key)."""


def claim(study: optuna.Study, key: str, value: Mapping[str, Any]) -> bool:
    """Set the study attribute ``key`` to ``value`` unless it is set; whether this call set it.

    ``Study.set_user_attr`` overwrites, so two workers that both found the attribute missing would
    both think they set it. On an RDB storage the attribute is inserted as a row, and the table's
    unique (study, key) constraint lets one insert in and refuses the other, whatever the timing;
    elsewhere (in memory, journal) it is checked and set.
    """
    storage = _storage(study)
    engine = getattr(getattr(storage, "_backend", storage), "engine", None)
    if not isinstance(engine, sqlalchemy.engine.Engine):
        if key in study.user_attrs:
            return False
        study.set_user_attr(key, dict(value))
        return True
    row = {
        "study_id": storage.get_study_id_from_name(study.study_name),
        "key": key,
        "value_json": json.dumps(dict(value)),
    }
    try:
        with engine.begin() as connection:
            connection.execute(sqlalchemy.insert(_ATTRS).values(**row))
    except sqlalchemy.exc.IntegrityError:
        return False
    return True
