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
:func:`dapple_lightning.trials.run_trial`; a process-per-job launcher isolates every job.

The loop is the search's own (``_loop``, the one :class:`~dapple_lightning.search.PlanSearch`
drives): the sweeper only turns a batch of drawn plans into jobs and their return values into
outcomes. Resuming, the fingerprint (here without the architecture hash: the sweeper never builds
the model), repeated proposals, ``n_trials`` as the study's total work and the confirmation round
(``confirm_repeats`` more runs of the contenders, as jobs like any other) are the loop's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from dapple_lightning.plan import SCHEDULES, Plan, whole
from dapple_lightning.search._bookkeeping import heartbeat_storage
from dapple_lightning.search._choice import choice_lines, choose_plan, throughput_study
from dapple_lightning.search._files import write_atomic
from dapple_lightning.search._loop import (
    Drawn,
    Outcome,
    create_sampler,
    enqueue_baselines,
    enqueue_plans,
    existing_study,
    open_study,
    optimize,
)
from dapple_lightning.search._redact import redact, spells_secret
from dapple_lightning.search._results import best_choice, trial_plan
from dapple_lightning.search._seed import BASELINES, compute_units, enqueue_planner_seeds
from dapple_lightning.search._space import PlanSpace, describe_plan
from dapple_lightning.trials import Fingerprint, TrialConfig, check_factory_spec, load_factory, probe_model

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
    chunks: int = 2
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
    baselines: tuple[str, ...] = BASELINES
    heartbeat_s: int | None = 10
    confirm_repeats: int = 1
    model: str | None = None
    """``"module:function"`` called with a job's config, returning ``(LightningModule, train
    DataLoader)``: the model the planner profiles (in a child process) to seed the study."""
    planner_seeds: int = 3

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
        whole(self.n_trials, "hydra.sweeper.n_trials")
        whole(self.n_jobs, "hydra.sweeper.n_jobs")
        whole(self.confirm_repeats, "hydra.sweeper.confirm_repeats", 0)
        whole(self.planner_seeds, "hydra.sweeper.planner_seeds", 0)
        if self.model is not None:
            check_factory_spec(self.model)
        if not self.plan_key or not isinstance(self.plan_key, str):
            raise ValueError(f"hydra.sweeper.plan_key must name a config key, got {self.plan_key!r}")

    @classmethod
    def from_config(cls, space: Mapping[str, Any], **settings: Any) -> SweepSettings:
        """Settings from the plugin's plain-container config (lists become tuples)."""

        def tup(value: Any) -> tuple | None:
            return None if value is None else tuple(value)

        for key in ("directions", "metrics", "enqueue", "baselines"):
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
            chunks=space.get("chunks", 2),
            **settings,
        )

    def space(self) -> PlanSpace:
        return PlanSpace(
            self.num_layers,
            self.world_size,
            self.global_batch,
            self.micro_batches,
            self.schedules,
            self.max_stages,
            self.chunks,
        )

    def fingerprint(self) -> Fingerprint:
        return Fingerprint(self.num_layers, "", self.world_size, self.device, self.global_batch)


SPREAD_KEY = "samples_per_s_spread"
"""A job's returned relative spread of its throughput (half the interquartile range over the median)."""


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


def run_sweep(sweeper: Any, settings: SweepSettings, arguments: list[str]) -> list[Any]:
    """Run the sweep for the plugin ``sweeper`` (which holds ``config``, ``launcher``, ``hydra_context``)."""
    import logging

    from omegaconf import OmegaConf

    log = logging.getLogger("dapple_lightning.search.sweeper")
    config = sweeper.config
    _refuse_spelled_password(config)
    fixed = _fixed_overrides(sweeper, arguments)
    space = settings.space()

    def say(line: str) -> None:  # a line may quote another library's error, which may quote the URL
        log.info(redact(line, settings.storage))

    study = open_study(
        heartbeat_storage(settings.storage, settings.heartbeat_s),
        settings.study_name,
        fingerprint=settings.fingerprint(),
        space=space,
        directions=settings.directions,
        objectives=list(settings.metrics or ["objective"]),
        sampler=lambda offset: create_sampler(settings.sampler, settings.seed + offset),
        attrs={"task": str(config.hydra.job.name)},
        existing=existing_study(settings.storage, settings.study_name),
        allow_mismatch=settings.allow_mismatch,
        say=say,
    )
    enqueue_baselines(study, space, settings.baselines)  # measured first: what a found plan must beat
    enqueue_plans(study, space, settings.enqueue)
    if settings.planner_seeds and study.user_attrs.get("planner_seeded") is None:
        _seed_from_planner(study, space, settings, _job_config(sweeper, fixed), say)
    sweep_dir = Path(str(config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(sweep_dir / "multirun.yaml", OmegaConf.to_yaml(config))  # unresolved, as Hydra saves
    jobs = _Jobs(sweeper, settings, fixed, first_job=len(study.trials))
    optimize(
        study,
        space,
        jobs,
        n_trials=settings.n_trials,
        batch_size=settings.n_jobs,
        seed=settings.seed,
        confirm_repeats=settings.confirm_repeats,
        say=say,
    )
    _write_results(study, sweep_dir, say)
    return jobs.returns


def _job_config(sweeper: Any, fixed: list[str]) -> dict[str, Any] | None:
    """A job's config (the command line's overrides applied) as plain data, without Hydra's own
    node; ``None`` when it cannot be composed or resolved outside a job."""
    from omegaconf import OmegaConf

    try:
        config = sweeper.hydra_context.config_loader.load_sweep_config(sweeper.config, list(fixed))
        plain = OmegaConf.to_container(config, resolve=False)
        plain.pop("hydra", None)
        return OmegaConf.to_container(OmegaConf.create(plain), resolve=True)  # type: ignore[return-value]
    except Exception:  # e.g. an interpolation that only a running job resolves
        return None


def job_model(batch_size: int, *, target: str, app_dir: str, config: dict[str, Any]) -> Any:
    """The factory the planner's probe calls (``TrialConfig.model``): imports the app's
    ``target`` from its directory and calls it with the job's config (``batch_size`` is the
    config's own)."""
    import sys

    from omegaconf import OmegaConf

    if app_dir not in sys.path:
        sys.path.insert(0, app_dir)  # the app's modules import each other from there
    return load_factory(target)(OmegaConf.create(config))


def _seed_from_planner(
    study: optuna.Study, space: PlanSpace, settings: SweepSettings, config: dict[str, Any] | None, say: Any
) -> None:
    """Profile the app's model (``hydra.sweeper.model``) in a child process and queue the
    planner's picks after the baselines, as the search command does."""
    profile, units = None, None
    if settings.model is None:
        missing = "set hydra.sweeper.model to a 'module:function' that builds the job's model to seed with the planner"
    elif config is None:
        missing = "the job's config did not resolve"
    else:
        import sys

        app_dir = str(Path(sys.argv[0]).resolve().parent)
        kwargs = {"target": settings.model, "app_dir": app_dir, "config": config}
        trial = TrialConfig(
            "dapple_lightning.search._hydra:job_model",
            world_size=space.world_size,
            global_batch=space.global_batch,
            model_kwargs=kwargs,
            accelerator=settings.device,
        )
        say(f"profiling {settings.model} for the planner ...")
        try:
            info = probe_model(trial, profile=True)
        except RuntimeError as e:
            missing = f"the probe failed ({e})"
        else:
            missing, units = f"no profile ({info.profile_error})", compute_units(trial)
            if info.num_layers != space.num_layers:
                missing = f"the model has {info.num_layers} layers, the space {space.num_layers}"
            else:
                profile = info.profile
    enqueue_planner_seeds(study, space, profile, settings.planner_seeds, units, say, missing)


def _refuse_spelled_password(config: Any) -> None:
    """Refuse a storage URL whose password is written out in the config: Hydra saves the sweeper's
    config, as written, in every job's ``.hydra/hydra.yaml`` (and the command line's overrides)."""
    from omegaconf import OmegaConf

    written = OmegaConf.to_container(config.hydra.sweeper, resolve=False).get("storage")
    if isinstance(written, str) and spells_secret(written):
        raise ValueError(
            f"hydra.sweeper.storage={redact(written)!r} writes its password out, and Hydra saves that value in "
            "every job's .hydra/hydra.yaml; give the password as an interpolation, which Hydra saves as written, "
            "e.g. hydra.sweeper.storage='postgresql://user:${oc.env:DAPPLE_DB_PASSWORD}@host/db', or leave it "
            "out of the URL (PostgreSQL reads PGPASSWORD or ~/.pgpass)"
        )


def _fixed_overrides(sweeper: Any, arguments: list[str]) -> list[str]:
    """The command line's overrides; a sweep override is refused (the sweeper sweeps plans only)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create(config_loader=sweeper.hydra_context.config_loader)
    fixed = []
    for override in parser.parse_overrides(arguments):
        if override.is_sweep_override():
            raise ValueError(
                f"hydra/sweeper=dapple searches plans only; {override.input_line!r} is a sweep. Give fixed "
                "values, or run a separate sweep per value"
            )
        fixed.append(override.input_line)
    return fixed


class _Jobs:
    """The loop's runner for the sweeper: a batch of plans becomes one launch of Hydra jobs."""

    def __init__(self, sweeper: Any, settings: SweepSettings, fixed: list[str], first_job: int) -> None:
        self.sweeper, self.settings, self.fixed = sweeper, settings, fixed
        self.next_job = first_job  # job numbers continue across resumed runs: output dirs do not clash
        self.returns: list[Any] = []

    def __call__(self, batch: Sequence[Drawn]) -> list[Outcome]:
        overrides = [[*self.fixed, plan_override(d.plan, self.settings.plan_key)] for d in batch]
        self.sweeper.validate_batch_is_legal(overrides)
        results = self.sweeper.launcher.launch(overrides, initial_job_idx=self.next_job)
        self.next_job += len(batch)
        self.returns.append(results)
        return [_outcome(ret, self.settings) for ret in results]


def _outcome(ret: Any, settings: SweepSettings) -> Outcome:
    """A Hydra job's return as a trial's outcome: its objective values, or why it failed."""
    from hydra.core.utils import JobStatus

    attrs = {"job_dir": str(ret.working_dir)}
    if ret.status != JobStatus.COMPLETED:
        error = ret._return_value  # the job's exception; `return_value` would raise it
        reason = redact(f"{type(error).__name__}: {error}", settings.storage)
        return Outcome(TrialState.FAIL, attrs={**attrs, "fail_reason": reason}, summary=f"FAIL {reason}")
    try:
        values = _objective(ret.return_value, settings)
    except (TypeError, ValueError, KeyError) as e:
        return Outcome(TrialState.FAIL, attrs={**attrs, "fail_reason": f"{type(e).__name__}: {e}"}, summary=f"FAIL {e}")
    if isinstance(ret.return_value, Mapping) and isinstance(ret.return_value.get(SPREAD_KEY), int | float):
        attrs["spread"] = float(ret.return_value[SPREAD_KEY])  # how far apart two plans must be to be told apart
    return Outcome(TrialState.COMPLETE, tuple(values), attrs, summary=", ".join(f"{v:.4g}" for v in values))


def _write_results(study: optuna.Study, sweep_dir: Path, say: Any) -> None:
    """``optimization_results.yaml`` (Hydra's name for a sweep's result) and the choice, in numbers."""
    from omegaconf import OmegaConf

    try:
        best, _ = best_choice(study)  # the note is in choice_lines
    except ValueError:
        say("no trial completed")
        return
    plan = trial_plan(best, study)
    results: dict[str, Any] = {"name": "dapple", "best_trial": best.number, "best_values": list(best.values)}
    if throughput_study(study):
        choice = choose_plan(study)
        for line in choice_lines(choice):
            say(line)
        chosen = choice.chosen
        results["best_values"] = [chosen.samples_per_s]  # the median of the plan's runs
        results["best_spread"] = chosen.spread
        results["best_runs"] = [{"trial": t.number, "value": t.values[0]} for t in chosen.trials]
    results["best_plan"] = plan.to_dict()
    write_atomic(sweep_dir / "optimization_results.yaml", OmegaConf.to_yaml(OmegaConf.create(results)))
    say(f"best trial {best.number}: {results['best_values']} with {describe_plan(plan)}")
