"""Model surgery: find the layers to pipeline, cut a rank's stage out, put them back.

Everything that changes which modules a LightningModule holds lives here, so that the
strategy, ``plan="auto"`` and the search all cut and restore a model the same way:

- :func:`find_container` finds the container whose children a plan indexes: an ``nn.Sequential``
  that forward calls once, or an ``nn.ModuleList`` of blocks that forward loops over
  (:func:`find_sequential` where only a Sequential will do);
- :class:`Cut` replaces it, on one rank, by that rank's :class:`~dapple_lightning.runtime.StageModule`
  (for a ModuleList: by a list of the stage's blocks and placeholders; the layers of other stages
  go to the meta device) and later puts the whole container back with the trained weights;
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
from dapple_lightning.runtime import StageExit, StageModule, stand_in_blocks

__all__ = [
    "Container",
    "Cut",
    "capture_input",
    "find_container",
    "find_sequential",
    "partition",
    "set_submodule",
    "standing_in",
    "unchanged",
]


Container = nn.Sequential | nn.ModuleList
"""What a plan's layer indices index: a Sequential that forward calls once, or a ModuleList of
blocks that forward loops over (each block called once per micro-batch, in order)."""


def find_container(module: nn.Module, name: str | None = None) -> tuple[str, Container]:
    """The container to pipeline: the one named, or the module's only ``nn.Sequential`` / ``nn.ModuleList``."""
    if name is not None:
        try:
            found = module.get_submodule(name)
        except AttributeError as e:
            raise ValueError(f"sequential={name!r}: the module has no submodule {name!r}") from e
        if not isinstance(found, Container):
            raise TypeError(
                f"sequential={name!r} is a {type(found).__name__}; dapple pipelines an nn.Sequential of layers or "
                "an nn.ModuleList of blocks that forward loops over"
            )
        return name, found
    candidates = [(n, m) for n, m in module.named_children() if isinstance(m, Container)]
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise ValueError(
            f"{type(module).__name__} has no nn.Sequential or nn.ModuleList attribute to pipeline; put the layers "
            "to split into one (self.layers = nn.Sequential(...), self.blocks = nn.ModuleList(...)) or name a "
            "nested one with DappleStrategy(sequential='path.to.it')"
        )
    names = ", ".join(repr(n) for n, _ in candidates)
    raise ValueError(
        f"{type(module).__name__} has several nn.Sequential/nn.ModuleList attributes ({names}); choose one with "
        f"DappleStrategy(sequential={candidates[0][0]!r})"
    )


def find_sequential(module: nn.Module, name: str | None = None) -> tuple[str, nn.Sequential]:
    """The container to pipeline (:func:`find_container`) where only a Sequential will do: profiling
    runs its layers as a chain, which the blocks of a ModuleList (with side inputs) are not."""
    path, found = find_container(module, name)
    if not isinstance(found, nn.Sequential):
        raise TypeError(
            f"the container to pipeline, {path!r}, is an nn.ModuleList: plan='auto' and the plan search profile "
            "an nn.Sequential's layers as a chain and cannot run blocks with side inputs yet; give an explicit "
            "plan (DappleStrategy({'stages': [...], 'micro_batches': ...}))"
        )
    return path, found


def set_submodule(root: nn.Module, path: str, new: nn.Module) -> None:
    """Put ``new`` at the dotted ``path`` of ``root``."""
    parent_path, _, leaf = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, leaf, new)


def partition(container: Container, plan: Plan, rank: int) -> StageModule:
    """This rank's :class:`StageModule`: the container's layers of its stage, under their own names."""
    stage = plan.stages[plan.stage_of(rank)]
    named = list(container.named_children())
    blocks = len(container) if isinstance(container, nn.ModuleList) else None
    return StageModule(named[stage.start : stage.end], blocks=blocks)


@dataclass
class Cut:
    """``module`` with the container at ``path`` replaced by one rank's stage.

    Made by :meth:`apply`; :meth:`restore` undoes it. The container object itself is kept (its
    layers of other stages on the meta device), so that restoring gives the user back the very
    modules they built.

    ``stage`` (a :class:`StageModule`) holds the rank's layers under their indices in the
    container and takes the executor's calls. What sits at ``path`` meanwhile is ``stand_in``: the
    stage itself for a Sequential; for a ModuleList a list of the container's length, the stage's
    blocks in their places and placeholders elsewhere (see
    :func:`~dapple_lightning.runtime.stand_in_blocks`).
    """

    module: nn.Module
    path: str
    container: Container
    stage: StageModule
    stand_in: nn.Module
    _unhook: Callable[[], None] = lambda: None

    @classmethod
    def apply(cls, module: nn.Module, path: str, container: Container, plan: Plan, rank: int) -> Cut:
        """Replace the container by ``rank``'s stage of ``plan`` and free the other stages' layers."""
        stage = partition(container, plan, rank)
        unhook: Callable[[], None] = lambda: None  # noqa: E731
        stand_in: nn.Module = stage
        if isinstance(container, nn.ModuleList):
            layers = plan.stages[plan.stage_of(rank)]
            stand_in, unhook = stand_in_blocks(container, stage, layers.start, layers.end)
        local = set(stage.children())
        for layer in container.children():
            if layer not in local:
                layer.to("meta")  # frees the memory of layers that live on other ranks
        set_submodule(module, path, stand_in)
        return cls(module, path, container, stage, stand_in, unhook)

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
            set_submodule(self.module, self.path, self.stand_in)

    def restore(self, weights: Mapping[str, Tensor], device: torch.device) -> None:
        """Put the whole container back, its state from ``weights`` (keys relative to the container)."""
        self._unhook()
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
