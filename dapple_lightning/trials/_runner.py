"""Who runs a trial, and whether that process is certainly gone: liveness across restarts.

A search process records :func:`runner_info` on each trial it runs; a search started later on
the same host asks :func:`runner_dead` whether the recorded process is gone, to end at once the
trials a killed predecessor left running. The pid's start time tells a reused pid apart.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Any

from dapple_lightning.trials._launch import proc_stat

__all__ = ["runner_dead", "runner_info"]


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    fields = proc_stat(pid)
    return None if fields is None else fields[19]


def runner_info() -> dict[str, Any]:
    """Who runs a trial: this process's host, pid and start time (JSON), to find trials orphaned by a dead search."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid())}


def runner_dead(runner: Any) -> bool:
    """Whether the process that ``runner`` (a :func:`runner_info`) describes is certainly gone; only
    processes of this host can be told dead, anything else (another host, no record) is not."""
    if not isinstance(runner, Mapping) or runner.get("host") != socket.gethostname():
        return False
    pid = runner.get("pid")
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return runner.get("start") is not None and _start_time(pid) != runner.get("start")
