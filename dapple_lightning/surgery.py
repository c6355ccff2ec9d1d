"""Model surgery: find the layers to pipeline, cut a rank's stage out, put them back.

Everything that changes which modules a LightningModule holds lives here, so that the
strategy, ``plan="auto"`` and the search all cut and restore a model the same way:

- :func:`find_sequential` finds the container whose children a plan indexes;
- :class:`Cut` replaces it, on one rank, by that rank's :class:`~dapple_lightning.runtime.StageModule`
  (the layers of other stages go to the meta device) and later puts the whole container back
  with the trained weights;
- :func:`standing_in` and :func:`capture_input` let the user's own step run with something
  else in the container's place (to learn the container's input, or to time what the step
  does around it).

No process group and no Lightning here: the strategy gathers the weights, this module only
moves modules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dapple_lightning.plan import Plan
from dapple_lightning.runtime import StageExit, StageModule

__all__ = ["Cut", "capture_input", "find_sequential", "partition", "set_submodule", "standing_in", "unchanged"]


def find_sequential(module: nn.Module, name: str | None = None) -> tuple[str, nn.Sequential]:
    """The ``nn.Sequential`` to pipeline: the one named, or the module's only one."""
    if name is not None:
        try:
            found = module.get_submodule(name)
        except AttributeError as e:
            raise ValueError(f"sequential={name!r}: the module has no submodule {name!r}") from e
        if not isinstance(found, nn.Sequential):
            raise TypeError(
                f"sequential={name!r} is a {type(found).__name__}; dapple pipelines an nn.Sequential of layers"
            )
        return name, found
    candidates = [(n, m) for n, m in module.named_children() if isinstance(m, nn.Sequential)]
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise ValueError(
            f"{type(module).__name__} has no nn.Sequential attribute to pipeline; put the layers to split into "
            "one nn.Sequential (self.layers = nn.Sequential(...)) or name a nested one with "
            "DappleStrategy(sequential='path.to.it')"
        )
    names = ", ".join(repr(n) for n, _ in candidates)
    raise ValueError(
        f"{type(module).__name__} has several nn.Sequential attributes ({names}); choose one with "
        f"DappleStrategy(sequential={candidates[0][0]!r})"
    )


def set_submodule(root: nn.Module, path: str, new: nn.Module) -> None:
    """Put ``new`` at the dotted ``path`` of ``root``."""
    parent_path, _, leaf = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, leaf, new)


def partition(sequential: nn.Sequential, plan: Plan, rank: int) -> StageModule:
    """This rank's :class:`StageModule`: the Sequential's layers of its stage, under their own names."""
    stage = plan.stages[plan.stage_of(rank)]
    named = list(sequential.named_children())
    return StageModule(named[stage.start : stage.end])


@dataclass
class Cut:
    """``module`` with the container at ``path`` replaced by one rank's stage.

    Made by :meth:`apply`; :meth:`restore` undoes it. The container object itself is kept (its
    layers of other stages on the meta device), so that restoring gives the user back the very
    modules they built.
    """

    module: nn.Module
    path: str
    container: nn.Sequential
    stage: StageModule

    @classmethod
    def apply(cls, module: nn.Module, path: str, container: nn.Sequential, plan: Plan, rank: int) -> Cut:
        """Replace the container by ``rank``'s stage of ``plan`` and free the other stages' layers."""
        stage = partition(container, plan, rank)
        local = set(stage.children())
        for layer in container.children():
            if layer not in local:
                layer.to("meta")  # frees the memory of layers that live on other ranks
        set_submodule(module, path, stage)
        return cls(module, path, container, stage)

    @property
    def prefix(self) -> str:
        """The state-dict key prefix of the container's entries."""
        return f"{self.path}."

    @contextmanager
    def whole(self) -> Iterator[None]:
        """Within the block the module holds its container again (other stages' layers on the meta
        device): code that indexes it (``self.layers[i]``) or names parameters sees what one device sees."""
        set_submodule(self.module, self.path, self.container)
        try:
            yield
        finally:
            set_submodule(self.module, self.path, self.stage)

    def restore(self, weights: Mapping[str, Tensor], device: torch.device) -> None:
        """Put the whole container back, its state from ``weights`` (keys relative to the container)."""
        local = set(self.stage.children())
        for layer in self.container.children():
            if layer not in local:
                layer.to_empty(device=device)
        self.container.load_state_dict(weights)
        set_submodule(self.module, self.path, self.container)


@contextmanager
def standing_in(
    module: nn.Module, set_container: Callable[[nn.Module], None], container: nn.Module, stand_in: nn.Module
) -> Iterator[None]:
    """Within the block, ``stand_in`` replaces the container and ``module.log`` does nothing
    (the user's step may log); both are put back after."""
    set_container(stand_in)
    module.log = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del module.log
        set_container(container)


class _Capture(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.value: Any = None

    def forward(self, x: Any) -> Any:
        self.value = x
        raise StageExit


def capture_input(
    module: nn.Module, set_container: Callable[[nn.Module], None], container: nn.Module, step: Callable[[], Any]
) -> Any:
    """Run ``step`` (the user's training_step on a batch) until it calls the container; return its input."""
    capture = _Capture()
    with standing_in(module, set_container, container, capture), torch.no_grad(), suppress(StageExit):
        step()
    if capture.value is None:
        raise RuntimeError(
            "plan='auto' ran training_step once to find the Sequential's input, but the step never called it; "
            "dapple needs each step to pass the batch through the Sequential exactly once"
        )
    return capture.value


@contextmanager
def unchanged(module: nn.Module) -> Iterator[None]:
    """Within the block, profiling and trial steps may train: afterwards the module's parameters
    and buffers, its gradients (none) and the RNG states are as before, so that training with
    the chosen plan starts exactly where training with that plan given by hand would."""
    tensors = [*module.parameters(), *module.buffers()]
    saved = [t.detach().clone() for t in tensors]
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for tensor, value in zip(tensors, saved):
                tensor.copy_(value)
        for param in module.parameters():
            param.grad = None
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
