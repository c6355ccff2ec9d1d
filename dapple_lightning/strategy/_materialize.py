"""Models built on the meta device, materialised stage by stage.

A model too big for one rank is built without memory: ``with trainer.init_module(empty_init=True)``
(which builds on the meta device under dapple) or ``torch.device("meta")``. After the cut, each
rank allocates only what it holds (its stage's layers and the modules outside the container)
and initialises it with each module's ``reset_parameters()``. Every module's draw is seeded by
its path in the model, so a layer gets the same initial weights whichever rank, stage or plan
holds it, and no rank ever holds the whole model (nor needs rank 0's copy of it).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from dapple_lightning.strategy._lightning import unmoved_cpu

__all__ = ["STAYS_CUT", "materialize", "meta_context", "on_meta", "unmoved_on_meta"]

STAYS_CUT = (
    "dapple: this model was materialised stage by stage, and stays so after fit (no rank can hold all of it): "
    "run validate/test/predict inside the fit (validation loops, callbacks) or in a new run that loads its "
    "checkpoint; trainer.save_checkpoint after fit writes the whole model"
)


@contextmanager
def meta_context(precision: Any) -> Iterator[None]:
    """Tensors made within are on the meta device (and of the precision plugin's dtype)."""
    with torch.device("meta"), precision.tensor_init_context():
        yield


def on_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


@contextmanager
def unmoved_on_meta(module: nn.Module | None) -> Iterator[None]:
    """Within the block ``module.cpu()`` leaves a module that is still on the meta device as it is
    (Lightning's teardown moves the model to the CPU, and a meta tensor has no data to move: a run
    that failed before materialising, or a spawn run's launching process, would report that
    instead of its own error)."""
    if module is None or not on_meta(module):
        yield
        return
    with unmoved_cpu(module):
        yield


def materialize(module: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate ``module``'s meta tensors on ``device`` and initialise them (see the module docstring).

    Raises:
        ValueError: A module with tensors on the meta device has no ``reset_parameters()``, so
            nothing could give them values.
    """
    empty = [
        (name, sub)
        for name, sub in module.named_modules()
        if any(t.is_meta for t in (*sub.parameters(recurse=False), *sub.buffers(recurse=False)))
    ]
    lacking = [
        name or type(module).__name__ for name, sub in empty if not callable(getattr(sub, "reset_parameters", None))
    ]
    if lacking:
        raise ValueError(
            f"the model was built on the meta device, and dapple initialises each rank's part with the modules' "
            f"reset_parameters(); these modules hold meta tensors but have none: {lacking}. Give them a "
            "reset_parameters() that fills their parameters and buffers, or build the model on a real device"
        )
    ties = _ties(empty)
    for _, sub in empty:  # all allocated first: a module's reset may fill its children's tensors too
        sub.to_empty(device=device, recurse=False)
    for places in ties:  # allocating gave each place its own tensor: one again, the first place's
        first_sub, first_name = places[0][1:]
        for _, sub, name in places[1:]:
            sub._parameters[name] = first_sub._parameters[first_name]
    for name, sub in [*empty, *((places[0][0], places[0][1]) for places in ties)]:
        # A tied parameter's value is its first module's draw, as when a model built on a device
        # ties a later module's weight to an earlier one's: that module's reset runs again, last.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed((seed + zlib.crc32(name.encode())) % 2**63)
            with torch.no_grad():
                sub.reset_parameters()


def _ties(modules: list[tuple[str, nn.Module]]) -> list[list[tuple[str, nn.Module, str]]]:
    """The meta parameters that several of ``modules`` hold, each as its places (module path,
    module, attribute), in the model's order."""
    places: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for path, sub in modules:
        for name, param in sub._parameters.items():
            if param is not None and param.is_meta:
                places.setdefault(id(param), []).append((path, sub, name))
    return [found for found in places.values() if len(found) > 1]
