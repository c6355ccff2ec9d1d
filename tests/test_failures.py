"""Any rank's failure ends every rank promptly, shows the original error once, leaves no process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "faulty.py"
LIMIT_S = 120  # the whole run, start-up included: a hang fails here
ENDED_WITHIN_S = 10  # from the failure to the last rank's end; the strategy's peer timeout is 120 s


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state  # a zombie has ended; only its exit status is left


def wait_gone(pids: list[int], deadline: float) -> list[int]:
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.2)  # polling for exit with a deadline, not synchronisation
    return [p for p in pids if alive(p)]


@pytest.mark.parametrize(
    ("where", "rank"),
    [("layer", 0), ("step", 2), ("callback", 1), ("data", 1), ("kill", 1)],
)
def test_failure_ends_every_rank(where: str, rank: int, tmp_path: Path) -> None:
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), where, str(rank)],
        capture_output=True,
        text=True,
        timeout=LIMIT_S + 30,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    took = time.monotonic() - start
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert took < LIMIT_S, f"took {took:.1f} s"
    message = f"injected failure ({where}) on rank {rank}"
    if where != "kill":
        assert output.count(f"ValueError: {message}") == 1, output[-4000:]
    pids = [int(p.read_text()) for p in tmp_path.glob("pid-*")]
    assert len(pids) == 3
    assert wait_gone(pids, time.monotonic() + 10) == [], "processes left behind"
    ended_after = time.time() - float((tmp_path / "failed-at").read_text())
    assert ended_after < ENDED_WITHIN_S, f"the last rank ended {ended_after:.1f} s after the failure"
