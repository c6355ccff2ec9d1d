"""``plan="auto"`` for layers that the user's own code calls one by one: the layers as a chain
the profiler can run.

The profiler (``planner.profile_layers``) runs layers as an ``nn.Sequential`` does, each on the
previous one's output. The blocks of a ModuleList are called by the user's own loop instead,
with side inputs that the step computes from the batch, and a chain of containers runs with the
user's code between them::

    for block in self.blocks:
        x = block(x, mask, position_ids=pos)

    x = self.features(x)                    # an nn.Sequential calls its own layers in turn
    x = torch.flatten(self.avgpool(x), 1)   # code between the containers
    x = self.classifier(x)

:class:`BlockChain` learns what that code does by running the user's ``training_step`` with
hooks on every layer of the chain (``Chain.named_layers``: the children of each container, in
plan order; a Sequential calling its children sets them off as a loop does its blocks), and
records each layer's call: its first positional argument (the activation, which crosses stages),
the other arguments and keywords (the side inputs, which never do) and its output. Each layer then
runs in the profile as a :class:`ChainedBlock`: on the activation alone, with the side inputs the
step gave it, returning what the code passes on to the next layer. Where the step's code changes
the activation between two layers (pooling and flattening between containers), the chained value
is not what the next layer got, and that layer runs on what it got in the step instead; the
bytes crossing a cut there stay the previous layer's output, which is what the runtime sends (the
next stage runs the code between them). The step is recorded at every batch size the profile
runs (the sample and :func:`~dapple_lightning.autoplan.small_batch_of` it), rather than side
tensors sliced to fewer rows: a ``(T, T)`` mask whose ``T`` happens to equal the batch cannot be
told from a batch-first tensor by its shape.

The same records give the step outside the layers its replay (every layer's output, see
:func:`~dapple_lightning.autoplan.time_step_around`), so profiling needs no second capture.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from functools import partial
from itertools import pairwise
from typing import Any

import torch
from torch import nn

from dapple_lightning.autoplan import small_batch_of, time_step_around, time_step_outside
from dapple_lightning.microbatch import Rows, batch_size_of, map_tensors, slice_batch
from dapple_lightning.planner import ModelProfile, fresh_leaves
from dapple_lightning.runtime import StageExit
from dapple_lightning.strategy._lightning import silenced_log
from dapple_lightning.strategy._resident import Resident
from dapple_lightning.surgery import Chain, capture_input, set_submodule

__all__ = ["BlockCall", "BlockChain", "ChainedBlock", "record_block_calls", "sample_chain"]

_ATOMS = (
    torch.Tensor,
    nn.Module,
    str,
    bytes,
    int,
    float,
    complex,
    bool,
    torch.dtype,
    torch.device,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
)


def _is_plain(value: Any) -> bool:
    """Whether ``value`` is made of tensors and values a block cannot change in place."""
    if value is None or isinstance(value, _ATOMS):
        return True
    if isinstance(value, tuple | list):
        return all(_is_plain(v) for v in value)
    if isinstance(value, Mapping):
        return all(_is_plain(v) for v in value.values())
    return False


def _fresh(value: Any) -> Any:
    """``value`` itself, or a copy where it holds state a block may change (a key/value cache
    appends to itself on every call): each profiled call then starts from the state the step's
    own call found, not from what earlier profiled calls left."""
    return value if _is_plain(value) else copy.deepcopy(value)


@dataclass
class BlockCall:
    """One layer's call in the user's step (tensors detached: recorded without autograd)."""

    activation: Any
    """The first positional argument: what crosses stages."""
    args: tuple
    """The side inputs given by position, after the activation."""
    kwargs: dict[str, Any]
    """The side inputs given by keyword."""
    output: Any = None


class _Names:
    """How messages name the chain's layers: ``block i`` of one ModuleList, else by index and path."""

    def __init__(self, chain: Chain) -> None:
        self.paths = [path for path, _ in chain.named_layers()]
        self.blocks = len(chain.containers) == 1 and isinstance(chain.containers[0], nn.ModuleList)
        self.singular = "block" if self.blocks else "layer"
        self.plural = f"{self.singular}s"
        self.where = (
            "of the pipelined ModuleList" if self.blocks else f"of the pipelined containers {list(chain.paths)}"
        )
        self.rule = (
            "dapple needs forward to call every block of the pipelined ModuleList once per batch, in order"
            if self.blocks
            else f"dapple needs forward to run the containers {list(chain.paths)} in this order, each of their "
            "layers once per batch"
        )

    def __call__(self, index: int) -> str:
        return f"block {index}" if self.blocks else f"layer {index} ({self.paths[index]})"


def _order_problem(order: list[int], name: _Names, count: int | None = None) -> str | None:
    """What is wrong with the order the step called the layers in, if anything (with ``count``:
    once the step is over, whether it called them all)."""
    for position, index in enumerate(order):
        if index < position:
            return f"it called {name(index)} again after {name(order[position - 1])}"
        if index > position:
            return f"it called {name(index)} before {name(position)}"
    if count is not None and len(order) < count:
        return f"it called {len(order)} of the {count} {name.plural}"
    return None


def record_block_calls(module: nn.Module, chain: Chain, step: Callable[[], Any]) -> list[BlockCall]:
    """Run ``step`` (the user's training_step on a batch) until the chain's last layer returns;
    every layer's call, in order. Logging is silenced and nothing is recorded for autograd."""
    calls: list[BlockCall] = []
    order: list[int] = []
    layers = [layer for _, layer in chain.named_layers()]
    name = _Names(chain)

    def refuse(problem: str) -> None:
        raise RuntimeError(
            f"plan='auto' ran training_step once to learn how forward calls the {name.plural}, and {problem}; "
            f"{name.rule}"
        )

    def pre(index: int, _: nn.Module, args: tuple, kwargs: dict) -> None:
        order.append(index)
        problem = _order_problem(order, name)
        if problem is not None:  # before the layer runs on what was meant for another (a shape error)
            refuse(problem)
        if not args:
            raise TypeError(
                f"{name(index)} {name.where} was called without a positional argument; dapple passes the "
                f"activation from {name.singular} to {name.singular} as each {name.singular}'s first positional "
                f"argument: call it as {name.singular}(x, ...) with side inputs after x or as keywords"
            )
        calls.append(BlockCall(args[0], tuple(_fresh(a) for a in args[1:]), {k: _fresh(v) for k, v in kwargs.items()}))

    def post(index: int, _: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        calls[-1].output = output
        if index == len(layers) - 1:
            raise StageExit  # the rest of the step (head, loss) is timed apart, see time_step_around

    handles = []
    for index, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(partial(pre, index), with_kwargs=True, prepend=True))
        handles.append(layer.register_forward_hook(partial(post, index), with_kwargs=True))
    try:
        with silenced_log(module), torch.no_grad(), suppress(StageExit):
            step()
    finally:
        for handle in handles:
            handle.remove()
    problem = _order_problem(order, name, len(layers))
    if problem is not None:
        refuse(problem)
    return calls


def _passed_on(output: Any, next_activation: Any) -> int | None:
    """Where in a layer's output the code finds the next layer's activation: ``None`` for the
    whole output (``x = block(x)``), ``k`` for its ``k``-th element (``x = block(x)[k]``)."""
    if output is not next_activation and isinstance(output, tuple | list):
        for k, item in enumerate(output):
            if item is next_activation:
                return k
    return None  # the output itself, or the code changes it between layers: profile it as it is


def _alike(value: Any, recorded: Any) -> bool:
    """Whether ``value`` has the structure, shapes and dtypes of ``recorded``."""
    if isinstance(value, torch.Tensor) and isinstance(recorded, torch.Tensor):
        return value.shape == recorded.shape and value.dtype == recorded.dtype
    if isinstance(value, tuple | list) and isinstance(recorded, tuple | list):
        return len(value) == len(recorded) and all(_alike(v, r) for v, r in zip(value, recorded))
    return False


def _copied(value: Any) -> Any:
    return map_tensors(value, torch.clone)


_IN_PLACE = "leaf Variable that requires grad is being used in an in-place operation"


class ChainedBlock(nn.Module):
    """Layer ``index`` of the chain as the profiler runs a layer: called on the activation alone,
    with the side inputs that the step gave it on as many rows; returns what the code passes to
    the next layer.

    When what the chain hands it is not what the step gave it (another shape: code between the
    layers pooled or flattened it), it runs on the step's own activation, as a fresh leaf, so that
    its backward still computes the input gradient that a stage beginning with it computes. A
    layer that changes its input in place (``ReLU(inplace=True)``) cannot run on a leaf that
    requires grad: after the first refusal it runs on a copy, as a stage that begins with it does
    (``runtime.StageModule``), and the copy is timed with it.

    The layer is a submodule, so that the profile counts its parameters and times the optimizer
    over them.
    """

    def __init__(self, index: int, block: nn.Module, chain: BlockChain) -> None:
        super().__init__()
        self.index = index
        self.block = block
        self.copies = False
        self.__dict__["_chain"] = chain  # a plain reference: the chain is no submodule

    def forward(self, x: Any) -> Any:
        chain: BlockChain = self.__dict__["_chain"]
        call = chain.calls(batch_size_of(x))[self.index]
        if not _alike(x, call.activation):
            x = fresh_leaves(call.activation)
        try:
            output = self._run(_copied(x) if self.copies else x, call)
        except RuntimeError as err:
            if self.copies or _IN_PLACE not in str(err):
                raise
            self.copies = True
            output = self._run(_copied(x), call)
        pick = chain.picks[self.index]
        return output if pick is None else output[pick]

    def _run(self, x: Any, call: BlockCall) -> Any:
        return self.block(x, *(_fresh(a) for a in call.args), **{k: _fresh(v) for k, v in call.kwargs.items()})


class BlockChain:
    """The layers of ``chain`` as layers the profiler can run one after the other
    (:attr:`layers`), learned from the user's step.

    ``step(rows)`` runs the user's training_step on the first ``rows`` rows of the profiling
    sample; it is recorded at ``rows`` and at the profile's smaller batch.
    """

    def __init__(self, module: nn.Module, chain: Chain, step: Callable[[int], Any], rows: int) -> None:
        self._module, self._chain, self._step = module, chain, step
        small = small_batch_of(rows)
        sizes = [rows] if small is None else [rows, small]
        self._calls = {n: record_block_calls(module, chain, lambda n=n: step(n)) for n in sizes}
        first = self._calls[rows]
        self.picks = [*(_passed_on(call.output, after.activation) for call, after in pairwise(first)), None]
        """Per layer, what of its output the code passes on (see :func:`_passed_on`)."""
        self.layers = [ChainedBlock(index, layer, self) for index, (_, layer) in enumerate(chain.named_layers())]
        self.sample_input = first[0].activation
        """The first layer's activation on the sample: the chain's input."""

    def calls(self, rows: int) -> list[BlockCall]:
        """Every layer's call in the step on ``rows`` rows."""
        if rows not in self._calls:
            raise ValueError(
                f"the layers were recorded on {sorted(self._calls)} rows, not {rows}: profile them at those sizes"
            )
        return self._calls[rows]

    def step_outside(self, rows: int) -> tuple[float, float]:
        """Forward and backward seconds of the step's own code on ``rows`` rows (around the layers)."""
        outputs = [call.output for call in self.calls(rows)]
        put = partial(self._chain.put, self._module)
        return time_step_around(self._module, put, self._chain.containers, lambda: self._step(rows), outputs)

    def named(self, profile: ModelProfile) -> ModelProfile:
        """``profile`` with each layer named after itself rather than its :class:`ChainedBlock`: by
        index and class for one container (``3:Block``), with its path too for several
        (``8:classifier.0:Linear``)."""
        data = profile.to_dict()
        several = len(self._chain.containers) > 1
        for index, (layer, (path, module)) in enumerate(zip(data["layers"], self._chain.named_layers(), strict=True)):
            kind = type(module).__name__
            layer["name"] = f"{index}:{path}:{kind}" if several else f"{index}:{kind}"
        return ModelProfile.from_dict(data)


def sample_chain(
    module: nn.Module, chain: Chain, sample: Any, resident: Resident
) -> tuple[list[nn.Module], Any, Callable[[int], tuple[float, float]], BlockChain | None]:
    """What profiling ``chain`` needs, learned by running the user's step on ``sample`` (a slice of the
    global batch; the caller undoes what the step changes): the layers as the profiler runs them,
    their input on the sample, the step's own seconds outside them on ``n`` rows, and the
    :class:`BlockChain` standing for them (``None`` for one Sequential, whose own layers are profiled).
    ``resident`` brings each layer to the device only while it is called."""
    rows = batch_size_of(sample)

    def step_on(n: int) -> Any:
        return module.training_step(slice_batch(sample, Rows(0, n)), 0)

    if not chain.called_whole:
        with resident.one_at_a_time():
            blocks = BlockChain(module, chain, step_on, rows)
        return blocks.layers, blocks.sample_input, blocks.step_outside, blocks
    path, container = chain.single()
    set_container = partial(set_submodule, module, path)
    sample_input = capture_input(module, set_container, container, lambda: step_on(rows))

    def step_outside(n: int) -> tuple[float, float]:
        part_input = slice_batch(sample_input, Rows(0, n))
        with resident.one_at_a_time():  # the container's output, without autograd
            return time_step_outside(module, set_container, container, lambda: step_on(n), part_input)

    return list(container), sample_input, step_outside, None
