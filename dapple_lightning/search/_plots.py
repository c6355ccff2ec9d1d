"""Pictures of a study (``search plot``): how the search went, what each plan measured, how good the planner's guesses were.

Three figures, each written as HTML (plotly, interactive, opens offline) and PNG (kaleido):

- ``history``: every measured trial's samples/s in trial order, and the best so far;
- ``plans``: each plan's measured samples/s (the median of its runs, as the choice ranks plans),
  the highest first, with the spread the choice tells plans apart by as error bars (``_choice``:
  its trials' step-time spread, or how far its runs disagree, whichever is larger);
- ``predicted``: the planner's predicted step time against the measured one, for the trials that
  have both (the planner's seeds), beside the line where they agree.

Optuna's own views of the study come along as HTML and PNG too: the parameters' slices and
importances, the intermediate values, the Pareto front of a two-objective study.

PNG needs kaleido, and kaleido 1.x a Chrome or Chromium on the machine (Debian: ``apt-get install
chromium``; or ``plotly_get_chrome``). Without them the HTML is written and the output says why
the PNGs were skipped.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from dapple_lightning.search._choice import plan_results
from dapple_lightning.search._space import describe_plan

__all__ = ["plot_study"]

_NO_PREDICTIONS = (
    "no trial has both a predicted and a measured step time (predictions come with the planner's seeds, "
    "--planner-seeds K): predicted.html not written"
)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _measured(study: optuna.Study) -> list[FrozenTrial]:
    """Completed trials that measured samples/s themselves (not answered from another's measurement)."""
    return [
        t
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if _number(t.user_attrs.get("samples_per_s")) is not None and t.user_attrs.get("duplicate_of") is None
    ]


def _plan_label(trial: FrozenTrial) -> str:
    a = trial.user_attrs
    if a.get("plan_str"):
        return str(a["plan_str"])
    if isinstance(a.get("plan"), dict):
        return describe_plan(a["plan"])
    return f"trial {trial.number}"


def _history(go: Any, trials: list[FrozenTrial]) -> Any:
    numbers = [t.number for t in trials]
    speeds = [float(t.user_attrs["samples_per_s"]) for t in trials]
    fig = go.Figure()
    fig.add_scatter(
        x=numbers,
        y=speeds,
        mode="markers",
        name="trial",
        text=[_plan_label(t) for t in trials],
        hovertemplate="trial %{x}: %{y:.1f} samples/s<br>%{text}<extra></extra>",
    )
    best_so_far = list(itertools.accumulate(speeds, max))
    fig.add_scatter(x=numbers, y=best_so_far, mode="lines", line_shape="hv", name="best so far")
    fig.update_layout(title="Optimisation history", xaxis_title="trial", yaxis_title="samples/s")
    return fig


def _plans(go: Any, study: optuna.Study) -> Any:
    results = plan_results(study)
    fig = go.Figure(
        go.Bar(
            x=[describe_plan(r.plan) for r in results],
            y=[r.samples_per_s for r in results],
            error_y={"type": "data", "array": [r.samples_per_s * r.spread for r in results], "visible": True},
            customdata=[[r.number, ", ".join(str(t.number) for t in r.trials)] for r in results],
            hovertemplate="%{x}<br>%{y:.1f} ± %{error_y.array:.1f} samples/s (median; first trial %{customdata[0]})"
            "<br>trials %{customdata[1]}<extra></extra>",
        )
    )
    fig.update_layout(
        title="Measured samples/s per plan (the median of its runs; error bars: the spread that tells plans apart)",
        xaxis_title="plan",
        yaxis_title="samples/s",
    )
    return fig


def _predicted(go: Any, study: optuna.Study) -> Any | None:
    pairs = [
        (t.number, p, m, _plan_label(t))
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if (p := _number(t.user_attrs.get("predicted_step_s"))) is not None
        and (m := _number(t.user_attrs.get("median_step_s"))) is not None
    ]
    if not pairs:
        return None
    fig = go.Figure()
    fig.add_scatter(
        x=[p for _, p, _, _ in pairs],
        y=[m for _, _, m, _ in pairs],
        mode="markers+text",
        text=[f"trial {n}" for n, _, _, _ in pairs],
        textposition="top center",
        customdata=[label for *_, label in pairs],
        name="trial",
        hovertemplate="%{text}: predicted %{x:.4g} s, measured %{y:.4g} s<br>%{customdata}<extra></extra>",
    )
    edge = [0.0, max(max(p, m) for _, p, m, _ in pairs) * 1.1]
    fig.add_scatter(x=edge, y=edge, mode="lines", line={"dash": "dot"}, name="measured = predicted")
    fig.update_layout(
        title="Predicted vs measured step time", xaxis_title="predicted s/step", yaxis_title="measured s/step"
    )
    return fig


def _optuna_figures(study: optuna.Study, say: Callable[[str], None]) -> dict[str, Any]:
    """Optuna's own views of the study."""
    vis = optuna.visualization
    figures: dict[str, Any] = {}
    if len(study.directions) > 1:
        figures["pareto_front"] = vis.plot_pareto_front(study, target_names=["samples/s", "peak bytes"])
        target: dict[str, Any] = {"target": lambda t: t.values[0], "target_name": "samples/s"}
    else:
        figures["intermediate_values"] = vis.plot_intermediate_values(study)
        target = {"target_name": "samples/s"}
    # The plan's shape, as far as the trials have it: chunked plans name their own micro-batch counts.
    seen = {name for t in study.get_trials(deepcopy=False) for name in t.params}
    shape = ["micro_batches", "stages", "schedule", "chunks", *sorted(n for n in seen if n.endswith("_micro_batches"))]
    if params := [name for name in shape if name in seen]:
        figures["slice"] = vis.plot_slice(study, params=params, **target)
    try:
        figures["importances"] = vis.plot_param_importances(study, **target)
    except (ValueError, RuntimeError) as e:  # too few completed trials
        say(f"skipping parameter importances: {e}")
    return figures


def _write_png(figures: dict[str, Any], out: Path, say: Callable[[str], None]) -> None:
    """The PNGs, with one browser for all of them; on any failure, say why and go on."""
    import plotly.io as pio

    paths = [out / f"{name}.png" for name in figures]
    try:
        pio.write_images(list(figures.values()), paths)  # one kaleido session for every figure
    except Exception as e:  # kaleido or its browser missing or broken: the HTML is what matters
        reason = " ".join(str(e).split())[:300] or type(e).__name__
        say(
            f"PNG skipped ({type(e).__name__}: {reason}); it needs kaleido (pip install kaleido) and, for "
            "kaleido 1.x, Chrome or Chromium (apt-get install chromium, or plotly_get_chrome)"
        )
        return
    for path in paths:
        say(f"wrote {path}")


def plot_study(study: optuna.Study, out: Path, *, png: bool = True, say: Callable[[str], None] = print) -> int:
    """Write the study's figures into ``out`` (HTML, and PNG when ``png`` and kaleido can); 0, or 1
    when no trial has measured anything yet.

    The HTML files share one ``plotly.min.js`` in ``out``, so they open without a network.
    """
    import plotly.graph_objects as go

    trials = _measured(study)
    if not trials:
        say(f"study {study.study_name!r} has no measured trial yet: nothing to plot")
        return 1
    out.mkdir(parents=True, exist_ok=True)
    figures: dict[str, Any] = {"history": _history(go, trials), "plans": _plans(go, study)}
    predicted = _predicted(go, study)
    if predicted is None:
        say(_NO_PREDICTIONS)
    else:
        figures["predicted"] = predicted
    figures.update(_optuna_figures(study, say))
    for name, fig in figures.items():
        path = out / f"{name}.html"
        fig.write_html(str(path), include_plotlyjs="directory")
        say(f"wrote {path}")
    if png:
        _write_png(figures, out, say)
    return 0
