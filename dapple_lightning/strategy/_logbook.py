"""Recovery for a stage without a replica: its neighbours log what they send it; after its rank is
lost, the replacement replays its steps since the last checkpoint (SWIFT's logging).

With ``DappleStrategy(recovery="log")``, every rank that sends to a rank of an unreplicated stage
keeps, per training step, the messages it sent that rank (the activations in, or the gradients
in) in host memory, and writes them to node-local storage with the state recovery keeps when a
peer is lost; the lowest-ranked of them keeps the step's global batch too (the stage's own rows,
labels and inputs come from it). A replay starts from a checkpoint the strategy saved, so the
log holds only steps since one: none before the first save (a run that never saves one keeps
nothing), and from then on the steps since the checkpoint before the last (keeping one more covers
a save that a failure interrupted).

After torchrun's restart, :func:`replay_lost_stages` (from :func:`._resume.recover`, collective):
when a stage has no rank that kept the recovered step and one rank, its replacement loads its
part of the last checkpoint, receives the log from each neighbour, and runs the steps since the
checkpoint again alone (:meth:`dapple_lightning.runtime.Pipeline.replay`), with the optimizer and its
per-step LR schedules; the other stages keep the step they kept and do not roll back. Refused,
with the job then starting as the script says: gradient clipping (its norm spans every stage),
schedulers stepped per epoch or on a metric, a checkpoint or log step missing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device

from dapple_lightning.plan import Plan
from dapple_lightning.runtime import Message
from dapple_lightning.strategy._heartbeat import long_host_work
from dapple_lightning.strategy._parts import FitParts
from dapple_lightning.strategy._recovery import private_directory, state_bytes

__all__ = ["Logbook", "replay_lost_stages"]


def _neighbours(plan: Plan, rank: int) -> list[int]:
    stage = plan.stage_of(rank)
    return sorted(r for s in (stage - 1, stage + 1) if 0 <= s < plan.num_stages for r in plan.stage_ranks(s))


def _watched(plan: Plan, rank: int) -> list[int]:
    """Ranks of unreplicated stages that ``rank`` sends to."""
    alone = [plan.stage_ranks(s)[0] for s in range(plan.num_stages) if plan.stages[s].replicas == 1]
    return [r for r in alone if r != rank and rank in _neighbours(plan, r)]


class Logbook:
    """This rank's log of what it sent to unreplicated stages, per training step: in host memory
    while training runs (one copy of the messages, no write), to storage when the rank writes its
    kept state after a loss (:meth:`flush`), so that it outlives torchrun's restart."""

    def __init__(self, plan: Plan, rank: int, directory: Path, *elsewhere: Path) -> None:
        self.directory = directory
        self.directories = [directory, *elsewhere]
        """Where the log may be on storage: where the rank's state is (see :func:`._recovery.room_for`)."""
        self._copied: Any = None
        """On CUDA: an event recorded after the latest copy of a message to the host."""
        self.watched = set(_watched(plan, rank))
        self.keeps_batch = any(min(_neighbours(plan, lost)) == rank for lost in self.watched)
        self._messages: dict[tuple[str, int], list[Message]] = {}
        self._steps: dict[int, dict[str, Any]] = {}
        self._checkpoints: list[int] = []

    def record(self, link: str, dst: int, tensors: list[torch.Tensor], as_tuple: bool) -> None:
        """Keep a host copy of a message sent to ``dst``. From a GPU the copy goes into page-locked
        memory without waiting (a copy into pageable memory would wait for the device at every
        message); :meth:`flush` waits for the copies before it writes them."""
        if dst not in self.watched:
            return
        copies = []
        for t in tensors:
            if t.device.type == "cuda":
                copies.append(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t.detach(), non_blocking=True))
            else:
                copies.append(t.detach().to("cpu", copy=True))
        if any(t.device.type == "cuda" for t in tensors):
            self._copied = torch.cuda.Event()
            self._copied.record()  # after the copies, on the stream they were queued on
        self._messages.setdefault((link, dst), []).append((copies, as_tuple))

    def nbytes(self) -> int:
        """The bytes of the messages and batches the log holds."""
        return state_bytes(self._steps)

    def end_step(self, step: int, batch: Any, batch_idx: int) -> None:
        """The step's messages (and batch) join the log, once a checkpoint was saved to replay from."""
        if not self.watched:
            return
        if not self._checkpoints:  # no replay could use it: no growth without bound when none is saved
            self._messages = {}
            return
        entry = {"messages": self._messages, "batch_idx": batch_idx}
        if self.keeps_batch:
            entry["batch"] = move_data_to_device(batch, "cpu")
        self._messages = {}
        self._steps[step] = entry

    def checkpointed(self, step: int) -> None:
        """A checkpoint of ``step`` was saved: only the steps since the one before it stay (in memory,
        and on storage from an earlier loss)."""
        self._checkpoints = [*self._checkpoints[-1:], step]
        for old in [s for s in self._steps if s < self._checkpoints[0]]:
            del self._steps[old]
        for directory in self.directories:
            for path in directory.glob("step*.pt") if directory.is_dir() else ():
                if int(path.stem[4:]) < self._checkpoints[0]:
                    path.unlink(missing_ok=True)

    def flush(self, directory: Path | None = None) -> None:
        """The log to storage in ``directory`` (one of :attr:`directories`; ``None``: the first), a file
        per step, each under a temporary name then renamed (called with the rank's kept state, after a
        loss). The same steps elsewhere, from an earlier attempt, go."""
        if not self._steps:
            return
        directory = directory or self.directory
        if directory not in self.directories:
            self.directories.append(directory)
        if self._copied is not None:
            self._copied.synchronize()  # the messages' copies to the host are done
        private_directory(directory)
        for step, entry in self._steps.items():
            path = directory / f"step{step}.pt"
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            torch.save(entry, tmp)
            os.replace(tmp, path)
            for other in self.directories:
                if other != directory:
                    (other / path.name).unlink(missing_ok=True)

    def read(self, steps: range, lost: int) -> list[dict[str, Any]] | None:
        """This rank's entries for ``lost`` over ``steps``, wherever they were written; ``None`` if one is missing."""
        entries = []
        for step in steps:
            path = next((d / f"step{step}.pt" for d in self.directories if (d / f"step{step}.pt").is_file()), None)
            if path is None:
                return None
            entry = torch.load(path, map_location="cpu", weights_only=False)
            messages = {k: v for k, v in entry["messages"].items() if k[1] == lost}
            entries.append({**entry, "messages": messages})
        return entries


def replay_lost_stages(
    parts: FitParts, logbook: Logbook, plan: Plan, lost: list[int], checkpoint: tuple[str, int], step: int, group: Any
) -> str | None:
    """Replay every rank in ``lost`` (each an unreplicated stage's) from ``checkpoint`` (path, its
    step) up to ``step`` (collective over every rank); ``logbook``: this rank's. ``None`` when done;
    else why it was refused, on every rank, before any state changed."""
    rank, (path, start) = dist.get_rank(), checkpoint
    trainer = parts.module.trainer
    logs: dict[int, Any] = {}
    for victim in lost:
        if rank in _neighbours(plan, victim):
            with long_host_work(parts.timeout.total_seconds()):  # pickling the log holds the GIL
                dist.send_object_list([logbook.read(range(start, step), victim)], dst=victim, group=group)
        elif rank == victim:
            for sender in _neighbours(plan, victim):
                box: list[Any] = [None]
                with long_host_work(parts.timeout.total_seconds()):
                    dist.recv_object_list(box, src=sender, group=group)
                logs[sender] = box[0]
    refusal = _refusal(parts, trainer, path, start, step, logs) if rank in lost else None
    refusals: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(refusals, refusal, group=group)
    if found := next((r for r in refusals if r is not None), None):
        return found
    if rank in lost:
        _replay(parts, trainer, path, start, step, logs)
    return None


def _refusal(parts: FitParts, trainer: Any, path: str, start: int, step: int, logs: Mapping[int, Any]) -> str | None:
    missing = [sender for sender, entries in logs.items() if entries is None]
    if missing:
        return f"the log of steps {start}-{step - 1} is incomplete on rank(s) {missing}"
    if not Path(path).exists():
        return f"the checkpoint {path} is not there"
    if parts.pipeline.reducers:
        return "the stage shares parameters with other stages, whose gradients a replay alone cannot sum"
    if trainer.gradient_clip_val:
        return "gradient clipping's norm spans every stage, which a replay alone cannot compute"
    if any(c.interval != "step" or c.reduce_on_plateau for c in trainer.lr_scheduler_configs):
        return "only schedulers stepped per step (interval='step', not on a metric) can be replayed"
    return None


def _replay(parts: FitParts, trainer: Any, path: str, start: int, step: int, logs: Mapping[int, Any]) -> None:
    configs = trainer.lr_scheduler_configs
    checkpoint = parts.load_checkpoint(path)
    parts.checkpoints.load_model(checkpoint, strict=False)
    parts.checkpoints.load_optimizers(checkpoint)
    for config, state in zip(configs, checkpoint.get("lr_schedulers", []), strict=False):
        config.scheduler.load_state_dict(state)
    steps, pipeline = parts.steps, parts.pipeline
    for i in range(step - start):
        entries = [entries[i] for entries in logs.values()]
        batch = next(e["batch"] for e in entries if "batch" in e)
        batch_idx = entries[0]["batch_idx"]
        inbox: dict[tuple[str, int], list[Message]] = {}
        for sender, entry in zip(logs, entries, strict=True):
            for (link, _), messages in entry["messages"].items():
                inbox[(link, sender)] = messages
        with pipeline.replay(inbox):
            steps.dataloader_idx = 0
            steps.train(pipeline, (batch, batch_idx), {}, parts.train_step_context)
        for optimizer in parts.optimizers:
            optimizer.zero_grad()
        steps.add_fresh_gradients(1.0)
        for optimizer in parts.optimizers:
            optimizer.step()
        for config in configs:  # as Lightning steps them: by the batch's index in its epoch
            if (batch_idx + 1) % config.frequency == 0:
                config.scheduler.step()
    sys.stderr.write(f"dapple: rank {dist.get_rank()} replayed steps {start}-{step - 1} from its neighbours' log\n")
