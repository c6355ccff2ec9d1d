"""What the strategy says about memory: a given plan against ``memory_limit``, and the trace.

**The budget.** ``DappleStrategy(memory_limit=...)`` takes bytes or text (``"6GiB"``,
``planner.parse_memory``); ``None`` is the device's memory (``planner.device_memory``: on a GPU
what is free plus what this process holds, less 10% of the total; on CPU the machine's RAM
shared evenly by the node's ranks).

``plan="auto"`` never chooses a plan predicted over the budget (the planner caps every stage at
it). A plan given by hand is the user's call, so it is not refused: rank 0 profiles the layers
once on a micro-batch of the first training batch (the meters of ``planner._memory``: saved
bytes, peaks, the optimizer's real state), prices the plan with the cost model and warns, naming
each stage over the budget with its numbers, while the other ranks wait in the launcher's store.
A stage with ``offload`` is priced at its window, not its layers (``planner._stage_memory``). The
profile runs on the plan's device (rank 0's, where its stage will run), not where the module waits
before the cut (usually the CPU): kernels save different tensors on different devices (CPU attention
keeps the whole score matrix). As for ``plan="auto"`` (``_resident.Resident``), the code outside the
pipelined layers comes to the device and the layers a window at a time (at most a rank's share of
an even split); everything goes back where it was after. It is a prediction, not a measurement of
the run.

**The trace.** :func:`write_trace` gathers every rank's timeline on rank 0 and writes the Chrome
trace (``runtime.write_chrome_trace``).
"""

from __future__ import annotations

import warnings
from itertools import count
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from dapple_lightning.autoplan import draw_batch, optimizer_factory, profile_in_windows
from dapple_lightning.microbatch import Rows, batch_size_of, slice_batch
from dapple_lightning.plan import Plan
from dapple_lightning.planner import Cluster, estimate, over_budget, stage_memory_lines
from dapple_lightning.runtime import Timeline, write_chrome_trace
from dapple_lightning.strategy._auto_blocks import sample_chain
from dapple_lightning.strategy._checkpoint import gather_on_zero
from dapple_lightning.strategy._failures import HOST_WAIT
from dapple_lightning.strategy._lightning import training_loader
from dapple_lightning.strategy._resident import Resident, parameter_bytes
from dapple_lightning.surgery import Chain, unchanged

__all__ = ["predicted_memory", "warn_if_over_budget", "write_trace"]

_checks = count()  # one store key per check in a process; the same sequence on every rank


def predicted_memory(
    module: nn.Module, chain: Chain, plan: Plan, batch: Any, device: torch.device | None = None
) -> tuple[float, ...]:
    """Predicted peak bytes per rank of each stage of ``plan`` for the global ``batch`` (on ``device``),
    from a profile of ``chain``'s layers on one micro-batch of it on ``device`` (by default where
    the module is); the module is left as it was, where it was."""
    rows = batch_size_of(batch)
    sample = slice_batch(batch, Rows(0, max(1, -(-rows // plan.micro_batches))))
    home = next(module.parameters()).device
    device = home if device is None else device
    try:
        optimizer = optimizer_factory(module)
    except Exception:  # the cost model's optimizer factor stands in for the real state
        optimizer = None
    resident = Resident(module, chain, device, home)
    window = None if device == home else max(1, parameter_bytes(resident.layers) // plan.world_size)
    try:
        with unchanged(module):
            layers, sample_input, _, _ = sample_chain(module, chain, sample, resident)
            profile = profile_in_windows(
                layers, sample_input, hold=resident.hold, window_bytes=window, repeats=1, warmup=0, optimizer=optimizer
            )
    finally:
        resident.send_home()
    # Only memory is read from the estimate: the links' figures do not matter.
    cluster = Cluster(1, plan.world_size, 1e9, 1e9, 1e9, 1e9, latency_s=0.0)
    return estimate(plan, profile, cluster, rows).memory_bytes


def warn_if_over_budget(module: Any, chain: Chain, plan: Plan, trainer: Any, limit: float | None) -> None:
    """When fitting with a ``limit``, on rank 0: warn when ``plan`` is predicted over ``limit``
    bytes per rank on the first training batch (the loader's order is left as it was); say the
    prediction otherwise. The other ranks wait for it in the launcher's store, for up to
    :data:`~._failures.HOST_WAIT`: profiling a large model may take longer than the process
    group's timeout, which their next collective would otherwise hit."""
    if limit is None or trainer.state.fn != TrainerFn.FITTING:
        return
    done = f"dapple/memory_check/{next(_checks)}"
    store = dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    if trainer.global_rank != 0:
        if store is not None:
            store.wait([done], HOST_WAIT)
        return
    try:
        _predict_and_warn(module, chain, plan, trainer, limit)
    finally:  # also when it failed: rank 0's error then ends the job, not the others' wait
        if store is not None:
            store.set(done, "1")


def _predict_and_warn(module: Any, chain: Chain, plan: Plan, trainer: Any, limit: float) -> None:
    if any(p.is_meta for p in module.parameters()):
        rank_zero_info("dapple memory_limit: the model is on the meta device, so the plan's memory is not predicted")
        return
    device = trainer.strategy.root_device  # where rank 0's stage will run
    batch = move_data_to_device(draw_batch(training_loader(trainer)), device)
    peaks = predicted_memory(module, chain, plan, batch, device)
    problem = over_budget(plan, peaks, limit)
    if problem is not None:
        warnings.warn(f"dapple: {problem}", UserWarning, stacklevel=2)
    else:
        lines = "\n".join(stage_memory_lines(plan, peaks, limit))
        rank_zero_info(f"dapple plan's predicted peak memory per rank, within memory_limit:\n{lines}")


def write_trace(timeline: Timeline, path: str) -> None:
    """Gather every rank's events on rank 0 and write them as a Chrome trace to ``path`` (collective)."""
    if (gathered := gather_on_zero([*timeline.events, *timeline.counters])) is not None:
        written = write_chrome_trace([e for part in gathered for e in part], path)
        rank_zero_info(f"dapple: wrote Chrome trace to {written}")
