"""Using a study's result: its best plan, any trial's plan, and the ``optuna://`` plan spec.

This is the side of the search that training runs use, after (or while) a search runs::

    strategy = strategy_from_study("sqlite:///dapple_search.db", "gpt")
    plan = resolve_plan_spec("optuna://sqlite:///dapple_search.db?study=gpt")  # a Plan

The strategy itself knows nothing of studies: a config that names its plan with ``optuna://`` is
resolved here before the strategy is built (the examples' ``make_trainer`` does).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import optuna
from optuna.trial import FrozenTrial, TrialState

from dapple_lightning.plan import Plan
from dapple_lightning.search._config import DEFAULT_STORAGE
from dapple_lightning.search._fingerprint import Fingerprint, check_fingerprint
from dapple_lightning.search._redact import cause, redact, storage_error
from dapple_lightning.search._space import describe_plan, plan_from_params

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
    "trial_plan",
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


MIN_SPREAD = 0.03
"""Relative measurement spread assumed for a trial that recorded none (or less)."""


def relative_spread(step_times: Sequence[float]) -> float | None:
    """Half the interquartile range of ``step_times`` over their median (``None`` for fewer than 4)."""
    if len(step_times) < 4:
        return None
    q1, median, q3 = statistics.quantiles(step_times, n=4)
    return (q3 - q1) / 2 / median if median > 0 else None


def spread(trial: FrozenTrial) -> float:
    """The trial's relative measurement spread (half the interquartile range of its step times over
    their median), at least :data:`MIN_SPREAD`."""
    value = trial.user_attrs.get("spread")
    return max(float(value), MIN_SPREAD) if isinstance(value, int | float) else MIN_SPREAD


def best_choice(study: optuna.Study) -> tuple[FrozenTrial, str | None]:
    """The trial to train with, and a note when the fastest one could not be told apart from data parallelism.

    The fastest completed trial, unless data parallelism was measured within the two trials'
    spreads of it: then the difference is noise and data parallelism, the simpler plan, is chosen.

    Raises:
        ValueError: When no trial has completed yet.
    """
    leader = best_trial(study)
    if len(study.directions) > 1 or study.directions[0] != optuna.study.StudyDirection.MAXIMIZE:
        return leader, None
    dp = next((t for t in ranked_trials(study) if trial_plan(t, study).num_stages == 1), None)
    if dp is None or dp.number == leader.number:
        return leader, None
    noise = spread(leader) + spread(dp)
    lead = leader.values[0] / dp.values[0] - 1
    if lead > noise:
        return leader, None
    note = (
        f"trial {leader.number} ({describe_plan(trial_plan(leader, study))}, {leader.values[0]:.1f}) leads data "
        f"parallelism (trial {dp.number}, {dp.values[0]:.1f}) by {lead:+.1%}, within the measurements' spread "
        f"({noise:.1%}): they cannot be told apart, so the simpler plan, data parallelism, is chosen"
    )
    return dp, note


def explain_choice(spec: str, samples_per_s: float | None = None) -> str:
    """What the study named by ``spec`` (``optuna://STORAGE?study=NAME``) measured and chose, for
    printing after training with it; with this run's ``samples_per_s``, how that compares with the
    study's data-parallel trial."""
    storage, params = _split_study_query(spec.strip()[len(STUDY_SCHEME) :])
    study = load_search(storage, params["study"])
    chosen, note = best_choice(study)
    ranked = ranked_trials(study)
    lines = [f"plan search {params['study']!r}: {len(ranked)} trials measured, fastest first"]
    for t in ranked[:6]:
        mark = "  <- chosen" if t.number == chosen.number else ""
        plan = describe_plan(trial_plan(t, study))
        lines.append(f"  trial {t.number:>3}  {t.values[0]:8.1f} samples/s +-{spread(t):.0%}  {plan}{mark}")
    if note:
        lines.append(f"  {note}")
    dp = next((t for t in ranked if trial_plan(t, study).num_stages == 1), None)
    if samples_per_s is not None and dp is not None:
        ratio = samples_per_s / dp.values[0]
        lines.append(
            f"this run: {samples_per_s:.1f} samples/s with the chosen plan, {ratio:.2f}x data parallelism's "
            f"{dp.values[0]:.1f} samples/s (trial {dp.number})"
        )
    elif dp is None:
        lines.append("  data parallelism was not measured in this study")
    return redact("\n".join(lines), storage)


def best_trial(study: optuna.Study) -> FrozenTrial:
    """The fastest completed trial (for a multi-objective study: the fastest of the Pareto front).

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
