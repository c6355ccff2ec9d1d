"""The plan search as an Optuna study: measured trials in a database, resumable, seeded by the planner.

A study is standard Optuna storage (SQLite by default; any Optuna storage URL works), so
``optuna-dashboard sqlite:///dapple_search.db`` shows it live. What the search stores:

- ``study.user_attrs``: ``fingerprint`` (model, ranks, device, batch: see ``_fingerprint``),
  ``space`` (the searched micro-batch counts and schedules), ``model`` (the factory),
  ``objectives`` (``["samples_per_s"]`` or ``["samples_per_s", "peak_bytes"]``),
  ``planner_seeded`` and ``interrupted_trials``;
- per trial: the plan (``user_attrs["plan"]``, the :meth:`Plan.to_dict` form, and ``plan_str``),
  every measurement (``samples_per_s``, ``median_step_s``, ``step_times``, ``peak_bytes``,
  ``max_rss_bytes``, ``wall_s``), and for trials that did not complete ``fail_reason`` (``"timeout"``,
  ``"oom"``, the failing rank's last stderr lines, or why the plan is infeasible).

**Resuming.** ``n_trials`` is the number of finished trials the study should hold, so re-running
the same command continues where it stopped and does only what is missing. A trial that was
running when the search was stopped (Ctrl-C, SIGTERM, or SIGKILL of the search process) is marked
FAIL, does not count, and its plan is queued again. After a SIGKILL the trial's processes notice
that their parent is gone and kill their own process group; the next run finds the trial still
RUNNING with a dead owner (same host, pid gone) and marks it then. The sampler's seed is offset
by the number of trials already in the study, so a resumed search does not replay the random
start-up choices of the first run.
"""

from __future__ import annotations

import math
import os
import random
import socket
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import unquote

import optuna
from optuna.trial import FrozenTrial, TrialState

from dapple_lightning.plan import SCHEDULES, Plan
from dapple_lightning.search._fingerprint import Fingerprint, check_fingerprint
from dapple_lightning.search._probe import ModelInfo, probe_model
from dapple_lightning.search._space import DEFAULT_MAX_PLANS, PlanSpace, describe_plan, plan_from_params
from dapple_lightning.search._trial import TrialConfig, TrialResult, run_trial

if TYPE_CHECKING:
    from dapple_lightning.strategy import DappleStrategy

__all__ = [
    "DEFAULT_STORAGE",
    "PlanSearch",
    "SearchConfig",
    "best_plan",
    "best_trial",
    "create_sampler",
    "format_table",
    "load_search",
    "ranked_trials",
    "resolve_plan_spec",
    "run_search",
    "strategy_from_study",
    "trial_plan",
    "trial_rows",
]

DEFAULT_STORAGE = "sqlite:///dapple_search.db"
STUDY_SCHEME = "optuna://"
_OBJECTIVES_SINGLE = ["samples_per_s"]
_OBJECTIVES_MULTI = ["samples_per_s", "peak_bytes"]
_FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


@dataclass(frozen=True)
class SearchConfig:
    """A plan search: what to measure (``trial``) and how to run the study."""

    trial: TrialConfig
    """The model, ranks, batch, steps and limits of every trial."""
    storage: str = DEFAULT_STORAGE
    """Optuna storage URL (``sqlite:///file.db``, ``postgresql://...``, ...)."""
    study_name: str = "dapple"
    """Study in the storage; re-running with the same name resumes it."""
    n_trials: int | None = 20
    """Measured trials the study should hold (not: trials to add): complete, pruned or failed ones,
    not counting interrupted trials or repeated proposals of an already measured plan (those reuse
    the earlier result and cost nothing). ``None``: the whole grid with ``sampler="grid"``, 20
    otherwise."""
    timeout_s: float | None = None
    """Stop starting trials after this many seconds of this run (the running one finishes)."""
    sampler: Literal["tpe", "random", "grid"] = "tpe"
    """``tpe`` (seeded, multivariate), ``random``, or ``grid``: every plan of the space, in order."""
    seed: int = 0
    """Seed of the sampler."""
    multi_objective: bool = False
    """Maximize samples/s and minimize peak bytes per rank (a Pareto front) instead of samples/s only."""
    micro_batches: tuple[int, ...] | None = None
    """Micro-batch counts to search; ``None``: the divisors of the global batch."""
    schedules: tuple[str, ...] = SCHEDULES
    """Schedules to search."""
    max_stages: int | None = None
    """Most stages a plan may have; ``None``: ``min(layers, world size)``."""
    planner_seeds: int = 3
    """Measure the planner's top this-many plans first (once per study; 0: do not ask the planner)."""
    enqueue: tuple[Any, ...] = ()
    """Plans to measure first (anything ``Plan.coerce`` takes); ones already in the study are skipped."""
    pruner: Literal["median", "none"] = "median"
    """``median``: stop a trial whose throughput at a timed step is below the median of earlier trials
    at that step (single objective only; after 3 trials)."""
    tpe_startup_trials: int = 10
    """Trials TPE samples at random (enqueued ones count) before it models the results (Optuna's
    default; 5 did no better in ``benchmarks/search.py``'s replays)."""
    allow_mismatch: bool = False
    """Resume a study whose fingerprint differs from this setup's (measurements will not compare)."""
    max_grid: int = DEFAULT_MAX_PLANS
    """``sampler="grid"`` refuses spaces with more plans than this."""
    progress: bool = True
    """Print one line per finished trial."""

    def __post_init__(self) -> None:
        if not isinstance(self.trial, TrialConfig):
            raise TypeError(f"trial must be a TrialConfig, got {type(self.trial).__name__}")
        if self.sampler not in ("tpe", "random", "grid"):
            raise ValueError(f"unknown sampler {self.sampler!r}; choose tpe, random or grid")
        if self.pruner not in ("median", "none"):
            raise ValueError(f"unknown pruner {self.pruner!r}; choose median or none")
        if self.n_trials is not None and (
            isinstance(self.n_trials, bool) or not isinstance(self.n_trials, int) or self.n_trials < 1
        ):
            raise ValueError(f"n_trials must be an integer >= 1 or None, got {self.n_trials!r}")
        if self.planner_seeds < 0:
            raise ValueError(f"planner_seeds must be >= 0, got {self.planner_seeds}")
        if not isinstance(self.storage, str) or "://" not in self.storage:
            raise ValueError(f"storage must be an Optuna storage URL like {DEFAULT_STORAGE!r}, got {self.storage!r}")
        if self.micro_batches is not None:
            object.__setattr__(self, "micro_batches", tuple(self.micro_batches))
        object.__setattr__(self, "schedules", tuple(self.schedules))
        object.__setattr__(self, "enqueue", tuple(self.enqueue))

    @property
    def objectives(self) -> list[str]:
        return list(_OBJECTIVES_MULTI if self.multi_objective else _OBJECTIVES_SINGLE)

    @property
    def directions(self) -> list[str]:
        return ["maximize", "minimize"] if self.multi_objective else ["maximize"]


# ------------------------------------------------------------------------------ runner identity


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()[19]


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


# ------------------------------------------------------------------------------------ studies


def _storage_hint(storage: str) -> str:
    try:
        names = optuna.get_all_study_names(storage)
    except Exception:  # the storage itself may be the problem
        return ""
    return f" (studies there: {', '.join(names)})" if names else " (it holds no study)"


def load_search(storage: str, study_name: str) -> optuna.Study:
    """Open an existing study.

    Raises:
        ValueError: When the storage has no such study; the message lists the ones it has.
    """
    try:
        return optuna.load_study(study_name=study_name, storage=storage)
    except KeyError as e:
        raise ValueError(f"no study {study_name!r} in {storage}{_storage_hint(storage)}") from e


def _fingerprint_of(study: optuna.Study) -> Fingerprint | None:
    data = study.user_attrs.get("fingerprint")
    return Fingerprint.from_dict(data) if isinstance(data, Mapping) else None


def trial_plan(trial: FrozenTrial, study: optuna.Study | None = None) -> Plan:
    """The plan a trial measured (from its ``plan`` attribute, else decoded from its parameters)."""
    data = trial.user_attrs.get("plan")
    if isinstance(data, Mapping):
        return Plan.from_dict(data)
    fp = _fingerprint_of(study) if study is not None else None
    if fp is None:
        raise ValueError(f"trial {trial.number} stores no plan and the study no fingerprint to decode its parameters")
    return plan_from_params(trial.params, num_layers=fp.num_layers, world_size=fp.world_size)


def ranked_trials(study: optuna.Study) -> list[FrozenTrial]:
    """Completed trials, best first by the first objective (samples/s for the search's own studies);
    for a multi-objective study only the Pareto front."""
    if len(study.directions) > 1:
        trials = list(study.best_trials)
    else:
        trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    sign = -1.0 if study.directions[0] == optuna.study.StudyDirection.MAXIMIZE else 1.0
    return sorted(trials, key=lambda t: sign * t.values[0])


def best_trial(study: optuna.Study) -> FrozenTrial:
    """The best completed trial: the fastest (for a multi-objective study: the fastest of the Pareto front).

    Raises:
        ValueError: When no trial has completed yet.
    """
    ranked = ranked_trials(study)
    if not ranked:
        counts = {s.name: 0 for s in TrialState}
        for t in study.get_trials(deepcopy=False):
            counts[t.state.name] += 1
        summary = ", ".join(f"{n} {k.lower()}" for k, n in counts.items() if n)
        raise ValueError(f"study {study.study_name!r} has no completed trial yet ({summary or 'no trials'})")
    return ranked[0]


def _check(study: optuna.Study, fingerprint: Fingerprint | Mapping[str, Any] | None, allow_mismatch: bool) -> None:
    if fingerprint is not None:
        check_fingerprint(
            study.user_attrs.get("fingerprint"), fingerprint, study_name=study.study_name, allow_mismatch=allow_mismatch
        )


def best_plan(
    storage: str = DEFAULT_STORAGE,
    study_name: str = "dapple",
    fingerprint: Fingerprint | Mapping[str, Any] | None = None,
    *,
    allow_mismatch: bool = False,
) -> Plan:
    """The plan of a study's best trial (see :func:`best_trial`).

    Args:
        storage: Optuna storage URL.
        study_name: the study.
        fingerprint: when given, the study must have been made for this setup.
        allow_mismatch: take the plan even when the fingerprints differ.

    Raises:
        ValueError: No such study, no completed trial, or a fingerprint mismatch.
    """
    study = load_search(storage, study_name)
    _check(study, fingerprint, allow_mismatch)
    return trial_plan(best_trial(study), study)


def strategy_from_study(
    storage: str = DEFAULT_STORAGE,
    study_name: str = "dapple",
    *,
    fingerprint: Fingerprint | Mapping[str, Any] | None = None,
    allow_mismatch: bool = False,
    **strategy_kwargs: Any,
) -> DappleStrategy:
    """A :class:`~dapple_lightning.DappleStrategy` that runs a study's best plan.

    ``strategy_kwargs`` go to ``DappleStrategy`` (``start_method``, ``timeout``, ...). The strategy
    still checks, when training starts, that the plan fits the model's layers and the Trainer's
    devices.
    """
    from dapple_lightning.strategy import DappleStrategy

    plan = best_plan(storage, study_name, fingerprint, allow_mismatch=allow_mismatch)
    return DappleStrategy(plan, **strategy_kwargs)


def resolve_plan_spec(spec: Any) -> Any:
    """Turn ``"optuna://STORAGE_URL?study=NAME[&trial=N]"`` into that study's best plan (or trial ``N``'s).

    Anything else is returned unchanged, so a strategy can call this on every plan argument.
    ``study=`` (and ``trial=``) must come last: what precedes them is the storage URL, query
    included (``optuna://postgresql://u@h/db?sslmode=require&study=gpt``). Examples::

        resolve_plan_spec("optuna://sqlite:///dapple_search.db?study=gpt")
        resolve_plan_spec("optuna://sqlite:////abs/path/search.db?study=gpt&trial=12")
    """
    if not isinstance(spec, str) or not spec.strip().startswith(STUDY_SCHEME):
        return spec
    body = spec.strip()[len(STUDY_SCHEME) :]
    storage, params = _split_study_query(body)
    if "study" not in params:
        raise ValueError(
            f"plan spec {spec!r} names no study; write {STUDY_SCHEME}STORAGE_URL?study=NAME "
            f"(e.g. {STUDY_SCHEME}{DEFAULT_STORAGE}?study=dapple)"
        )
    if "://" not in storage:
        raise ValueError(f"plan spec {spec!r}: {storage!r} is not an Optuna storage URL like {DEFAULT_STORAGE!r}")
    if "trial" in params:
        study = load_search(storage, params["study"])
        try:
            number = int(params["trial"])
            trial = study.trials[number]
        except (ValueError, IndexError) as e:
            raise ValueError(f"plan spec {spec!r}: study {params['study']!r} has no trial {params['trial']!r}") from e
        if trial.state != TrialState.COMPLETE:
            raise ValueError(f"plan spec {spec!r}: trial {number} is {trial.state.name}, not COMPLETE")
        return trial_plan(trial, study)
    return best_plan(storage, params["study"])


def _split_study_query(body: str) -> tuple[str, dict[str, str]]:
    """``"sqlite:///x.db?study=a&trial=2"`` -> ``("sqlite:///x.db", {"study": "a", "trial": "2"})``."""
    for sep in ("?study=", "&study="):
        index = body.rfind(sep)
        if index >= 0:
            storage, query = body[:index], body[index + 1 :]
            params = {}
            for part in query.split("&"):
                key, _, value = part.partition("=")
                if key not in ("study", "trial"):
                    raise ValueError(f"unknown parameter {key!r} after study= in {body!r}; only trial= may follow")
                params[key] = unquote(value)
            return storage, params
    return body, {}


# ------------------------------------------------------------------------ study bookkeeping
# Shared by PlanSearch and the Hydra sweeper (``_hydra``): which trials count, which are stale.


def runner_info() -> dict[str, Any]:
    """Who runs a trial: stored in its ``runner`` attribute to find trials orphaned by a dead search."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid())}


def interrupted_trials(study: optuna.Study) -> set[int]:
    return set(study.user_attrs.get("interrupted_trials", []))


def finished_count(study: optuna.Study) -> int:
    """Finished trials (complete, pruned, failed) that count towards ``n_trials``: not the interrupted
    ones, and not repeated proposals of a measured plan (they reuse its result and cost nothing)."""
    skip = interrupted_trials(study)
    return sum(
        1
        for t in study.get_trials(deepcopy=False, states=_FINISHED)
        if t.number not in skip and t.user_attrs.get("duplicate_of") is None
    )


def distinct_finished(study: optuna.Study) -> int:
    """Distinct plans (parameter sets) among the counted finished trials."""
    skip = interrupted_trials(study)
    return len({_key(t.params) for t in study.get_trials(deepcopy=False, states=_FINISHED) if t.number not in skip})


def mark_interrupted(study: optuna.Study, number: int, params: Mapping[str, Any]) -> None:
    """Mark a running trial FAIL as interrupted (it will not count) and queue its plan again."""
    numbers = list(study.user_attrs.get("interrupted_trials", []))
    if number not in numbers:
        study.set_user_attr("interrupted_trials", [*numbers, number])
        if params:
            study.enqueue_trial(dict(params), user_attrs={"source": "retry", "retry_of": number})
    study.tell(number, state=TrialState.FAIL, skip_if_finished=True)


def recover_stale_trials(study: optuna.Study) -> list[int]:
    """Mark interrupted the RUNNING trials whose search process is gone (same host); their numbers."""
    stale = [
        t
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if _runner_dead(t.user_attrs.get("runner"))
    ]
    for t in stale:
        mark_interrupted(study, t.number, t.params)
    return [t.number for t in stale]


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
    skip = interrupted_trials(study)
    key = _key(trial.params)
    for t in study.get_trials(deepcopy=False, states=_FINISHED):
        if t.number != trial.number and t.number not in skip and _key(t.params) == key:
            return t
    return None


def unmeasured_plan(study: optuna.Study, space: PlanSpace, seed: int, tries: int = 500) -> Plan | None:
    """A random plan of ``space`` no counted finished trial of ``study`` has measured (``None``: none found)."""
    skip = interrupted_trials(study)
    seen = {_key(t.params) for t in study.get_trials(deepcopy=False, states=_FINISHED) if t.number not in skip}
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
        self.count = 0

    def repeated(self, study: optuna.Study, space: PlanSpace) -> Plan | None:
        self.count += 1
        if self.count < self.limit:
            return None
        self.count = 0
        self.seed += 1
        plan = unmeasured_plan(study, space, self.seed)
        if plan is not None:
            study.enqueue_trial(space.params(plan), user_attrs={"source": "explore"})
        return plan


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


# -------------------------------------------------------------------------------------- search


class PlanSearch:
    """Runs (or resumes) a plan search; see :class:`SearchConfig` and the module docstring.

    Example::

        config = SearchConfig(TrialConfig("my_models:gpt", world_size=4, global_batch=64), n_trials=30)
        study = PlanSearch(config).run()
        print(best_plan(config.storage, config.study_name))
    """

    def __init__(self, config: SearchConfig, *, say: Callable[[str], None] | None = None) -> None:
        self.config = config
        self._say = say or ((lambda line: print(line, flush=True)) if config.progress else (lambda line: None))
        self.study: optuna.Study | None = None
        self.space: PlanSpace | None = None
        self.model: ModelInfo | None = None
        self._repeats = RepeatGuard(seed=config.seed)

    # --------------------------------------------------------------------------- set-up

    def open(self) -> optuna.Study:
        """Create or load the study, check it against the model, queue seeds; the study."""
        cfg = self.config
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        existing = self._existing()
        if existing is not None:
            stored = existing.user_attrs.get("objectives")
            if stored is not None and list(stored) != cfg.objectives:
                raise ValueError(
                    f"study {cfg.study_name!r} optimizes {stored}, this run asks for {cfg.objectives}; "
                    f"{'drop' if cfg.multi_objective else 'add'} --multi-objective or use another study name"
                )
        seeded = existing is not None and existing.user_attrs.get("planner_seeded") is not None
        want_profile = cfg.planner_seeds > 0 and not seeded
        self._say(f"probing model {cfg.trial.model} ...")
        info = probe_model(cfg.trial, profile=want_profile)
        self.model = info
        if existing is not None:
            diffs = check_fingerprint(
                existing.user_attrs.get("fingerprint"),
                info.fingerprint,
                study_name=cfg.study_name,
                allow_mismatch=cfg.allow_mismatch,
            )
            if diffs:
                self._say(f"warning: fingerprint differs ({'; '.join(diffs)}); continuing as asked")
        space = PlanSpace(
            info.num_layers,
            cfg.trial.world_size,
            cfg.trial.global_batch,
            cfg.micro_batches,
            cfg.schedules,
            cfg.max_stages,
        )
        self.space = space
        if existing is not None:
            self._check_space(existing, space)
        study = optuna.create_study(
            storage=cfg.storage,
            study_name=cfg.study_name,
            directions=cfg.directions,
            sampler=self._sampler(len(existing.trials) if existing is not None else 0),
            pruner=self._pruner(),
            load_if_exists=True,
        )
        self.study = study
        if existing is None or "fingerprint" not in study.user_attrs:
            study.set_user_attr("fingerprint", info.fingerprint.to_dict())
            study.set_user_attr("space", _space_attrs(space))
            study.set_user_attr("model", {"factory": cfg.trial.model, "kwargs": dict(cfg.trial.model_kwargs)})
            study.set_user_attr("objectives", cfg.objectives)
        self._recover_stale(study)
        self._enqueue_user(study, space)
        if want_profile:
            self._enqueue_planner(study, space, info)
        if cfg.sampler == "grid":
            self._enqueue_grid(study, space)
        return study

    def _existing(self) -> optuna.Study | None:
        cfg = self.config
        try:
            names = optuna.get_all_study_names(cfg.storage)
        except Exception as e:
            raise ValueError(f"cannot open storage {cfg.storage!r}: {e}") from e
        if cfg.study_name not in names:
            return None
        return optuna.load_study(study_name=cfg.study_name, storage=cfg.storage)

    def _check_space(self, study: optuna.Study, space: PlanSpace) -> None:
        stored = study.user_attrs.get("space")
        if not isinstance(stored, Mapping):
            return
        now = _space_attrs(space)
        # Optuna refuses to change a categorical parameter's choices within a study.
        diffs = [
            f"{k}: study {stored.get(k)} != now {now[k]}"
            for k in ("micro_batches", "schedules")
            if stored.get(k) != now[k]
        ]
        if diffs:
            raise ValueError(
                f"study {study.study_name!r} searched other choices ({'; '.join(diffs)}); Optuna cannot change "
                "a categorical parameter's choices within a study: search the same ones or use another study name"
            )

    def _sampler(self, offset: int) -> optuna.samplers.BaseSampler:
        cfg = self.config
        # grid: every plan is enqueued; the random sampler only fills what nothing fixed.
        kind = "random" if cfg.sampler == "grid" else cfg.sampler
        return create_sampler(kind, cfg.seed + offset, cfg.tpe_startup_trials)

    def _pruner(self) -> optuna.pruners.BasePruner:
        cfg = self.config
        if cfg.pruner == "none" or cfg.multi_objective:
            return optuna.pruners.NopPruner()
        return optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=cfg.trial.warmup)

    def _recover_stale(self, study: optuna.Study) -> None:
        for number in recover_stale_trials(study):
            self._say(f"trial {number:>3} was running when its search process died: marked FAIL, plan queued again")

    def _enqueue_user(self, study: optuna.Study, space: PlanSpace) -> None:
        for item in self.config.enqueue:
            plan = Plan.coerce(item)
            try:
                params = space.params(plan)
            except ValueError as e:
                raise ValueError(f"enqueued plan {describe_plan(plan)} is not in the search space: {e}") from e
            study.enqueue_trial(params, user_attrs={"source": "user"}, skip_if_exists=True)

    def _enqueue_planner(self, study: optuna.Study, space: PlanSpace, info: ModelInfo) -> None:
        from dapple_lightning.search._seed import planner_seeds

        cfg = self.config
        if info.profile is None:
            reason = f"no profile ({info.profile_error})"
        else:
            try:
                seeds = planner_seeds(info.profile, space, cfg.planner_seeds)
            except ImportError as e:
                reason = f"planner not available ({e})"
            except ValueError as e:
                reason = f"planner found no plan ({e})"
            else:
                for s in seeds:
                    study.enqueue_trial(
                        space.params(s.plan),
                        user_attrs={
                            "source": "planner",
                            "planner_rank": s.rank,
                            "predicted_step_s": s.predicted_step_s,
                        },
                        skip_if_exists=True,
                    )
                    self._say(
                        f"planner pick #{s.rank}: {describe_plan(s.plan)} (predicted {s.predicted_step_s:.3g} s/step)"
                    )
                study.set_user_attr("planner_seeded", [describe_plan(s.plan) for s in seeds])
                return
        self._say(f"not seeding with the planner: {reason}")
        study.set_user_attr("planner_seeded", reason)

    def _enqueue_grid(self, study: optuna.Study, space: PlanSpace) -> None:
        if study.user_attrs.get("grid_enqueued"):
            return
        size = space.size
        if size > self.config.max_grid:
            raise ValueError(
                f"the grid holds {size} plans, more than max_grid={self.config.max_grid}; restrict micro_batches, "
                "schedules or max_stages, or use the tpe sampler"
            )
        plans = list(space.plans())
        # A seeded shuffle: a drift in the machine's load must not line up with one region of the space.
        random.Random(self.config.seed).shuffle(plans)
        for plan in plans:
            study.enqueue_trial(space.params(plan), user_attrs={"source": "grid"}, skip_if_exists=True)
        study.set_user_attr("grid_enqueued", True)

    # ------------------------------------------------------------------------------ run

    def run(self) -> optuna.Study:
        """Run trials until the study holds ``n_trials`` finished ones (or the time is up); the study.

        Raises:
            KeyboardInterrupt: Passed on after the running trial's processes are killed and the
                trial is marked FAIL (and queued again).
        """
        cfg = self.config
        study = self.study or self.open()
        space = self.space
        assert space is not None
        target = cfg.n_trials if cfg.n_trials is not None else (space.size if cfg.sampler == "grid" else 20)
        started = time.monotonic()
        done = finished_count(study)
        if done >= target:
            self._say(f"study {cfg.study_name!r} already holds {done} finished trials (n_trials={target})")
        while done < target:
            if cfg.timeout_s is not None and time.monotonic() - started > cfg.timeout_s:
                self._say(f"time limit of {cfg.timeout_s:g} s reached after {done} finished trials")
                break
            if distinct_finished(study) >= space.size:
                self._say(f"every one of the {space.size} plans of the space has been tried")
                break
            self._one(study, space)
            done = finished_count(study)
        return study

    def _one(self, study: optuna.Study, space: PlanSpace) -> None:
        cfg = self.config
        trial = study.ask()
        try:
            plan, previous = draw_plan(study, trial, space)
            if previous is not None:
                self._progress(study, trial.number, repeat_trial(study, trial, previous))
                explore = self._repeats.repeated(study, space)
                if explore is not None:
                    self._say(
                        f"the sampler keeps repeating itself: queued the unmeasured plan {describe_plan(explore)}"
                    )
                return
            self._repeats.measured()
            on_step = None
            if not cfg.multi_objective and cfg.pruner != "none":

                def on_step(step: int, samples_per_s: float) -> bool:
                    trial.report(samples_per_s, step)
                    return trial.should_prune()

            result = run_trial(plan, cfg.trial, on_step, on_start=lambda pgid: trial.set_user_attr("pgid", pgid))
        except BaseException as e:
            if isinstance(e, Exception):
                # A bug of ours or a storage error, not the candidate's: record it and go on.
                self._safe_fail(study, trial, f"search error: {type(e).__name__}: {e}")
                self._say(f"trial {trial.number:>3} search error: {type(e).__name__}: {e}")
                return
            self._interrupt(study, trial)
            raise
        self._tell(study, trial, plan, result)

    def _interrupt(self, study: optuna.Study, trial: optuna.Trial) -> None:
        try:
            trial.set_user_attr("fail_reason", "interrupted: the search was stopped; the plan is queued again")
            mark_interrupted(study, trial.number, trial.params)
            self._say(f"trial {trial.number:>3} interrupted; run the same command again to resume")
        except Exception:  # never hide the interruption behind a storage error
            pass

    def _safe_fail(self, study: optuna.Study, trial: optuna.Trial, reason: str) -> None:
        try:
            trial.set_user_attr("fail_reason", reason)
            study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
        except Exception:
            pass

    def _tell(self, study: optuna.Study, trial: optuna.Trial, plan: Plan, result: TrialResult) -> None:
        trial.set_user_attr("wall_s", round(result.wall_s, 3))
        if result.status == "complete":
            assert result.samples_per_s is not None
            trial.set_user_attr("samples_per_s", result.samples_per_s)
            trial.set_user_attr("median_step_s", result.median_step_s)
            trial.set_user_attr("step_times", list(result.step_times))
            trial.set_user_attr("peak_bytes", list(result.peak_bytes))
            trial.set_user_attr("activation_bytes", list(result.activation_bytes))
            trial.set_user_attr("max_rss_bytes", list(result.max_rss_bytes))
            trial.set_user_attr("peak_memory_bytes", result.peak_memory_bytes)
            values: list[float] = [result.samples_per_s]
            if self.config.multi_objective:
                values.append(float(result.peak_memory_bytes or 0))
            study.tell(trial, values)
            self._progress(study, trial.number, f"{result.samples_per_s:9.1f} samples/s")
            return
        trial.set_user_attr("fail_reason", result.reason)
        if result.fail_kind is not None:
            trial.set_user_attr("fail_kind", result.fail_kind)
        if result.detail:
            trial.set_user_attr("fail_detail", result.detail)
        if result.status == "failed":
            study.tell(trial, state=TrialState.FAIL)
            first = (result.reason or "").strip().splitlines()
            self._progress(study, trial.number, f"FAIL {result.fail_kind}: {first[-1] if first else ''}")
        else:  # infeasible or pruned: the sampler should learn to avoid the region, not retry it
            if result.status == "infeasible":
                trial.set_user_attr("infeasible", True)
            study.tell(trial, state=TrialState.PRUNED)
            self._progress(study, trial.number, f"PRUNED: {result.reason}")

    def _progress(self, study: optuna.Study, number: int, outcome: str) -> None:
        t = study.trials[number]
        plan = t.user_attrs.get("plan_str", "?")
        try:
            best = best_trial(study)
            tail = f"best {best.values[0]:.1f} samples/s (trial {best.number})"
            if len(study.directions) > 1:
                tail += f", Pareto front of {len(study.best_trials)}"
        except ValueError:
            tail = "no completed trial yet"
        done = finished_count(study)
        target = self.config.n_trials or "grid"
        self._say(f"trial {number:>3} [{done}/{target}] {plan:<28} {_clip(outcome, 60):<30} | {tail}")


def _clip(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _key(params: Mapping[str, Any]) -> tuple:
    return tuple(sorted(params.items()))


def _space_attrs(space: PlanSpace) -> dict[str, Any]:
    return {
        "micro_batches": list(space.micro_batches or ()),
        "schedules": list(space.schedules),
        "max_stages": space.stage_limit,
        "num_layers": space.num_layers,
        "size": space.size,
    }


def run_search(config: SearchConfig) -> optuna.Study:
    """Run or resume a plan search; the Optuna study (see :class:`PlanSearch`)."""
    return PlanSearch(config).run()


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


def _format_bytes(n: float | None) -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def trial_rows(study: optuna.Study) -> list[dict[str, str]]:
    """One row per trial, as the CLI's ``trials`` table shows them."""
    interrupted = set(study.user_attrs.get("interrupted_trials", []))
    rows = []
    for t in study.get_trials(deepcopy=False):
        a = t.user_attrs
        reason = a.get("fail_reason") or ("interrupted" if t.number in interrupted else "")
        if a.get("duplicate_of") is not None:
            reason = f"same plan as trial {a['duplicate_of']}" + (f"; {reason}" if reason else "")
        samples = a.get("samples_per_s")
        rows.append(
            {
                "trial": str(t.number),
                "state": t.state.name,
                "source": str(a.get("source", "")),
                "plan": str(a.get("plan_str", "")),
                "samples/s": f"{samples:.1f}" if isinstance(samples, int | float) else "-",
                "step s": f"{a['median_step_s']:.3f}" if isinstance(a.get("median_step_s"), int | float) else "-",
                "peak mem/rank": _format_bytes(a.get("peak_memory_bytes")),
                "max RSS": _format_bytes(max(a["max_rss_bytes"])) if a.get("max_rss_bytes") else "-",
                "reason": " ".join(str(reason).split()),
            }
        )
    return rows


def format_table(rows: Sequence[Mapping[str, str]], columns: Sequence[str] | None = None, max_width: int = 70) -> str:
    """Rows as an aligned text table (cells longer than ``max_width`` are clipped)."""
    if not rows:
        return "(none)"
    columns = list(columns or rows[0].keys())
    cells = [[_clip(str(r.get(c, "")), max_width) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)
