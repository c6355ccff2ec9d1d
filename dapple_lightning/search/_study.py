"""The plan search as an Optuna study: measured trials in a database, resumable, seeded by the planner.

:class:`PlanSearch` is the front that measures each plan with :func:`run_trial`; the loop it
drives (open, ask, draw, tell, resume) is ``_loop``'s, shared with the Hydra sweeper.

A study is standard Optuna storage (SQLite by default; any Optuna storage URL works), so
``optuna-dashboard sqlite:///dapple_search.db`` shows it live. What the search stores:

- ``study.user_attrs``: ``fingerprint`` (model, ranks, device, batch: see ``_fingerprint``),
  ``space`` (the searched micro-batch counts and schedules), ``model`` (the factory),
  ``objectives`` (``["samples_per_s"]`` or ``["samples_per_s", "peak_bytes"]``),
  ``planner_seeded``, ``interrupted_trial_N`` for each interrupted trial ``N`` (an attribute per
  trial: workers sharing a study never rewrite a common list), and ``confirmation_after_K`` for each
  confirmation round (its contenders; see ``_confirm``); the fingerprint is written last, so a
  study holding it holds the rest;
- per trial: the plan (``user_attrs["plan"]``, the :meth:`Plan.to_dict` form, and ``plan_str``),
  every measurement (``samples_per_s``, ``median_step_s``, ``step_times``, ``peak_bytes``,
  ``max_rss_bytes``, ``wall_s``), ``confirms`` on a confirmation trial (the trial whose plan it
  measures again), and for trials that did not complete ``fail_reason`` (``"timeout"``,
  ``"oom"``, the failing rank's last stderr lines, or why the plan is infeasible).

Resuming, trials orphaned by a dead search and several workers on one study are the loop's and
its bookkeeping's (``_loop``, ``_bookkeeping``; ``docs/search.md`` for users): ``n_trials`` is the
number of counted finished trials the study should hold, so the same command run again continues.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import optuna
from optuna.trial import TrialState

from dapple_lightning.planner import relative_spread
from dapple_lightning.search._bookkeeping import heartbeat_storage
from dapple_lightning.search._config import SearchConfig
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
from dapple_lightning.search._redact import redact
from dapple_lightning.search._seed import compute_units, enqueue_planner_seeds, memory_refusal
from dapple_lightning.search._space import PlanSpace
from dapple_lightning.trials import ModelInfo, TrialResult, probe_model, run_trial

__all__ = ["PlanSearch", "run_search"]

DEFAULT_N_TRIALS = 20


class PlanSearch:
    """Runs (or resumes) a plan search; see :class:`SearchConfig` and the module docstring.

    Example::

        config = SearchConfig(TrialConfig("my_models:gpt", world_size=4, global_batch=64), n_trials=30)
        study = PlanSearch(config).run()
        print(best_plan(config.storage, config.study_name))
    """

    def __init__(self, config: SearchConfig, *, say: Callable[[str], None] | None = None) -> None:
        self.config = config
        show = say or ((lambda line: print(line, flush=True)) if config.progress else (lambda line: None))
        # A line may quote another library's error, which may quote the storage URL.
        self._say = lambda line: show(redact(line, config.storage))
        self.study: optuna.Study | None = None
        self.space: PlanSpace | None = None
        self.model: ModelInfo | None = None
        self._refusal: Callable[[Any], str | None] = lambda plan: None

    def open(self) -> optuna.Study:
        """Create or load the study, check it against the model, queue seeds; the study."""
        cfg = self.config
        existing = existing_study(cfg.storage, cfg.study_name)
        seeded = existing is not None and existing.user_attrs.get("planner_seeded") is not None
        want_seeds = cfg.planner_seeds > 0 and not seeded
        want_profile = want_seeds or cfg.memory_limit is not None
        self._say(f"probing model {cfg.trial.model} ...")
        self.model = info = probe_model(cfg.trial, profile=want_profile)
        t = cfg.trial
        self.space = space = PlanSpace(
            info.num_layers, t.world_size, t.global_batch, cfg.micro_batches, cfg.schedules, cfg.max_stages, cfg.chunks
        )
        # grid: every plan is enqueued; the random sampler only fills what nothing fixed.
        kind = "random" if cfg.sampler == "grid" else cfg.sampler
        self.study = study = open_study(
            heartbeat_storage(cfg.storage, cfg.heartbeat_s),
            cfg.study_name,
            fingerprint=info.fingerprint,
            space=space,
            directions=cfg.directions,
            objectives=cfg.objectives,
            sampler=lambda offset: create_sampler(kind, cfg.seed + offset, cfg.tpe_startup_trials),
            pruner=self._pruner(),
            attrs={"model": {"factory": t.model, "kwargs": dict(t.model_kwargs)}},
            existing=existing,
            allow_mismatch=cfg.allow_mismatch,
            say=self._say,
        )
        enqueue_baselines(study, space, cfg.baselines)  # measured first: what a found plan must beat
        enqueue_plans(study, space, cfg.enqueue)
        if cfg.memory_limit is not None:
            if info.profile is None:
                raise RuntimeError(
                    f"memory_limit needs the model's profile to predict each plan's memory, and profiling failed: "
                    f"{info.profile_error}"
                )
            self._refusal = memory_refusal(info.profile, space, cfg.memory_limit)
        if want_seeds:
            missing = f"no profile ({info.profile_error})"
            units = compute_units(cfg.trial)
            enqueue_planner_seeds(
                study, space, info.profile, cfg.planner_seeds, units, self._say, missing, cfg.memory_limit
            )
        if cfg.sampler == "grid":
            self._enqueue_grid(study, space)
        return study

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
        target = cfg.n_trials
        if target is None:
            target = space.size if cfg.sampler == "grid" else DEFAULT_N_TRIALS
        optimize(
            study,
            space,
            self._measure,
            n_trials=target,
            timeout_s=cfg.timeout_s,
            seed=cfg.seed,
            confirm_repeats=cfg.confirm_repeats,
            label="samples/s",
            say=self._say,
        )
        return study

    # ------------------------------------------------------------------------------ measuring

    def _measure(self, batch: list[Drawn]) -> list[Outcome]:
        """The loop's runner: one trial at a time, in fresh processes, pruned by the study's pruner
        (a confirmation trial runs to its end)."""
        return [self._measure_one(d) for d in batch]

    def _measure_one(self, drawn: Drawn) -> Outcome:
        cfg, trial = self.config, drawn.trial
        on_step = None
        if not cfg.multi_objective and cfg.pruner != "none" and drawn.confirms is None:

            def on_step(step: int, samples_per_s: float) -> bool:
                trial.report(samples_per_s, step)
                return trial.should_prune()

        if (reason := self._refusal(drawn.plan)) is not None:
            return outcome_of(TrialResult("infeasible", reason=reason), multi_objective=cfg.multi_objective)
        started = lambda pgid: trial.set_user_attr("pgid", pgid)  # noqa: E731
        result = run_trial(drawn.plan, cfg.trial, on_step, on_start=started, on_wait=self._say)  # waits for devices
        return outcome_of(result, multi_objective=cfg.multi_objective, warmup=cfg.trial.warmup)

    def _pruner(self) -> optuna.pruners.BasePruner:
        cfg = self.config
        if cfg.pruner == "none" or cfg.multi_objective:
            return optuna.pruners.NopPruner()
        return optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=cfg.trial.warmup)

    # ------------------------------------------------------------------------------- seeding

    def _enqueue_grid(self, study: optuna.Study, space: PlanSpace) -> None:
        if study.user_attrs.get("grid_enqueued"):
            return
        plans = space.grid(self.config.max_grid)
        # A seeded shuffle: a drift in the machine's load must not line up with one region of the space.
        random.Random(self.config.seed).shuffle(plans)
        enqueue_plans(study, space, plans, source="grid")
        study.set_user_attr("grid_enqueued", True)


_MEASURED = ("samples_per_s", "median_step_s", "peak_memory_bytes")
_PER_RANK = ("step_times", "peak_bytes", "activation_bytes", "max_rss_bytes")


def outcome_of(result: TrialResult, *, multi_objective: bool = False, warmup: int = 0) -> Outcome:
    """What the study records of a measured trial: its values, measurements and why it did not complete."""
    attrs: dict[str, Any] = {"wall_s": round(result.wall_s, 3)}
    if result.status == "complete":
        assert result.samples_per_s is not None
        attrs.update({k: getattr(result, k) for k in _MEASURED})
        attrs.update({k: list(getattr(result, k)) for k in _PER_RANK})
        measured_spread = relative_spread(result.step_times[warmup:])
        if measured_spread is not None:
            attrs["spread"] = measured_spread  # how far apart two plans must be to be told apart
        values = (result.samples_per_s,)
        if multi_objective:
            values += (float(result.peak_memory_bytes or 0),)
        return Outcome(TrialState.COMPLETE, values, attrs, f"{result.samples_per_s:9.1f} samples/s")
    attrs["fail_reason"] = result.reason
    if result.fail_kind is not None:
        attrs["fail_kind"] = result.fail_kind
    if result.detail:
        attrs["fail_detail"] = result.detail
    if result.status == "failed":
        first = (result.reason or "").strip().splitlines()
        return Outcome(TrialState.FAIL, attrs=attrs, summary=f"FAIL {result.fail_kind}: {first[-1] if first else ''}")
    # infeasible or pruned: the sampler should learn to avoid the region, not retry it
    if result.status == "infeasible":
        attrs["infeasible"] = True
    return Outcome(TrialState.PRUNED, attrs=attrs, summary=f"PRUNED: {result.reason}")


def run_search(config: SearchConfig) -> optuna.Study:
    """Run or resume a plan search; the Optuna study (see :class:`PlanSearch`)."""
    return PlanSearch(config).run()
