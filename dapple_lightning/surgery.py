"""Model surgery: find the layers to pipeline, cut a rank's stage out, put them back.

Everything that changes which modules a LightningModule holds lives here, so that the
strategy, ``plan="auto"`` and the search all cut and restore a model the same way:

- :func:`find_chain` finds the containers whose children a plan indexes (a :class:`Chain`): an
  ``nn.Sequential`` that forward calls once, an ``nn.ModuleList`` of blocks that forward loops
  over, or several of them that forward runs in turn with its own code between them
  (:func:`find_container` for one, :func:`find_sequential` where only a Sequential will do);
- :class:`Cut` replaces them, on one rank, by that rank's :class:`~dapple_lightning.runtime.StageModule`
  (for a ModuleList or a chain: by stand-ins holding the stage's layers and placeholders; the
  layers of other stages go to the meta device) and later puts the whole containers back with the
  trained weights;
- :func:`standing_in` and :func:`capture_input` let the user's own step run with something
  else in the container's place (to learn the container's input, or to time what the step
  does around it).

No process group and no Lightning here: the strategy gathers the weights, this module only
moves modules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from dapple_lightning.plan import Plan
from dapple_lightning.runtime import StageExit, StageModule, stand_in_layers

__all__ = [
    "Chain",
    "Container",
    "Cut",
    "capture_input",
    "find_chain",
    "find_container",
    "find_sequential",
    "partition",
    "set_submodule",
    "split_ties",
    "standing_for",
    "standing_in",
    "unchanged",
]


Container = nn.Sequential | nn.ModuleList
"""What a plan's layer indices index: a Sequential that forward calls once, or a ModuleList of
blocks that forward loops over (each block called once per micro-batch, in order)."""


def find_container(module: nn.Module, name: str | None = None) -> tuple[str, Container]:
    """The container to pipeline: the one named, or the module's only ``nn.Sequential`` / ``nn.ModuleList``
    (its only attribute that is one, or else its only one that no other container holds)."""
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
    if not candidates:  # nested, as a Hugging Face model's blocks are (model.transformer.h)
        candidates = _outermost_containers(module)
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise ValueError(
            f"{type(module).__name__} has no nn.Sequential or nn.ModuleList attribute to pipeline, nor any nested "
            "one; put the layers to split into one (self.layers = nn.Sequential(...), "
            "self.blocks = nn.ModuleList(...))"
        )
    names = ", ".join(repr(n) for n, _ in candidates)
    raise ValueError(
        f"{type(module).__name__} has several nn.Sequential/nn.ModuleList attributes ({names}); choose one with "
        f"DappleStrategy(sequential={candidates[0][0]!r}), or several that forward runs in turn with "
        f"sequential={[n for n, _ in candidates]!r}"
    )


def _outermost_containers(module: nn.Module, prefix: str = "") -> list[tuple[str, Container]]:
    """The containers among ``module``'s descendants that no other container holds."""
    found: list[tuple[str, Container]] = []
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if isinstance(child, Container):
            found.append((path, child))
        else:
            found += _outermost_containers(child, f"{path}.")
    return found


def find_sequential(module: nn.Module, name: str | None = None) -> tuple[str, nn.Sequential]:
    """The container to pipeline (:func:`find_container`) where only a Sequential will do: the plan
    search's trials profile its layers as a chain in a process of their own, and cannot run the
    blocks of a ModuleList with the side inputs the user's loop gives them."""
    path, found = find_container(module, name)
    if not isinstance(found, nn.Sequential):
        raise TypeError(
            f"the container to pipeline, {path!r}, is an nn.ModuleList: the plan search profiles an "
            "nn.Sequential's layers and cannot run blocks with side inputs yet; train with plan='auto' "
            "(DappleStrategy(sequential=...), which profiles the blocks through your training_step) or an "
            "explicit plan (DappleStrategy({'stages': [...], 'micro_batches': ...}))"
        )
    return path, found


@dataclass(frozen=True, eq=False)
class Chain:
    """The containers whose children are a plan's layers, in the order forward runs them.

    Layer ``i`` of a plan is the ``i``-th child in that order: the children of ``containers[0]``,
    then those of ``containers[1]``, and so on. Code between the containers (pooling, flatten,
    a norm) is the user's and runs unchanged.
    """

    paths: tuple[str, ...]
    containers: tuple[Container, ...]

    @classmethod
    def of(cls, path: str, container: Container) -> Chain:
        return cls((path,), (container,))

    def __len__(self) -> int:
        return sum(len(c) for c in self.containers)

    @property
    def called_whole(self) -> bool:
        """Whether the user's step calls the stage once (one ``nn.Sequential``), rather than each layer itself."""
        return len(self.containers) == 1 and isinstance(self.containers[0], nn.Sequential)

    def named_layers(self) -> list[tuple[str, nn.Module]]:
        """Every layer, in plan order, with its path in the model."""
        return [
            (f"{path}.{name}", layer)
            for path, container in zip(self.paths, self.containers)
            for name, layer in container.named_children()
        ]

    def state_dict(self) -> dict[str, Tensor]:
        """The containers' state under the model's keys (after a cut, other stages' layers are meta tensors)."""
        return {
            f"{path}.{key}": value
            for path, container in zip(self.paths, self.containers)
            for key, value in container.state_dict().items()
        }

    def put(self, module: nn.Module, modules: Sequence[nn.Module]) -> None:
        """Put ``modules`` at the containers' paths in ``module``, one each."""
        for path, new in zip(self.paths, modules, strict=True):
            set_submodule(module, path, new)

    def single(self) -> tuple[str, Container]:
        """The one container (path and module) of a chain of one."""
        if len(self.containers) != 1:
            raise ValueError(f"expected one container to pipeline, got {len(self.containers)}: {list(self.paths)}")
        return self.paths[0], self.containers[0]


def find_chain(module: nn.Module, name: str | Sequence[str] | None = None) -> Chain:
    """The containers to pipeline: the one or several named (in the order forward runs them), or
    the module's only ``nn.Sequential`` / ``nn.ModuleList`` (:func:`find_container`)."""
    if name is None or isinstance(name, str):
        return Chain.of(*find_container(module, name))
    paths = [str(n) for n in name]
    if not paths:
        raise ValueError("sequential=[]: name at least one container to pipeline")
    for i, a in enumerate(paths):
        for b in paths[i + 1 :]:
            if a == b or b.startswith(f"{a}.") or a.startswith(f"{b}."):
                raise ValueError(
                    f"sequential={paths!r} names {a!r} and {b!r}, which overlap; name containers that hold "
                    "different layers, in the order forward runs them"
                )
    return Chain(tuple(paths), tuple(find_container(module, path)[1] for path in paths))


def split_ties(module: nn.Module, chain: Chain, plan: Plan) -> list[nn.Parameter]:
    """The parameters ``plan`` puts in more than one place, in the model's order: held by layers
    of two stages, or by a layer of the chain and a module outside it (an embedding and a head
    tied inside one Sequential).

    A cut keeps such a parameter on every rank and the pipeline sums its gradient over every
    rank, as for the parameters outside the containers: each stage adds what its layers
    contributed, which is the single-device gradient.
    """
    stage_of = {index: s for s, stage in enumerate(plan.stages) for index in range(stage.start, stage.end)}
    places: dict[int, set[int | None]] = {}  # parameter -> the stages holding it (None: outside the chain)
    for index, (_, layer) in enumerate(chain.named_layers()):
        for _, param in layer.named_parameters(remove_duplicate=False):
            places.setdefault(id(param), set()).add(stage_of[index])
    inside = tuple(f"{path}." for path in chain.paths)
    ordered: dict[int, nn.Parameter] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in places:
            ordered.setdefault(id(param), param)
            if not name.startswith(inside):
                places[id(param)].add(None)
    return [param for key, param in ordered.items() if len(places[key]) > 1]


def _retie(module: nn.Module, params: Sequence[nn.Parameter]) -> Callable[[], None]:
    """A function that puts ``params`` back wherever ``module`` holds them now (a layer moved to
    the meta device gets a meta copy of each; the tie must survive on every rank)."""
    wanted = {id(p): p for p in params}
    places = [
        (sub, name, wanted[id(p)])
        for sub in module.modules()
        for name, p in sub._parameters.items()
        if p is not None and id(p) in wanted
    ]

    def retie() -> None:
        for sub, name, param in places:
            sub._parameters[name] = param

    return retie


def set_submodule(root: nn.Module, path: str, new: nn.Module) -> None:
    """Put ``new`` at the dotted ``path`` of ``root``."""
    parent_path, _, leaf = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, leaf, new)


def partition(layers: Container | Chain, plan: Plan, rank: int) -> StageModule:
    """This rank's :class:`StageModule` of ``plan``: its stage's layers (under chunks, every stage's
    of the rank, in stage order: the executor runs one stage's per call) of one container, under
    their own names, or of a chain of several, named by their index in the chain (messages then
    name their paths)."""
    stages = [plan.stages[s] for s in plan.stages_of(rank)]
    indices = [i for stage in stages for i in range(stage.start, stage.end)]
    # Under chunks no stage recomputes or offloads (the plan refuses it): the first stage speaks for all.
    options: dict[str, Any] = {"recompute": stages[0].recompute, "offload": stages[0].offload}
    if isinstance(layers, Chain) and len(layers.containers) == 1:
        layers = layers.containers[0]
    if isinstance(layers, Chain):
        named = layers.named_layers()
        names = [name for name, _ in named]
        return StageModule([(str(i), named[i][1]) for i in indices], blocks=len(layers), names=names, **options)
    named = list(layers.named_children())
    blocks = len(layers) if isinstance(layers, nn.ModuleList) else None
    return StageModule([named[i] for i in indices], blocks=blocks, **options)


@dataclass
class Cut:
    """``module`` with the containers of ``chain`` replaced by one rank's stage.

    Made by :meth:`apply`; :meth:`restore` undoes it. The container objects themselves are kept
    (their layers of other stages on the meta device), so that restoring gives the user back the
    very modules they built.

    ``stage`` (a :class:`StageModule`) holds the rank's layers and takes the executor's calls.
    What sits at the containers' paths meanwhile is ``stand_ins``: for one Sequential the stage
    itself; otherwise, for each container, one of its own class and length with the stage's
    layers in their places and placeholders elsewhere (see
    :func:`~dapple_lightning.runtime.stand_in_layers`).
    """

    module: nn.Module
    chain: Chain
    stage: StageModule
    stand_ins: tuple[nn.Module, ...]
    _unhook: Callable[[], None] = lambda: None

    @classmethod
    def apply(cls, module: nn.Module, chain: Chain, plan: Plan, rank: int) -> Cut:
        """Replace the containers by ``rank``'s stage of ``plan`` and free the other stages' layers."""
        ties = split_ties(module, chain, plan)
        if any(p.is_meta for p in ties):
            raise ValueError(
                "the model was built on the meta device and the plan splits parameters that layers share "
                f"({len(ties)} tied): their value would come from a different module's initialisation on each "
                "stage. Give one stage all the layers that share them, or build the model on a real device"
            )
        retie = _retie(module, ties)
        stage = partition(chain, plan, rank)
        stand_ins, unhook = standing_for(chain, stage, plan, rank)
        local = set(stage.children())
        for _, layer in chain.named_layers():
            if layer not in local:
                layer.to("meta")  # frees the memory of layers that live on other ranks
        retie()
        stage.shared = tuple(ties)
        cut = cls(module, chain, stage, stand_ins, unhook)
        chain.put(module, stand_ins)
        return cut

    @contextmanager
    def whole(self) -> Iterator[None]:
        """Within the block the module holds its containers again (other stages' layers on the meta
        device): code that indexes them (``self.layers[i]``) or names parameters sees what one device sees."""
        self.chain.put(self.module, self.chain.containers)
        try:
            yield
        finally:
            self.chain.put(self.module, self.stand_ins)

    def restore(self, weights: Mapping[str, Tensor], device: torch.device) -> None:
        """Put the whole containers back, their state from ``weights`` (under the model's keys)."""
        self._unhook()
        local = set(self.stage.children())
        for _, layer in self.chain.named_layers():
            if layer not in local:
                layer.to_empty(device=device)
        for path, container in zip(self.chain.paths, self.chain.containers):
            prefix = f"{path}."
            container.load_state_dict({k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)})
        self.chain.put(self.module, self.chain.containers)


def standing_for(
    chain: Chain, stage: StageModule, plan: Plan, rank: int
) -> tuple[tuple[nn.Module, ...], Callable[[], None]]:
    """What stands at the containers' paths while ``stage`` (``rank``'s of ``plan``) runs, as
    :class:`Cut` describes it, and the function that removes the stand-ins' hooks."""
    if chain.called_whole:
        return (stage,), lambda: None
    ranges = {s: (plan.stages[s].start, plan.stages[s].end) for s in plan.stages_of(rank)}
    stand_ins, unhook = stand_in_layers(chain.containers, stage, ranges)
    return tuple(stand_ins), unhook


_Placed = TypeVar("_Placed")


@contextmanager
def standing_in(set_container: Callable[[_Placed], None], container: _Placed, stand_in: _Placed) -> Iterator[None]:
    """Within the block, ``stand_in`` replaces the container; it is put back after.
    ``set_container`` may also put a chain's containers and their stand-ins (sequences of
    modules) in their places. The user's step may log: a caller that runs it inside Lightning's
    trainer silences ``module.log`` (the strategy does, through its Lightning adapter)."""
    set_container(stand_in)
    try:
        yield
    finally:
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
    with standing_in(set_container, container, capture), torch.no_grad(), suppress(StageExit):
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
    the chosen plan starts exactly where training with that plan given by hand would. The saved
    copy is on the CPU: on a GPU a second copy of the whole model would halve what fits."""
    tensors = [*module.parameters(), *module.buffers()]
    saved = [t.detach().to("cpu", copy=True) for t in tensors]
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
