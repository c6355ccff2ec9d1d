"""Which of the pipelined layers ``plan="auto"`` holds on the device while it profiles and tries plans.

``plan="auto"`` must work for a model that needs the pipeline for memory: one whose layers do
not all fit on one device. Until it has chosen, every rank keeps the layers of the chain on the
host (the CPU, where setup leaves the model before the cut) and brings to the device only those it
runs: a window of consecutive layers while they are profiled, one layer at a time while the
user's step is recorded, and the rank's stage while a plan is tried. Everything outside the
chain (embeddings, a head, the loss) runs on every rank at every moment and stays on the device.

Tensors move by ``.data``, so that the Parameter objects (the optimizer's, the pipeline's hooks)
stay the same ones; a tensor the module also uses outside the chain (a tied embedding) is never
sent to the host, nor one that a layer on the device shares with one leaving it. On the CPU host and device are one, and nothing moves; what is held is still
counted (:attr:`Resident.peak_bytes`), which is what the tests read there.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import torch
from torch import Tensor, nn

from dapple_lightning.surgery import Chain

__all__ = ["Resident", "parameter_bytes"]


def parameter_bytes(modules: Sequence[nn.Module]) -> int:
    """Bytes of the parameters of ``modules``, each counted once."""
    seen = {id(p): p for m in modules for p in m.parameters()}
    return sum(p.numel() * p.element_size() for p in seen.values())


class Resident:
    """Moves ``chain``'s layers between ``device`` and ``home`` so that only those in use are on the device.

    Args:
        module: the LightningModule, its containers in place.
        chain: the pipelined containers.
        device: where the rank computes.
        home: where the layers not in use wait (the CPU).
    """

    def __init__(self, module: nn.Module, chain: Chain, device: torch.device, home: torch.device | None = None) -> None:
        self.device, self.home = device, home if home is not None else torch.device("cpu")
        self.layers = [layer for _, layer in chain.named_layers()]
        # What the module holds without the containers: the code outside them.
        chain.put(module, [nn.Module() for _ in chain.paths])
        try:
            outside = [*module.parameters(), *module.buffers()]
        finally:
            chain.put(module, chain.containers)
        self._outside = {id(t) for t in outside}
        self._outside_tensors = outside
        _move(outside, device, set())
        self._held: set[int] = set(range(len(self.layers))) if device == self.home else set()
        self.peak_bytes = 0
        """The most parameter bytes of the chain's layers held on the device at once since made."""
        self.hold([])

    @property
    def held_bytes(self) -> int:
        """Parameter bytes of the chain's layers on the device now."""
        return parameter_bytes([self.layers[i] for i in sorted(self._held)])

    def hold(self, indices: Sequence[int]) -> None:
        """Have exactly the layers ``indices`` of the chain on the device, the others at home."""
        wanted = set(indices)
        # A tensor shared with a wanted layer (weights tied across the chain) stays with it.
        staying = self._outside | {id(t) for i in wanted for t in _tensors(self.layers[i])}
        for index in sorted(self._held - wanted):
            _move(_tensors(self.layers[index]), self.home, staying)
        for index in sorted(wanted - self._held):
            _move(_tensors(self.layers[index]), self.device, self._outside)
        self._held = wanted
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    @contextmanager
    def one_at_a_time(self) -> Iterator[None]:
        """Within the block, each layer of the chain comes to the device when it is called and leaves when
        it returns (forward hooks): for runs without autograd (recording the user's step), whose
        layers need nothing of each other once they returned."""
        handles = []
        for index, layer in enumerate(self.layers):
            handles.append(layer.register_forward_pre_hook(partial(self._arrive, index), prepend=True))
            handles.append(layer.register_forward_hook(partial(self._leave, index)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self.hold([])

    def _arrive(self, index: int, *_: object) -> None:
        self.hold([index])

    def _leave(self, index: int, *_: object) -> None:
        self.hold([])

    def send_home(self) -> None:
        """Everything at home, the code outside the chain too: the module where it was before."""
        self.hold([])
        _move(self._outside_tensors, self.home, set())


def _tensors(module: nn.Module) -> list[Tensor]:
    return [*module.parameters(), *module.buffers()]


def _move(tensors: Sequence[Tensor], device: torch.device, keep: set[int]) -> None:
    """Move ``tensors`` (and their gradients) to ``device`` in place, those in ``keep`` aside."""
    with torch.no_grad():
        for t in tensors:
            if id(t) in keep or t.device == device:
                continue
            grad = t.grad if isinstance(t, nn.Parameter) else None
            if grad is not None:
                t.grad = None
            t.data = t.data.to(device)
            if grad is not None:
                t.grad = grad.to(device)
