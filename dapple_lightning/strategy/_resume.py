"""After torchrun restarts the job: the survivors' state back into every rank.

:mod:`._recovery` has each survivor write its state, as of one global step, to node-local
storage when a peer is lost. After the restart's rendezvous, :func:`recover` (collective):

1. every rank reads its own file, if any, and all ranks gather which step each holds;
2. the recovered step is the newest one that every stage holds on at least one rank (normally
   the one step every survivor wrote); if some stage holds none (every replica of it lost), the
   job starts as the script says (its ``ckpt_path``, or the start), and rank 0 says so;
3. a rank without that step (the replacement of the lost rank) receives its stage's state from
   the stage's first replica that holds it, point to point: replicas hold the same weights and
   optimizer state, which is what data parallelism guarantees;
4. the state becomes the checkpoint Lightning restores (``_loaded_checkpoint``): the rank's
   module and optimizer state, loops, callbacks, schedulers and precision state; the RNG states
   and the data position wait for the first safe point, where they were taken.

The data position is :class:`~._order.EpochOrder`'s.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from dapple_lightning.plan import Plan
from dapple_lightning.strategy._heartbeat import long_host_work
from dapple_lightning.strategy._lightning import Patches, hand_over_checkpoint
from dapple_lightning.strategy._logbook import Logbook, replay_lost_stages
from dapple_lightning.strategy._parts import FitParts
from dapple_lightning.strategy._recovery import FORMAT, Recovery, files_of, is_active, private_directory

__all__ = ["RECOVERED", "begin", "kept_plan", "load_optimizers", "recover"]

RECOVERED = "dapple_recovered_step"
"""Key of a checkpoint dict built from recovered state (each rank's part only)."""
_fits = 0  # fits begun in this process: a vote namespace per fit, the same on every rank


def begin(recovery: Recovery, trainer: Any, plan: Plan, group: Any, parts: FitParts, patches: Patches) -> None:
    """At the end of the strategy's ``setup`` for a fit: start recovery's bookkeeping (its hooks
    recorded in ``patches``) and, after torchrun restarted the job, hand Lightning the recovered
    state (collective then)."""
    rank, world = trainer.global_rank, trainer.world_size
    identity = {
        "run": os.environ.get("TORCHELASTIC_RUN_ID"),
        "plan": plan.to_yaml(),
        "world": world,
        "rank": rank,
        "stage": plan.group_of(rank),
        "fit": _take_fit(),
        "timeout_s": parts.timeout.total_seconds(),
    }
    if not _restarted():  # a first attempt: anything kept under this run's name is another job's or stale
        for place in files_of(rank):
            for stale in place.parent.glob(f"*rank{rank}.pt*"):
                stale.unlink(missing_ok=True)
    recovery.start(trainer, identity, patches)
    if recovery.active and recovery.mode == "log":
        logs = [place.parent / f"log-rank{rank}" for place in files_of(rank)]  # where the state may go
        if not _restarted():
            for directory in logs:
                shutil.rmtree(directory, ignore_errors=True)
        recovery.logbook = Logbook(plan, rank, *logs)
        parts.pipeline.record_sends(recovery.logbook.record)
    if not recovery.active or not _restarted():
        return
    checkpoint = recover(identity, plan, group, recovery, parts)
    if checkpoint is not None:
        recovery.recovered = checkpoint
        # Lightning restores from it as from a checkpoint file: its strategy.setup comes before the restore.
        hand_over_checkpoint(trainer, checkpoint)


def _take_fit() -> int:
    global _fits
    _fits += 1
    return _fits - 1


def _restarted() -> bool:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def kept_plan(recovery: Recovery, group: Any) -> Plan | None:
    """``plan="auto"`` after torchrun's restart: the plan the job trained with, from any rank's kept
    state, rather than a new choice the kept state would not fit (collective over every rank)."""
    if not is_active(recovery.mode) or not _restarted():
        return None
    job = {"run": os.environ.get("TORCHELASTIC_RUN_ID"), "fit": _fits, "world": dist.get_world_size()}
    state = _read(dist.get_rank(), job, mmap=True)
    mine = None if state is None else state["plan"]
    plans: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(plans, mine, group=group)
    found = next((p for p in plans if p is not None), None)
    if found is None:
        return None
    rank_zero_info("dapple: plan='auto' takes the plan the job trained with before torchrun restarted it (kept state)")
    return Plan.from_yaml(found)


def recover(
    identity: Mapping[str, Any], plan: Plan, group: Any, recovery: Recovery, parts: FitParts
) -> dict[str, Any] | None:
    """The checkpoint dict of the newest step every stage kept, for this rank; ``None`` if there is
    none (collective over every rank; ``group``: a gloo group, or ``None`` under gloo). With the
    log (``recovery="log"``), a stage without a replica that kept it is replayed (:mod:`._logbook`)."""
    rank, world = identity["rank"], identity["world"]
    mine = _read(rank, {k: identity[k] for k in ("run", "plan", "world", "stage", "fit")})
    kept: list[Any] = [None] * world
    dist.all_gather_object(kept, None if mine is None else (mine["step"], mine["snapshot"]["checkpoint"]), group=group)
    held = [None if k is None else k[0] for k in kept]
    step, lost = _newest_common(held, plan), []
    why = "no kept state (the failure came before the first step)"
    if step is None and any(h is not None for h in held):
        why = "no step that every stage kept (every replica of a stage was lost)"
        if recovery.logbook is not None:
            step, lost, why = _replayable(kept, plan, parts, recovery.logbook, why, group)
    if step is None:
        rank_zero_warn(
            f"dapple: the job was restarted, and recovery found {why}; it starts as the script says "
            "(its ckpt_path, or the start)"
        )
        return None
    sources = {}
    for needy in (r for r in range(world) if held[r] != step):
        source = min(
            r for r in range(world) if held[r] == step and (needy in lost or plan.group_of(r) == plan.group_of(needy))
        )
        sources[needy] = source
        if rank == source:  # a replayed rank needs only the small state: its own weights are replayed
            sent = (
                {k: v for k, v in mine.items() if k not in ("state_dict", "optimizer_states")}
                if needy in lost
                else mine
            )
            with long_host_work(identity["timeout_s"]):  # pickling a stage's state holds the GIL
                dist.send_object_list([sent], dst=needy, group=group)
        elif rank == needy:
            box: list[Any] = [None]
            with long_host_work(identity["timeout_s"]):  # and so does unpickling it
                dist.recv_object_list(box, src=source, group=group)
            mine = box[0]
    assert mine is not None
    if rank in lost:
        optimizer_states = [o.state_dict() for o in parts.optimizers]
        mine = {**mine, "state_dict": parts.module.state_dict(), "optimizer_states": optimizer_states}
    moved = ", ".join(f"rank {n} from rank {s}" for n, s in sources.items()) or "none"
    rank_zero_info(f"dapple: recovered step {step} from the ranks' kept state (sent to replacements: {moved})")
    return _as_checkpoint(mine, step)


def _replayable(
    kept: list[Any], plan: Plan, parts: FitParts, logbook: Logbook, why: str, group: Any
) -> tuple[int | None, list[int], str]:
    """The newest kept step, with the ranks to replay to reach it, when every stage that lacks it
    has one rank and the ranks that kept it name one checkpoint before it (collective)."""
    step = max(k[0] for k in kept if k is not None)
    lacking = [
        s for s in range(plan.num_stages) if all(kept[r] is None or kept[r][0] != step for r in plan.stage_ranks(s))
    ]
    checkpoints = {k[1] for k in kept if k is not None and k[0] == step}
    if any(plan.stages[s].replicas > 1 for s in lacking) or len(checkpoints) != 1 or None in checkpoints:
        return None, [], why + ", and no log and checkpoint to replay it from"
    (checkpoint,) = checkpoints
    lost = [plan.stage_ranks(s)[0] for s in lacking]
    refusal = replay_lost_stages(parts, logbook, plan, lost, checkpoint, step, group)
    if refusal is not None:
        return None, [], f"a stage to replay, which cannot be: {refusal}"
    return step, lost, ""


def _read(rank: int, identity: Mapping[str, Any], *, mmap: bool = False) -> dict[str, Any] | None:
    """``rank``'s kept state if it is this job's (format and the ``identity`` keys given match);
    ``mmap``: the tensors are not read."""
    path = next((p for p in files_of(rank) if p.is_file()), None)  # the first place that holds it
    if path is None:
        return None
    private_directory(path.parent)  # refuses a directory another user could have planted a file in
    try:
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)  # this run's own file
    except Exception as error:  # a torn or foreign file: as if it were not there
        rank_zero_warn(f"dapple: could not read the kept state {path}: {error}")
        return None
    same = state.get("format") == FORMAT and all(state.get(k) == v for k, v in identity.items())
    return state if same else None


def _newest_common(held: list[Any], plan: Plan) -> int | None:
    by_stage = [{held[r] for r in plan.stage_ranks(s)} - {None} for s in range(plan.num_stages)]
    common = set.intersection(*by_stage) if by_stage else set()
    return max(common) if common else None


def _as_checkpoint(state: Mapping[str, Any], step: int) -> dict[str, Any]:
    snapshot = state["snapshot"]
    checkpoint = {
        "epoch": snapshot["epoch"],
        "global_step": snapshot["global_step"],
        "pytorch-lightning_version": pl.__version__,
        "loops": snapshot["loops"],
        "callbacks": snapshot["callbacks"],
        "lr_schedulers": snapshot["lr_schedulers"],
        "state_dict": state["state_dict"],
        "optimizer_states": state["optimizer_states"],
        RECOVERED: step,
        "dapple_rng": snapshot["rng"],
        "dapple_order": snapshot["order"],
        "dapple_batches_that_stepped": snapshot["batches_that_stepped"],
    }
    precision, precision_state = snapshot["precision"]
    if precision_state:
        checkpoint[precision] = precision_state
    return checkpoint


def load_optimizers(optimizers: list[torch.optim.Optimizer], checkpoint: Mapping[str, Any]) -> None:
    """A recovered checkpoint holds each optimizer's state as this rank had it (no single-device layout)."""
    for optimizer, state in zip(optimizers, checkpoint["optimizer_states"], strict=True):
        optimizer.load_state_dict(state)
