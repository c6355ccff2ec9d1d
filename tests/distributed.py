"""Run a function on several CPU processes joined by a gloo process group.

Used by the runtime tests: real processes, real point-to-point traffic, a hard time limit
so a deadlock fails the test instead of hanging the suite. Ranks fork from a server process that
imported torch and Lightning once (what ``DappleStrategy(start_method="forkserver")`` does), so a
rank starts without importing them again.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dapple_lightning.strategy import FORKSERVER_PRELOAD


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, environ: dict, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    # A forked rank has the fork server's environment; give it the test's, as spawn would.
    os.environ.clear()
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    result: Any
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
        result = ("ok", fn(rank, world_size, *args))
    except BaseException:
        result = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(result))


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 120) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; their results by rank."""
    mp.get_context("forkserver").set_forkserver_preload(list(FORKSERVER_PRELOAD))
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _worker,
            args=(world_size, dict(os.environ), free_port(), out_dir, fn, args),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        for proc in ctx.processes:
            proc.join(timeout)
        alive = [p for p in ctx.processes if p.is_alive()]
        for p in alive:
            p.kill()
        if alive:
            raise TimeoutError(f"{len(alive)} of {world_size} ranks still running after {timeout} s (deadlock?)")
        results = []
        for rank in range(world_size):
            path = Path(out_dir, f"{rank}.pkl")
            if not path.exists():
                raise RuntimeError(f"rank {rank} died without a result (exit code {ctx.processes[rank].exitcode})")
            status, value = pickle.loads(path.read_bytes())
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results
