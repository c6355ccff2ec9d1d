"""Any rank's failure ends every rank promptly, shows the original error once, leaves no process.

A killed rank closes its sockets and its peers' next receive fails; a stopped one (SIGSTOP: a hung
process, or a host lost without closing its connections) does not, and only the heartbeat
(strategy/_heartbeat.py) ends its peers before the 120 s timeout. Both run under torchrun, which
reports every rank's exit status.
"""

from __future__ import annotations

import inspect
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dapple_lightning import DappleStrategy
from dapple_lightning.strategy._heartbeat import PEERS_END_WITHIN_S

SCRIPT = Path(__file__).parent / "scripts" / "faulty.py"
TIMEOUT_S = inspect.signature(DappleStrategy).parameters["timeout"].default.total_seconds()
"""The process group's timeout that faulty.py's strategy keeps: what peers wait on a lost rank without the heartbeat."""
SAFETY = 10
"""How much slower than the heartbeat's own schedule a machine may be before the test calls it a hang."""
ENDED_WITHIN_S = SAFETY * PEERS_END_WITHIN_S
"""From the failure to the last rank's end, the raising rank's own failure path and shutdown included. How
long it takes is measured by benchmarks/failure_detection.py (docs/benchmarks.md); this bound only tells
an end through the heartbeat or a closed connection from peers left waiting for the timeout."""
RUN_LIMIT_S = 3 * TIMEOUT_S
"""The whole run, start-up included: a run that outlives even the timeout is hung."""
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "3"]
EXIT = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*exitcode\s*:\s*(-?\d+)")


def test_the_bound_tells_the_heartbeat_from_the_timeout() -> None:
    assert ENDED_WITHIN_S < TIMEOUT_S, (
        f"{SAFETY} x the heartbeat's {PEERS_END_WITHIN_S} s is {ENDED_WITHIN_S} s, not below the {TIMEOUT_S} s "
        "timeout: lower SAFETY, or test_failure_ends_every_rank passes with a heartbeat that never ends a peer"
    )


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state  # a zombie has ended; only its exit status is left


def wait_gone(pids: list[int], until: float) -> list[int]:
    """The processes of ``pids`` still alive at the wall-clock time ``until``, or none as soon as all have ended."""
    while time.time() < until:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.2)  # polling for exit with a deadline, not synchronisation
    return [p for p in pids if alive(p)]


@pytest.mark.parametrize(
    ("where", "rank", "launch"),
    [
        ("layer", 0, "plain"),
        ("step", 2, "plain"),
        ("callback", 1, "plain"),
        ("data", 1, "plain"),
        ("kill", 1, "torchrun"),
        ("stop", 1, "torchrun"),
    ],
)
def test_failure_ends_every_rank(where: str, rank: int, launch: str, tmp_path: Path) -> None:
    launcher = TORCHRUN if launch == "torchrun" else [sys.executable]
    proc = subprocess.run(
        [*launcher, str(SCRIPT), str(tmp_path), where, str(rank)],
        capture_output=True,
        text=True,
        timeout=RUN_LIMIT_S,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    message = f"injected failure ({where}) on rank {rank}"
    if where not in ("kill", "stop"):  # the raising rank's error, shown once
        assert output.count(f"ValueError: {message}") == 1, output[-4000:]
    if launch == "torchrun":  # its summary lists each failed rank's exit status
        statuses = {int(r): int(code) for r, code in EXIT.findall(output)}
        assert sorted(statuses) == [0, 1, 2] and 0 not in statuses.values(), output[-3000:]
        # The lost rank: SIGKILL-ed by the test, or after its SIGSTOP by a peer's heartbeat, which names it.
        assert statuses[rank] == -signal.SIGKILL, output[-3000:]
    if where == "stop":
        assert f"rank {rank} sent no heartbeat" in output, output[-3000:]
    pids = [int(p.read_text()) for p in tmp_path.glob("pid-*")]
    assert len(pids) == 3
    failed_at = float((tmp_path / "failed-at").read_text())
    left = wait_gone(pids, failed_at + ENDED_WITHIN_S)
    for pid in left:
        os.kill(pid, signal.SIGKILL)  # this run's own ranks, still alive: not left to the next test
    assert left == [], f"processes {left} still alive {ENDED_WITHIN_S:.0f} s after the failure: hung or left behind"
    ended_after = time.time() - failed_at
    assert ended_after < ENDED_WITHIN_S, (
        f"the last rank ended {ended_after:.1f} s after the failure, past {SAFETY} x the heartbeat's "
        f"{PEERS_END_WITHIN_S} s: its peers waited for the {TIMEOUT_S:.0f} s timeout"
    )


def test_torchrun_restarts_the_job_after_a_killed_rank(tmp_path: Path) -> None:
    """Under ``--max-restarts 1`` the restarted ranks meet on keys of their own (a dead rank's gloo
    address left in torchrun's store made the restart fail) and train to the end."""
    proc = subprocess.run(
        [*TORCHRUN, "--max-restarts", "1", str(SCRIPT), str(tmp_path), "kill", "1", "once"],
        capture_output=True,
        text=True,
        timeout=RUN_LIMIT_S,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert [(tmp_path / f"done-{r}").read_text() for r in range(3)] == ["6 1"] * 3
