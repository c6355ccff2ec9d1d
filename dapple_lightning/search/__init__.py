"""Plan search as a hyperparameter study: measured trials of candidate plans, stored by Optuna.

The parallel plan is searched like a hyperparameter. Each trial trains one candidate plan for a
few steps in fresh processes (never in the search process: a crash, hang or out-of-memory ends
the trial, not the study), the study lives in an Optuna database (resumable; ``optuna-dashboard``
opens it), the planner's picks are measured first, and a later run trains with the best plan::

    from dapple_lightning.search import SearchConfig, TrialConfig, run_search, strategy_from_study

    run_search(SearchConfig(TrialConfig("my_models:gpt", world_size=4, global_batch=64),
                            storage="sqlite:///search.db", study_name="gpt", n_trials=30))
    trainer = Trainer(devices=4, strategy=strategy_from_study("sqlite:///search.db", "gpt"))

or from the shell: ``python -m dapple_lightning.search run|best|trials|plot`` (see ``_cli``), or
as a Hydra sweep (``hydra/sweeper=dapple``, see ``_hydra``).

The search depends on the trials and the strategy, never the reverse: a config's
``plan: optuna://...`` is turned into a plan by :func:`resolve_plan_spec` before a strategy is
built. This package is Optuna and Hydra; the processes that measure a plan are
``dapple_lightning.trials``'s (:class:`TrialConfig` and :class:`Fingerprint`, which the search's
own calls take, are re-exported here).

Pieces, one module each:

- what to search: :class:`PlanSpace` (``_space``, valid plans only, define-by-run);
- what a study's measurements are valid for: :class:`Fingerprint` (``dapple_lightning.trials``),
  compared whenever a study is resumed or read;
- the study: :func:`optimize` (``_loop``, the one loop), its bookkeeping (``_bookkeeping``:
  :class:`RepeatGuard`, :func:`interrupted_trials`, ...), the confirmation round that ends it
  (``_confirm``: the contenders measured again, interleaved), the planner's seeds
  (:func:`planner_seeds`, ``_seed``);
- the fronts that drive the loop: :class:`PlanSearch` / :func:`run_search` (``_study``) and the
  Hydra sweeper (:func:`run_sweep`, ``_hydra``);
- the result: which plan the measurements support (:func:`choose_plan`, ``_choice``: plans by
  median, told apart only beyond their spreads), :func:`best_plan`, :func:`strategy_from_study`,
  :func:`resolve_plan_spec` (``_results``), :func:`trial_rows` / :func:`format_table` (``_report``);
- what leaves the search: URLs with their passwords masked (``_redact``), files replaced whole
  (``_files``).

The study's modules (the loop, the sweeper, the results) load on first use. The trial processes
import ``dapple_lightning.trials``, not this package (unless the model's factory lives here, as
``dapple_lightning.search.testing``'s do).
"""

from __future__ import annotations

import importlib
from typing import Any

from dapple_lightning.search._seed import SeedPlan, baseline_plans, compute_units, local_cluster, planner_seeds
from dapple_lightning.search._space import (
    DEFAULT_MAX_PLANS,
    PlanSpace,
    describe_plan,
    params_from_plan,
    plan_from_params,
)
from dapple_lightning.trials import Fingerprint, FingerprintMismatch, TrialConfig

_LAZY = {
    "DEFAULT_STORAGE": "_config",
    "SearchConfig": "_config",
    "RepeatGuard": "_bookkeeping",
    "distinct_finished": "_bookkeeping",
    "finished_count": "_bookkeeping",
    "interrupted_trials": "_bookkeeping",
    "unmeasured_plan": "_bookkeeping",
    "Drawn": "_loop",
    "Outcome": "_loop",
    "create_sampler": "_loop",
    "optimize": "_loop",
    "PlanSearch": "_study",
    "run_search": "_study",
    "best_choice": "_results",
    "best_plan": "_results",
    "best_trial": "_results",
    "explain_choice": "_results",
    "load_search": "_results",
    "ranked_trials": "_results",
    "resolve_plan_spec": "_results",
    "strategy_from_study": "_results",
    "Choice": "_choice",
    "PlanResult": "_choice",
    "choice_lines": "_choice",
    "choose_plan": "_choice",
    "plan_results": "_choice",
    "trial_plan": "_choice",
    "format_table": "_report",
    "trial_rows": "_report",
    "SweepSettings": "_hydra",
    "plan_override": "_hydra",
    "run_sweep": "_hydra",
}

__all__ = [  # the names imported above, then those loaded on first use
    "DEFAULT_MAX_PLANS",
    "Fingerprint",
    "FingerprintMismatch",
    "PlanSpace",
    "SeedPlan",
    "TrialConfig",
    "baseline_plans",
    "compute_units",
    "describe_plan",
    "local_cluster",
    "params_from_plan",
    "plan_from_params",
    "planner_seeds",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
