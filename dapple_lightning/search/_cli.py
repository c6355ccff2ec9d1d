"""``python -m dapple_lightning.search``: run a plan search, show its trials and its best plans.

::

    # search (re-running the same command resumes the study)
    python -m dapple_lightning.search run --model dapple_lightning.search.testing:mlp \\
        --devices 2 --batch-size 8 --trials 10 --storage sqlite:///dapple_search.db --study mlp
    # the best plans, and the best as a plan YAML for DappleStrategy(plan="best.yaml")
    python -m dapple_lightning.search best --study mlp --export best.yaml
    # every trial: state, plan, samples/s, memory, why it failed
    python -m dapple_lightning.search trials --study mlp
    # history, samples/s per plan, predicted vs measured: HTML and PNG (pip install 'dapple-lightning[plots]')
    python -m dapple_lightning.search plot --study mlp --out plots/

The database is ordinary Optuna storage: ``optuna-dashboard sqlite:///dapple_search.db`` shows the
study live (``pip install optuna-dashboard``). Several ``run`` commands on one study share its
trials (``--storage postgresql://...`` across hosts, a ``--seed`` each); one that dies has its
running trial measured again by another (``--heartbeat``).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any

from dapple_lightning.plan import ALL_SCHEDULES, CHUNKED_SCHEDULES, SCHEDULES
from dapple_lightning.search._files import write_atomic
from dapple_lightning.search._redact import redact

__all__ = ["main"]


def _shower(args: argparse.Namespace) -> Any:
    """``print`` for text that may quote the storage URL: its password masked."""
    return lambda text: print(redact(text, args.storage))


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,2,4, got {text!r}") from e


def _schedules(text: str) -> tuple[str, ...]:
    values = tuple(x.strip() for x in text.split(",") if x.strip())
    for v in values:
        if v not in (*ALL_SCHEDULES, *CHUNKED_SCHEDULES):
            known = ",".join((*ALL_SCHEDULES, *CHUNKED_SCHEDULES))
            raise argparse.ArgumentTypeError(f"unknown schedule {v!r}; choose from {known}")
    return values


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--model-kwargs must be a JSON object: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--model-kwargs must be a JSON object, got {text!r}")
    return value


def _heartbeat(text: str) -> int | None:
    return _whole(text) or None


def _whole(text: str) -> int:
    try:
        value = int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}") from e
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


def _common(p: argparse.ArgumentParser) -> None:
    from dapple_lightning.search import DEFAULT_STORAGE

    p.add_argument("--storage", default=DEFAULT_STORAGE, help="Optuna storage URL (default: %(default)s)")
    p.add_argument("--study", default="dapple", help="study name (default: %(default)s)")


def _parser() -> argparse.ArgumentParser:
    from dapple_lightning.search._config import DEFAULT_HEARTBEAT_S

    parser = argparse.ArgumentParser(
        prog="python -m dapple_lightning.search",
        description="Search DAPPLE plans as hyperparameters: short measured runs in fresh processes, "
        "stored in an Optuna study (open it with optuna-dashboard STORAGE_URL).",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run or resume a search")
    _common(run)
    run.add_argument("--model", required=True, help="model factory module:function (batch_size=B -> module, loader)")
    run.add_argument("--model-kwargs", type=_json_object, default={}, help="JSON object of extra factory arguments")
    run.add_argument("--devices", type=int, required=True, help="ranks every plan runs on")
    run.add_argument("--batch-size", type=int, required=True, help="global batch (samples per optimizer step)")
    run.add_argument(
        "--trials", type=int, default=None, help="finished trials the study should hold (default 20; grid: all)"
    )
    run.add_argument("--timeout", type=float, default=None, help="stop starting trials after this many seconds")
    run.add_argument("--timeout-per-trial", type=float, default=300.0, help="wall-clock limit of one trial (s)")
    run.add_argument("--stall-timeout", type=float, default=None, help="kill a trial when no step ends this long (s)")
    run.add_argument("--warmup", type=int, default=1, help="untimed steps per trial (default: %(default)s)")
    run.add_argument("--steps", type=int, default=3, help="timed steps per trial (default: %(default)s)")
    run.add_argument("--seed", type=int, default=0, help="sampler seed; give each worker of one study its own")
    run.add_argument(
        "--heartbeat",
        type=_heartbeat,
        default=DEFAULT_HEARTBEAT_S,
        help="seconds between a running trial's heartbeats; a trial silent for 3 of them lost its worker "
        "and is run again by another (default: %(default)s; 0: off)",
    )
    run.add_argument("--sampler", choices=("tpe", "random", "grid"), default="tpe")
    run.add_argument("--multi-objective", action="store_true", help="maximize samples/s and minimize peak memory")
    run.add_argument(
        "--micro-batches", type=_ints, default=None, help="counts to search, e.g. 1,2,4,8 (default: divisors of B)"
    )
    run.add_argument("--schedules", type=_schedules, default=SCHEDULES, help="e.g. dapple,gpipe,zb-h2,interleaved,zb-v")
    run.add_argument("--max-stages", type=int, default=None, help="most stages a plan has (with chunks, all of them)")
    run.add_argument("--chunks", type=int, default=2, help="stages per rank group of interleaved plans (default: 2)")
    run.add_argument("--planner-seeds", type=int, default=3, help="measure the planner's top K plans first (0: off)")
    run.add_argument("--memory-limit", help="per-rank budget the planner's seeds fit, e.g. 6GiB (default: RAM/ranks)")
    run.add_argument(
        "--baselines",
        default="data_parallel,straight",
        help="plans measured first, once per study: data_parallel, straight (comma-separated; '' for none)",
    )
    run.add_argument(
        "--confirm-repeats",
        type=_whole,
        default=1,
        help="at the end, measure the leading plans (the fastest, data parallelism, the closest rival) this many "
        "more times each, interleaved, before choosing by their medians (default: %(default)s; 0: off)",
    )
    run.add_argument("--enqueue", action="append", default=[], help="plan YAML file to measure first (repeatable)")
    run.add_argument("--pruner", choices=("median", "none"), default="median")
    run.add_argument("--threads-per-rank", type=int, default=None)
    run.add_argument("--accelerator", default="cpu")
    run.add_argument("--sequential", default=None, help="attribute path of the Sequential to pipeline")
    run.add_argument("--allow-mismatch", action="store_true", help="resume a study made for another setup")
    run.add_argument("--keep-logs", action="store_true", help="keep every trial's directory of logs")
    run.add_argument("--quiet", action="store_true", help="no line per trial")

    best = sub.add_parser("best", help="the best plans as a table; --export writes the best as plan YAML")
    _common(best)
    best.add_argument("--top", type=int, default=5, help="how many plans to list (default: %(default)s)")
    best.add_argument("--export", type=Path, default=None, help="write the best plan's YAML here")

    trials = sub.add_parser("trials", help="every trial: state, plan, samples/s, memory, reason")
    _common(trials)

    plot = sub.add_parser(
        "plot", help="the study's history, samples/s per plan, predicted vs measured, as HTML and PNG (needs plotly)"
    )
    _common(plot)
    plot.add_argument(
        "--out", type=Path, default=Path("dapple_search_plots"), help="directory for the files (default: %(default)s)"
    )
    plot.add_argument("--no-png", action="store_true", help="HTML only (PNG needs kaleido and a Chrome/Chromium)")
    return parser


def _cmd_run(args: argparse.Namespace) -> int:
    from dapple_lightning.search import PlanSearch, SearchConfig, TrialConfig, best_choice, trial_plan
    from dapple_lightning.search._choice import choice_lines, choose_plan, throughput_study

    trial = TrialConfig(
        model=args.model,
        world_size=args.devices,
        global_batch=args.batch_size,
        warmup=args.warmup,
        steps=args.steps,
        timeout_s=args.timeout_per_trial,
        stall_timeout_s=args.stall_timeout,
        model_kwargs=args.model_kwargs,
        sequential=args.sequential,
        accelerator=args.accelerator,
        threads_per_rank=args.threads_per_rank,
        keep_logs=args.keep_logs,
    )
    config = SearchConfig(
        trial=trial,
        storage=args.storage,
        study_name=args.study,
        heartbeat_s=args.heartbeat,
        n_trials=args.trials if args.trials is not None else (None if args.sampler == "grid" else 20),
        timeout_s=args.timeout,
        sampler=args.sampler,
        seed=args.seed,
        multi_objective=args.multi_objective,
        micro_batches=args.micro_batches,
        schedules=args.schedules,
        max_stages=args.max_stages,
        chunks=args.chunks,
        planner_seeds=args.planner_seeds,
        memory_limit=args.memory_limit,
        baselines=tuple(b for b in args.baselines.split(",") if b),
        confirm_repeats=args.confirm_repeats,
        enqueue=tuple(args.enqueue),
        pruner=args.pruner,
        allow_mismatch=args.allow_mismatch,
        progress=not args.quiet,
    )
    search = PlanSearch(config)
    try:
        study = search.run()
    except KeyboardInterrupt:
        print("interrupted: the running trial is marked FAIL and queued again; run the same command to resume")
        return 130
    try:
        best, _ = best_choice(study)  # the note is in choice_lines
    except ValueError as e:
        print(str(e))
        return 1
    if throughput_study(study):
        print("\n" + "\n".join(choice_lines(choose_plan(study))))
    print(f"\nbest: trial {best.number}\n{trial_plan(best, study).table()}")
    return 0


def _cmd_best(args: argparse.Namespace) -> int:
    from dapple_lightning.search import best_choice, format_table, load_search, ranked_trials, trial_plan, trial_rows
    from dapple_lightning.search._choice import choose_plan, compare_with_data_parallel, throughput_study
    from dapple_lightning.search._report import plan_rows

    study = load_search(args.storage, args.study)
    ranked = ranked_trials(study)
    if not ranked:
        print(f"study {args.study!r} has no completed trial yet")
        return 1
    show = _shower(args)
    if throughput_study(study):
        choice = choose_plan(study)
        show(f"study {args.study!r}: plans by median samples/s (± the spread that tells plans apart)")
        show(format_table(plan_rows(choice, study)[: args.top]))
        show("\n" + "\n".join([*([choice.note] if choice.note else []), compare_with_data_parallel(choice)]))
    else:
        rows_by_number = {r["trial"]: r for r in trial_rows(study)}
        columns = ("trial", "plan", "samples/s", "step s", "peak mem/rank", "source")
        rows = [
            {"#": str(place), **{k: rows_by_number[str(t.number)][k] for k in columns}}
            for place, t in enumerate(ranked[: args.top], start=1)
        ]
        multi = len(study.directions) > 1
        show(f"study {args.study!r}: {'Pareto front (samples/s up, peak memory down)' if multi else 'best trials'}")
        show(format_table(rows))
    chosen, _ = best_choice(study)
    best = trial_plan(chosen, study)
    show(f"\nbest (trial {chosen.number}):\n{best.table()}")
    if args.export is not None:
        write_atomic(args.export, best.to_yaml())  # a reader never sees half a plan
        show(f"\nwrote {args.export} (DappleStrategy(plan={str(args.export)!r}))")
    return 0


def _cmd_trials(args: argparse.Namespace) -> int:
    from dapple_lightning.search import format_table, load_search, trial_rows

    study = load_search(args.storage, args.study)
    _shower(args)(format_table(trial_rows(study)))  # failure reasons may quote a storage error
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    import optuna

    from dapple_lightning.search import load_search

    if not optuna.visualization.is_available():
        shown = redact(args.storage)
        print(
            "plotting needs plotly, which is not installed: pip install plotly kaleido "
            "(or pip install 'dapple-lightning[plots]')\n"
            "(or browse the study without it: pip install optuna-dashboard && optuna-dashboard "
            f"'{shown}'{', the password in place of ***' if shown != args.storage else ''})"
        )
        return 1
    from dapple_lightning.search._plots import plot_study

    study = load_search(args.storage, args.study)
    return plot_study(study, args.out, png=not args.no_png, say=_shower(args))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # SIGTERM (kill PID, a scheduler's stop) ends the search like Ctrl-C: the running trial's
    # processes are killed and the trial is marked, instead of the process vanishing mid-trial.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    commands = {"run": _cmd_run, "best": _cmd_best, "trials": _cmd_trials, "plot": _cmd_plot}
    try:
        return commands[args.command](args)
    except ValueError as e:
        print(f"error: {redact(str(e), args.storage)}", file=sys.stderr)
        return 2
