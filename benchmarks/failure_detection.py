"""Failure detection: how long the other ranks live after one rank is killed or stopped (issue 16).

Runs ``tests/scripts/faulty.py`` (a 3-rank MLP, plan 1:2, stage 1's rank 1 fails at its third
step) under ``torchrun --standalone --nproc_per_node 3`` and measures, per launch, the time from
the failure (the time the failing rank writes just before it kills or stops itself) to the moment
the last of the two other ranks has ended (polled every 20 ms in ``/proc``).

    kill   SIGKILL: the process and its sockets are gone; gloo's next receive from it fails
    stop   SIGSTOP: the process stays, its sockets stay open (a hung process, a lost host);
           only the heartbeat (strategy/_heartbeat.py) or the 120 s timeout ends the others

The stopped rank is killed at the end of each launch if still there (before the heartbeat it
was, and torchrun would have waited 30 s for it after its SIGTERM).

    ./dev python benchmarks/failure_detection.py --launches 3
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

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "faulty.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "3"]
BAD_RANK = 1


def _alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def one_launch(where: str, limit_s: float) -> float:
    """Seconds from the failure to the end of the last other rank."""
    with tempfile.TemporaryDirectory() as out:
        launcher = subprocess.Popen(
            [*TORCHRUN, str(SCRIPT), out, where, str(BAD_RANK)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        failed_at = Path(out, "failed-at")
        deadline = time.monotonic() + limit_s
        while not failed_at.exists() and time.monotonic() < deadline:
            time.sleep(0.02)  # polling for the injected failure, with a deadline
        text = failed_at.read_text() if failed_at.exists() else ""
        while not text and time.monotonic() < deadline:  # written, not yet flushed
            time.sleep(0.02)
            text = failed_at.read_text()
        pids = {int(p.name.split("-")[1]): int(p.read_text()) for p in Path(out).glob("pid-*")}
        others = [pid for rank, pid in pids.items() if rank != BAD_RANK]
        while any(_alive(p) for p in others) and time.monotonic() < deadline:
            time.sleep(0.02)
        took = time.time() - float(text)
        if BAD_RANK in pids and _alive(pids[BAD_RANK]):
            os.kill(pids[BAD_RANK], signal.SIGKILL)
        launcher.wait(timeout=limit_s)
        return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", type=int, default=3, help="launches per failure kind")
    parser.add_argument("--limit", type=float, default=200.0, help="seconds before a launch is given up")
    args = parser.parse_args()
    print("| failure | launches | seconds to the last other rank's end (each) | median |")
    print("|---|---|---|---|")
    for where in ("kill", "stop"):
        times = [one_launch(where, args.limit) for _ in range(args.launches)]
        each = ", ".join(f"{t:.2f}" for t in times)
        print(f"| {where} | {len(times)} | {each} | {statistics.median(times):.2f} |", flush=True)
    with open("/proc/loadavg") as f:
        print(f"load average at the end: {f.read().split()[0]} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
