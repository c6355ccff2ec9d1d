"""Plan search as a hyperparameter study: measured trials of candidate plans, stored by Optuna.

The parallel plan is searched like a hyperparameter. Each trial trains one candidate plan for a
few steps in fresh processes (never in the search process: a crash, hang or out-of-memory ends
the trial, not the study), the study lives in an Optuna database (resumable; ``optuna-dashboard``
opens it), the planner's picks are measured first, and a later run trains with the best plan::

    from dapple_lightning.search import SearchConfig, TrialConfig, run_search, strategy_from_study

    run_search(SearchConfig(TrialConfig("my_models:gpt", world_size=4, global_batch=64),
                            storage="sqlite:///search.db", study_name="gpt", n_trials=30))
    trainer = Trainer(devices=4, strategy=strategy_from_study("sqlite:///search.db", "gpt"))

or from the shell: ``python -m dapple_lightning.search run|best|trials|plot`` (see ``_cli``).

Pieces: :class:`PlanSpace` (valid plans only, define-by-run), :func:`run_trial` (one measured run),
:class:`PlanSearch` (the study), :func:`best_plan` / :func:`strategy_from_study` /
:func:`resolve_plan_spec` (use the result). Names that need Optuna load on first use, so the
trial processes, which import this package, do not pay for Optuna.
"""

from __future__ import annotations

import importlib
from typing import Any

from dapple_lightning.search._fingerprint import Fingerprint, FingerprintMismatch, check_fingerprint
from dapple_lightning.search._space import (
    DEFAULT_MAX_PLANS,
    PlanSpace,
    count_plans,
    describe_plan,
    enumerate_plans,
    params_from_plan,
    plan_from_params,
)
from dapple_lightning.search._trial import TrialConfig, TrialResult, run_trial

_LAZY = {
    "DEFAULT_STORAGE": "_study",
    "PlanSearch": "_study",
    "SearchConfig": "_study",
    "best_plan": "_study",
    "best_trial": "_study",
    "create_sampler": "_study",
    "load_search": "_study",
    "ranked_trials": "_study",
    "resolve_plan_spec": "_study",
    "run_search": "_study",
    "strategy_from_study": "_study",
    "trial_plan": "_study",
    "ModelInfo": "_probe",
    "probe_model": "_probe",
}

__all__ = [
    "DEFAULT_MAX_PLANS",
    "DEFAULT_STORAGE",
    "Fingerprint",
    "FingerprintMismatch",
    "ModelInfo",
    "PlanSearch",
    "PlanSpace",
    "SearchConfig",
    "TrialConfig",
    "TrialResult",
    "best_plan",
    "best_trial",
    "check_fingerprint",
    "count_plans",
    "create_sampler",
    "describe_plan",
    "enumerate_plans",
    "load_search",
    "params_from_plan",
    "plan_from_params",
    "probe_model",
    "ranked_trials",
    "resolve_plan_spec",
    "run_search",
    "run_trial",
    "strategy_from_study",
    "trial_plan",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
