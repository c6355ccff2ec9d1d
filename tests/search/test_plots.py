"""``search plot``: the history, samples/s per plan with its spread, predicted vs measured step time,
as HTML and PNG, from a study built in SQLite without running a trial."""

from __future__ import annotations

import json
import re
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, IntDistribution
from optuna.trial import TrialState

from dapple_lightning.plan import Plan
from dapple_lightning.search import params_from_plan
from dapple_lightning.search._cli import main as cli

pytest.importorskip("plotly", reason="search plot needs plotly: pip install 'dapple-lightning[plots]'")

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")

DP = Plan.data_parallel(6, 2, 2)
PIPE4 = Plan.straight(6, 2, micro_batches=4)
PIPE2 = Plan.straight(6, 2, micro_batches=2)
# (plan, samples/s, median step s, spread, predicted step s): in trial order.
TRIALS = [
    (DP, 100.0, 0.080, 0.05, None),
    (PIPE4, 312.5, 0.0256, 0.02, 0.0240),
    (PIPE2, 200.0, 0.040, None, 0.0300),
    (PIPE4, 250.0, 0.032, 0.04, None),  # the same plan again, slower: the plan's median counts
]


def _distributions(params):
    return {
        k: CategoricalDistribution(["dapple", "gpipe"])
        if k == "schedule"
        else CategoricalDistribution([1, 2, 4, 8])
        if k == "micro_batches"
        else IntDistribution(0, 10)
        for k in params
    }


def _study(storage: str, name: str, predictions: bool = True) -> optuna.Study:
    study = optuna.create_study(storage=storage, study_name=name, direction="maximize")
    for plan, speed, step, spread, predicted in TRIALS:
        attrs = {"plan": plan.to_dict(), "plan_str": plan.describe(), "samples_per_s": speed, "median_step_s": step}
        if spread is not None:
            attrs["spread"] = spread
        if predicted is not None and predictions:
            attrs |= {"predicted_step_s": predicted, "source": "planner"}
        params = params_from_plan(plan)
        trial = optuna.trial.create_trial(
            params=params, distributions=_distributions(params), values=[speed], user_attrs=attrs
        )
        study.add_trial(trial)
    failed = {"plan": PIPE2.to_dict(), "fail_reason": "oom"}
    study.add_trial(optuna.trial.create_trial(state=TrialState.FAIL, user_attrs=failed))
    return study


def _figure(html: str) -> list[dict]:
    """The data traces plotly wrote into the HTML (``Plotly.newPlot(id, DATA, LAYOUT, ...)``)."""
    match = re.search(r"Plotly\.newPlot\(\s*\"[^\"]+\",\s*(\[.*?\]),\s*\{", html, re.S)
    assert match, "no Plotly.newPlot call in the HTML"
    return json.loads(match.group(1))


def _png_renders(tmp_path: Path) -> str | None:
    """Why kaleido cannot render a PNG here, or ``None`` when it can."""
    try:
        import plotly.graph_objects as go

        go.Figure(go.Scatter(x=[0, 1], y=[0, 1])).write_image(tmp_path / "probe.png")
    except Exception as e:
        return f"kaleido cannot render here ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
    return None


def test_plot_writes_history_plans_and_predicted_as_html_and_png(tmp_path, capsys):
    storage = f"sqlite:///{tmp_path / 'plots.db'}"
    _study(storage, "s")
    out = tmp_path / "plots"
    assert cli(["plot", "--storage", storage, "--study", "s", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for name in ("history", "plans", "predicted"):
        assert (out / f"{name}.html").is_file() and f"wrote {out / name}.html" in printed
    assert (out / "plotly.min.js").is_file()  # the HTML opens without a network

    history = _figure((out / "history.html").read_text())
    assert history[0]["x"] == [0, 1, 2, 3] and history[0]["y"] == [100.0, 312.5, 200.0, 250.0]
    assert history[1]["name"] == "best so far" and history[1]["y"] == [100.0, 312.5, 312.5, 312.5]

    (bars,) = _figure((out / "plans.html").read_text())
    assert bars["x"] == [PIPE4.describe(), PIPE2.describe(), DP.describe()]  # the highest median first
    assert bars["y"] == [281.25, 200.0, 100.0]
    # The spreads the choice tells plans apart by: how far PIPE4's two runs disagree (half their range
    # over their median), the 3% assumed where nothing was measured, DP's step times' 5%.
    assert bars["error_y"]["array"] == pytest.approx([31.25, 6.0, 5.0])
    assert bars["customdata"][0] == [1, "1, 3"]  # its first trial, and every trial of the plan

    points, diagonal = _figure((out / "predicted.html").read_text())
    assert points["text"] == ["trial 1", "trial 2"]
    assert points["x"] == [0.0240, 0.0300] and points["y"] == [0.0256, 0.040]
    assert diagonal["name"] == "measured = predicted"

    reason = _png_renders(tmp_path)
    if reason is not None:
        assert "PNG skipped" in printed  # said, not crashed
        pytest.skip(reason)
    for name in ("history", "plans", "predicted"):
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_writes_the_html_and_says_why_when_png_fails(tmp_path, capsys, monkeypatch):
    import plotly.io

    def no_browser(*args, **kwargs):
        raise RuntimeError("Kaleido requires Google Chrome to be installed.")

    monkeypatch.setattr(plotly.io, "write_images", no_browser, raising=False)
    monkeypatch.setattr(plotly.io, "write_image", no_browser)
    storage = f"sqlite:///{tmp_path / 'plots.db'}"
    _study(storage, "s")
    out = tmp_path / "plots"
    assert cli(["plot", "--storage", storage, "--study", "s", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "PNG skipped (RuntimeError: Kaleido requires Google Chrome to be installed.)" in printed
    assert "apt-get install chromium" in printed
    assert (out / "plans.html").is_file() and not list(out.glob("*.png"))


def test_plot_says_when_no_trial_has_a_prediction(tmp_path, capsys):
    storage = f"sqlite:///{tmp_path / 'plots.db'}"
    _study(storage, "s", predictions=False)
    out = tmp_path / "plots"
    assert cli(["plot", "--storage", storage, "--study", "s", "--out", str(out), "--no-png"]) == 0
    printed = capsys.readouterr().out
    assert "no trial has both a predicted and a measured step time" in printed
    assert not (out / "predicted.html").exists() and (out / "history.html").is_file()
    assert not list(out.glob("*.png"))


def test_plot_of_a_study_without_measurements_says_so(tmp_path, capsys):
    storage = f"sqlite:///{tmp_path / 'plots.db'}"
    optuna.create_study(storage=storage, study_name="empty", direction="maximize")
    assert cli(["plot", "--storage", storage, "--study", "empty", "--out", str(tmp_path / "plots")]) == 1
    assert "has no measured trial yet" in capsys.readouterr().out


def test_plot_of_a_study_of_chunked_plans_only_slices_by_their_own_parameters(tmp_path, capsys):
    storage = f"sqlite:///{tmp_path / 'plots.db'}"
    study = optuna.create_study(storage=storage, study_name="chunks", direction="maximize")
    for plan, speed in ((Plan.chunked(6, "1:1", layout="v", micro_batches=4), 90.0), (Plan.chunked(6, "1:1"), 80.0)):
        attrs = {"plan": plan.to_dict(), "plan_str": plan.describe(), "samples_per_s": speed, "median_step_s": 0.1}
        params = params_from_plan(plan)
        distributions = {
            k: CategoricalDistribution(["zb-v", "interleaved"]) if k == "schedule" else IntDistribution(0, 10)
            for k in params
        }
        study.add_trial(
            optuna.trial.create_trial(params=params, distributions=distributions, values=[speed], user_attrs=attrs)
        )
    out = tmp_path / "plots"
    assert cli(["plot", "--storage", storage, "--study", "chunks", "--out", str(out), "--no-png"]) == 0
    html = (out / "slice.html").read_text()
    assert "zb-v_micro_batches" in html and "interleaved_micro_batches" in html and "chunks" in html
