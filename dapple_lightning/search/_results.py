"""Using a study's result: its best plan, any trial's plan, and the ``optuna://`` plan spec.

This is the side of the search that training runs use, after (or while) a search runs::

    strategy = strategy_from_study("sqlite:///dapple_search.db", "gpt")
    plan = resolve_plan_spec("optuna://sqlite:///dapple_search.db?study=gpt")  # a Plan

The strategy itself knows nothing of studies: a config that names its plan with ``optuna://`` is
resolved here before the strategy is built (the examples' ``make_trainer`` does).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import optuna
from optuna.trial import FrozenTrial, TrialState

from dapple_lightning.plan import Plan
from dapple_lightning.search._choice import (
    choice_lines,
    choose_plan,
    no_completed_trial,
    throughput_study,
    trial_plan,
)
from dapple_lightning.search._config import DEFAULT_STORAGE
from dapple_lightning.search._redact import cause, redact, storage_error
from dapple_lightning.search._space import describe_plan
from dapple_lightning.trials import Fingerprint, check_fingerprint

if TYPE_CHECKING:
    from dapple_lightning.strategy import DappleStrategy

__all__ = [
    "STUDY_SCHEME",
    "best_choice",
    "best_plan",
    "best_trial",
    "explain_choice",
    "load_search",
    "ranked_trials",
    "resolve_plan_spec",
    "strategy_from_study",
]

STUDY_SCHEME = "optuna://"


def _storage_hint(storage: str) -> str:
    try:
        names = optuna.get_all_study_names(storage)
    except Exception:  # the storage itself may be the problem
        return ""
    return f" (studies there: {', '.join(names)})" if names else " (it holds no study)"


def load_search(storage: str, study_name: str) -> optuna.Study:
    """Open an existing study.

    Raises:
        ValueError: When the storage has no such study (the message lists the ones it has), or
            cannot be opened. Messages show the URL with its password masked.
    """
    try:
        return optuna.load_study(study_name=study_name, storage=storage)
    except KeyError as e:
        raise ValueError(f"no study {study_name!r} in {redact(storage)}{_storage_hint(storage)}") from e
    except Exception as e:  # the storage itself: unreachable, refused, not a database
        raise storage_error(storage, e) from cause(e, storage)


def ranked_trials(study: optuna.Study) -> list[FrozenTrial]:
    """Completed trials, best first by the first objective (samples/s for the search's own studies);
    for a multi-objective study only the Pareto front."""
    if len(study.directions) > 1:
        trials = list(study.best_trials)
    else:
        trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    sign = -1.0 if study.directions[0] == optuna.study.StudyDirection.MAXIMIZE else 1.0
    return sorted(trials, key=lambda t: sign * t.values[0])


def best_choice(study: optuna.Study) -> tuple[FrozenTrial, str | None]:
    """The trial to train with (the chosen plan's first measurement), and a note when the choice is not
    simply the fastest plan: see :func:`choose_plan` for the rule and :class:`Choice` for the numbers.

    A study that does not maximize one throughput (a Pareto front, a minimized loss) keeps Optuna's
    own best trial (:func:`best_trial`), without a note.

    Raises:
        ValueError: When no trial has completed yet.
    """
    if not throughput_study(study):
        return best_trial(study), None
    choice = choose_plan(study)
    return choice.chosen.trial, choice.note


def explain_choice(spec: str, samples_per_s: float | None = None) -> str:
    """What the study named by ``spec`` (``optuna://STORAGE?study=NAME``) measured and chose, for
    printing after training with it; with this run's ``samples_per_s``, how that compares with the
    study's data parallelism."""
    storage, params = _split_study_query(spec.strip()[len(STUDY_SCHEME) :])
    study = load_search(storage, params["study"])
    name = params["study"]
    if not throughput_study(study):
        best = best_trial(study)
        return redact(f"plan search {name!r}: trial {best.number}, {describe_plan(trial_plan(best, study))}", storage)
    choice = choose_plan(study)
    first, *rest = choice_lines(choice)
    lines = [f"plan search {name!r}: {first}", *rest]
    dp = choice.data_parallel
    if samples_per_s is not None and dp is not None:
        runs = f"{len(dp.trials)} run{'s' if len(dp.trials) > 1 else ''}"
        lines.append(
            f"this run: {samples_per_s:.1f} samples/s with the chosen plan (measured {choice.chosen.figure()}), "
            f"{samples_per_s / dp.samples_per_s:.2f}x data parallelism's {dp.figure()} (trial {dp.number}, {runs})"
        )
    return redact("\n".join(lines), storage)


def best_trial(study: optuna.Study) -> FrozenTrial:
    """The fastest completed trial, one measurement (for a multi-objective study: the fastest of the
    Pareto front); the plan to train with is :func:`best_choice`'s.

    Raises:
        ValueError: When no trial has completed yet.
    """
    ranked = ranked_trials(study)
    if not ranked:
        raise no_completed_trial(study)
    return ranked[0]


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
    if fingerprint is not None:
        check_fingerprint(
            study.user_attrs.get("fingerprint"), fingerprint, study_name=study.study_name, allow_mismatch=allow_mismatch
        )
    return trial_plan(best_choice(study)[0], study)


def strategy_from_study(
    storage: str = DEFAULT_STORAGE,
    study_name: str = "dapple",
    *,
    fingerprint: Fingerprint | Mapping[str, Any] | None = None,
    allow_mismatch: bool = False,
    **strategy_kwargs: Any,
) -> DappleStrategy:
    """A :class:`~dapple_lightning.DappleStrategy` that trains with a study's best plan.

    The one way to train with a search's result from Python; a config names the same plan as
    ``plan: optuna://STORAGE_URL?study=NAME`` (see :func:`resolve_plan_spec`). ``fingerprint``
    (of the model and cluster you train on) refuses a study made for another setup unless
    ``allow_mismatch``. ``strategy_kwargs`` go to ``DappleStrategy`` (``start_method``,
    ``timeout``, ...); the strategy still checks, when training starts, that the plan fits the
    model's layers and the Trainer's devices.
    """
    from dapple_lightning.strategy import DappleStrategy

    plan = best_plan(storage, study_name, fingerprint, allow_mismatch=allow_mismatch)
    return DappleStrategy(plan, **strategy_kwargs)


def resolve_plan_spec(spec: Any) -> Any:
    """Turn ``"optuna://STORAGE_URL?study=NAME[&trial=N]"`` into that study's best plan (or trial ``N``'s).

    Anything else is returned unchanged, so every plan argument can pass through it before a
    strategy is built (the strategy itself does not know the scheme).
    ``study=`` (and ``trial=``) must come last: what precedes them is the storage URL, query
    included (``optuna://postgresql://u@h/db?sslmode=require&study=gpt``). Examples::

        resolve_plan_spec("optuna://sqlite:///dapple_search.db?study=gpt")
        resolve_plan_spec("optuna://sqlite:////abs/path/search.db?study=gpt&trial=12")

    A password in the URL is masked in every message. A config that Hydra saves (``.hydra/``)
    should not spell it out: ``optuna://postgresql://user:${oc.env:DAPPLE_DB_PASSWORD}@host/db?study=gpt``
    is saved as written and resolved when the app reads ``cfg.plan``.
    """
    if not isinstance(spec, str) or not spec.strip().startswith(STUDY_SCHEME):
        return spec
    body = spec.strip()[len(STUDY_SCHEME) :]
    shown = redact(spec.strip())  # the spec as messages show it: the URL's password masked
    storage, params = _split_study_query(body)
    if "study" not in params:
        raise ValueError(
            f"plan spec {shown!r} names no study; write {STUDY_SCHEME}STORAGE_URL?study=NAME "
            f"(e.g. {STUDY_SCHEME}{DEFAULT_STORAGE}?study=dapple)"
        )
    if "://" not in storage:
        raise ValueError(
            f"plan spec {shown!r}: {redact(storage)!r} is not an Optuna storage URL like {DEFAULT_STORAGE!r}"
        )
    if "trial" in params:
        study = load_search(storage, params["study"])
        try:
            number = int(params["trial"])
            trial = study.trials[number]
        except (ValueError, IndexError) as e:
            raise ValueError(f"plan spec {shown!r}: study {params['study']!r} has no trial {params['trial']!r}") from e
        if trial.state != TrialState.COMPLETE:
            raise ValueError(f"plan spec {shown!r}: trial {number} is {trial.state.name}, not COMPLETE")
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
                    raise ValueError(
                        f"unknown parameter {key!r} after study= in {redact(body)!r}; only trial= may follow"
                    )
                params[key] = unquote(value)
            return storage, params
    return body, {}
