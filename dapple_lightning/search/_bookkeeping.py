"""Which trials of a study count, which were orphaned, which repeat a measured plan.

Optuna's trial states say little about a plan search: a trial interrupted by Ctrl-C ends FAIL but
must not count (its plan is queued again), a trial left RUNNING by a search that was killed must be
found and marked, and a sampler that proposes a plan already measured gets the earlier result back
instead of a second measurement. These rules are kept here, in functions of the study, so that the
search loop (``_loop``) and the benchmark's replays apply the same ones.

**Several workers on one study.** A worker's trials beat in the database (Optuna's heartbeat, on
any RDB storage: SQLite, PostgreSQL, MySQL): :func:`heartbeat_storage` opens the storage with an
interval, :func:`draw_plan` starts the beat of each trial it draws (a daemon thread beats until the
trial is finished) and first ends the trials whose beat stopped, on whichever host they ran:
Optuna's ``fail_stale_trials`` marks them FAIL and :func:`requeue_stale_trial`, the storage's stale
trial callback, marks them interrupted and queues their plans again. A restarted search also
checks, on its own host, whether the process of a RUNNING trial is gone (:func:`recover_stale_trials`),
to mark at once what its killed predecessor left. A plan another worker is measuring right now is
waited for and its result taken, not measured a second time (:func:`draw_plan`).

**Confirmation trials** (``_confirm``) measure a measured plan again on purpose. They carry
:data:`CONFIRMS`: they are not answered from the earlier measurement, do not count towards
``n_trials``, and a retry of one interrupted is a confirmation trial too.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Mapping
from typing import Any

import optuna
import sqlalchemy
from optuna.trial import FrozenTrial, TrialState

from dapple_lightning.plan import Plan
from dapple_lightning.search._redact import cause, storage_error
from dapple_lightning.search._space import PlanSpace, describe_plan
from dapple_lightning.trials import runner_dead, runner_info

__all__ = [
    "CONFIRMS",
    "GRACE_BEATS",
    "RepeatGuard",
    "distinct_finished",
    "draw_plan",
    "explored_count",
    "exploring_elsewhere",
    "fail_stale",
    "finished_count",
    "heartbeat_storage",
    "mark_interrupted",
    "recover_stale_trials",
    "repeat_trial",
    "requeue_stale_trial",
    "same_plan",
    "start_heartbeat",
    "unmeasured_plan",
]

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
_INTERRUPTED = "interrupted_trial_"
"""Study attribute ``interrupted_trial_N``: trial ``N`` was interrupted."""


CONFIRMS = "confirms"
"""Trial attribute of a confirmation trial: the number of the trial whose plan it measures again."""
_CONFIRMATION_ATTRS = (CONFIRMS, "confirmation_round")
"""What a retry of an interrupted confirmation trial keeps of it."""


def _key(params: Mapping[str, Any]) -> tuple:
    return tuple(sorted(params.items()))


def _requeue(study: optuna.Study, number: int, params: Mapping[str, Any], attrs: Mapping[str, Any]) -> None:
    """Queue the retry of interrupted trial ``number`` (whose parameters and attributes were
    ``params`` and ``attrs``); nothing for a trial that drew no plan."""
    if params:
        kept = {k: attrs[k] for k in _CONFIRMATION_ATTRS if k in attrs}
        study.enqueue_trial(dict(params), user_attrs={"source": "retry", "retry_of": number, **kept})


# ------------------------------------------------------------------------------- what counts


def interrupted_trials(study: optuna.Study) -> set[int]:
    """Numbers of the trials a stopped or dead search left unfinished (they do not count).

    Each has an attribute of its own on the study, ``interrupted_trial_N``: workers sharing a
    study never rewrite a common list, which two of them doing at once would lose an update of.
    """
    return {int(key[len(_INTERRUPTED) :]) for key in study.user_attrs if key.startswith(_INTERRUPTED)}


def _counted(study: optuna.Study) -> list[FrozenTrial]:
    skip = interrupted_trials(study)
    return [t for t in study.get_trials(deepcopy=False, states=FINISHED) if t.number not in skip]


def finished_count(study: optuna.Study) -> int:
    """Finished trials (complete, pruned, failed) that count towards ``n_trials``: not the interrupted
    ones, not repeated proposals of a measured plan (they reuse its result and cost nothing), and not
    confirmation trials (they re-measure plans, they do not search).

    With several workers on the study, the trials the others are measuring now count too: they
    will finish, and a worker that did not count them would start a trial too many at the end of
    the study. Should one of those workers die instead, its trial stops counting once a worker
    finds its heartbeat stopped, and that worker queues the plan again and goes on; when none is
    left running by then, the study holds one trial too few until a search runs again.
    """
    return explored_count(study) + len(exploring_elsewhere(study))


def explored_count(study: optuna.Study) -> int:
    """The counted finished trials of the search itself, not those other workers still measure."""
    return sum(1 for t in _counted(study) if t.user_attrs.get("duplicate_of") is None and CONFIRMS not in t.user_attrs)


def exploring_elsewhere(study: optuna.Study) -> list[FrozenTrial]:
    """The search's trials (not confirmation trials) that other workers are measuring now."""
    return [t for t in _running_elsewhere(study) if CONFIRMS not in t.user_attrs]


def distinct_finished(study: optuna.Study) -> int:
    """Distinct plans (parameter sets) among the counted finished trials."""
    return len({_key(t.params) for t in _counted(study)})


def mark_interrupted(
    study: optuna.Study,
    number: int,
    params: Mapping[str, Any],
    reason: str = "the search was stopped",
    attrs: Mapping[str, Any] | None = None,
) -> bool:
    """Mark a running trial interrupted (it will not count), end it FAIL and queue its plan again;
    whether this call ended it. ``attrs``, the trial's attributes, say whether it confirmed a plan
    (its retry then does too).

    Only the caller whose FAIL ended the trial queues the retry: of two workers that find the
    same orphaned trial, the second finds it finished and queues nothing (on storages that lock
    the trial's row while ending it: PostgreSQL, MySQL, and SQLite opened by
    :func:`heartbeat_storage`; on SQLite opened otherwise both may, at worst one extra measurement
    of the plan).
    """
    study.set_user_attr(f"{_INTERRUPTED}{number}", {"reason": reason, "by": runner_info()})
    try:
        study.tell(number, state=TrialState.FAIL)
    except (RuntimeError, ValueError):  # another worker ended it first
        return False
    _requeue(study, number, params, attrs or {})
    return True


def recover_stale_trials(study: optuna.Study) -> list[int]:
    """End the trials a dead search left RUNNING, mark them interrupted, queue their plans again; the
    numbers of those this call ended (not those another worker recovering the same study ended first).

    Two rules: a trial whose heartbeat stopped (:func:`fail_stale`, any host), and, on this host, a
    trial whose search process is gone, at once, without waiting out the heartbeat's grace period
    (the same command run again after a SIGKILL; also the trials of storages without heartbeats).
    """
    ended = fail_stale(study)
    dead = [
        t
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if runner_dead(t.user_attrs.get("runner"))
    ]
    reason = "its search process died"
    return ended + [t.number for t in dead if mark_interrupted(study, t.number, t.params, reason, t.user_attrs)]


# ---------------------------------------------------------------------------------- heartbeat

GRACE_BEATS = 3
"""A RUNNING trial whose heartbeat is older than this many intervals is stale: its worker is gone
(Optuna's default is 2; one more absorbs a database write that waited on a lock)."""
_NO_HEARTBEAT = "its worker's heartbeat stopped"


def heartbeat_storage(url: str, interval_s: int | None) -> optuna.storages.BaseStorage:
    """The RDB storage at ``url``, whose trials beat every ``interval_s`` seconds (``None``: no
    heartbeat); a trial silent for :data:`GRACE_BEATS` intervals is stale, and the worker that finds
    it ends it with :func:`requeue_stale_trial`. On SQLite, transactions lock the database when they
    begin, so that workers sharing the file never pop one queued trial twice.

    Raises:
        ValueError: When the storage cannot be opened (the URL's password masked).
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            storage = optuna.storages.RDBStorage(
                url,
                heartbeat_interval=interval_s,
                grace_period=None if interval_s is None else GRACE_BEATS * interval_s,
                heartbeat_stale_trial_callback=None if interval_s is None else requeue_stale_trial,
            )
    except Exception as e:
        raise storage_error(url, e) from cause(e, url)
    _lock_sqlite_on_begin(storage.engine)
    if interval_s is not None:
        # Optuna warns at every ask that heartbeats belong to Study.optimize; the search asks and
        # tells itself and beats its trials in draw_plan.
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
    return storage


def _lock_sqlite_on_begin(engine: sqlalchemy.engine.Engine) -> None:
    """Make every SQLite transaction of ``engine`` take the database's write lock when it begins.

    pysqlite begins a transaction only at its first write, after the reads: two workers popping
    the queue at once both read a trial WAITING and both set it RUNNING (and both measure it; seen
    in 11 of 200 pops of two processes popping in a loop). ``BEGIN IMMEDIATE`` makes each read,
    check and write one step, as PostgreSQL's row locks do (SQLAlchemy's recipe for SQLite).
    """
    if engine.dialect.name != "sqlite" or engine.url.database in (None, "", ":memory:"):
        return

    @sqlalchemy.event.listens_for(engine, "connect")
    def _no_implicit_begin(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.isolation_level = None

    @sqlalchemy.event.listens_for(engine, "begin")
    def _begin_immediate(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()  # the connections Optuna opened to set up the database: new ones take the above


def requeue_stale_trial(study: optuna.Study, trial: FrozenTrial) -> None:
    """The storage's callback for a trial Optuna's ``fail_stale_trials`` has just ended FAIL: marked
    interrupted (it does not count) and its plan queued again, as a Ctrl-C'd trial's. Optuna calls it
    only in the worker whose FAIL ended the trial, so the plan is queued once.

    In place of Optuna's ``RetryHeartbeatStaleTrialCallback``, which would copy the trial's attributes
    (its runner, its processes, the measurement it did not finish) to the retry and leave the failed
    trial counting towards ``n_trials``.
    """
    study.set_user_attr(f"{_INTERRUPTED}{trial.number}", {"reason": _NO_HEARTBEAT, "by": runner_info()})
    _requeue(study, trial.number, trial.params, trial.user_attrs)


def fail_stale(study: optuna.Study) -> list[int]:
    """End the RUNNING trials whose heartbeat stopped (Optuna's ``fail_stale_trials``, with
    :func:`requeue_stale_trial`); the numbers of those this call ended. Nothing on a storage
    without heartbeats.

    Optuna ends a trial before its callback marks it: for that moment another worker counts it as
    finished, and may stop one trial early; the worker that ended it goes on to ``n_trials``.
    """
    running = [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    mine, attrs = {"reason": _NO_HEARTBEAT, "by": runner_info()}, study.user_attrs
    return [n for n in running if attrs.get(f"{_INTERRUPTED}{n}") == mine]


def start_heartbeat(study: optuna.Study, trial: optuna.Trial) -> int | None:
    """Record ``trial``'s heartbeat now, then every interval of its storage from a daemon thread
    until the storage says the trial finished; the interval (``None``: the storage has no heartbeat).

    Optuna beats only inside ``Study.optimize`` (its beating thread is private to it); the search
    asks and tells itself, so it beats through the storage's public heartbeat methods, which
    ``fail_stale_trials`` and the grace period then read as Optuna's own.
    """
    storage = trial.storage
    get = getattr(storage, "get_heartbeat_interval", None)
    interval = get() if get is not None else None
    if interval is None:
        return None
    trial_id = storage.get_trial_id_from_study_id_trial_number(
        storage.get_study_id_from_name(study.study_name), trial.number
    )
    storage.record_heartbeat(trial_id)

    def beat() -> None:
        while True:
            time.sleep(interval)  # the heartbeat's period, not synchronisation
            try:
                if storage.get_trial(trial_id).state.is_finished():
                    return
                storage.record_heartbeat(trial_id)
            except Exception:  # the database is away for a moment: the next beat tries again
                pass

    threading.Thread(target=beat, name=f"dapple-heartbeat-{trial.number}", daemon=True).start()
    return interval


# ------------------------------------------------------------------------------------ drawing


def draw_plan(study: optuna.Study, trial: optuna.Trial, space: PlanSpace) -> tuple[Plan, FrozenTrial | None]:
    """Draw ``trial``'s plan from ``space`` and record on the trial who runs it, where the plan
    came from (the sampler unless a queued trial says otherwise) and the plan itself; also the
    earlier finished trial of the same plan, if there is one (see :func:`same_plan`).

    The trial's heartbeat starts here, and first the trials whose heartbeat stopped are ended and
    queued again (:func:`fail_stale`). When another worker is measuring the same plan in an earlier
    trial, this waits for its result rather than measure the plan a second time at once; should that
    trial be interrupted instead, the plan is measured here. A confirmation trial (:data:`CONFIRMS`)
    is neither answered from an earlier trial nor waits.
    """
    trial.set_user_attr("runner", runner_info())
    interval = start_heartbeat(study, trial)
    if interval is not None:
        trial.set_user_attr("heartbeat_s", interval)  # a trial that beats can be waited for
    fail_stale(study)
    if "source" not in trial.user_attrs:
        trial.set_user_attr("source", "sampler")
    plan = space.suggest(trial)
    trial.set_user_attr("plan", plan.to_dict())
    trial.set_user_attr("plan_str", describe_plan(plan))
    if CONFIRMS in trial.user_attrs:
        return plan, None  # measured again on purpose, at once: neither answered nor waited for
    while interval is not None and _measuring_elsewhere(study, trial):
        time.sleep(interval)  # polled: the other trial ends with its result, or with its worker's heartbeat
        fail_stale(study)
    return plan, same_plan(study, trial)


def _running_elsewhere(study: optuna.Study) -> list[FrozenTrial]:
    """The RUNNING trials that other processes run and beat for (one without a heartbeat, left by an
    older search, may never end)."""
    me = runner_info()
    return [
        t
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if "heartbeat_s" in t.user_attrs and t.user_attrs.get("runner") != me
    ]


def _measuring_elsewhere(study: optuna.Study, trial: optuna.Trial) -> bool:
    """Whether another process measures ``trial``'s plan in an earlier trial, now.

    Only earlier trials: of two workers that draw the same plan at once, the later one waits. Only
    other processes: a batch of this process's trials is measured together, after all are drawn.
    """
    key = _key(trial.params)
    return any(t.number < trial.number and _key(t.params) == key for t in _running_elsewhere(study))


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
