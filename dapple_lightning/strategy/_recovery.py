"""Training survives a lost rank under torchrun's restarts, without a checkpoint (SWIFT's idea).

No copy of the model is made while training runs well. Each rank keeps a few small facts per
step (Lightning's loop counters, schedulers and callbacks' state, the RNG states, the epoch's
data order), taken at the step's *safe point* (the strategy's ``batch_to_device`` for a training
batch, after every bit of the previous step's bookkeeping). When a peer is lost, every survivor
whose parameters still belong to that snapshot writes them, with its optimizer state and the
snapshot, to node-local storage and ends; torchrun's agent then restarts every rank, and
:mod:`._resume` hands the state back (a replacement receives its stage's from a replica).

Consistency comes from a per-step vote in the launcher's store, just before the optimizer step
(after Lightning's closure and gradient clipping, inside the optimizer's step), on one counter per
step (:mod:`._ballot`): every rank adds one to it, and a rank that learns of a lost peer adds a
large number instead (the heartbeat thread does, on a store client of its own, which also wakes
the ranks waiting). The order of those adds is the decision: the step commits when every vote came
before any abort. On commit every live rank steps (the step is local and cannot fail because of a
peer), on abort none does. A gloo collective cannot serve as the vote: it can complete on one rank
and fail on another when a third dies in it.

The phases of a rank, and what a failure in each leaves:

=========  =====================================================  ================================
phase      from / to                                              on a lost peer
=========  =====================================================  ================================
idle       setup / the first safe point                           nothing to keep: from the start
step       a safe point / the vote                                write params + the snapshot
window     the vote / the end of the optimizer's update           wait for the update's end
after      the update's end / the next safe point (Lightning's    write params + Lightning's state
           bookkeeping, callbacks, validation, checkpoints)       as it is then (*)
=========  =====================================================  ================================

(*) A collective fails in the ``after`` phase only once Lightning's bookkeeping of the update is
done (in a callback, validation, a checkpoint save), and Lightning restores a loop state taken
there as it restores a checkpoint saved there (``restarted_on_train_batch_end``,
``restarted_mid_evaluation``). A SIGTERM or a lost peer seen by the heartbeat there waits for the
main thread instead: it may arrive between the update and its bookkeeping.

A rank learns of a loss three ways: a collective raises in the main thread (the strategy's
``on_exception``), the heartbeat thread sees a stale peer (the main thread may be blocked in a
receive for good), or torchrun's agent sends SIGTERM to stop the attempt. All three end in
:meth:`Recovery.save_and_exit`, which writes once, under a lock the main thread takes to leave
the ``step`` phase, so no write sees half an optimizer step.
"""

from __future__ import annotations

import datetime
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from dapple_lightning.microbatch import tensors
from dapple_lightning.planner import format_bytes
from dapple_lightning.strategy._ballot import Ballot, Undecided
from dapple_lightning.strategy._heartbeat import attempt, end_rank, launcher_client
from dapple_lightning.strategy._lightning import (
    Patches,
    after_closure,
    batches_that_stepped,
    callbacks_state,
    collect_rng_states,
    set_batches_that_stepped,
    set_rng_states,
)
from dapple_lightning.strategy._order import EpochOrder, track
from dapple_lightning.strategy._snapshot import BufferCopies, Snapshot, loops_state
from dapple_lightning.strategy._step import to_cpu

__all__ = ["FORMAT", "Recovery", "RecoveryMode", "files_of", "is_active", "room_for"]

RecoveryMode = bool | Literal["auto", "log"]
FORMAT = 1
"""Version of the files survivors write; a file of another version is not read."""
_PROCESS_LOCAL = (
    "_lock",
    "_written",
    "_lost",
    "_unwrap",
    "_trainer",
    "_signals",
    "_ballot",
    "_aborts",
    "_buffers",
    "_buffer_copies",
)
"""A :class:`Recovery`'s attributes that do not travel to spawned ranks: locks, hooks, connections, live objects."""
_WINDOW_WAIT_S = 10.0
"""How long a lost peer's watcher waits for the main thread to reach a safe point from the window."""


def is_active(mode: RecoveryMode) -> bool:
    """``"auto"``: on when torchrun's agent may restart the job (``--max-restarts`` > 0); ``"log"``: on,
    with the log that lets an unreplicated stage be replayed (:mod:`._logbook`)."""
    if mode not in ("auto", "log", True, False):
        raise ValueError(f"recovery must be 'auto', 'log', True or False, got {mode!r}")
    if mode == "auto":
        return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and "TORCHELASTIC_RUN_ID" in os.environ
    return bool(mode)


def files_of(rank: int) -> list[Path]:
    """Where ``rank`` may keep its state, in order of preference: node-local, one directory per user and
    torchrun run, under ``DAPPLE_RECOVERY_DIR``, else ``/dev/shm`` where it exists (memory), then
    under the temporary directory (on disk) for when the first lacks the room (see :func:`room_for`)."""
    disk = tempfile.gettempdir()
    first = os.environ.get("DAPPLE_RECOVERY_DIR") or ("/dev/shm" if os.access("/dev/shm", os.W_OK) else disk)
    run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    roots = [first] if Path(first) == Path(disk) else [first, disk]
    return [Path(root) / f"dapple-recovery-{os.getuid()}" / run / f"rank{rank}.pt" for root in roots]


def free_bytes(path: Path) -> int:
    """Bytes free on the file system that holds ``path`` (or would: its nearest existing ancestor)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def room_for(rank: int, size: int, free: Callable[[Path], int]) -> Path:
    """Where ``rank`` writes state of about ``size`` bytes: the first of :func:`files_of` whose file system
    has the room (``free`` tells the bytes free there), saying so when that is not the first; the
    last when none has it (the write then fails, saying where). ``/dev/shm`` is often small in
    containers (Docker's default is 64 MiB), and a full one fails the write."""
    places = files_of(rank)
    needed = size + size // 16 + 2**24  # the pickle's own bytes, and room for other writers
    chosen = next((p for p in places if free(p.parent) >= needed), places[-1])
    if chosen != places[0]:
        sys.stderr.write(
            f"dapple: rank {rank} keeps its state for recovery in {chosen.parent}: {places[0].parent} has "
            f"{format_bytes(free(places[0].parent))} free, {format_bytes(needed)} are needed\n"
        )
    return chosen


def state_bytes(obj: Any) -> int:
    """The bytes of the tensors in ``obj`` (dicts, lists and tuples of them)."""
    return sum(t.nbytes for t in tensors(obj))


def private_directory(path: Path) -> Path:
    """``path`` created (mode 0700) or checked: the files in it are unpickled, so another user must
    not be able to plant one there."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    for part in (path, path.parent):
        info = part.stat()
        if info.st_uid != os.getuid() or info.st_mode & 0o022:
            raise PermissionError(f"{part} must belong to this user and not be writable by others")
    return path


class Recovery:
    """One rank's side of recovery while it trains: snapshot, vote, write on a loss."""

    def __init__(self, mode: RecoveryMode) -> None:
        self.mode = mode
        is_active(mode)  # validates
        self.active = False
        self.rank = 0
        self._phase: Literal["idle", "step", "window", "after"] = "idle"
        self._lock = threading.RLock()
        self._written = threading.Event()  # this rank wrote its state (or found it could not)
        self._lost = threading.Event()  # a peer is known lost
        self._exit_at_safe_point = False  # SIGTERM or a lost peer arrived in the window
        self._writing = False  # a write is under way (a signal handler must not start another)
        self._stop_after_write = False  # a SIGTERM came during the write
        self._trainer: Any = None
        self._identity: dict[str, Any] = {}
        self._snapshot: Snapshot | None = None
        self._ballot: Ballot | None = None  # the main thread's vote, on its own client of the launcher's store
        self._aborts: Ballot | None = None  # another client's, for the heartbeat thread: it aborts a vote under way
        self._pending: int | None = None  # the step whose vote the main thread casts or waits for
        self._signals: Any = None
        self._unwrap: Any = None  # removes the optimizers' step hooks
        self._buffers: dict[str, Any] = {}  # the module's buffers at the last safe point
        self._buffer_copies: BufferCopies | None = None  # where the module's buffers are, found once per module
        self.free_bytes: Callable[[Path], int] = free_bytes
        """Tells the bytes free where the state may go (see :func:`room_for`)."""
        self.order: EpochOrder | None = None
        """The training loader's order, whose epoch start the snapshot keeps."""
        self.logbook: Any = None
        """With ``recovery="log"``: this rank's :class:`~._logbook.Logbook`."""
        self.last_checkpoint: tuple[str, int] | None = None
        """The last checkpoint the strategy saved: its path and global step."""
        self.recovered: dict[str, Any] | None = None
        """After a restart: the checkpoint dict recovered for this rank, until the first safe point (its RNG
        states are set there, its data position when the training loader is set up)."""

    def __getstate__(self) -> dict[str, Any]:  # the strategy travels to spawned ranks before any fit
        state = self.__dict__.copy()
        for name in _PROCESS_LOCAL:
            state.pop(name)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["mode"])  # fresh process-local attributes
        self.__dict__.update(state)

    # ------------------------------------------------------------------ set-up

    def start(self, trainer: Any, identity: dict[str, Any], patches: Patches) -> None:
        """Begin for a fit: ``identity`` (run, plan, world, rank, stage) goes into the file; every
        optimizer step waits for the vote (its hook into the precision plugin recorded in ``patches``)."""
        self._trainer, self._identity, self.rank = trainer, identity, identity["rank"]
        self._phase, self._snapshot, self._exit_at_safe_point = "idle", None, False
        self._written.clear()
        self._lost.clear()
        if not is_active(self.mode):
            return
        self._ballot, self._aborts = (
            Ballot(_vote_store(trainer, identity["fit"], identity["timeout_s"]), identity["world"]) for _ in range(2)
        )
        if trainer.accumulate_grad_batches != 1 or not trainer.lightning_module.automatic_optimization:
            rank_zero_warn(
                "dapple: recovery needs automatic optimization without gradient accumulation (one optimizer step "
                "per batch); it is off for this run, and a lost rank ends the job as without it"
            )
            return
        self.active = True
        # The vote goes where every collective of the step is behind and the update ahead: after
        # Lightning's closure (training_step, backward) and its gradient clipping (an all-reduce),
        # inside the optimizer's step. An optimizer step pre-hook would run before the closure.
        after_closure(patches, trainer.strategy.precision_plugin, self._vote)
        hooks = [o.register_step_post_hook(self._updated) for o in trainer.strategy.optimizers]

        def unwrap() -> None:
            for hook in hooks:
                hook.remove()

        self._unwrap = unwrap

    def track_loader(self, patches: Patches, dataloader: object, trainer: Any) -> None:
        """``process_dataloader``: the training loader's order becomes resumable."""
        if self.active and trainer.state.stage == RunningStage.TRAINING:
            self.order = track(patches, dataloader, None if self.recovered is None else self.recovered["dapple_order"])

    def listen(self) -> None:
        """At the start of training: torchrun's SIGTERM (the agent stopping the attempt) writes the state.
        Installed after Lightning's own handler, which broadcasts on the process group, which is lost."""
        if self.active and threading.current_thread() is threading.main_thread():
            self._signals = signal.signal(signal.SIGTERM, self._on_sigterm)

    def close(self, *, failed: bool) -> None:
        """After ``fit``: the signal handler goes; on success this rank's file too (it is stale)."""
        if self._signals is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._signals)
            self._signals = None
        if self.active and not failed:
            for path in files_of(self.rank):
                path.unlink(missing_ok=True)
        self.recovered, self.order = None, None
        if self._unwrap is not None:
            self._unwrap()
            self._unwrap = None
        self.active = False
        self._ballot = self._aborts = None  # the vote's connections to the launcher's store

    # ------------------------------------------------------------------ the step

    def safe_point(self) -> None:
        """A training batch is about to move: the previous step is done, bookkeeping included."""
        if not self.active:
            return
        if self.recovered is not None:  # where the recovered step's snapshot was taken
            set_rng_states(self.recovered["dapple_rng"])
            # Lightning counts a restart after a validation as one at the end of a batch and steps this twice.
            set_batches_that_stepped(self._trainer, self.recovered["dapple_batches_that_stepped"])
            self.recovered = None
            for path in files_of(self.rank):  # restored: it must not come back after a later failure
                path.unlink(missing_ok=True)
        if self._trainer.accumulate_grad_batches != 1:  # raised since the start (GradientAccumulationScheduler)
            self.active = False
            rank_zero_warn("dapple: gradient accumulation began, which recovery cannot follow; recovery is off")
            return
        snapshot = Snapshot.of(self._take())
        with self._lock:
            self._snapshot, self._phase = snapshot, "step"
        if self._exit_at_safe_point:
            self.save_and_exit("the job is being stopped (a peer was lost)")

    def _take(self) -> dict[str, Any]:
        """The step's small state; and the module's buffers (running statistics), which its forward
        changes before the vote: a write must hold them as they were at the step's start. Taken
        every step; :mod:`._snapshot` says how it is kept cheap and apart from the live objects."""
        trainer, module = self._trainer, self._trainer.lightning_module
        if self._buffer_copies is None or not self._buffer_copies.of(module):
            self._buffer_copies = BufferCopies(module)
        self._buffers = self._buffer_copies.take()
        precision = trainer.strategy.precision_plugin
        return {
            "epoch": trainer.current_epoch,
            "global_step": trainer.global_step,
            "loops": loops_state(trainer),
            "rng": collect_rng_states(include_cuda=torch.cuda.is_available()),
            "batches_that_stepped": batches_that_stepped(trainer),
            "checkpoint": self.last_checkpoint,
            "callbacks": callbacks_state(trainer),
            "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
            "precision": (type(precision).__qualname__, precision.state_dict()),
            "order": None if self.order is None else self.order.position(trainer),
        }

    def after_step(self, args: tuple) -> None:
        """The strategy's ``training_step`` ran: the step's log (if any) to storage."""
        if self.active and self.logbook is not None:
            self.logbook.end_step(self._trainer.global_step, args[0], args[1] if len(args) > 1 else 0)

    def checkpointed(self, path: Any, step: int) -> None:
        """The strategy saved a checkpoint of ``step``: the log since it is what a replay needs."""
        if self.active:
            self.last_checkpoint = (str(path), step)
            if self.logbook is not None:
                self.logbook.checkpointed(step)

    def _updated(self, *args: Any) -> None:
        """Optimizer step post-hook: the update is done; Lightning's bookkeeping of it follows."""
        if self.active:
            with self._lock:
                self._phase = "after"

    def _vote(self) -> None:
        """Before the optimizer's update: go on only if every rank reached this point (see the module docstring)."""
        if not self.active or self._snapshot is None:
            return
        with self._lock:
            self._phase = "window"  # a write from now on waits for the end of the update
        step = self._snapshot.step
        device_work_done(self._trainer.strategy.root_device)  # what the vote certifies has happened
        self._pending = step  # from here a loss the heartbeat sees aborts this step's vote
        try:
            # A loss seen before the step was published was missed by on_peer_lost's abort.
            if self._lost.is_set() or self._exit_at_safe_point:
                commit = self._ballot.abort(step)
            else:
                commit = self._ballot.cast(step)
        except Undecided as error:  # the phase stays "window": no state is kept, since peers may have updated
            raise RuntimeError(f"dapple: {error}; this rank cannot tell whether its peers updated") from error
        finally:
            self._pending = None
        # Every rank has voted on step - 1, so step - 2's keys are done with. The last rank (on the last
        # stage, which ends its backward first and waits here anyway) deletes them, off the critical path.
        if self.rank == self._identity["world"] - 1 and step >= 2:
            self._ballot.forget(step - 2)
        if not commit:
            with self._lock:
                self._phase = "step"  # nothing stepped: the snapshot still describes this rank
            raise RuntimeError(
                f"dapple: a peer was lost before every rank reached the optimizer step of step {step}; no rank steps"
            )

    # ------------------------------------------------------------------ a loss

    def on_failure(self) -> None:
        """The main thread's error (the strategy's ``on_exception``): write the state if it is whole."""
        if not self.active:
            return
        self._lost.set()
        with self._lock:
            if self._phase == "after":  # the update and its bookkeeping are done: Lightning's state as it is
                state = self._take()
                if self._trainer.validating:
                    _inside_a_batch(state["loops"]["fit_loop"]["epoch_loop.val_loop.batch_progress"])
                self._snapshot = Snapshot.of(state)
                self._phase = "step"
            if self._phase == "step":
                self._write()
            elif self._phase == "window" and not self._written.is_set():
                sys.stderr.write(
                    f"dapple: rank {self.rank} failed inside its optimizer's update; its state is not one step's, so "
                    "it is not kept for recovery\n"
                )

    def on_peer_lost(self, reason: str) -> None:
        """The heartbeat thread's end (the main thread may be blocked in a receive for good)."""
        self._lost.set()
        aborts, pending = self._aborts, self._pending  # (close() may clear them as this runs)
        if self.active and aborts is not None and pending is not None:
            try:  # the main thread waits for a vote that the lost peer will never cast
                aborts.abort(pending, learn=False)
            except RuntimeError as error:
                sys.stderr.write(f"dapple: rank {self.rank} could not abort the vote on step {pending}: {error}\n")
        if self.active:
            with self._lock:
                if self._phase == "step":
                    self.save_and_exit(reason)  # under the lock: the main thread cannot start an update
                self._exit_at_safe_point = True
            self._written.wait(_WINDOW_WAIT_S)  # the main thread writes where it can, then ends
            self.save_and_exit(reason)  # waits for a write under way (it holds the lock); writes if it can
        _end(self.rank, reason)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self._writing:  # the handler interrupted this thread's own write: let it finish, then end
            self._stop_after_write = True
            return
        with self._lock:  # reentrant: the main thread may hold it, in which case its phase is consistent
            if self._phase == "step" or self._phase == "idle":
                self.save_and_exit("torchrun stopped this attempt")
        self._exit_at_safe_point = True  # in the window: at the next safe point

    def save_and_exit(self, reason: str) -> None:
        with self._lock:
            if self._phase == "step":
                self._write()
        _end(self.rank, reason)

    def _write(self) -> None:
        """This rank's state at its snapshot's step, to node-local storage, once (under the lock)."""
        if self._written.is_set() or self._writing or self._snapshot is None:
            return
        self._writing = True
        module, strategy = self._trainer.lightning_module, self._trainer.strategy
        state = {
            "format": FORMAT,
            **self._identity,
            "step": self._snapshot.step,
            "snapshot": self._snapshot.unpack(),
            "state_dict": {k: self._buffers.get(k, v).detach().cpu() for k, v in module.state_dict().items()},
            "optimizer_states": [to_cpu(o.state_dict()) for o in strategy.optimizers],
        }
        logged = self.logbook.nbytes() if self.logbook is not None else 0
        path = room_for(self.rank, state_bytes(state) + logged, self.free_bytes)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            private_directory(path.parent)
            torch.save(state, tmp)  # the page cache outlives the process: no fsync needed for a restart
            os.replace(tmp, path)  # a rank killed mid-write leaves the previous file whole
            for other in files_of(self.rank):  # an earlier attempt's, elsewhere, must not be read instead
                if other != path:
                    other.unlink(missing_ok=True)
            if self.logbook is not None:
                self.logbook.flush(path.parent / f"log-rank{self.rank}")
        except Exception as error:  # a full /dev/shm raises RuntimeError from torch.save, not OSError
            tmp.unlink(missing_ok=True)
            sys.stderr.write(f"dapple: rank {self.rank} could not keep its state for recovery in {path}: {error}\n")
        finally:
            self._written.set()
            self._writing = False
        if self._stop_after_write:  # torchrun is stopping the attempt: the failure path would only delay it
            _end(self.rank, "torchrun stopped this attempt")


def device_work_done(device: torch.device) -> None:
    """Return once ``device`` has finished the work queued on it so far.

    The vote certifies that this step's gradient sums (and the clipping's norm) are complete. On a
    GPU, NCCL's ``work.wait()`` only makes the current stream wait for the collective: the host goes
    on while it runs. Voting then, a rank could commit a step whose all-reduce a peer's death leaves
    half done, and keep weights updated from partial sums. An event recorded after that work and
    waited for on the host closes the gap (one host wait per step). On the CPU the collectives
    have already finished when their ``wait()`` returns, and there is nothing to wait for.
    """
    if device.type == "cuda":
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        done.synchronize()


def _vote_store(trainer: Any, fit: int, timeout_s: float) -> Any:
    """A client of the launcher's store (torchrun's agent, or rank 0 under Lightning's launcher), under
    keys of this attempt's fit only: the agent's store outlives the attempts."""
    env = trainer.strategy.cluster_environment
    client = launcher_client(env.main_address, env.main_port, datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"dapple/vote/{attempt()}/{fit}", client)


def _inside_a_batch(progress: dict[str, Any]) -> None:
    """A validation run's progress taken between two of its batches (a collective failed as the next
    one moved) as if taken inside the next: Lightning then finishes the run after the restore, as the
    uninterrupted run did, instead of counting it done (what it does for a state saved before it)."""
    for counts in (progress["total"], progress["current"]):
        if counts["ready"] == counts["started"] == counts["processed"] == counts["completed"]:
            counts["ready"] += 1
            counts["started"] += 1


def _end(rank: int, reason: str) -> None:
    end_rank(rank, f"{reason}. Its state is kept for the restart where it was whole.")
