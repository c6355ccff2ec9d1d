"""The plan search as a Hydra sweep: Optuna picks plans, Hydra's launcher runs them as jobs.

The Hydra plugin (``hydra_plugins/dapple_sweeper``, selected with ``hydra/sweeper=dapple``) is a
thin class; this module does the work. Each trial is one Hydra job whose overrides are the
command line's plus the sampled plan as a dict override::

    ++plan={micro_batches:4,schedule:dapple,stages:[{layers:[0,6],replicas:2},{layers:[6,10],replicas:2}]}

(``++`` sets the key whether or not the primary config has it; the key is ``plan_key``). The job's
configured launcher runs it, the task function's return value is the objective: a number (one
direction), or a mapping from which ``metrics`` picks one number per direction (e.g. an app
returning ``{"samples_per_s": ..., "peak_bytes": ...}`` with ``directions=[maximize, minimize]``).
A job that raises becomes a FAIL trial with the exception as ``fail_reason``; the sweep goes on.

Process isolation is the launcher's business: Hydra's basic launcher runs jobs in the sweeper's
process, which is fine for an app whose ranks are separate processes anyway
(``DappleStrategy(start_method="spawn")``) or whose job measures with
:func:`dapple_lightning.search.run_trial`; a process-per-job launcher isolates every job.

Resuming, the fingerprint (here without the architecture hash: the sweeper never builds the
model) and ``n_trials`` as the study's total work as in :mod:`dapple_lightning.search._study`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from dapple_lightning.plan import SCHEDULES, Plan
from dapple_lightning.search._fingerprint import Fingerprint, check_fingerprint
from dapple_lightning.search._space import PlanSpace, describe_plan
from dapple_lightning.search._study import (
    RepeatGuard,
    best_trial,
    create_sampler,
    distinct_finished,
    draw_plan,
    finished_count,
    mark_interrupted,
    recover_stale_trials,
    repeat_trial,
    trial_plan,
)

__all__ = ["SweepSettings", "plan_override", "run_sweep"]


@dataclass(frozen=True)
class SweepSettings:
    """The sweeper's configuration (``hydra.sweeper.*``), validated."""

    num_layers: int
    world_size: int
    global_batch: int
    device: str = "cpu"
    micro_batches: tuple[int, ...] | None = None
    schedules: tuple[str, ...] = SCHEDULES
    max_stages: int | None = None
    storage: str = "sqlite:///dapple_sweep.db"
    study_name: str = "dapple-sweep"
    n_trials: int = 20
    n_jobs: int = 1
    sampler: str = "tpe"
    seed: int = 0
    directions: tuple[str, ...] = ("maximize",)
    metrics: tuple[str, ...] | None = None
    plan_key: str = "plan"
    allow_mismatch: bool = False
    enqueue: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        if self.sampler not in ("tpe", "random"):
            raise ValueError(f"hydra.sweeper.sampler must be tpe or random, got {self.sampler!r}")
        for d in self.directions:
            if d not in ("maximize", "minimize"):
                raise ValueError(f"hydra.sweeper.directions: {d!r} is not maximize or minimize")
        if not self.directions:
            raise ValueError("hydra.sweeper.directions is empty; give e.g. [maximize]")
        if self.metrics is not None and len(self.metrics) != len(self.directions):
            raise ValueError(
                f"hydra.sweeper.metrics {list(self.metrics)} needs one name per direction {list(self.directions)}"
            )
        if len(self.directions) > 1 and self.metrics is None:
            raise ValueError("several directions need hydra.sweeper.metrics: the keys of the job's returned mapping")
        for name in ("n_trials", "n_jobs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"hydra.sweeper.{name} must be an integer >= 1, got {value!r}")
        if not self.plan_key or not isinstance(self.plan_key, str):
            raise ValueError(f"hydra.sweeper.plan_key must name a config key, got {self.plan_key!r}")

    @classmethod
    def from_config(cls, space: Mapping[str, Any], **settings: Any) -> SweepSettings:
        """Settings from the plugin's plain-container config (lists become tuples)."""

        def tup(value: Any) -> tuple | None:
            return None if value is None else tuple(value)

        for key in ("directions", "metrics", "enqueue"):
            if key in settings:
                settings[key] = tup(settings[key])
        if settings.get("enqueue") is None:
            settings.pop("enqueue", None)
        return cls(
            num_layers=space["num_layers"],
            world_size=space["world_size"],
            global_batch=space["global_batch"],
            device=str(space.get("device", "cpu")),
            micro_batches=tup(space.get("micro_batches")),
            schedules=tup(space.get("schedules")) or SCHEDULES,
            max_stages=space.get("max_stages"),
            **settings,
        )

    def space(self) -> PlanSpace:
        return PlanSpace(
            self.num_layers, self.world_size, self.global_batch, self.micro_batches, self.schedules, self.max_stages
        )

    def fingerprint(self) -> Fingerprint:
        return Fingerprint(self.num_layers, "", self.world_size, self.device, self.global_batch)


def _value(value: Any) -> str:
    """A value in Hydra's override grammar (dicts and lists nest; strings are quoted)."""
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    text = str(value).replace("\\", "\\\\").replace("'", "\\'")
    return f"'{text}'"


def plan_override(plan: Plan, key: str = "plan") -> str:
    """The Hydra override that sets ``key`` to ``plan`` (its :meth:`Plan.to_dict` form)."""
    return f"++{key}={_value(plan.to_dict())}"


def _objective(ret: Any, settings: SweepSettings) -> list[float]:
    if settings.metrics is not None:
        if not isinstance(ret, Mapping):
            raise TypeError(
                f"the job returned {type(ret).__name__}; with hydra.sweeper.metrics={list(settings.metrics)} "
                "it must return a mapping holding those keys"
            )
        missing = [m for m in settings.metrics if m not in ret]
        if missing:
            raise KeyError(f"the job's result lacks {missing}; it has {sorted(map(str, ret))}")
        values = [ret[m] for m in settings.metrics]
    elif isinstance(ret, Mapping):
        raise TypeError(
            f"the job returned a mapping with keys {sorted(map(str, ret))}; choose the objective(s) with "
            "hydra.sweeper.metrics=[KEY]"
        )
    elif isinstance(ret, Sequence) and not isinstance(ret, str):
        values = list(ret)
    else:
        values = [ret]
    if len(values) != len(settings.directions):
        raise ValueError(f"the job returned {len(values)} value(s) for {len(settings.directions)} direction(s)")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ValueError(f"the job returned {v!r}; the objective must be a finite number")
        out.append(float(v))
    return out


def _open_study(settings: SweepSettings, space: PlanSpace, task: str) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    names = optuna.get_all_study_names(settings.storage)
    existing = settings.study_name in names
    offset = 0
    if existing:
        old = optuna.load_study(study_name=settings.study_name, storage=settings.storage)
        check_fingerprint(
            old.user_attrs.get("fingerprint"),
            settings.fingerprint(),
            study_name=settings.study_name,
            allow_mismatch=settings.allow_mismatch,
        )
        offset = len(old.trials)
    sampler = create_sampler(settings.sampler, settings.seed + offset)
    study = optuna.create_study(
        storage=settings.storage,
        study_name=settings.study_name,
        directions=list(settings.directions),
        sampler=sampler,
        load_if_exists=True,
    )
    if "fingerprint" not in study.user_attrs:
        study.set_user_attr("fingerprint", settings.fingerprint().to_dict())
        study.set_user_attr("space", space.to_dict())
        study.set_user_attr("objectives", list(settings.metrics or ["objective"]))
        study.set_user_attr("task", task)
    return study


def run_sweep(sweeper: Any, settings: SweepSettings, arguments: list[str]) -> list[Any]:
    """Run the sweep for the plugin ``sweeper`` (which holds ``config``, ``launcher``, ``hydra_context``)."""
    import logging

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    log = logging.getLogger("dapple_lightning.search.sweeper")
    config, launcher = sweeper.config, sweeper.launcher
    parser = OverridesParser.create(config_loader=sweeper.hydra_context.config_loader)
    fixed = []
    for override in parser.parse_overrides(arguments):
        if override.is_sweep_override():
            raise ValueError(
                f"hydra/sweeper=dapple searches plans only; {override.input_line!r} is a sweep. Give fixed "
                "values, or run a separate sweep per value"
            )
        fixed.append(override.input_line)
    space = settings.space()
    study = _open_study(settings, space, str(config.hydra.job.name))
    for number in recover_stale_trials(study):
        log.info(f"trial {number} was left running by a dead sweep: marked FAIL, plan queued again")
    for item in settings.enqueue:
        study.enqueue_trial(space.params(Plan.coerce(item)), user_attrs={"source": "user"}, skip_if_exists=True)
    sweep_dir = Path(str(config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(config, sweep_dir / "multirun.yaml")

    returns: list[Any] = []
    job_idx = len(study.trials)  # job numbers continue across resumed runs: output dirs do not clash
    repeats = RepeatGuard(seed=settings.seed)
    while (done := finished_count(study)) < settings.n_trials:
        if distinct_finished(study) >= space.size:
            log.info(f"every one of the {space.size} plans of the space has been tried")
            break
        batch: list[tuple[optuna.Trial, Plan]] = []
        for _ in range(min(settings.n_jobs, settings.n_trials - done)):
            trial = study.ask()
            plan, previous = draw_plan(study, trial, space)
            if previous is not None:
                log.info(f"trial {trial.number}: {repeat_trial(study, trial, previous)}")
                repeats.repeated(study, space)
                continue
            repeats.measured()
            batch.append((trial, plan))
        if not batch:
            continue
        overrides = [[*fixed, plan_override(plan, settings.plan_key)] for _, plan in batch]
        try:
            sweeper.validate_batch_is_legal(overrides)
            results = launcher.launch(overrides, initial_job_idx=job_idx)
        except BaseException:
            for trial, _ in batch:
                mark_interrupted(study, trial.number, trial.params)
            raise
        job_idx += len(batch)
        returns.append(results)
        for (trial, _), ret in zip(batch, results):
            _tell(study, trial, ret, settings, log)
    _write_results(study, sweep_dir, log)
    return returns


def _tell(study: optuna.Study, trial: optuna.Trial, ret: Any, settings: SweepSettings, log: Any) -> None:
    from hydra.core.utils import JobStatus

    trial.set_user_attr("job_dir", str(ret.working_dir))
    plan = trial.user_attrs.get("plan_str")
    if ret.status != JobStatus.COMPLETED:
        error = ret._return_value  # the job's exception; `return_value` would raise it
        reason = f"{type(error).__name__}: {error}"
        trial.set_user_attr("fail_reason", reason)
        study.tell(trial, state=TrialState.FAIL)
        log.info(f"trial {trial.number} {plan}: FAIL {reason}")
        return
    try:
        values = _objective(ret.return_value, settings)
    except (TypeError, ValueError, KeyError) as e:
        trial.set_user_attr("fail_reason", f"{type(e).__name__}: {e}")
        study.tell(trial, state=TrialState.FAIL)
        log.info(f"trial {trial.number} {plan}: FAIL {e}")
        return
    study.tell(trial, values)
    log.info(f"trial {trial.number} {plan}: {values}")


def _write_results(study: optuna.Study, sweep_dir: Path, log: Any) -> None:
    from omegaconf import OmegaConf

    try:
        best = best_trial(study)
    except ValueError:
        log.info("no trial completed")
        return
    plan = trial_plan(best, study)
    results = {
        "name": "dapple",
        "best_trial": best.number,
        "best_values": list(best.values),
        "best_plan": plan.to_dict(),
    }
    OmegaConf.save(OmegaConf.create(results), sweep_dir / "optimization_results.yaml")
    log.info(f"best trial {best.number}: {best.values} with {describe_plan(plan)}")
