"""One rank of a trial: trains the candidate plan for a few steps and records what it measured.

Run by the trial's leader (``_leader``), once per rank, with the variables ``torchrun`` would set (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ...): Lightning sees an externally launched cluster and starts no processes of
its own. Rank 0 prints one event line per optimizer step (see ``_child.emit``), so the search can
report intermediate values and prune while the trial runs.

Exit codes: 0 trained; ``_child.INFEASIBLE`` the plan does not fit the model or its batches (the
reason is in ``infeasible.json``); anything else is a failure.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

from dapple_lightning.trials._child import INFEASIBLE, emit, start_parent_watchdog

__all__ = ["main"]


def _check_feasible(plan: Any, module: Any, loader: Any, world_size: int, sequential: str | None) -> int:
    """Raise ``ValueError`` if ``plan`` cannot run this model on its batches; the batch's rows."""
    from dapple_lightning.microbatch import batch_size_of
    from dapple_lightning.surgery import find_sequential

    _, seq = find_sequential(module, sequential)
    plan.check(num_layers=len(seq), world_size=world_size)
    rows = batch_size_of(next(iter(loader)))
    widest = max(s.replicas for s in plan.stages)
    if plan.micro_batches * widest > rows:
        raise ValueError(
            f"{plan.micro_batches} micro-batches x {widest} replicas need at least "
            f"{plan.micro_batches * widest} rows per batch, but the loader's batches have {rows}: "
            "some replica would get an empty slice"
        )
    return rows


def _state_bytes(module: Any, optimizers: list[Any]) -> int:
    """Bytes of this rank's parameters, gradients and optimizer state (after partitioning)."""
    import torch

    total = 0
    for p in module.parameters():
        total += p.numel() * p.element_size()
        if p.grad is not None:
            total += p.grad.numel() * p.grad.element_size()
    for opt in optimizers:
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    total += value.numel() * value.element_size()
    return total


def _step_timer(emit_events: bool) -> Any:
    """A callback recording the wall time between the ends of consecutive optimizer steps (the first
    from its start) and each step's rows; with ``emit_events`` it reports each step to the search."""
    from lightning.pytorch import Callback

    from dapple_lightning.microbatch import batch_size_of

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.rows: list[int] = []
            self._last = 0.0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if not self.times and not self._last:
                self._last = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            now = time.perf_counter()
            self.times.append(now - self._last)
            self.rows.append(batch_size_of(batch))
            self._last = now
            if emit_events:
                emit("step", step=len(self.times) - 1, seconds=self.times[-1], rows=self.rows[-1])

    return StepTimer()


def _leave() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        # Leave together: a rank that exits while a peer still talks to it aborts that peer.
        dist.barrier()
        dist.destroy_process_group()


def main(spec_path: str) -> int:
    start_parent_watchdog()
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out_dir"])
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))

    # Quiet Lightning's banners: rank 0's stdout carries the events the search reads.
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)

    import torch
    from lightning.pytorch import Trainer, seed_everything

    from dapple_lightning.plan import Plan
    from dapple_lightning.strategy import DappleStrategy
    from dapple_lightning.trials._factory import call_factory

    torch.set_num_threads(int(spec["threads"]))
    seed_everything(int(spec["seed"]), verbose=False)
    plan = Plan.from_dict(spec["plan"])
    module, loader = call_factory(spec["model"], int(spec["global_batch"]), dict(spec["model_kwargs"]))
    try:
        _check_feasible(plan, module, loader, world_size, spec["sequential"])
    except ValueError as e:
        # Every rank reaches the same verdict from the same inputs, without talking to the others.
        if rank == 0:
            (out / "infeasible.json").write_text(json.dumps({"reason": str(e)}))
        return INFEASIBLE

    timer = _step_timer(emit_events=rank == 0)
    strategy = DappleStrategy(
        plan,
        start_method="popen",
        sequential=spec["sequential"],
        track_memory=bool(spec["track_memory"]),
        timeout=timedelta(seconds=float(spec["pg_timeout_s"])),
    )
    trainer = Trainer(
        accelerator=spec["accelerator"],
        devices=world_size,
        strategy=strategy,
        max_steps=int(spec["warmup"]) + int(spec["steps"]),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[timer],
    )
    trainer.fit(module, train_dataloaders=loader)
    stats = strategy.step_stats
    record = {
        "rank": rank,
        "stage": plan.group_of(rank),  # its stage; with chunks, its rank group
        "step_times": timer.times,
        "rows": timer.rows,
        "peak_live_bytes": int(stats.peak_live_bytes),
        "peak_live_microbatches": int(stats.peak_live_microbatches),
        "state_bytes": _state_bytes(trainer.lightning_module, trainer.optimizers),
        # ru_maxrss is in KiB on Linux.
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    _leave()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
