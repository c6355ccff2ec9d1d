"""What recovery copies of a rank's state at every step's safe point, made cheap to take.

Recovery takes these every step while training runs well (:mod:`._recovery`), on the critical
path before the step's first forward, so each part is read the cheapest way that still gives a
copy the live objects cannot change:

- Lightning's loop state: the loops and their progress trackers are found once per trainer
  (:class:`LoopsReader`), then read field by field each step.
- The module's buffers (running statistics, which a forward changes before the optimizer's
  update): found once per module as ``(module, name)`` slots, then cloned each step.
- The parts that may share objects with live ones (callbacks' and schedulers' state dicts) are
  pickled into one bytes object (:class:`Snapshot`); the parts that are fresh objects when taken
  (the RNG states, the data position) are kept as they are, since pickling a tensor costs more
  than the rest of the snapshot together.
"""

from __future__ import annotations

import copy
import pickle
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from dapple_lightning.strategy._lightning import BaseProgress, Loop

__all__ = ["FRESH", "BufferCopies", "LoopsReader", "Snapshot", "loops_state"]

FRESH = ("rng", "order")
"""Snapshot parts that are new objects when taken (``torch.get_rng_state()`` and numpy's ``get_state``
return copies, Python's is a tuple of ints, the data position a tensor replaced each epoch)."""


@dataclass(frozen=True)
class Snapshot:
    """A step's small state: the parts that may share objects with live ones pickled when taken (one
    bytes object per step instead of a tree of dicts that would live through the step, and through
    the garbage collector's older generations), the :data:`FRESH` parts as they are."""

    step: int
    packed: bytes
    fresh: dict[str, Any]

    @classmethod
    def of(cls, state: dict[str, Any]) -> Snapshot:
        shared = {k: v for k, v in state.items() if k not in FRESH}
        packed = pickle.dumps(shared, protocol=pickle.HIGHEST_PROTOCOL)
        return cls(state["global_step"], packed, {k: state[k] for k in FRESH})

    def unpack(self) -> dict[str, Any]:
        return {**pickle.loads(self.packed), **self.fresh}


class LoopsReader:
    """Lightning's loops' state dict (what its checkpoints hold under ``"loops"``), read without
    ``dataclasses.asdict``, whose recursive copies were most of a step's snapshot.

    The loops and the names of their progress trackers are found once; each read walks those
    names again (a loop that replaced a tracker or a sub-loop is read as it is now). A tracker's
    state is its ``__dict__`` (as its ``load_state_dict`` reads it back) of numbers and nested
    trackers; a loop's own ``state_dict`` entry (a data loader's state, say) is deep-copied.
    """

    _TOP = ("fit", "validate", "test", "predict")

    def __init__(self, trainer: Any) -> None:
        self._layout = {f"{name}_loop": list(_walk(getattr(trainer, f"{name}_loop"), (), "")) for name in self._TOP}

    def __call__(self, trainer: Any) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for top, loops in self._layout.items():
            into: dict[str, Any] = {}
            for path, prefix, trackers, own_state in loops:
                loop = getattr(trainer, top)
                for name in path:
                    loop = getattr(loop, name)
                into[prefix + "state_dict"] = copy.deepcopy(loop.on_save_checkpoint()) if own_state else {}
                for name in trackers:
                    into[prefix + name] = _progress(getattr(loop, name))
            state[top] = into
        return state


def _walk(loop: Loop, path: tuple[str, ...], prefix: str) -> Iterator[tuple[tuple[str, ...], str, list[str], bool]]:
    """``(attribute path, key prefix, tracker names, has own state)`` of ``loop`` and its sub-loops, in
    the order of Lightning's ``_Loop.state_dict``."""
    trackers, subloops = [], []
    for name, value in vars(loop).items():
        if isinstance(value, BaseProgress):
            trackers.append(name)
        elif isinstance(value, Loop):
            subloops.append(name)
    own_state = type(loop).on_save_checkpoint is not Loop.on_save_checkpoint  # the base's is always {}
    yield path, prefix, trackers, own_state
    for name in subloops:
        yield from _walk(getattr(loop, name), (*path, name), f"{prefix}{name}.")


def _progress(tracker: BaseProgress) -> dict[str, Any]:
    return {k: _progress(v) if isinstance(v, BaseProgress) else v for k, v in vars(tracker).items()}


_READERS: weakref.WeakKeyDictionary[Any, tuple[Any, LoopsReader]] = weakref.WeakKeyDictionary()


def loops_state(trainer: Any) -> dict[str, Any]:
    """``trainer``'s loops' state dict, through a :class:`LoopsReader` kept per trainer (and its fit loop)."""
    kept = _READERS.get(trainer)
    if kept is None or kept[0] is not trainer.fit_loop:
        kept = _READERS[trainer] = (trainer.fit_loop, LoopsReader(trainer))
    return kept[1](trainer)


class BufferCopies:
    """Copies of a module's persistent buffers under their ``state_dict`` keys, with the slots that
    hold them found once: each copy reads the slot again, so a buffer replaced by assignment is seen.
    A key whose value is not one of the module's buffers (a state-dict hook made it) is read through
    ``state_dict`` every time."""

    def __init__(self, module: nn.Module) -> None:
        slots = {id(b): (m, n) for m in module.modules() for n, b in m._buffers.items() if b is not None}
        params = {id(p) for p in module.parameters()}
        self._slots: dict[str, tuple[nn.Module, str]] = {}
        self._slow = False
        for key, value in module.state_dict(keep_vars=True).items():
            if id(value) in params or not isinstance(value, Tensor):
                continue
            if id(value) in slots:
                self._slots[key] = slots[id(value)]
            else:
                self._slow = True
        self._module = weakref.ref(module)

    def of(self, module: nn.Module) -> bool:
        """Whether these slots were found on ``module``."""
        return self._module() is module

    def take(self) -> dict[str, Tensor]:
        module = self._module()
        if module is None:
            return {}
        if self._slow:
            params = {id(p) for p in module.parameters()}
            items = module.state_dict(keep_vars=True).items()
            return {k: v.detach().clone() for k, v in items if id(v) not in params and isinstance(v, Tensor)}
        copies = {}
        for key, (owner, name) in self._slots.items():
            buffer = owner._buffers.get(name)
            if buffer is not None:
                copies[key] = buffer.detach().clone()
        return copies
