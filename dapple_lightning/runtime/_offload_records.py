"""What an offloaded stage records: what it holds in memory (:class:`Residency`), and what
``offload: auto`` measures in its first training step to choose its window (:class:`TransferTimes`).

The first step runs with a window of one layer, so nothing overlaps: each layer's parameters are
read when asked for, and the time a layer computes starts once its read is done. Recorded per layer
(the least over the step's micro-batches): the forward (from its read to the next layer's call, the
last layer's to the end of the stage's forward), the backward (from its read to the previous layer's
announcement; the first layer's, which has no one after it, is taken as twice its forward), the
read of its parameters and the write of its gradients, on the worker. The planner's
:func:`~dapple_lightning.planner.choose_window` replays them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from dapple_lightning.planner import WindowChoice, choose_window

__all__ = ["Residency", "TransferTimes"]


@dataclass
class Residency:
    """What an :class:`Offloader` held in memory, counted three ways, and the peaks since :meth:`reset`.

    ``tracked``: the offloader's own ledger, the bytes of the layer tensors (parameters, gradients,
    optimizer state) it read in, or found made by autograd or the optimizer, and has not dropped.
    ``storage``: the bytes of the storages the layers' tensors point to now (a scan).
    ``alive``: the bytes of every storage the ledger ever held that is still allocated (a
    ``weakref.finalize`` on each storage subtracts its bytes once the memory is freed, so a storage
    that something else, such as autograd, keeps alive stays counted).
    ``layers``: layers with anything in the ledger; ``alive_layers``: layers with a storage still allocated.
    """

    tracked: int = 0
    storage: int = 0
    alive: int = 0
    layers: int = 0
    alive_layers: int = 0
    peak_tracked: int = 0
    peak_storage: int = 0
    peak_alive: int = 0
    peak_layers: int = 0
    peak_alive_layers: int = 0
    samples: int = 0

    def reset(self) -> None:
        """Start new peaks from what is in memory now."""
        self.peak_tracked, self.peak_storage = self.tracked, self.storage
        self.peak_alive, self.peak_layers, self.peak_alive_layers = self.alive, self.layers, self.alive_layers

    def update(self) -> None:
        self.samples += 1
        self.peak_tracked = max(self.peak_tracked, self.tracked)
        self.peak_storage = max(self.peak_storage, self.storage)
        self.peak_alive = max(self.peak_alive, self.alive)
        self.peak_layers = max(self.peak_layers, self.layers)
        self.peak_alive_layers = max(self.peak_alive_layers, self.alive_layers)


class TransferTimes:
    """Per-layer compute and transfer seconds of an offloaded stage, the least seen of each."""

    def __init__(self, layers: int) -> None:
        self.forward_s = [math.inf] * layers
        self.backward_s = [math.inf] * layers
        self.read_s = [math.inf] * layers
        self.write_s = [math.inf] * layers
        self._open: tuple[list[float], int, float] | None = None

    def begin(self, kind: str, index: int) -> None:
        """Layer ``index``'s ``"forward"`` or ``"backward"`` compute starts now."""
        self.end()
        self._open = (self.forward_s if kind == "forward" else self.backward_s, index, time.perf_counter())

    def end(self) -> None:
        """The computing layer is done (the next is called, or the stage's forward ended)."""
        if self._open is not None:
            times, index, start = self._open
            times[index] = min(times[index], time.perf_counter() - start)
            self._open = None

    def transfer(self, kind: str, index: int, seconds: float) -> None:
        times = self.read_s if kind == "read" else self.write_s
        times[index] = min(times[index], seconds)

    @property
    def trained(self) -> bool:
        """Whether a backward was measured (a training step, not an evaluation)."""
        return any(not math.isinf(t) for t in self.backward_s)

    def choose(self) -> WindowChoice:
        """The smallest window whose measured transfers hide behind the measured compute."""
        self.end()
        measured = (self.forward_s, self.backward_s, self.read_s, self.write_s)
        forward, backward, read, write = ([0.0 if math.isinf(t) else t for t in times] for times in measured)
        backward[0] = 2 * forward[0]  # nothing announces its end (see the module's docstring)
        return choose_window(forward, backward, read, write)
