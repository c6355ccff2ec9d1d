"""``plan="auto"`` for an ``nn.ModuleList`` of blocks: the blocks as a chain the profiler can run.

The profiler (``planner.profile_layers``) runs layers as an ``nn.Sequential`` does, each on the
previous one's output. The blocks of a ModuleList are called by the user's own loop instead,
with side inputs that the step computes from the batch::

    for block in self.blocks:
        x = block(x, mask, position_ids=pos)

:class:`BlockChain` learns what that loop does by running the user's ``training_step`` with
hooks on every block, and records each block's call: its first positional argument (the
activation, which crosses stages), the other arguments and keywords (the side inputs, which
never do) and its output. Each block then runs in the profile as a :class:`ChainedBlock`: on the
activation alone, with the side inputs the step gave it, returning what the loop passes on to
the next block. The step is recorded at every batch size the profile runs (the sample and
:func:`~dapple_lightning.autoplan.small_batch_of` it), rather than side tensors sliced to fewer
rows: a ``(T, T)`` mask whose ``T`` happens to equal the batch cannot be told from a
batch-first tensor by its shape.

The same records give the step outside the blocks its replay (the last block's output, see
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

from dapple_lightning.autoplan import small_batch_of, time_step_around
from dapple_lightning.microbatch import batch_size_of
from dapple_lightning.planner import ModelProfile
from dapple_lightning.runtime import StageExit
from dapple_lightning.surgery import standing_in

__all__ = ["BlockCall", "BlockChain", "ChainedBlock", "record_block_calls"]

_RULE = "dapple needs forward to call every block of the pipelined ModuleList once per batch, in order"

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
    """One block's call in the user's step (tensors detached: recorded without autograd)."""

    activation: Any
    """The first positional argument: what crosses stages."""
    args: tuple
    """The side inputs given by position, after the activation."""
    kwargs: dict[str, Any]
    """The side inputs given by keyword."""
    output: Any = None


def _order_problem(order: list[int], count: int) -> str | None:
    """What is wrong with the order the step called the blocks in, if anything."""
    for position, index in enumerate(order):
        if index < position:
            return f"it called block {index} again after block {order[position - 1]}"
        if index > position:
            return f"it called block {index} before block {position}"
    if len(order) < count:
        return f"it called {len(order)} of the {count} blocks"
    return None


def record_block_calls(
    module: nn.Module, set_container: Callable[[nn.Module], None], blocks: nn.ModuleList, step: Callable[[], Any]
) -> list[BlockCall]:
    """Run ``step`` (the user's training_step on a batch) until its last block returns; every
    block's call, in order. Logging is silenced and nothing is recorded for autograd."""
    calls: list[BlockCall] = []
    order: list[int] = []

    def pre(index: int, _: nn.Module, args: tuple, kwargs: dict) -> None:
        order.append(index)
        if not args:
            raise TypeError(
                f"block {index} of the pipelined ModuleList was called without a positional argument; dapple "
                "passes the activation from block to block as each block's first positional argument: call it "
                "as block(x, ...) with side inputs after x or as keywords"
            )
        calls.append(BlockCall(args[0], tuple(_fresh(a) for a in args[1:]), {k: _fresh(v) for k, v in kwargs.items()}))

    def post(index: int, _: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        calls[-1].output = output
        if index == len(blocks) - 1:
            raise StageExit  # the rest of the step (head, loss) is timed apart, see time_step_around

    handles = []
    for index, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(partial(pre, index), with_kwargs=True, prepend=True))
        handles.append(block.register_forward_hook(partial(post, index), with_kwargs=True))
    try:
        # The container stands in for itself: standing_in only silences the step's logging here.
        with standing_in(module, set_container, blocks, blocks), torch.no_grad(), suppress(StageExit):
            step()
    finally:
        for handle in handles:
            handle.remove()
    problem = _order_problem(order, len(blocks))
    if problem is not None:
        raise RuntimeError(
            f"plan='auto' ran training_step once to learn how forward calls the blocks, and {problem}; {_RULE}"
        )
    return calls


def _passed_on(output: Any, next_activation: Any) -> int | None:
    """Where in a block's output the loop finds the next block's activation: ``None`` for the
    whole output (``x = block(x)``), ``k`` for its ``k``-th element (``x = block(x)[k]``)."""
    if output is not next_activation and isinstance(output, tuple | list):
        for k, item in enumerate(output):
            if item is next_activation:
                return k
    return None  # the output itself, or the loop changes it between blocks: profile it as it is


class ChainedBlock(nn.Module):
    """Block ``index`` as the profiler runs a layer: called on the activation alone, with the side
    inputs that the step gave it on as many rows; returns what the loop passes to the next block.

    The block is a submodule, so that the profile counts its parameters and times the optimizer
    over them.
    """

    def __init__(self, index: int, block: nn.Module, chain: BlockChain) -> None:
        super().__init__()
        self.index = index
        self.block = block
        self.__dict__["_chain"] = chain  # a plain reference: the chain is no submodule

    def forward(self, x: Any) -> Any:
        chain: BlockChain = self.__dict__["_chain"]
        call = chain.calls(batch_size_of(x))[self.index]
        output = self.block(x, *(_fresh(a) for a in call.args), **{k: _fresh(v) for k, v in call.kwargs.items()})
        pick = chain.picks[self.index]
        return output if pick is None else output[pick]


class BlockChain:
    """The blocks of ``blocks`` as layers of a chain (:attr:`layers`), learned from the user's step.

    ``step(rows)`` runs the user's training_step on the first ``rows`` rows of the profiling
    sample; it is recorded at ``rows`` and at the profile's smaller batch.
    """

    def __init__(
        self,
        module: nn.Module,
        set_container: Callable[[nn.Module], None],
        blocks: nn.ModuleList,
        step: Callable[[int], Any],
        rows: int,
    ) -> None:
        self._module, self._set_container, self._blocks, self._step = module, set_container, blocks, step
        small = small_batch_of(rows)
        sizes = [rows] if small is None else [rows, small]
        self._calls = {n: record_block_calls(module, set_container, blocks, lambda n=n: step(n)) for n in sizes}
        first = self._calls[rows]
        self.picks = [*(_passed_on(call.output, after.activation) for call, after in pairwise(first)), None]
        """Per block, what of its output the loop passes on (see :func:`_passed_on`)."""
        self.layers = [ChainedBlock(index, block, self) for index, block in enumerate(blocks)]
        self.sample_input = first[0].activation
        """The first block's activation on the sample: the chain's input."""

    def calls(self, rows: int) -> list[BlockCall]:
        """Every block's call in the step on ``rows`` rows."""
        if rows not in self._calls:
            raise ValueError(
                f"the blocks were recorded on {sorted(self._calls)} rows, not {rows}: profile them at those sizes"
            )
        return self._calls[rows]

    def step_outside(self, rows: int) -> tuple[float, float]:
        """Forward and backward seconds of the step's own code on ``rows`` rows (around the blocks)."""
        return time_step_around(
            self._module, self._set_container, self._blocks, lambda: self._step(rows), self.calls(rows)[-1].output
        )

    def named(self, profile: ModelProfile) -> ModelProfile:
        """``profile`` with each layer named after its block rather than its :class:`ChainedBlock`."""
        data = profile.to_dict()
        for index, (layer, block) in enumerate(zip(data["layers"], self._blocks, strict=True)):
            layer["name"] = f"{index}:{type(block).__name__}"
        return ModelProfile.from_dict(data)
