"""The leader of a trial: starts one worker per rank, waits, and reports how they ended.

It leads the trial's process group (a new session), and every rank inherits that group, so
killing the group ends the whole trial. Like ``torchrun`` it sets the rendezvous variables for
each rank; unlike it, it keeps no agent polling on the cores. It runs in one of two ways
(``TrialConfig.launcher``):

- ``exec``: the search starts it as ``python -m dapple_lightning.search._supervisor SPEC.json``
  (``dapple_lightning`` and its search package import neither torch nor Optuna, so it starts in a
  fraction of a second), and it starts each rank as ``python -m dapple_lightning.search._worker
  SPEC.json``;
- ``fork``: the trial template process (``_zygote``), which has imported torch, Lightning and
  dapple_lightning once, forks it, and it forks each rank from itself, so no rank pays for those
  imports again.

Rank 0's stdout is the leader's (the channel the search reads step events from); every other
stream goes to a file in the trial directory. When a rank fails, the others get ``grace_s``
seconds to end on their own (their errors are often the informative ones), then are killed.
``supervisor.json`` records every rank's exit code and the leader's own; that code is 0 when
every rank succeeded, ``INFEASIBLE`` (3) when every rank said the plan does not fit, 1 otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dapple_lightning.search._child import emit

INFEASIBLE = 3
POLL_S = 0.05


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Forked:
    """A rank forked from this process (the ``fork`` launcher): ``poll`` and ``kill`` like ``Popen``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(POLL_S)  # polling a child process
        return self.returncode  # type: ignore[return-value]


def _fork_rank(spec_path: str, env: dict[str, str], stdout: Any, stderr: Any) -> _Forked:
    """Fork a rank from this (already-importing) process and run the worker in it."""
    pid = os.fork()
    if pid:
        return _Forked(pid)
    code = 1
    try:
        os.environ.clear()
        os.environ.update(env)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        if stdout is not None:
            os.dup2(stdout.fileno(), 1)
        os.dup2(stderr.fileno(), 2)
        from dapple_lightning.search._worker import main as worker_main

        code = worker_main(spec_path)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def supervise(spec_path: str, *, fork: bool = False) -> int:
    """Run every rank of the trial in ``spec_path``; the trial's exit code (see the module docstring)."""
    parent = os.getppid()
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out_dir"])
    world_size = int(spec["world_size"])
    grace_s = float(spec.get("grace_s", 5.0))
    port = _free_port()
    threads = str(spec["threads"])
    procs: list[Any] = []
    files = []
    for rank in range(world_size):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            NODE_RANK="0",
            OMP_NUM_THREADS=threads,
            MKL_NUM_THREADS=threads,
            PYTHONUNBUFFERED="1",
        )
        stdout = None if rank == 0 else open(out / f"rank{rank}.out", "wb")  # noqa: SIM115 (closed below)
        stderr = open(out / f"rank{rank}.err", "wb")  # noqa: SIM115
        files += [f for f in (stdout, stderr) if f is not None]
        if fork:
            procs.append(_fork_rank(spec_path, env, stdout, stderr))
        else:
            procs.append(
                subprocess.Popen(
                    [spec["python"], "-m", "dapple_lightning.search._worker", spec_path],
                    stdin=subprocess.DEVNULL,
                    stdout=stdout,
                    stderr=stderr,
                    env=env,
                )
            )
    codes: list[int | None] = [None] * world_size
    first_failure: int | None = None
    killed: list[int] = []
    failed_at = 0.0
    while any(c is None for c in codes):
        if os.getppid() != parent:
            # Orphaned: nobody will collect this trial. SIGKILL the whole group, this process too.
            os.killpg(os.getpgrp(), signal.SIGKILL)
        for rank, p in enumerate(procs):
            if codes[rank] is None and (code := p.poll()) is not None:
                codes[rank] = code
                if code != 0 and first_failure is None:
                    first_failure, failed_at = rank, time.monotonic()
                    # Tells the search the trial is ending, so that a stall limit stops counting.
                    emit("rank_failed", rank=rank, code=code)
        if first_failure is not None and time.monotonic() - failed_at > grace_s:
            for rank, p in enumerate(procs):
                if codes[rank] is None:
                    p.send_signal(signal.SIGKILL)
                    codes[rank] = p.wait()
                    killed.append(rank)
        time.sleep(POLL_S)  # polling child processes, not synchronising with them
    for f in files:
        f.close()
    if all(c == 0 for c in codes):
        exit_code = 0
    elif all(c == INFEASIBLE for c in codes):
        exit_code = INFEASIBLE
    else:
        exit_code = 1
    record = {
        "returncodes": codes,
        "first_failure": first_failure,
        "killed_after_failure": killed,
        "exit_code": exit_code,
    }
    (out / "supervisor.json").write_text(json.dumps(record))
    return exit_code


if __name__ == "__main__":
    sys.exit(supervise(sys.argv[1]))
