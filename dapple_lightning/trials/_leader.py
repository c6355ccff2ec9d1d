"""The leader of a trial: PyTorch's elastic agent runs one worker per rank, the leader reports how they ended.

The leader leads the trial's process group (a new session); its ranks stay in that group, so
killing the group ends the whole trial. It hands the ranks to
:func:`torch.distributed.launcher.api.elastic_launch` (the agent behind ``torchrun``: rendezvous,
the rank variables, no restarts, a dead rank ends the others at its next look, every
``MONITOR_S``). How the ranks start is the one choice left (``TrialConfig.launcher``):

- ``fork``: the trial template (``_zygote``), which imported torch, Lightning and dapple_lightning
  once, forks the leader, and the agent forks each rank from it, so no rank pays for those imports;
- ``exec``: the search starts the leader as ``python -m dapple_lightning.trials._leader SPEC.json``
  and the agent spawns fresh interpreters for the ranks (nothing shared at all).

Why not ``torchrun`` itself: it starts every rank in a session of its own (outside the trial's
process group) and as a fresh interpreter; ``benchmarks/search_launcher.py`` measures what that
costs per trial (docs/benchmarks.md, "Search: trial launchers").

Rank 0's stdout is the leader's (the channel the search reads step events from); every other
stream goes to a file in the trial directory. ``supervisor.json`` records the ranks that failed
(with their exit codes; the agent ended the others), the ranks that ended without Python
running (``vanished``: a signal, not an exception) and the leader's own code: 0 when every rank
succeeded, ``INFEASIBLE`` (3) when the plan does not fit (``infeasible.json``), 1 otherwise.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import uuid
from pathlib import Path
from typing import Any

from dapple_lightning.trials._child import INFEASIBLE, start_parent_watchdog

__all__ = ["lead"]

MONITOR_S = 0.05
"""How often the agent looks at its ranks: how late a dead rank is noticed, at most."""


def _rank(spec_path: str) -> None:
    """One rank (in the agent's child): its streams to the trial directory, then the worker."""
    out = Path(json.loads(Path(spec_path).read_text())["out_dir"])
    rank = int(os.environ["RANK"])
    alive = out / f"rank{rank}.alive"
    alive.touch()  # removed on any end Python sees; left behind by a signal (see `lead`)
    if rank != 0:
        os.dup2(os.open(out / f"rank{rank}.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 1)
    os.dup2(os.open(out / f"rank{rank}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
    from dapple_lightning.trials._worker import main

    try:
        code = main(spec_path)
    except Exception:
        # The agent's child hands the exception to the agent without printing it: print it here,
        # in this rank's own stream, where the search looks for the failing rank's error.
        traceback.print_exc()
        raise
    finally:
        alive.unlink(missing_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
    if code:
        sys.exit(code)


def lead(spec_path: str, *, fork: bool = False) -> int:
    """Run every rank of the trial in ``spec_path``; the trial's exit code (see the module docstring)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    start_parent_watchdog()
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out_dir"])
    world_size = int(spec["world_size"])
    threads = str(spec["threads"])
    os.environ.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, PYTHONUNBUFFERED="1")
    if spec.get("visible_devices") is not None:
        # The GPUs this trial leased (`_devices`), set before any rank starts and so before any
        # CUDA context exists: the ranks see only these, as cuda:0 .. cuda:world_size-1.
        os.environ["CUDA_VISIBLE_DEVICES"] = spec["visible_devices"]
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=MONITOR_S,
        start_method="fork" if fork else "spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(out / "elastic")),
    )
    record: dict[str, Any] = {"returncodes": [0] * world_size, "first_failure": None, "killed_after_failure": []}
    try:
        elastic_launch(config, _rank)(spec_path)
        exit_code = 0
    except ChildFailedError as e:
        failed = {rank: failure.exitcode for rank, failure in e.failures.items()}
        record = {
            "returncodes": [failed.get(rank) for rank in range(world_size)],
            "first_failure": e.get_first_failure()[0],
            "killed_after_failure": [rank for rank in range(world_size) if rank not in failed],
        }
        exit_code = INFEASIBLE if (out / "infeasible.json").exists() else 1
    # The agent reports only the first rank it sees fail. When that rank merely lost a peer, the
    # cause may be a rank that vanished without running any Python (SIGKILL from the OOM killer):
    # its marker file is still there. The search reads both and decides (`_trial._collect`).
    record["vanished"] = [rank for rank in range(world_size) if (out / f"rank{rank}.alive").exists()]
    (out / "supervisor.json").write_text(json.dumps({**record, "exit_code": exit_code}))
    return exit_code


if __name__ == "__main__":
    sys.exit(lead(sys.argv[1]))
