"""Recovery without a checkpoint (issue 16): its failure-free cost, and the time it takes after a kill.

Runs ``benchmarks/_recovery_job.py`` (6 ``Linear(1024, 1024)`` + ``Tanh``, batch 64, SGD with
momentum; plan 2:1, M = 2: four layers on ranks 0 and 1, two on rank 2) under
``python -m torch.distributed.run --standalone --nproc_per_node 3 --max-restarts 1`` on CPU/gloo.

1. **Failure-free overhead.** One launch; in the same three processes, ``--rounds`` rounds of two
   fits of ``--overhead-steps`` steps each, ``DappleStrategy(recovery=False)`` and
   ``recovery=True`` (order turned every round: off/on, on/off, ...). Per fit, the median time
   between rank 0's ``on_train_batch_end`` calls after ``--warmup`` steps; per round, the ratio
   on/off and the difference. Beside it, the two places where recovery adds work, timed on every
   rank: the strategy's ``batch_to_device`` (the snapshot) and the precision plugin's
   ``_after_closure`` (the vote; on the rank that arrives last, no wait for the others is in it, so
   the minimum over the ranks is the vote's own store round trips).
   ``--part alternate``: the same per-step work measured between neighbouring steps instead of
   between fits: one fit of ``--alternate-steps`` steps with ``recovery=True`` whose snapshot and
   vote are switched on and off step by step (pairs on-off, off-on, ...; the heartbeat, the
   signal handler and the data-order wrapper stay on in both), so the drift of a shared machine
   between fits is out of the comparison; per pair, on/off and on - off of rank 0's step times.
   With ``--on log`` the log's copies are switched with them, and the job saves a checkpoint every
   50 steps (the log keeps the steps since one); pairs with a save are left out.
2. **Recovery time.** ``--repeats`` launches of each, interleaved: rank 1 (a stage-0 replica)
   SIGKILLs itself in its forward of step ``--kill-at`` of ``--steps``;
   ``recover``: ``recovery=True``, no checkpoint; ``checkpoint``: ``recovery=False``, a
   ``ModelCheckpoint`` every 5 steps, the restarted attempt passes the newest to ``fit``.
   From the kill (the time the victim writes just before its SIGKILL) to the first step the
   restarted job completes and to the end of the interrupted step, with the phases in between
   from the ranks' event times (each phase ends when the last rank reaches its event).

    python benchmarks/recovery.py                 # about 6 minutes on 2 busy cores
    python benchmarks/recovery.py --rounds 2 --repeats 1 --overhead-steps 12   # smoke run
    python benchmarks/recovery.py --part alternate  # the per-step cost between neighbouring steps
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
JOB = Path(__file__).with_name("_recovery_job.py")
RANKS = {"pipeline": 3, "replicas": 2, "stages": 2}
"""Ranks of each ``--plan``: 2:1 (four layers on 2 replicas, two on one rank), one stage on 2 ranks,
or 1:1 with the same cut (no replica, so nothing could be recovered: the per-step cost alone)."""
CHECKPOINT_EVERY = 5  # as in the job
SAVE_EVERY = 50  # as in the job (alternate with --on log)
PHASES = [
    ("spawned", "kill to the restarted ranks' start (detection, survivors' exit, torchrun's restart)"),
    ("imported", "interpreter and imports (torch, Lightning, dapple)"),
    ("built", "model and Trainer"),
    ("setup", "process group rendezvous"),
    ("restored", "strategy setup and restore (recovered state or checkpoint)"),
]


def ranks() -> int:
    """The job's number of ranks, for the plan ``main`` chose (``DAPPLE_BENCH_PLAN``, read by the job too)."""
    return RANKS[os.environ.get("DAPPLE_BENCH_PLAN", "pipeline")]


def launch(out: Path, mode: str, steps: int, kill_at: int, rounds: int = 1) -> float:
    """Runs the job under torchrun; its wall time. Raises with the log's tail if it fails."""
    out.mkdir(parents=True)
    # The survivors' state goes where it goes by default (/dev/shm), in a folder of this launch's own.
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="dapple-recovery-bench-", dir=shm) as kept:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "DAPPLE_RECOVERY_DIR": kept}
        start = time.time()
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks())]
        proc = subprocess.run(
            [*torchrun, "--max-restarts", "1", str(JOB), str(out), mode, str(steps), str(kill_at), str(rounds)],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
    (out / "log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} launch failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return time.time() - start


def events(out: Path, attempt: int, rank: int) -> dict[str, float]:
    """A rank's ``event -> time`` of one attempt (the first time of each name)."""
    found: dict[str, float] = {}
    for line in (out / f"events-{attempt}-{rank}").read_text().splitlines():
        name, _, at = line.rpartition(" ")
        found.setdefault(name, float(at))
    return found


def median_step(ends: list[float], warmup: int) -> float:
    durations = [b - a for a, b in itertools.pairwise(ends)]
    return statistics.median(durations[warmup - 1 :])


def overhead(work: Path, rounds: int, steps: int, warmup: int) -> dict[str, Any]:
    """Part 1: per round, the median step time of the off and the on fit, and the per-rank hook times."""
    wall = launch(work / "overhead", "overhead", steps, -1, rounds)
    rank0 = events_by_label(work / "overhead")
    per_round = []
    for r in range(rounds):
        off, on = median_step(rank0[f"off-{r}"], warmup), median_step(rank0[f"on-{r}"], warmup)
        per_round.append({"off": off, "on": on, "ratio": on / off, "added": on - off})
    timings = [json.loads((work / "overhead" / f"timing-{rank}.json").read_text()) for rank in range(ranks())]
    hooks = {}
    for hook in ("batch_to_device", "after_closure"):
        for arm in ("off", "on"):
            # per step, the fastest rank's time; then the median over steps and rounds
            fastest = [
                min(t[f"{arm}-{r}"][hook][i] for t in timings)
                for r in range(rounds)
                for i in range(warmup, min(len(t[f"{arm}-{r}"][hook]) for t in timings))
            ]
            per_rank = [
                statistics.median(x for r in range(rounds) for x in t[f"{arm}-{r}"][hook][warmup:]) for t in timings
            ]
            hooks[(hook, arm)] = {"fastest": statistics.median(fastest), "per_rank": per_rank}
    for r, x in enumerate(per_round):  # CPU seconds per step, summed over the ranks
        for arm in ("off", "on"):
            x[f"cpu-{arm}"] = sum(median_step(t[f"{arm}-{r}"]["cpu"], warmup) for t in timings)
    return {"rounds": per_round, "hooks": hooks, "wall": wall}


def alternate(work: Path, steps: int, warmup: int, save_every: int | None) -> dict[str, Any]:
    """Part 1 within one fit: per pair of neighbouring steps, the on step's time against the off one's.
    With ``save_every`` (``--on log``: the job saves a checkpoint every that many steps, in the step
    after the one saved), pairs with a save in them are left out."""
    wall = launch(work / "alternate", "alternate", steps, -1)
    ends = events_by_label(work / "alternate")["alternate"]
    pairs = []
    for first in range(max(2, warmup + warmup % 2), len(ends) - 1, 2):  # steps first, first + 1
        if save_every and any(step % save_every == 0 for step in (first, first + 1)):
            continue
        times = {step: ends[step] - ends[step - 1] for step in (first, first + 1)}
        on, off = (times[first], times[first + 1]) if alternate_on(first) else (times[first + 1], times[first])
        pairs.append({"on": on, "off": off})
    return {"pairs": pairs, "wall": wall}


def alternate_on(step: int) -> bool:
    """The job's schedule of on and off steps (``_recovery_job.alternate_on``)."""
    return (step % 2 == 0) == ((step // 2) % 2 == 0)


def show_alternate(result: dict[str, Any]) -> None:
    pairs = result["pairs"]
    ratios = [x["on"] / x["off"] for x in pairs]
    added = [1e3 * (x["on"] - x["off"]) for x in pairs]
    print(f"\n### Per-step overhead between neighbouring steps ({len(pairs)} pairs, rank 0)\n")
    print("| | median | 90% bootstrap of the median | min to max |")
    print("|---|---|---|---|")
    print(f"| off step, ms | {1e3 * statistics.median(x['off'] for x in pairs):.1f} | | |")
    print(f"| on step, ms | {1e3 * statistics.median(x['on'] for x in pairs):.1f} | | |")
    low, high = bootstrap_median(ratios)
    print(
        f"| on / off | {statistics.median(ratios):.4f} | {low:.4f} to {high:.4f} | {min(ratios):.3f} to {max(ratios):.3f} |"
    )
    low, high = bootstrap_median(added)
    print(
        f"| on - off, ms | {statistics.median(added):+.2f} | {low:+.2f} to {high:+.2f} | {min(added):+.1f} to {max(added):+.1f} |"
    )
    print(f"\n(launch wall time {result['wall']:.0f} s)")


def events_by_label(out: Path) -> dict[str, list[float]]:
    """Rank 0's step end times of attempt 0, by fit label, in step order."""
    by_label: dict[str, list[float]] = {}
    for line in (out / "events-0-0").read_text().splitlines():
        if line.startswith("step "):
            _, fit, _, at = line.split()
            by_label.setdefault(fit, []).append(float(at))
    return by_label


def recovery_run(out: Path, mode: str, steps: int, kill_at: int) -> dict[str, Any]:
    """Part 2, one launch: the times from the kill, the phases, the steps redone."""
    wall = launch(out, mode, steps, kill_at)
    killed = float((out / "killed-at").read_text())
    after = [events(out, 1, rank) for rank in range(3)]
    redone = sorted(int(name.split()[2]) for name in after[0] if name.startswith("step "))
    if not redone or redone[-1] != steps - 1 or not all("done" in e for e in after):
        raise RuntimeError(
            f"{mode}: the restarted job did not finish all {steps} steps (steps after the restart: {redone})"
        )
    first, again = redone[0], after[0][f"step {mode} {kill_at}"]
    expected_first = kill_at if mode == "recover" else (kill_at // CHECKPOINT_EVERY) * CHECKPOINT_EVERY
    if first != expected_first:
        raise RuntimeError(f"{mode}: the restarted job began at step {first}, not {expected_first}")
    if mode == "recover" and "dapple: recovered step" not in (out / "log").read_text():
        raise RuntimeError("recover: the log does not say that a step was recovered")
    phases, previous = {}, killed
    for name, _ in PHASES:
        reached = max(e[name] for e in after) if name != "spawned" else min(e[name] for e in after)
        phases[name], previous = reached - previous, reached
    phases["steps"] = again - previous
    result = {
        "first": after[0][f"step {mode} {first}"] - killed,
        "again": again - killed,
        "lost": kill_at - first,  # completed steps trained again, besides the interrupted one
        "phases": phases,
        "wall": wall,
    }
    for name, at in after[0].items():
        if name.startswith("kept "):  # "kept <rank>": when that survivor's state file was written
            result[f"kept-{name.split()[1]}"] = at - killed
    log = (out / "log").read_text()
    for key, marker in (("sigterm", "closing signal SIGTERM"), ("ended", "failed (exitcode")):
        at = agent_time(log, marker, killed)
        if at is not None:
            result[key] = at - killed
    before = events(out, 0, 0)
    if "saved" in before:
        result["save"] = before["saved"] - before["saving"]
    return result


def bootstrap_median(values: list[float], draws: int = 2000) -> tuple[float, float]:
    """5th and 95th percentiles of the median of ``values`` resampled with replacement (seeded)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return medians[draws // 20], medians[draws - 1 - draws // 20]


def agent_time(log: str, marker: str, near: float) -> float | None:
    """``time.time()`` of the first line of torchrun's agent log holding ``marker`` (its prefix is
    glog's ``W1203 09:44:24.044000``: month, day and local time), on the day of ``near``."""
    for line in log.splitlines():
        found = re.match(r"[IWE](\d\d)(\d\d) (\d\d):(\d\d):(\d\d\.\d+)", line)
        if found and marker in line:
            month, day, hour, minute = (int(v) for v in found.groups()[:4])
            day_of = datetime.datetime.fromtimestamp(near).replace(month=month, day=day, hour=hour, minute=minute)
            return day_of.replace(second=0, microsecond=0).timestamp() + float(found.group(5))
    return None


def show_overhead(result: dict[str, Any]) -> None:
    rounds = result["rounds"]
    print("\n### Failure-free overhead (median step time per fit, rank 0)\n")
    print("| round | off, ms | on, ms | on/off | added, ms | CPU ms/step off | CPU ms/step on | CPU added, ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r, x in enumerate(rounds):
        print(
            f"| {r} | {1e3 * x['off']:.1f} | {1e3 * x['on']:.1f} | {x['ratio']:.3f} | {1e3 * x['added']:+.1f} "
            f"| {1e3 * x['cpu-off']:.1f} | {1e3 * x['cpu-on']:.1f} | {1e3 * (x['cpu-on'] - x['cpu-off']):+.1f} |"
        )

    def spread(values: list[float], fmt: str) -> str:
        return f"{statistics.median(values):{fmt}} ({min(values):{fmt}} to {max(values):{fmt}})"

    med = {k: 1e3 * statistics.median(x[k] for x in rounds) for k in ("off", "on", "cpu-off", "cpu-on")}
    print(
        f"| median (min to max) | {med['off']:.1f} | {med['on']:.1f} | {spread([x['ratio'] for x in rounds], '.3f')} "
        f"| {spread([1e3 * x['added'] for x in rounds], '+.1f')} | {med['cpu-off']:.1f} | {med['cpu-on']:.1f} "
        f"| {spread([1e3 * (x['cpu-on'] - x['cpu-off']) for x in rounds], '+.1f')} |"
    )
    low, high = bootstrap_median([x["ratio"] for x in rounds])
    print(f"\nThe median ratio's 90% bootstrap interval (rounds resampled): {low:.3f} to {high:.3f}")
    print("\nWhere recovery adds work, ms per step (median over steps; fastest rank, and ranks 0 / 1 / 2):\n")
    print("| hook | off: fastest rank | on: fastest rank | added | off, per rank | on, per rank |")
    print("|---|---|---|---|---|---|")
    for hook, what in (("batch_to_device", "snapshot"), ("after_closure", "vote")):
        off, on = result["hooks"][(hook, "off")], result["hooks"][(hook, "on")]
        ranks = ["/".join(f"{1e3 * t:.2f}" for t in x["per_rank"]) for x in (off, on)]
        print(
            f"| `{hook}` ({what}) | {1e3 * off['fastest']:.2f} | {1e3 * on['fastest']:.2f} "
            f"| {1e3 * (on['fastest'] - off['fastest']):+.2f} | {ranks[0]} | {ranks[1]} |"
        )
    print(f"\n(launch wall time {result['wall']:.0f} s)")


def show_recovery(runs: dict[str, list[dict[str, Any]]], kill_at: int) -> None:
    print(f"\n### Recovery time after a SIGKILL of rank 1 in its forward of step {kill_at} (seconds from the kill)\n")
    print("| | recovery (no checkpoint) | restart from the last checkpoint (every 5 steps) |")
    print("|---|---|---|")

    def row(title: str, pick) -> None:
        cells = []
        for mode in ("recover", "checkpoint"):
            values = [pick(x) for x in runs[mode]]
            if any(v is None for v in values):
                cells.append("-")
                continue
            each = ", ".join(f"{v:.2f}" for v in values)
            cells.append(f"{statistics.median(values):.2f} ({each})")
        print(f"| {title} | {cells[0]} | {cells[1]} |")

    row("first step completed after the restart", lambda x: x["first"])
    row(f"interrupted step {kill_at} completed again", lambda x: x["again"])
    for name, title in PHASES:
        row(f"- {title}", lambda x, name=name: x["phases"][name])
    row(f"- steps from the restored state to the end of step {kill_at}", lambda x: x["phases"]["steps"])
    row("torchrun's SIGTERM to the survivors (its log)", lambda x: x.get("sigterm"))
    row("rank 2's state written (its file's time)", lambda x: x.get("kept-2"))
    row("rank 0's state written (its file's time)", lambda x: x.get("kept-0"))
    row("the attempt's end (torchrun's log)", lambda x: x.get("ended"))
    row("a checkpoint save, before the kill", lambda x: x.get("save"))
    lost = {mode: sorted({x["lost"] for x in runs[mode]}) for mode in runs}
    print(f"| completed steps trained again (besides step {kill_at}) | {lost['recover']} | {lost['checkpoint']} |")
    print(
        f"| launch wall time | {statistics.median(x['wall'] for x in runs['recover']):.1f} "
        f"| {statistics.median(x['wall'] for x in runs['checkpoint']):.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=12, help="overhead: rounds of an off and an on fit")
    parser.add_argument("--overhead-steps", type=int, default=24, help="overhead: steps per fit")
    parser.add_argument("--warmup", type=int, default=4, help="overhead: steps left out of each fit's median")
    parser.add_argument("--repeats", type=int, default=3, help="recovery: launches per mode, interleaved")
    parser.add_argument("--steps", type=int, default=14, help="recovery: steps of the job")
    parser.add_argument("--kill-at", type=int, default=8, help="recovery: the step whose forward the kill interrupts")
    parser.add_argument(
        "--part", choices=["both", "overhead", "alternate", "recovery"], default="both", help="what to measure"
    )
    parser.add_argument("--alternate-steps", type=int, default=400, help="alternate: steps of the one fit")
    parser.add_argument(
        "--on", choices=["true", "log"], default="true", help='overhead: the "on" arm\'s recovery: True, or "log"'
    )
    parser.add_argument(
        "--plan",
        choices=list(RANKS),
        default="pipeline",
        help="overhead: 2:1 on 3 ranks (pipeline), one stage on 2 ranks (replicas), or 1:1 on 2 ranks (stages); "
        "the last two have one rank per core here",
    )
    parser.add_argument("--batch", type=int, default=64, help="rows per step (longer steps, the same per-step work)")
    parser.add_argument("--keep", type=Path, help="keep the launches' events and logs in this folder")
    args = parser.parse_args()
    if not 0 < args.warmup < args.overhead_steps - 2 or not CHECKPOINT_EVERY < args.kill_at < args.steps:
        parser.error(
            f"need 0 < --warmup < --overhead-steps - 2 and {CHECKPOINT_EVERY} < --kill-at < --steps "
            f"(got {args.warmup}, {args.overhead_steps}, {args.kill_at}, {args.steps})"
        )
    if args.plan != "pipeline" and args.part in ("both", "recovery"):
        parser.error(f"--plan {args.plan} measures the overhead only: use --part overhead or --part alternate")
    os.environ["DAPPLE_BENCH_BATCH"] = str(args.batch)
    os.environ["DAPPLE_BENCH_PLAN"] = args.plan  # read by the job and by launch()
    os.environ["DAPPLE_BENCH_ON"] = args.on  # read by the job's "on" arm; the launches inherit it
    began, load_before = time.time(), load_average()
    with tempfile.TemporaryDirectory(prefix="dapple-recovery-bench-") as tmp:
        work = args.keep or Path(tmp)
        runs: dict[str, list[dict[str, Any]]] = {"recover": [], "checkpoint": []}
        for i in range(args.repeats if args.part in ("both", "recovery") else 0):
            for mode in ("recover", "checkpoint") if i % 2 == 0 else ("checkpoint", "recover"):
                runs[mode].append(recovery_run(work / f"{mode}-{i}", mode, args.steps, args.kill_at))
                print(
                    f"{mode} {i}: step {args.kill_at} again {runs[mode][-1]['again']:.2f} s after the kill", flush=True
                )
        if args.part in ("both", "overhead"):
            show_overhead(overhead(work, args.rounds, args.overhead_steps, args.warmup))
        if args.part == "alternate":
            save_every = SAVE_EVERY if args.on == "log" else None
            show_alternate(alternate(work, args.alternate_steps, args.warmup, save_every))
    if args.part in ("both", "recovery"):
        show_recovery(runs, args.kill_at)
    print(
        f"\nwhole benchmark {time.time() - began:.0f} s; load average {load_before} at the start, "
        f"{load_average()} at the end, on {os.cpu_count()} cores"
    )


def load_average() -> str:
    """The 1-minute load average: how busy the shared machine was."""
    return Path("/proc/loadavg").read_text().split()[0]


if __name__ == "__main__":
    main()
