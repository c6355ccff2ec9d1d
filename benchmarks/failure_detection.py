"""Failure detection: how long a 3-rank job lives after one rank fails, for each failure of the test.

Runs ``tests/scripts/faulty.py`` (a 3-rank MLP, plan 1:2; the failing rank fails at its third step),
the same launches as ``tests/test_failures.py::test_failure_ends_every_rank``, and measures per
launch the time from the failure (the time the failing rank writes just before it fails) to the
moment the last of the three ranks has ended (each polled every 20 ms in ``/proc``), and to the end
of the last of the two other ranks.

    layer, step, callback, data   the rank raises (a layer, training_step, a callback, the dataset),
                                  launched plainly (Lightning's launcher starts the other ranks)
    kill   SIGKILL under torchrun: the process and its sockets are gone; gloo's next receive fails
    stop   SIGSTOP under torchrun: the process stays, its sockets stay open (a hung process, a lost
           host); only the heartbeat (strategy/_heartbeat.py) or the process group's timeout ends
           the others

Launches are interleaved: round ``r`` runs every failure once, so load drifts spread over all of them.
Each failure gets the median, the minimum and maximum, and a distribution-free interval of the median
(order statistics, ``pool_rounds.median_interval``). The test only bounds the last rank's end at
``SAFETY`` times the heartbeat's own slowest path (``strategy/_heartbeat.py``'s ``PEERS_END_WITHIN_S``),
below the process group's timeout: how fast a failure ends a job is measured here, not asserted there.

    ./dev python benchmarks/failure_detection.py --launches 6
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pool_rounds import median_interval

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "faulty.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "3"]
FAILURES = {  # as test_failure_ends_every_rank: the failing rank and the launcher
    "layer": (0, "plain"),
    "step": (2, "plain"),
    "callback": (1, "plain"),
    "data": (1, "plain"),
    "kill": (1, "torchrun"),
    "stop": (1, "torchrun"),
}


def _alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def _poll(condition, deadline: float) -> None:
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)  # polling with a deadline


def one_launch(where: str, limit_s: float) -> tuple[float, float]:
    """Seconds from the failure to the end of the last rank, and of the last rank but the failing one."""
    bad_rank, launch = FAILURES[where]
    launcher = TORCHRUN if launch == "torchrun" else [sys.executable]
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.Popen(
            [*launcher, str(SCRIPT), out, where, str(bad_rank)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        deadline = time.monotonic() + limit_s
        failed_at = Path(out, "failed-at")
        _poll(lambda: failed_at.exists() and failed_at.read_text(), deadline)  # written and flushed
        failed = float(failed_at.read_text())
        pids = {int(p.name.split("-")[1]): int(p.read_text()) for p in Path(out).glob("pid-*")}
        others = [pid for rank, pid in pids.items() if rank != bad_rank]
        _poll(lambda: not any(_alive(p) for p in others), deadline)
        others_ended = time.time() - failed
        _poll(lambda: not _alive(pids[bad_rank]), deadline)
        all_ended = time.time() - failed
        for pid in pids.values():
            if _alive(pid):  # past the limit: this launch's own rank, not left running
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=limit_s)
        return all_ended, others_ended


def _summary(times: list[float]) -> str:
    low, high, coverage = median_interval(times, 0.95) if len(times) >= 5 else (min(times), max(times), float("nan"))
    return f"{statistics.median(times):.2f} | {min(times):.2f}-{max(times):.2f} | {low:.2f}-{high:.2f} ({coverage:.0%})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", type=int, default=6, help="launches per failure (rounds)")
    parser.add_argument("--limit", type=float, default=200.0, help="seconds before a launch is given up")
    parser.add_argument("--only", nargs="+", choices=sorted(FAILURES), default=list(FAILURES), help="failures to run")
    args = parser.parse_args()
    every: dict[str, list[float]] = {where: [] for where in args.only}
    others: dict[str, list[float]] = {where: [] for where in args.only}
    for round_ in range(args.launches):
        for where in args.only:
            last, other = one_launch(where, args.limit)
            every[where].append(last)
            others[where].append(other)
            print(f"round {round_}: {where} last rank {last:.2f} s, last other rank {other:.2f} s", flush=True)
    print("\nSeconds from the failure to the end of the last rank (every rank; the test's measure),")
    print("then to the end of the last other rank.\n")
    print(
        "| failure | launcher | launches | last rank: median | min-max | interval of the median | last other rank: median | min-max |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for where in args.only:
        other = others[where]
        print(
            f"| {where} | {FAILURES[where][1]} | {len(every[where])} | {_summary(every[where])} | "
            f"{statistics.median(other):.2f} | {min(other):.2f}-{max(other):.2f} |"
        )
    with open("/proc/loadavg") as f:
        print(f"load average at the end: {f.read().split()[0]} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
