"""Every change dapple makes to objects it does not own, and every private Lightning name it uses.

The objects are Lightning's (trainer, loops, precision plugin, callbacks), the optimizers and the
user's (the LightningModule, its data loaders). Where Lightning offers a public hook or override,
the strategy uses it (``ParallelStrategy``'s hooks, torch's optimizer step hooks); the rest is
listed here. Each change is an attribute set through a :class:`Patches` record, which keeps
(object, attribute, previous value) and puts every one back in reverse order on
:meth:`Patches.remove` (the strategy's ``teardown``, which Lightning also calls after an
exception) or at the end of a ``with`` block (:meth:`Patches.scoped`, also when the block raises).

=========================== ========================= ==================================================== =========
object                      attribute                 why                                                  undone
=========================== ========================= ==================================================== =========
user's LightningModule      ``log`` (instance)        a micro-batch's values are captured and combined per block end
                                                      global batch; while plan="auto" runs the step to
                                                      profile, nothing is logged
user's LightningModule      ``cpu`` (instance)        Lightning's teardown moves the model to the CPU; a   block end
                                                      module left on the meta device has nothing to move
precision plugin            ``clip_grad_by_norm``     the norm must span every stage's gradients, not this teardown
                                                      rank's
precision plugin            ``_after_closure``        recovery's vote goes after the closure and clipping, teardown
                                                      inside the optimizer step: no public hook runs there
optimizer                   ``step``                  an offloaded stage steps layer by layer where their  teardown
                                                      state lives
``BaseFinetuning`` instance ``finetune_function``     the hook sees the whole model, and a param group it  teardown
                                                      adds keeps this rank's parameters
``BaseFinetuning`` (class)  ``filter_on_optimizer``   what one device's optimizer holds, by name           block end
                                                      (Lightning calls it on the class)
``ModelSummary`` callback   ``_summary`` (instance)   it prints the whole model, as one device does, not   teardown
                                                      this rank's stage (:mod:`._summary`)
loader's ``RandomSampler``  ``generator``             every rank draws the same order                      teardown
loader's ``BatchSampler``   ``sampler``               recovery resumes an epoch mid-way                    teardown
                                                      (:class:`~._order.EpochOrder`)
checkpoint connector        ``_loaded_checkpoint``    the state recovered after a restart is what          no (*)
                                                      Lightning restores
fit loop's epoch loop       ``_batches_that_stepped`` a recovered step's count, which Lightning counts     no (*)
                                                      twice after a validation
=========================== ========================= ==================================================== =========

(*) Lightning's state, handed over as a checkpoint's restore would set it: not undone. The strategy
also sets ``rank_zero_only.rank`` as Lightning's own strategies do. The runtime changes the
``forward`` of the user's batch norms (``runtime._batchnorm``, undone at teardown by ``Buffers``)
and of split linear layers (``runtime._linear_split``, for one block): a room below the strategy,
with its own undo.

Private Lightning names are used here only: the distributed helpers of ``lightning.fabric``
(``_init_dist_connection`` and the like, as ``DDPStrategy`` uses them), its RNG state
collectors, the script and spawn launchers (whose ``_wrapping_function`` and
``_collect_rank_zero_results`` :class:`SpawnLauncher` overrides), the loop and progress base
classes (:mod:`._snapshot` walks them), ``call._call_callbacks_state_dict``,
``LightningModule._apply_batch_transfer_handler`` and ``fit_loop._data_source``; :mod:`._summary`
overrides the private ``_forward_example_input`` and ``_get_summary_data`` of Lightning's summary.

Checked against Lightning 2.4.0 and 2.6.6, the ends of the range pyproject allows (the whole suite
runs on both): another version may move any of these, which ``tests/test_lightning_adapter.py`` and
the tests that fit through the strategy would show.
"""

from __future__ import annotations

import multiprocessing
import os
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _all_gather_ddp_if_available as all_gather_if_available,
)
from lightning.fabric.utilities.distributed import (
    _destroy_dist_connection as destroy_dist_connection,
)
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized as distributed_is_initialized,
)
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device as default_backend_for,
)
from lightning.fabric.utilities.distributed import (
    _init_dist_connection as init_dist_connection,
)
from lightning.fabric.utilities.distributed import (
    _sync_ddp_if_available as sync_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device
from lightning.fabric.utilities.seed import _collect_rng_states as collect_rng_states
from lightning.fabric.utilities.seed import _set_rng_states as set_rng_states
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.loops.loop import _Loop as Loop
from lightning.pytorch.loops.progress import _BaseProgress as BaseProgress
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher as ScriptLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import (
    _check_missing_main_guard,
    _disable_module_memory_sharing,
    _GlobalStateSnapshot,
)
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

__all__ = [
    "FORKSERVER_PRELOAD",
    "STATE_LEFT_IN_SPAWNED_RANKS",
    "BaseProgress",
    "Loop",
    "Patches",
    "ScriptLauncher",
    "SpawnLauncher",
    "after_closure",
    "all_gather_if_available",
    "batches_that_stepped",
    "callbacks_state",
    "collect_rng_states",
    "default_backend_for",
    "destroy_dist_connection",
    "distributed_is_initialized",
    "finetuning_filter",
    "hand_over_checkpoint",
    "init_dist_connection",
    "live_changes",
    "optimizers_to_device",
    "set_batches_that_stepped",
    "set_rng_states",
    "shadowed_log",
    "silenced_log",
    "sync_if_available",
    "training_loader",
    "transfer_batch",
    "unmoved_cpu",
]

_ABSENT = object()
"""The previous value of an attribute the object did not hold itself (it came from its class)."""


@dataclass(frozen=True)
class _Change:
    target: Any
    name: str
    previous: Any


_LIVE: weakref.WeakSet[Patches] = weakref.WeakSet()


class Patches:
    """A record of attributes set on objects the strategy does not own, undone in reverse order."""

    def __init__(self) -> None:
        self._changes: list[_Change] = []

    def set(self, target: Any, name: str, value: Any) -> None:
        """Set ``target.name = value``, remembering what ``target`` held itself (or that it held nothing)."""
        self._changes.append(_Change(target, name, vars(target).get(name, _ABSENT)))
        setattr(target, name, value)
        _LIVE.add(self)

    @contextmanager
    def scoped(self, target: Any, name: str, value: Any) -> Iterator[None]:
        """``target.name = value`` within the block only (also when it raises)."""
        mark = len(self._changes)
        self.set(target, name, value)
        try:
            yield
        finally:
            self._undo(mark)

    def remove(self) -> None:
        """Put every changed attribute back as it was, the last change first."""
        self._undo(0)

    def changes(self) -> list[tuple[Any, str]]:
        """(object, attribute) of every change in force."""
        return [(c.target, c.name) for c in self._changes]

    def _undo(self, mark: int) -> None:
        while len(self._changes) > mark:
            change = self._changes.pop()
            if change.previous is _ABSENT:
                delattr(change.target, change.name)
            else:
                setattr(change.target, change.name, change.previous)
        if not self._changes:
            _LIVE.discard(self)


def live_changes() -> list[tuple[Any, str]]:
    """(object, attribute) of every change in force in this process, by any record."""
    return [change for patches in list(_LIVE) for change in patches.changes()]


def silenced_log(module: Any) -> Any:
    """A block in which ``module.log`` does nothing (the user's step runs outside Lightning's loops)."""
    return Patches().scoped(module, "log", lambda *args, **kwargs: None)


def shadowed_log(module: Any, log: Callable[..., None]) -> Any:
    """A block in which ``module.log`` is ``log`` (an instance attribute shadows the method)."""
    return Patches().scoped(module, "log", log)


def unmoved_cpu(module: Any) -> Any:
    """A block in which ``module.cpu()`` leaves ``module`` where it is."""
    return Patches().scoped(module, "cpu", lambda: module)


def finetuning_filter(filter_on_optimizer: Callable[[Any, Any], list[Any]]) -> Any:
    """A block in which ``BaseFinetuning.filter_on_optimizer`` is ``filter_on_optimizer``."""
    return Patches().scoped(BaseFinetuning, "filter_on_optimizer", staticmethod(filter_on_optimizer))


def after_closure(patches: Patches, precision: Any, run: Callable[[], None]) -> None:
    """``run()`` after the precision plugin's work that follows the closure (the callbacks'
    ``on_before_optimizer_step``, gradient clipping), just before the optimizer's update."""
    original = precision._after_closure

    def then_run(model: Any, optimizer: Any) -> None:
        original(model, optimizer)
        run()

    patches.set(precision, "_after_closure", then_run)


def training_loader(trainer: Trainer) -> Any:
    """The training loader as the user gave it, before the fit loop has set up its combined loader."""
    return trainer.fit_loop._data_source.dataloader()


def hand_over_checkpoint(trainer: Trainer, checkpoint: dict[str, Any]) -> None:
    """Lightning restores ``checkpoint`` after the strategy's ``setup``, as a ``ckpt_path``'s."""
    trainer._checkpoint_connector._loaded_checkpoint = checkpoint


def batches_that_stepped(trainer: Trainer) -> int:
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def set_batches_that_stepped(trainer: Trainer, count: int) -> None:
    trainer.fit_loop.epoch_loop._batches_that_stepped = count


def callbacks_state(trainer: Trainer) -> dict[str, Any]:
    """The callbacks' state as a checkpoint holds it."""
    return call._call_callbacks_state_dict(trainer)


def transfer_batch(module: Any, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
    """``batch`` through the module's ``transfer_batch_to_device`` and ``on_after_batch_transfer`` hooks."""
    return module._apply_batch_transfer_handler(batch, device=device, dataloader_idx=dataloader_idx)


# ------------------------------------------------------------------------- the spawn launcher

FORKSERVER_PRELOAD = ("torch", "lightning.pytorch", "dapple_lightning.strategy")
"""What the fork server imports once, so that no rank forked from it imports them again."""

STATE_LEFT_IN_SPAWNED_RANKS = (
    "dapple: after fit with start_method='spawn' (or 'forkserver') the optimizer, scheduler and loop state stayed in the spawned "
    "ranks; this process has the trained weights only. Save inside the run (a ModelCheckpoint or a callback's "
    "on_train_end), launch with start_method='popen' (the default), or save the weights with "
    "torch.save(model.state_dict(), path)"
)


class SpawnLauncher(_MultiProcessingLauncher):
    """Lightning's spawn launcher; ranks leave the process group together.

    After ``fit`` the launching process has the trained weights but not the optimizer, scheduler
    or loop state, which stayed in the ranks: the strategy is told (``on_state_left_in_ranks``),
    so it refuses to write a checkpoint that would silently lack them.
    """

    def __init__(
        self, strategy: ParallelStrategy, start_method: str, on_state_left_in_ranks: Callable[[], None]
    ) -> None:
        super().__init__(strategy, start_method=start_method)
        self._on_state_left_in_ranks = on_state_left_in_ranks

    @override
    def launch(self, function: Any, *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
        if self._start_method == "forkserver":
            _check_missing_main_guard()  # a forked rank imports __main__ again, as a spawned one does
            # Takes effect when this process starts its fork server, i.e. on the first launch.
            multiprocessing.get_context("forkserver").set_forkserver_preload(list(FORKSERVER_PRELOAD))
            # Lightning hands this snapshot (seeds, deterministic flags) only to spawned ranks; a
            # forked rank would otherwise carry the fork server's RNG, not this process's. The
            # launcher travels to the ranks with the bound method they run, and the snapshot with it.
            self._parent_globals = _GlobalStateSnapshot.capture()
            # A forked rank has the fork server's environment, which predates variables set
            # since (Lightning's PL_GLOBAL_SEED, a user's settings); a spawned rank has this one,
            # with the port that Lightning's launch is about to set.
            assert self._strategy.cluster_environment is not None
            os.environ["MASTER_PORT"] = str(self._strategy.cluster_environment.main_port)
            self._parent_environ = dict(os.environ)
        result = super().launch(function, *args, trainer=trainer, **kwargs)
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            self._on_state_left_in_ranks()
        return result

    @override
    def _wrapping_function(
        self, process_idx: int, trainer: Any, function: Any, args: Any, kwargs: Any, *rest: Any
    ) -> None:
        if self._start_method == "forkserver":
            os.environ.clear()
            os.environ.update(self._parent_environ)
            self._parent_globals.restore()
            if isinstance(self._strategy.accelerator, CPUAccelerator):
                # The model reaches a forked rank in shared memory, as it does a spawned one: unshare
                # it, as Lightning does for spawned CPU ranks, or every rank would update the same
                # parameters (on a GPU each rank's own copy is the one it moves to its device).
                args, kwargs = _disable_module_memory_sharing((args, kwargs))
        super()._wrapping_function(process_idx, trainer, function, args, kwargs, *rest)

    @override
    def _collect_rank_zero_results(self, trainer: Trainer, results: Any) -> Any:
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            # Leave together: a rank that exits while a peer still talks to it aborts that peer.
            if distributed_is_initialized():
                dist.barrier()
                dist.destroy_process_group()
