"""Helpers for the search's child processes (the trial ranks and the model probe).

Stdlib only: these helpers run before torch is imported in the ranks and the probe.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any

__all__ = ["EVENT_PREFIX", "INFEASIBLE", "emit", "parse_event", "start_parent_watchdog"]

INFEASIBLE = 3
"""The exit code of a trial's rank (``_worker``) and leader (``_leader``) for a plan that does not
fit the model or its batches (the reason in ``infeasible.json``)."""

EVENT_PREFIX = "@@dapple-search "
"""Lines on a trial's stdout that start with this are events for the search; the rest is chatter."""


def emit(event: str, **fields: Any) -> None:
    """Write one event line (``EVENT_PREFIX`` + JSON) to stdout and flush it at once."""
    sys.stdout.write(EVENT_PREFIX + json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def parse_event(line: str) -> dict[str, Any] | None:
    """The event of an event line, ``None`` for any other line."""
    if not line.startswith(EVENT_PREFIX):
        return None
    try:
        event = json.loads(line[len(EVENT_PREFIX) :])
    except json.JSONDecodeError:
        return None
    return event if isinstance(event, dict) else None


def start_parent_watchdog(interval_s: float = 0.5) -> None:
    """Kill this process's whole group when its parent dies.

    A trial runs in its own process group, so it survives the search process (or its leader)
    being killed with SIGKILL, which no handler can catch. An orphan is re-parented, so a
    changed parent pid means the parent is gone: then nobody will collect the trial, and it must
    not keep the machine's cores busy.
    """
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(interval_s)  # a watchdog's polling period, not synchronisation
            if os.getppid() != parent:
                os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="dapple-search-watchdog", daemon=True).start()
