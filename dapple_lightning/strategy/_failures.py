"""How a rank learns that a peer is gone, on gloo and on NCCL, and what it tells the user.

Gloo reports a dead peer as a Python exception from the collective that waited on it
("Connection closed by peer", a timeout). NCCL does not: its collectives run on the GPU, and a
watchdog thread in each process checks them against the process group's timeout. What it does
then is set by ``TORCH_NCCL_ASYNC_ERROR_HANDLING``; torch's default tears the process down from
that thread, so Lightning never sees an exception, never runs ``on_exception`` or teardown, and
the job ends with an abort trace instead of the rank's own error. With ``2`` the watchdog aborts
the communicators only: the collective in flight (or the next one) raises
``DistBackendError`` in Python ("NCCL communicator was aborted ... Watchdog caught collective
operation timeout"), and the failure path is the one gloo takes.

Under torchrun with restarts (``--max-restarts``), the agent serves one c10d store for every
attempt, and the keys through which the ranks of the first attempt published their gloo
addresses are still there when the restarted ranks meet: a restarted rank can read a dead
predecessor's address and fail with "Gloo connectFullMesh failed ... Connection refused" (plain
torch does the same, checked with torch 2.13). :func:`attempt_store` gives each attempt keys of its own.

The timeout is then the watchdog's limit for any one collective, so a wait that is not GPU work
(other ranks waiting while rank 0 writes a checkpoint file) must not sit in an NCCL collective:
:func:`host_group` gives those waits a gloo group with a limit of their own.
"""

from __future__ import annotations

import os
import re
from datetime import timedelta

import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from dapple_lightning.strategy._lightning import init_dist_connection

__all__ = [
    "ASYNC_ERROR_HANDLING",
    "HOST_WAIT",
    "PEER_LOST",
    "as_timeout",
    "attempt_store",
    "connect",
    "host_group",
    "note_lost_peer",
    "prepare_backend",
]

ASYNC_ERROR_HANDLING = "2"
"""``TORCH_NCCL_ASYNC_ERROR_HANDLING`` unless the user set it: abort the communicators, keep the process."""

HOST_WAIT = timedelta(minutes=30)
"""The least a rank waits at a barrier on the host (for rank 0's checkpoint write, say) under NCCL."""

PEER_LOST = (
    r"(?s).*("
    # gloo
    r"Connection closed by peer|Connection reset by peer|Broken pipe|Timed out"
    # NCCL: the watchdog's timeout, a communicator it aborted, and a peer's exit seen by the transport.
    # Not NCCL's other errors (invalid usage such as two ranks on one GPU, out of memory in
    # communicator setup, a system error): those are this rank's own, and read as they are.
    r"|Watchdog caught collective operation timeout|NCCL communicator was aborted"
    r"|Some NCCL operations have failed or timed out|Connection closed by remote peer"
    r"|remote process exited or there was a network error"
    r").*"
)
"""What the error of a collective whose peer failed, was killed or stalled says."""


def as_timeout(value: timedelta | float) -> timedelta:
    """``DappleStrategy(timeout=...)`` as a ``timedelta``: one, or a number of seconds > 0."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(f"timeout must be a datetime.timedelta or a number of seconds, got {value!r}")
    if not seconds > 0:
        raise ValueError(f"timeout must be more than 0 seconds, got {value!r}")
    return timedelta(seconds=seconds)


def prepare_backend(backend: str) -> None:
    """Before the process group exists: with NCCL, failed collectives raise (see the module docstring).

    A value the user set is kept, except torchrun's: its agent exports ``1`` to every worker unless
    its own environment names another value, so under torchrun ``1`` is the launcher's default, which
    would tear the process down where recovery and the failure messages need an exception.
    """
    if backend != "nccl":
        return
    variable = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    if os.environ.get(variable) == "1" and "TORCHELASTIC_RUN_ID" in os.environ:
        rank_zero_info(
            f"dapple: {variable}=1 (torchrun's default for its workers) replaced by {ASYNC_ERROR_HANDLING}, so "
            "that a failed NCCL collective raises in Python instead of ending the process"
        )
        os.environ[variable] = ASYNC_ERROR_HANDLING
    os.environ.setdefault(variable, ASYNC_ERROR_HANDLING)


def connect(env: ClusterEnvironment, backend: str, timeout: timedelta, world_size: int) -> None:
    """Lightning's ``_init_dist_connection``, after :func:`prepare_backend`, on this attempt's keys under torchrun;
    refuses a process group of another size than the Trainer's."""
    prepare_backend(backend)
    init_dist_connection(env, backend, timeout=timeout, **attempt_store(timeout))
    if dist.get_world_size() != world_size:
        raise RuntimeError(
            f"the process group has {dist.get_world_size()} ranks but this Trainer expects {world_size}; a "
            "process group left over from an earlier run in this process (e.g. a Hydra multirun with "
            "start_method='popen') cannot be reused for another size: use DappleStrategy(start_method='spawn')"
        )


def attempt_store(timeout: timedelta) -> dict[str, dist.Store]:
    """``init_process_group``'s ``store=`` under torchrun's agent store: its keys under this restart's prefix;
    nothing otherwise (the store is then new for each launch)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return {}
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return {"store": dist.PrefixStore(f"dapple/attempt/{os.environ['TORCHELASTIC_RESTART_COUNT']}", agent)}


def host_group(backend: str, timeout: timedelta) -> dist.ProcessGroup | None:
    """A gloo group over every rank for waits on the host, when the world's backend is not gloo
    (collective); ``None`` under gloo, whose own group already waits on the host."""
    if backend == "gloo":
        return None
    return dist.new_group(backend="gloo", timeout=max(timeout, HOST_WAIT))


def note_lost_peer(exception: BaseException, rank: int, timeout: timedelta) -> None:
    """Where ``exception`` says a peer failed (:data:`PEER_LOST`), its message gains a note saying so; the
    original text stays first, so a local error that happens to match is still read as it is."""
    note = (
        f"dapple: rank {rank} lost a peer. Another rank failed or was killed; its own error is reported by "
        "that rank. (If no rank reports an error, a peer stalled for longer than "
        f"DappleStrategy(timeout={timeout.total_seconds():.0f} s).)"
    )
    exception.args = tuple(
        f"{arg}\n{note}" if isinstance(arg, str) and re.match(PEER_LOST, arg) else arg for arg in exception.args
    )
