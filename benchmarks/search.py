"""Search benchmark: the seeded Optuna plan search against the exhaustive grid of plans.

For each model, on ``--devices`` CPU processes (4 by default, one thread each):

1. **Grid.** Every plan of the space is measured as the search measures a trial: fresh processes,
   ``--warmup`` untimed steps, the median of ``--steps`` timed steps, samples/s. Each pass runs as
   ``PlanSearch(sampler="grid")`` into ``--db`` (a study per model and pass), so an interrupted
   benchmark resumes where it stopped; each pass measures the plans in another seeded random
   order, so a drift in the machine's load does not line up with one region of the space. The
   ground truth is each plan's mean over ``--passes`` passes; the pass-to-pass difference is the
   noise figure.
2. **Planner.** The model is profiled in a child process (as the search does) and the planner's
   best plans within the space are looked up in the grid: the rank of its first pick.
3. **Replay.** Each sampler runs against the ground truth, once per seed (``--seeds``), in
   ``PlanSearch``'s loop: ``tpe+planner`` (the default: TPE with the planner's top 3 plans queued
   first, after the baselines the real search queues; the planner's cluster shares this
   machine's cores, ``search.compute_units``), ``tpe`` alone, and ``random``. Counted:
   distinct plans measured before one is within 3% of the grid's best (a repeated proposal reuses
   the earlier result at no cost), and again within the tolerance the grid's noise supports (the
   standard error of a plan's ground truth, see :func:`noise_tolerance`). Random order
   without replacement needs ``(N + 1) / (k + 1)`` plans on average when ``k`` of ``N`` qualify.
4. **Live.** One real seeded search (``PlanSearch`` defaults, median pruner included) with a
   budget of 30% of the grid, its choices judged by the ground truth.

The replay isolates the sampler from measurement noise; the live search shows the whole loop,
noise included, once.

The models (``benchmarks/search_models.py``): the runtime benchmark's transformer (embedding +
8 ``TransformerEncoderLayer(256, 4, 1024)`` + head) and a VGG-style CNN (4 conv blocks + Flatten
+ 2 hidden FC + classifier). The space: schedule ``dapple``, ``M`` in ``--micro-batches``, at most
``--max-stages`` stages, any cut and any replica split.

    python benchmarks/search.py                          # defaults, see --help (grid times: docs/benchmarks.md)
    python benchmarks/search.py --passes 1               # one grid pass: half the time, noisier ground truth
    python benchmarks/search.py --quick                  # smoke run (CNN, 22 plans), minutes
    python benchmarks/search.py --write-docs             # also update docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna

from dapple_lightning.plan import Plan
from dapple_lightning.search import (
    PlanSearch,
    PlanSpace,
    RepeatGuard,
    SearchConfig,
    TrialConfig,
    baseline_plans,
    compute_units,
    create_sampler,
    describe_plan,
    planner_seeds,
    trial_plan,
)
from dapple_lightning.trials import probe_model

ROOT = Path(__file__).resolve().parents[1]
# Trial processes import the factories as benchmarks.search_models, from wherever this runs.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)

SECTION = "## Search: Optuna vs exhaustive grid"
WITHIN = 0.97  # "within 3% of the grid's best"


@dataclass(frozen=True)
class Model:
    name: str
    factory: str
    kwargs: dict[str, Any]
    global_batch: int
    description: str


MODELS = {
    "transformer": Model(
        "transformer",
        "benchmarks.search_models:transformer",
        {"seq": 32},
        16,
        "embedding 512x256 + 8 TransformerEncoderLayer(256, 4, 1024) + head; batch 16, sequence 32 "
        "(the runtime benchmark's 64 x 64 would take 8x longer per step)",
    ),
    "vgg": Model(
        "vgg",
        "benchmarks.search_models:vgg",
        {},
        64,
        "4 VGG blocks (32-64-128-256 channels, 32x32 images) + Flatten + 2 FC(1024) + classifier; batch 64",
    ),
}


def measured(study: optuna.Study) -> dict[Plan, float]:
    """Plan -> samples/s of every completed trial (the first measurement of a plan wins)."""
    table: dict[Plan, float] = {}
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        if t.user_attrs.get("duplicate_of") is None:
            table.setdefault(trial_plan(t, study), t.values[0])
    return table


def noise_tolerance(median_rel_diff: float) -> float:
    """How far below the grid's best a plan may be and still be indistinguishable from it: the
    standard error of one plan's ground truth (the mean of two passes).

    With independent normal noise of relative size ``sigma`` per measurement, ``|a - b|`` of two
    passes has median ``0.6745 * sqrt(2) * sigma``; the mean of the two has standard error
    ``sigma / sqrt(2)``, which is the median difference divided by ``2 * 0.6745``. Never below 3%.
    """
    return max(1 - WITHIN, median_rel_diff / (2 * 0.6745))


def replay(
    space: PlanSpace, table: dict[Plan, float], seeds: list[Plan], seed: int, sampler: Any, within: float = WITHIN
) -> int | None:
    """Distinct plans a seeded search measures until one is within ``1 - within`` of the grid's
    best (None: never; 3% by default).

    The loop is ``PlanSearch``'s: the seeds are queued first, a repeated proposal is answered from
    the earlier measurement (no cost) and, ten repeats in a row, a random unmeasured plan is queued.
    """
    best = max(table.values())
    if isinstance(sampler, str):
        sampler = create_sampler(sampler, seed)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    for plan in seeds:
        study.enqueue_trial(space.params(plan), skip_if_exists=True)
    guard = RepeatGuard(seed=seed)
    seen: set[Plan] = set()
    for _ in range(20 * len(table)):
        trial = study.ask()
        plan = space.suggest(trial)
        value = table.get(plan)
        repeat = plan in seen
        seen.add(plan)
        if value is None:  # the plan failed in the grid
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        else:
            study.tell(trial, value)
        if repeat:
            guard.repeated(study, space)
            continue
        guard.measured()
        if value is not None and value >= within * best:
            return len(seen)
        if len(seen) >= space.size:
            break
    return None


def _grid(model: Model, trial: TrialConfig, space_kw: dict[str, Any], args: argparse.Namespace, db: str, i: int):
    name = f"grid-{model.name}" if i == 0 else f"grid-{model.name}-{i + 1}"
    config = SearchConfig(
        trial,
        storage=db,
        study_name=name,
        sampler="grid",
        n_trials=None,
        planner_seeds=0,
        pruner="none",
        baselines=(),  # a grid measures every plan anyway
        confirm_repeats=0,  # one measurement per plan and pass: the passes are the repeats
        seed=args.seed + i,  # each pass measures the plans in another order
        **space_kw,
    )
    print(f"\n=== {model.name}: grid, pass {i + 1} ===", flush=True)
    search = PlanSearch(config)
    study = search.run()
    return search.space, measured(study), _duration(study)


def _duration(study: optuna.Study) -> float:
    """Seconds from the first trial's start to the last one's end (a resumed study reports its real cost)."""
    done = [t for t in study.get_trials(deepcopy=False) if t.datetime_start and t.datetime_complete]
    return (max(t.datetime_complete for t in done) - min(t.datetime_start for t in done)).total_seconds()


def _live(
    model: Model,
    trial: TrialConfig,
    space_kw: dict[str, Any],
    args: argparse.Namespace,
    db: str,
    table: dict[Plan, float],
    ranking: list[Plan],
) -> dict[str, Any]:
    """One real seeded search with a budget of 30% of the grid, judged by the grid's values."""
    best = table[ranking[0]]
    budget = math.ceil(0.3 * len(table))
    print(f"\n=== {model.name}: live seeded search, {budget} measured trials ===", flush=True)
    live_study = PlanSearch(
        SearchConfig(trial, storage=db, study_name=f"live-{model.name}", n_trials=budget, seed=args.seed, **space_kw)
    ).run()
    # Judge the live search's choices by the grid's (averaged) values, not its own noisy ones.
    order: list[Plan] = []
    for t in live_study.trials:
        if "plan" in t.user_attrs and t.user_attrs.get("duplicate_of") is None:
            plan = trial_plan(t, live_study)
            if plan not in order:
                order.append(plan)
    found = measured(live_study)
    top = max(found, key=found.get)
    return {
        "budget": budget,
        "best_plan": describe_plan(top),
        "best_live_samples_per_s": found[top],
        "grid_value_of_that_plan": table.get(top),
        "grid_rank_of_that_plan": ranking.index(top) + 1 if top in table else None,
        "measured_until_within_3pct": next(
            (i + 1 for i, p in enumerate(order) if table.get(p, 0.0) >= WITHIN * best), None
        ),
        "best_grid_rank_measured": min((ranking.index(p) + 1 for p in order if p in table), default=None),
        "seconds": _duration(live_study),
    }


def run_model(model: Model, args: argparse.Namespace, db: str) -> dict[str, Any]:
    trial = TrialConfig(
        model.factory,
        world_size=args.devices,
        global_batch=model.global_batch,
        warmup=args.warmup,
        steps=args.steps,
        model_kwargs=model.kwargs,
        threads_per_rank=1,
        track_memory=False,
        timeout_s=300.0,
    )
    space_kw = {"micro_batches": tuple(args.micro_batches), "schedules": ("dapple",), "max_stages": args.max_stages}
    passes = [_grid(model, trial, space_kw, args, db, i) for i in range(args.passes)]
    space = passes[0][0]
    assert space is not None
    # The ground truth: each plan's mean over the passes (plans that failed in a pass: the others).
    table = {p: statistics.mean(t[p] for _, t, _ in passes if p in t) for p in set().union(*(t for _, t, _ in passes))}
    ranking = sorted(table, key=lambda p: -table[p])
    best = table[ranking[0]]
    good = sum(1 for v in table.values() if v >= WITHIN * best)
    noise: dict[str, Any] = {}
    if len(passes) > 1:
        a, b = passes[0][1], passes[1][1]
        both = [p for p in a if p in b]
        noise = {
            "median_rel_diff": statistics.median(abs(a[p] - b[p]) / ((a[p] + b[p]) / 2) for p in both),
            "best1_rank_in_2": sorted(b, key=lambda p: -b[p]).index(max(a, key=a.get)) + 1,
            "best2_rank_in_1": sorted(a, key=lambda p: -a[p]).index(max(b, key=b.get)) + 1,
        }

    info = probe_model(trial, profile=True)
    picks = planner_seeds(info.profile, space, 3, compute_units(trial)) if info.profile else []
    pick_rank = ranking.index(picks[0].plan) + 1 if picks and picks[0].plan in table else None

    # The default search queues the baselines (what a found plan must beat) and then the planner's picks.
    default_seeds = list(dict.fromkeys([plan for _, plan in baseline_plans(space)] + [p.plan for p in picks]))
    tolerance = noise_tolerance(noise["median_rel_diff"]) if noise else 1 - WITHIN
    results: dict[str, list[int | None]] = {}
    at_noise: dict[str, list[int | None]] = {}
    for label, sampler, seeded in (("tpe+planner", "tpe", True), ("tpe", "tpe", False), ("random", "random", False)):
        seeds = default_seeds if seeded else []
        results[label] = [replay(space, table, seeds, s, sampler) for s in range(args.seeds)]
        at_noise[label] = [replay(space, table, seeds, s, sampler, 1 - tolerance) for s in range(args.seeds)]
    within_noise = sum(1 for v in table.values() if v >= (1 - tolerance) * best)

    live = _live(model, trial, space_kw, args, db, table, ranking) if args.live else {}
    return {
        "model": model.name,
        "description": model.description,
        "num_layers": space.num_layers,
        "grid_size": len(table),
        "space_size": space.size,
        "grid_seconds": [t for _, _, t in passes],
        "noise": noise,
        "best_plan": describe_plan(ranking[0]),
        "best_samples_per_s": best,
        "top5": [(describe_plan(p), table[p]) for p in ranking[:5]],
        "worst": (describe_plan(ranking[-1]), table[ranking[-1]]),
        "within_3pct": good,
        "within_10pct": sum(1 for v in table.values() if v >= 0.9 * best),
        "planner_picks": [(describe_plan(p.plan), table.get(p.plan), p.predicted_step_s) for p in picks],
        "planner_pick_rank": pick_rank,
        "planner_pick_ratio": table[picks[0].plan] / best if pick_rank else None,
        "replay": results,
        "random_expected": (len(table) + 1) / (good + 1),
        "seeds_queued": [describe_plan(p) for p in default_seeds],
        "noise_tolerance": tolerance,
        "within_noise": within_noise,
        "replay_at_noise": at_noise,
        "random_expected_at_noise": (len(table) + 1) / (within_noise + 1),
        "live": live,
    }


def _stats(values: list[int | None], grid: int) -> str:
    hit = [v for v in values if v is not None]
    if not hit:
        return "never"
    within = sum(1 for v in hit if v <= 0.3 * grid)
    med = statistics.median(hit)
    return (
        f"median {med:g} ({100 * med / grid:.0f}%), mean {statistics.mean(hit):.1f}, worst {max(hit)}; "
        f"{within}/{len(values)} seeds within 30%"
    )


def _table_row(r: dict[str, Any]) -> str:
    pick = (
        f"#{r['planner_pick_rank']} ({100 * r['planner_pick_ratio']:.0f}% of best)"
        if r["planner_pick_rank"]
        else "none in the space"
    )
    n = r["noise"]
    noise = (
        f"{100 * n['median_rel_diff']:.0f}% median; pass-1 best is #{n['best1_rank_in_2']} in pass 2"
        if n
        else "one pass"
    )
    grid_time = " + ".join(f"{t / 60:.1f}" for t in r["grid_seconds"]) + " min"
    g = r["grid_size"]
    return (
        f"| {r['model']} | {g} | {grid_time} | {r['best_plan']} ({r['best_samples_per_s']:.1f}) | "
        f"{r['within_3pct']} / {r['within_10pct']} | {noise} | {pick} | {_stats(r['replay']['tpe+planner'], g)} | "
        f"{_stats(r['replay']['tpe'], g)} | {_stats(r['replay']['random'], g)} ({r['random_expected']:.1f}) |"
    )


def _paragraphs(r: dict[str, Any]) -> list[str]:
    top = ", ".join(f"{p} {v:.1f}" for p, v in r["top5"])
    picks = "; ".join(
        f"{p} ({f'{v:.1f}' if v is not None else 'not measured'} samples/s, predicted {s * 1e3:.0f} ms/step)"
        for p, v, s in r["planner_picks"]
    )
    hit = [v for v in r["replay"]["tpe+planner"] if v is not None]
    met = bool(hit) and statistics.median(hit) <= 0.3 * r["grid_size"]
    n = r["noise"]
    rand = [v for v in r["replay"]["random"] if v is not None]
    verdict = (
        f"Target (median plans to within 3% <= 30% of the grid) for the default search: {'met' if met else 'not met'}"
    )
    if hit and rand:
        better = statistics.median(hit) < statistics.median(rand)
        verdict += f"; it needs {'fewer' if better else 'no fewer'} plans than random order (median)"
    if n:
        verdict += (
            f"; the two grid passes differ by {100 * n['median_rel_diff']:.0f}% per plan (median), "
            f"{'far ' if n['median_rel_diff'] > 0.09 else ''}more than the 3% the target asks for"
        )
    tol = r["noise_tolerance"]
    at_noise = [v for v in r["replay_at_noise"]["tpe+planner"] if v is not None]
    met_noise = bool(at_noise) and statistics.median(at_noise) <= 0.3 * r["grid_size"]
    g = r["grid_size"]
    noise_line = (
        f"At the tolerance the noise supports, {100 * tol:.0f}% (the standard error of a plan's ground truth, "
        f"from the passes' median difference; {r['within_noise']} plans qualify): tpe+planner "
        f"{_stats(r['replay_at_noise']['tpe+planner'], g)}; tpe {_stats(r['replay_at_noise']['tpe'], g)}; random "
        f"{_stats(r['replay_at_noise']['random'], g)} (expected {r['random_expected_at_noise']:.1f}). Target (median "
        f"<= 30% of the grid) at that tolerance: {'met' if met_noise else 'not met'}."
    )
    lines = [
        f"**{r['model']}** ({r['description']}; {r['num_layers']} layers). Top 5: {top}. Slowest: "
        f"{r['worst'][0]} {r['worst'][1]:.1f}. Queued first by the default search: "
        f"{', '.join(r['seeds_queued'])}. Planner's top 3 in the space: {picks}. {verdict}.",
        "",
        noise_line,
        "",
    ]
    if r["live"]:
        lv = r["live"]
        lines += [
            f"Live seeded search ({lv['budget']} measured trials, {lv['seconds'] / 60:.1f} min, PlanSearch "
            f"defaults): its best, {lv['best_plan']} at {lv['best_live_samples_per_s']:.1f} samples/s, is "
            f"#{lv['grid_rank_of_that_plan']} in the grid ({lv['grid_value_of_that_plan'] or float('nan'):.1f}); "
            f"the best plan it measured is #{lv['best_grid_rank_measured']} in the grid; plans measured until "
            f"one within 3% of the grid's best: {lv['measured_until_within_3pct'] or 'none within the budget'}.",
            "",
        ]
    return lines


def markdown(report: list[dict[str, Any]], args: argparse.Namespace, command: str) -> str:
    lines = [
        SECTION,
        "",
        f"Command: `{command}` (`benchmarks/search.py`; measured studies in `{args.db}`, resumable).",
        "",
        f"Setup: {args.devices} CPU processes, one thread each, on this shared 2-core machine (the processes "
        f"share the cores: plans rank by what they achieve here, not on {args.devices} real devices). Every "
        f"trial runs in fresh processes: {args.warmup} warm-up + {args.steps} timed steps, samples/s = batch / "
        f"median step. Space: schedule `dapple`, M in {{{', '.join(map(str, args.micro_batches))}}}, at most "
        f"{args.max_stages} stages, every cut and replica split (the grid is the whole space). The grid was "
        f"measured {args.passes} times, each pass in another random order; the ground truth is each plan's mean. "
        "Replay: each sampler runs against that ground truth from "
        f"{args.seeds} seeds, with PlanSearch's loop (planner's top 3 plans first for `tpe+planner`; a repeated "
        'proposal costs no measurement; ten repeats in a row queue a random unmeasured plan). "Plans to within '
        "3%\" counts distinct plans measured until one is within 3% of the grid's best; target: 30% of the grid.",
        "",
        "| model | grid | grid time | best plan (samples/s) | within 3% / 10% | pass-to-pass noise | planner's pick |"
        " tpe+planner | tpe | random (expected) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [_table_row(r) for r in report]
    lines.append("")
    for r in report:
        lines += _paragraphs(r)
    lines += [
        "Reading it: the replay separates the sampler from measurement noise, the live search shows the loop "
        "with it. Where run-to-run noise is as large as the differences between plans, no sampler can do much "
        'better than random order and "within 3%" is partly luck. The planner ranks the space with its cost '
        "model on a cluster whose devices share the machine's cores (`Cluster.compute_units`: cores over a "
        "rank's threads): no step is shorter than all ranks' work over the cores, which is why plans that keep "
        "only two of the four processes busy (one micro-batch through two stages) can beat data parallelism "
        "here. Measurements vary from run to run on this shared machine, so the numbers move between runs of "
        "this command.",
        "",
    ]
    return "\n".join(lines)


def write_docs(section: str) -> Path:
    path = ROOT / "docs" / "benchmarks.md"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start = text.find(SECTION)
    if start >= 0:
        end = text.find("\n## ", start + len(SECTION))
        text = text[:start] + section.rstrip() + "\n" + (text[end:] if end >= 0 else "")
    else:
        text = text.rstrip() + "\n\n" + section.rstrip() + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="transformer,vgg")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--micro-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    parser.add_argument("--max-stages", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--passes", type=int, default=2, help="measure the grid this many times; truth = mean")
    parser.add_argument("--db", default="benchmarks/search.db")
    parser.add_argument("--no-live", dest="live", action="store_false")
    parser.add_argument("--quick", action="store_true", help="the CNN only, M = 2, 2 timed steps, 5 seeds (smoke run)")
    parser.add_argument("--write-docs", action="store_true", help="replace our section of docs/benchmarks.md")
    parser.add_argument("--out", default=None, help="also write the raw results as JSON here")
    args = parser.parse_args()
    if args.quick:
        args.models, args.micro_batches, args.steps, args.seeds, args.passes = "vgg", [2], 2, 5, 1
        args.db = args.db.replace(".db", "-quick.db")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    db = f"sqlite:///{Path(args.db).resolve()}"
    report = [run_model(MODELS[name], args, db) for name in args.models.split(",")]
    command = "python " + " ".join(sys.argv)
    section = markdown(report, args, command)
    print("\n" + section)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    if args.write_docs:
        print(f"updated {write_docs(section)}")


if __name__ == "__main__":
    main()
