"""The trials of a study as text: the rows and the aligned tables the CLI prints."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

import optuna

from dapple_lightning.planner import format_bytes
from dapple_lightning.search._bookkeeping import CONFIRMS, interrupted_trials
from dapple_lightning.search._choice import Choice
from dapple_lightning.search._space import describe_plan

__all__ = ["clip", "format_table", "plan_rows", "trial_rows"]


def clip(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _format_bytes(n: float | None) -> str:
    return "-" if n is None or (isinstance(n, float) and math.isnan(n)) else format_bytes(n)


def trial_rows(study: optuna.Study) -> list[dict[str, str]]:
    """One row per trial, as the CLI's ``trials`` table shows them."""
    interrupted = interrupted_trials(study)
    rows = []
    for t in study.get_trials(deepcopy=False):
        a = t.user_attrs
        reason = a.get("fail_reason") or ("interrupted" if t.number in interrupted else "")
        if a.get("duplicate_of") is not None:
            reason = f"same plan as trial {a['duplicate_of']}" + (f"; {reason}" if reason else "")
        if a.get(CONFIRMS) is not None:
            reason = f"measures trial {a[CONFIRMS]}'s plan again" + (f"; {reason}" if reason else "")
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


def plan_rows(choice: Choice, study: optuna.Study) -> list[dict[str, str]]:
    """One row per measured plan, the highest median first, as the CLI's ``best`` table shows them:
    the median samples/s with its spread, each run, the median step time, and the first trial's
    memory and source."""
    first = {r["trial"]: r for r in trial_rows(study)}
    rows = []
    for place, r in enumerate(choice.ranked, start=1):
        steps = [
            t.user_attrs["median_step_s"] for t in r.trials if isinstance(t.user_attrs.get("median_step_s"), float)
        ]
        rows.append(
            {
                "#": str(place),
                "trial": str(r.number),
                "plan": describe_plan(r.plan) + ("  <- chosen" if r is choice.chosen else ""),
                "samples/s": r.figure(),
                "runs": " ".join(f"{t.values[0]:.1f}" for t in r.trials),
                "step s": f"{statistics.median(steps):.3f}" if steps else "-",
                **{k: first[str(r.number)][k] for k in ("peak mem/rank", "source")},
            }
        )
    return rows


def format_table(rows: Sequence[Mapping[str, str]]) -> str:
    """Rows as an aligned text table, the first row's keys as its columns (cells longer than 70
    characters are clipped)."""
    if not rows:
        return "(none)"
    columns = list(rows[0].keys())
    cells = [[clip(str(r.get(c, "")), 70) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)
